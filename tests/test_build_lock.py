"""A C++ kernel build killed midway leaves locks; the next build must notice, say so in one line, and go on
(before issue 50 every later call slept forever on torch's lock file, saying nothing)."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from longreach.attention import build_lock

BUILD = """
from longreach.attention import native
try:
    native._module()
except native.BuildError as error:
    print("BuildError:", error)
else:
    print("built")
"""


def compiler(folder, name, body):
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_a_build_killed_midway_does_not_block_the_next(tmp_path):
    """The issue's reproduction, with compilers that stand in for the real one: the first build hangs in its
    compiler until it is killed with SIGKILL; the second (a compiler that fails at once) must end, not hang."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions"), "CXX": compiler(tmp_path, "hanging-c++", "exec sleep 300")}
    first = subprocess.Popen([sys.executable, "-c", BUILD], env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not list((tmp_path / "extensions").rglob("lock")):  # torch's lock: the build has begun
            assert first.poll() is None and time.monotonic() < deadline, "the first build never took torch's lock"
            time.sleep(0.1)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    env["CXX"] = compiler(tmp_path, "failing-c++", "exit 1")
    second = subprocess.run([sys.executable, "-c", BUILD], env=env, capture_output=True, text=True, timeout=120)
    assert "BuildError" in second.stdout, second.stderr
    assert "removed a stale build lock" in second.stderr and f"process {first.pid}, is gone" in second.stderr
    assert not list((tmp_path / "extensions").rglob("lock")) and not list((tmp_path / "extensions").rglob(build_lock.LOCK))


def write_lock(folder, **holder):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / build_lock.LOCK).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), **holder}))
    (folder / build_lock.TORCH_LOCK).touch()


def test_a_lock_older_than_any_build_is_stale(tmp_path):
    write_lock(tmp_path)  # a live process (this one), but an hour old
    os.utime(tmp_path / build_lock.LOCK, (time.time() - 3600,) * 2)
    with pytest.warns(UserWarning, match=r"removed a stale build lock .*longreach-build.lock \(taken 3600 s ago"):
        with build_lock.holding(tmp_path):
            assert not (tmp_path / build_lock.TORCH_LOCK).exists()
    assert not (tmp_path / build_lock.LOCK).exists()


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
