"""``python -m longreach`` is the ``longreach`` command (so that ``torchrun -m longreach eval ...`` works)."""

from .cli import main

main()
