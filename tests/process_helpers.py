"""Test helper for the crash tests: wait for a child CLI to reach a point, then signal it."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable


def wait_until(proc: subprocess.Popen[str] | subprocess.Popen[bytes], ready: Callable[[], bool],
               what: str, *, timeout_s: float = 120, poll_s: float = 0.05) -> None:
    """Wait for ``ready()``; fail naming ``what`` if ``proc`` ends or time runs out first."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert proc.poll() is None, f"the process ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:g} s"
        time.sleep(poll_s)
