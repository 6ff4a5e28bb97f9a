"""What the ``longreach`` command's arguments must be: argparse types, and the folders and files it writes.

Every folder made here for a command is remembered (:data:`MADE`), so that a command that fails before
writing anything leaves no empty folder behind (:func:`remove_empty_made`).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

MADE: list[Path] = []  # folders made by writable_folder in this process, each call's deepest first


def positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is out of range: an integer >= 1")
    return value


def port(text: str) -> int:
    """argparse type: a TCP port, 1 .. 65535 (a larger number would be taken modulo 65536 by the socket)."""
    value = positive(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value} is out of range: a port is 1 .. 65535")
    return value


def prefill_tokens(text: str) -> int | None:
    """argparse type of --prefill-tokens: an integer >= 0, or 'auto' (``None``)."""
    if text == "auto":
        return None
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is out of range: an integer >= 0 or 'auto'")
    return int(text)


def threshold(text: str) -> float:
    """argparse type of --threshold: a score from 0 to 100."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value <= 100:  # NaN fails too
        raise argparse.ArgumentTypeError(f"{text} is out of range: a score from 0 to 100 (RULER: 85.6)")
    return value


def writable_folder(path: str, flag: str = "--out") -> Path:
    """``path`` as a folder we can write in (made if missing), or a one-line error naming ``flag``."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{flag}={path} is a file, not a folder: give a folder for the results")
    missing = [p for p in (folder, *folder.parents) if not p.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        MADE.extend(p for p in missing if p.is_dir())
        with tempfile.TemporaryFile(dir=folder):  # a name of its own: several processes may probe one folder at once
            pass
    except OSError as error:
        raise ValueError(f"{flag}={path} is not a writable folder ({error.strerror or error})") from None
    return folder


def remove_empty_made() -> None:
    """Remove the folders this process made that are still empty (a command that failed before its first result),
    deepest first; a folder that holds anything stays, and so do the folders above it."""
    while MADE:
        folder = MADE.pop(0)
        try:
            folder.rmdir()
        except OSError:  # not empty (or gone): what is above it stays too
            while MADE and MADE[0] in folder.parents:
                MADE.pop(0)


def writable_file(path: str, flag: str = "--out") -> Path:
    """A picture's path: its folder must be writable and the path itself not a folder; without a suffix it
    gets ``.png`` (what matplotlib would add when saving), so the path printed is the file written."""
    if Path(path).is_dir():
        raise ValueError(f"{flag}={path} is a folder: give a file name such as {Path(path) / 'picture.png'}")
    target = Path(path) if Path(path).suffix else Path(path + ".png")
    writable_folder(str(target.parent), flag)
    return target


def existing_file(path: str, flag: str) -> Path:
    """``path`` if it is a file, or a one-line error naming ``flag``."""
    if not Path(path).is_file():
        raise ValueError(f"{flag}={path} does not exist or is not a file")
    return Path(path)
