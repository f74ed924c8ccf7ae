"""The models a scheduler runs: ``tiny`` (the seeded torch LM and the stub)
and ``sampling``. Imports nothing else of ``scheduler``."""
