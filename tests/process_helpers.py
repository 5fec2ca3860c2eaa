"""Test helpers for child processes: wait for a child CLI to reach a point; where a process's
array lives in memory."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np


def wait_until(proc: subprocess.Popen[str] | subprocess.Popen[bytes], ready: Callable[[], bool],
               what: str, *, timeout_s: float = 120, poll_s: float = 0.05) -> None:
    """Wait for ``ready()``; fail naming ``what`` if ``proc`` ends or time runs out first."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert proc.poll() is None, f"the process ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:g} s"
        time.sleep(poll_s)


def mapping_of(array: np.ndarray) -> str:
    """The name of this process's memory mapping holding ``array``'s first byte (``[heap]``,
    ``/dev/shm/...``, a file, or "" for an anonymous mapping)."""
    address = array.ctypes.data
    with Path("/proc/self/maps").open() as maps:
        for line in maps:
            span, *rest = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return rest[4].strip() if len(rest) == 5 else ""
    raise AssertionError(f"no mapping holds address {address:#x}")
