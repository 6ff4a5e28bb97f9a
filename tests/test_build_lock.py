"""A C++ kernel build killed midway leaves locks; the next build must notice, say so in one line, and go on
(before issue 50 every later call slept forever on torch's lock file, saying nothing)."""

import json
import os
import socket
import subprocess
import sys
import threading
import time

from longreach.attention import build_lock

HOLDER = """
import importlib.util, sys, pathlib, time
spec = importlib.util.spec_from_file_location("build_lock", sys.argv[1])  # the module alone: no torch to import
build_lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build_lock)
folder = pathlib.Path(sys.argv[2])
with build_lock.holding(folder):
    (folder / build_lock.TORCH_LOCK).touch()  # what torch.utils.cpp_extension does next, before compiling
    print("building", flush=True)
    time.sleep(300)
"""


def compiler(folder, name, body):
    """A stand-in for the C++ compiler: a shell script."""
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_a_build_killed_midway_does_not_block_the_next(tmp_path, monkeypatch, capfd):
    """The issue's reproduction: a process takes the build's locks (ours, then torch's) and is killed with SIGKILL
    midway; the next build in this process, with a compiler that fails at once, must end in a BuildError (the
    fallback), not sleep forever on torch's lock. (With the real compiler the same sequence rebuilds the kernel.)"""
    from longreach.attention import native

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.setenv("CXX", compiler(tmp_path, "failing-c++", "exit 1"))
    folder = native._build_folder()
    builder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, build_lock.__file__, str(folder)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert builder.stdout.readline().strip() == "building"
    finally:
        builder.kill()
        builder.wait()
    assert (folder / build_lock.LOCK).exists() and (folder / build_lock.TORCH_LOCK).exists()
    outcome = []
    attempt = threading.Thread(target=lambda: outcome.append(_build(native)), daemon=True)
    attempt.start()
    attempt.join(timeout=120)
    assert outcome and isinstance(outcome[0], native.BuildError), "the build after the killed one hung on its lock"
    err = capfd.readouterr().err
    assert f"removed a stale build lock {folder / build_lock.LOCK} (its builder, process {builder.pid}, is gone)" in err
    assert not (folder / build_lock.LOCK).exists() and not (folder / build_lock.TORCH_LOCK).exists()


def _build(native):
    try:
        return native._build()
    except native.BuildError as error:
        return error


def write_lock(folder, **holder):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / build_lock.LOCK).write_text(
        json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), **holder})
    )
    (folder / build_lock.TORCH_LOCK).touch()


def test_a_lock_older_than_any_build_is_stale(tmp_path, capfd):
    write_lock(tmp_path)  # a live process (this one), but an hour old
    os.utime(tmp_path / build_lock.LOCK, (time.time() - 3600,) * 2)
    with build_lock.holding(tmp_path):
        assert not (tmp_path / build_lock.TORCH_LOCK).exists()
    assert not (tmp_path / build_lock.LOCK).exists()
    assert f"removed a stale build lock {tmp_path / build_lock.LOCK} (taken 3600 s ago" in capfd.readouterr().err


def test_a_live_builder_is_waited_for_and_named_once(tmp_path, capfd):
    write_lock(tmp_path)  # held by this process, alive
    (tmp_path / build_lock.TORCH_LOCK).unlink()
    entered = threading.Event()

    def build():
        with build_lock.holding(tmp_path):
            entered.set()

    waiter = threading.Thread(target=build)
    waiter.start()
    time.sleep(1.0)
    assert not entered.is_set()
    (tmp_path / build_lock.LOCK).unlink()  # the builder is done
    waiter.join(timeout=10)
    assert entered.is_set()
    err = capfd.readouterr().err
    assert err.count("waiting for process") == 1 and f"process {os.getpid()} on {socket.gethostname()}" in err


def test_a_half_written_kernel_is_not_imported_but_built_again(tmp_path, monkeypatch):
    """A library cut short by a build that died, or one being linked under another process's lock: a vLLM worker's
    ``prebuilt`` finds no kernel (it falls back), and a build in the main process replaces the file (here a compiler
    that fails at once: a BuildError, the fallback, not an ImportError from the loader)."""
    from longreach.attention import native

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.setenv("CXX", compiler(tmp_path, "failing-c++", "exit 1"))
    monkeypatch.setattr(native, "_loaded", [])
    folder = native._build_folder()
    folder.mkdir(parents=True)
    native._library(folder).write_bytes(b"\x7fELF cut")
    assert native.prebuilt() is None
    write_lock(folder)  # a build in progress: its library is not read, whatever it holds
    assert native.prebuilt() is None
    (folder / build_lock.LOCK).unlink()
    (folder / build_lock.TORCH_LOCK).unlink()
    assert isinstance(_build(native), native.BuildError) and not native._library(folder).exists()
    assert native._loaded == []
