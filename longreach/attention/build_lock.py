"""Who is building the C++ kernel: a lock that names its holder, so that a build killed midway never blocks the next.

``torch.utils.cpp_extension.load`` guards a build folder with an empty file, ``lock``, and waits without a
timeout for it to go away. A build killed with ``kill -9`` (or Ctrl-C at the wrong moment) leaves it, and every
later call in every process then sleeps forever, saying nothing. Before torch's lock, :func:`holding` takes a
lock of its own in the same folder, which records the builder's process id, host and start time. A lock whose
builder is gone (no such process on this host) or which is older than any build takes (:data:`BUILD_LIMIT`) is
stale: it is removed, with torch's, in one line that says so and names the file, and the build starts again.
While a live builder holds it, the caller waits, saying once whom it waits for.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from pathlib import Path

LOCK = "longreach-build.lock"  # ours, with its holder
TORCH_LOCK = "lock"  # torch.utils.cpp_extension's, empty
BUILD_LIMIT = 600.0  # seconds: a build takes about 25 (2 cores); a lock this old has no live build behind it
POLL = 0.25


@contextlib.contextmanager
def holding(folder: Path, limit: float = BUILD_LIMIT):
    """Hold the build lock of ``folder`` while the block builds; a stale lock (see the module) is replaced."""
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / LOCK
    waiting_for = None
    while not _take(lock):
        holder = _holder(lock)
        why = _stale(holder, lock, limit)
        if why:
            print(
                f"longreach: removed a stale build lock {lock} ({why}); building the CPU kernel again",
                file=sys.stderr,
                flush=True,
            )
            for name in (LOCK, TORCH_LOCK):
                with contextlib.suppress(FileNotFoundError):
                    (folder / name).unlink()
            continue
        if holder and holder.get("pid") != waiting_for:
            waiting_for = holder.get("pid")
            print(
                f"longreach: waiting for process {waiting_for} on {holder.get('host')}, which is building the CPU "
                f"attention kernel ({lock})",
                file=sys.stderr,
                flush=True,
            )
        time.sleep(POLL)
    try:
        with contextlib.suppress(FileNotFoundError):
            (folder / TORCH_LOCK).unlink()  # ours is held: a torch lock left here belongs to a build that died
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()


def _take(lock: Path) -> bool:
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as file:
        json.dump({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}, file)
    return True


def _holder(lock: Path) -> dict | None:
    """The holder a lock records; ``None`` when it is gone, or not yet (or never) written."""
    try:
        holder = json.loads(lock.read_text())
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def _stale(holder: dict | None, lock: Path, limit: float) -> str | None:
    """Why the lock is stale, or ``None`` while its builder may still be at work."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return None  # released meanwhile: take it
    if age > limit:
        return f"taken {age:.0f} s ago; a build takes under {limit:.0f} s"
    if holder is None:
        return (
            "unreadable, written 2 s ago or more" if age > 2.0 else None
        )  # a lock being written is empty for a moment
    pid = holder.get("pid")
    if holder.get("host") == socket.gethostname() and isinstance(pid, int) and not _alive(pid):
        return f"its builder, process {pid}, is gone"
    return None


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (a zombie, killed and not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc (macOS): the signal said it exists
    return state not in ("Z", "X")
