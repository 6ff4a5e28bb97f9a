"""Who made a result: longreach's version and git commit, the command line, and the model a name resolved to.

``longreach --version`` prints :func:`describe`; every run of the grid that has cases to run appends one
line to its results folder's ``runs.jsonl`` (:func:`run`, :func:`record`) as its first case is written;
the report lists them. Importing this
module is cheap (no torch): the command's ``--version`` uses it.
"""

from __future__ import annotations

import json
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

VERSION = "0.1.0"  # pyproject.toml's; longreach.__version__
RUNS = "runs.jsonl"  # one line per run of a results folder's grid
SOURCE = Path(__file__).resolve().parent.parent  # a clone's root when longreach runs from one


def version() -> str:
    return VERSION


def commit() -> dict | None:
    """``{"commit": sha, "uncommitted_changes": bool}`` of the clone longreach runs from; ``None`` when it is
    installed from a package (no git work tree at its root) or git is missing."""
    try:
        root = _git("rev-parse", "--show-toplevel")
        if Path(root).resolve() != SOURCE:  # longreach installed inside someone else's repository
            return None
        changes = _git("status", "--porcelain", "--untracked-files=no", "--", "longreach", "pyproject.toml")
        return {"commit": _git("rev-parse", "HEAD"), "uncommitted_changes": bool(changes)}
    except (OSError, subprocess.SubprocessError):
        return None


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(SOURCE), *args], capture_output=True, text=True, check=True, timeout=10
    ).stdout.strip()


def describe() -> str:
    """``longreach 0.1.0 (git 0bf9c23)``, with uncommitted changes said; the version alone outside a clone."""
    return f"longreach {label(version(), commit())}"


def label(release: str, clone: dict | None) -> str:
    """A version with the clone it ran from (:func:`commit`'s dict, or ``None``): ``0.1.0 (git 0bf9c23...)``."""
    if not clone or not clone.get("commit"):
        return release
    return (
        f"{release} (git {clone['commit'][:12]}"
        f"{', with uncommitted changes' if clone.get('uncommitted_changes') else ''})"
    )


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed: ``longreach`` and its arguments (``argv``, default this process's)."""
    args = sys.argv[1:] if argv is None else argv
    return shlex.join(["longreach", *args])


def model_name(name: str, config) -> str:
    """What ``--model NAME`` resolved to: a bundled model's own name, a folder's or a GGUF file's absolute path, a hub
    id at its revision (transformers' ``_commit_hash``) where it has one."""
    from .gguf_models import BUNDLED

    if name in BUNDLED:
        bundled = BUNDLED[name]
        return f"{bundled.origin} ({bundled.file}, dequantized; {bundled.install.split()[3]})"
    if Path(name).exists():
        return str(Path(name).resolve())
    revision = getattr(config, "_commit_hash", None)
    return f"{name}@{revision}" if revision else name


def run(model: str, config, cases: int, processes: int = 1, command: str | None = None) -> dict:
    """This run, as ``runs.jsonl`` keeps it: when it started, longreach's version and commit, the command line, the
    model as given and as resolved, the new cases it set out to run (process 0's share under ``torchrun``) and over
    how many processes, and the versions of Python, torch and transformers."""
    import torch
    import transformers

    return {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "longreach": version(),
        "git": commit(),
        "command": command or command_line(),
        "model": model,
        "model_name": model_name(model, config),
        "cases": cases,
        "processes": processes,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def record(out: Path, run: dict) -> None:
    """Append ``run`` (:func:`run`) to ``out/runs.jsonl``."""
    with (out / RUNS).open("a", encoding="utf-8") as sink:
        sink.write(json.dumps(run) + "\n")


def read(out: Path) -> list[dict]:
    """The runs recorded in ``out/runs.jsonl`` (none for a folder written before it was kept); a line that is not a
    JSON object is skipped."""
    path = out / RUNS
    if not path.exists():
        return []
    runs = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            run = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(run, dict):
            runs.append(run)
    return runs
