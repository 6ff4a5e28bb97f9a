"""The ``longreach`` command: ``eval``, ``report``, ``demo``, ``tune``, ``calibrate``, ``probe`` and the analyses.

``import longreach.cli`` is cheap: the parser (:mod:`.parser`) imports no torch, transformers or
matplotlib, and each command (:mod:`.commands`) imports what it needs when it runs.
"""

from __future__ import annotations

import sys

from ..provenance import command_line
from .arguments import MADE, remove_empty_made
from .parser import build_parser


def main(argv: list[str] | None = None) -> None:
    """Run the command line ``argv`` (default: this process's); bad input ends in one line, ``longreach: error: ...``."""
    args = build_parser().parse_args(argv)
    args.command_line = command_line(argv)
    MADE.clear()
    try:
        args.run(args)
    except (ValueError, RuntimeError, OSError) as error:
        remove_empty_made()
        sys.exit(f"longreach: error: {error}")
    except KeyboardInterrupt:
        remove_empty_made()
        sys.exit("longreach: interrupted; every finished case is saved, rerun the same command to resume")
