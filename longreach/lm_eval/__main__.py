"""``python -m longreach.lm_eval ARGS``: lm-eval's own command line with the ``longreach`` model registered.

lm-eval 0.4.13 cannot discover models of other packages by itself, so this registers
:class:`~longreach.lm_eval.LongreachLM` (and :class:`~longreach.lm_eval.vllm.LongreachVLLM`, ``longreach-vllm``,
where it is asked for) and hands the arguments to lm-eval's CLI unchanged; ``--model longreach`` is added when no
``--model`` is given.
"""

from __future__ import annotations

import sys

SUBCOMMANDS = ("run", "ls", "validate")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        from lm_eval.__main__ import cli_evaluate

        from . import LongreachLM  # noqa: F401  (registers the model)

        if "longreach-vllm" in " ".join(argv):
            from .vllm import LongreachVLLM  # noqa: F401  (registers it; vLLM imported only where asked for)
    except ImportError as error:
        sys.exit(f"longreach: error: {error}")
    command = argv[:1] if argv[:1] and argv[0] in SUBCOMMANDS else []
    rest = argv[len(command) :]
    if command in ([], ["run"]) and rest and not any(a == "--model" or a.startswith("--model=") for a in rest):
        rest = ["--model", "longreach", *rest]
    sys.argv = ["lm-eval", *command, *rest]
    try:
        cli_evaluate()
    except ValueError as error:  # longreach's own checks (a method, a parameter): one line, no traceback
        sys.exit(f"longreach: error: {error}")


if __name__ == "__main__":
    main()
