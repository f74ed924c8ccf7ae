"""The command line's own commands (``demo``, ``top``, ``rpc``) and the options two
command lines share (``options``); ``scheduler/__main__`` parses the arguments.
Nothing imports this package but ``scheduler/__main__`` and ``frontend/__main__``."""
