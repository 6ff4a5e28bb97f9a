"""Peak memory of a probe run in a process of its own (tests/test_kernel.py, tests/test_drop.py)."""

import os
import subprocess
import sys


def measure_peak_growth(probe: str, live_only: bool = True) -> int:
    """Run ``probe`` in a fresh process; it prints its growth of peak RSS in bytes. With ``live_only`` a fixed
    glibc mmap threshold returns freed blocks to the system, so RSS tracks live memory, not the allocator's
    cache; without it, RSS is what a user sees, heap fragmentation included."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"} if live_only else dict(os.environ)
    return int(
        subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=env).stdout
    )
