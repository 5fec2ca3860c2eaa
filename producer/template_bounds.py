"""Bound the time and memory of a chat template's start-up check.

Jinja's sandbox stops attribute tricks, not work: a template may loop 10^10 times or build a
10 GB string. The check's renders run first in a forked child under a wall-clock limit and an
address-space limit; the child only renders text (no tokenizer, no torch), so forking is safe.
"""

from __future__ import annotations

import os
import resource
import select
import signal
from collections.abc import Callable
from pathlib import Path

from sparkforge.shared.errors import ConfigError

CHECK_SECONDS = 10.0
"""Wall-clock limit for rendering the probe conversation (a real template takes milliseconds)."""
CHECK_MEMORY_BYTES = 1 << 30
"""Memory the renders may allocate beyond what the process already maps."""


def _mapped_bytes() -> int:
    with Path("/proc/self/status").open() as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _child(render: Callable[[], None], memory_bytes: int, out: int) -> None:
    """Render under the memory limit and report ``ok`` or ``memory`` (never returns)."""
    verdict = b"ok"
    try:
        limit = _mapped_bytes() + memory_bytes
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
        render()
    except MemoryError:
        verdict = b"memory"
    except BaseException:  # noqa: BLE001 - a failing template is the in-process probe's to name
        verdict = b"ok"
    os.write(out, verdict)
    os._exit(0)


def check_bounded(render: Callable[[], None]) -> None:
    """Run ``render`` in a forked child; refuse a template that takes over ``CHECK_SECONDS`` or
    allocates over ``CHECK_MEMORY_BYTES``.

    Raises:
        ConfigError: the renders ran past ``seconds`` or allocated past ``memory_bytes``.
    """
    seconds, memory_bytes = CHECK_SECONDS, CHECK_MEMORY_BYTES
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        os.close(read_end)
        _child(render, memory_bytes, write_end)
    os.close(write_end)
    ready: list[int] = []
    try:
        ready, _, _ = select.select([read_end], [], [], seconds)
        verdict = os.read(read_end, 16) if ready else b"time"
    finally:
        os.close(read_end)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    if verdict == b"time":
        raise ConfigError(f"chat_template: rendering the probe conversation took over "
                          f"{seconds:g} s (an endless or huge loop?); fix the template or pass "
                          "another --chat_template")
    if verdict != b"ok":  # b"memory", or nothing: the child died (e.g. killed for memory)
        raise ConfigError(f"chat_template: rendering the probe conversation needed over "
                          f"{memory_bytes / 2**30:g} GiB (huge output?); fix the template or pass "
                          "another --chat_template")
