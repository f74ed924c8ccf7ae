"""The command line's own commands (``demo``, ``top``); ``scheduler/__main__``
parses the arguments. Nothing imports this package but ``__main__``."""
