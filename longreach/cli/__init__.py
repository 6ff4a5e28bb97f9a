"""The ``longreach`` command: ``eval``, ``report``, ``demo``, ``tune``, ``calibrate``, ``probe`` and the analyses.

One module per family of commands, each declaring its subcommands (``add``) and running them: :mod:`.evaluation`
(eval, report), :mod:`.demos` (demo, ask, serve-demo), :mod:`.analyses` (dispersion, freq, matrix, cost, methods),
:mod:`.tuning` (tune, calibrate), :mod:`.probing` (probe); the flags they share in :mod:`.flags`, argument types and
output folders in :mod:`.arguments`, the parser that gathers them in :mod:`.parser`.

``import longreach.cli`` is cheap: the parser imports no torch, transformers or matplotlib, and each command imports
what it needs when it runs.
"""

from __future__ import annotations

import sys

from ..provenance import command_line
from .arguments import MADE, remove_empty_made
from .parser import build_parser


def main(argv: list[str] | None = None) -> None:
    """Run the command line ``argv`` (default: this process's); bad input ends in one line,
    ``longreach: error: ...``."""
    args = build_parser().parse_args(argv)
    args.command_line = command_line(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    MADE.clear()
    try:
        args.run(args)
    except (ValueError, RuntimeError, OSError) as error:
        remove_empty_made()
        sys.exit(f"longreach: error: {error}")
    except KeyboardInterrupt:
        remove_empty_made()
        sys.exit("longreach: interrupted; every finished case is saved, rerun the same command to resume")
