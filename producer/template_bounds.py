"""Bound the time and memory of a chat template's start-up check, and the time of each row.

Jinja's sandbox stops attribute tricks, not work: a template may loop 10^10 times or build a
10 GB string. The check's renders run first in a forked child under a wall-clock limit and an
address-space limit; the child only renders text (no tokenizer, no torch), so forking is safe.
A template benign on the probe may still loop on some rows: ``RowTimeLimit`` stops each row's
rendering in process (a fork per row would cost more than the row).
"""

from __future__ import annotations

import os
import resource
import select
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from sparkforge.shared.errors import ConfigError, SparkforgeError

CHECK_SECONDS = 10.0
"""Wall-clock limit for rendering the probe conversation (a real template takes milliseconds)."""
CHECK_MEMORY_BYTES = 1 << 30
"""Memory the renders may allocate beyond what the process already maps."""
TEMPLATE_ROW_SECONDS = 60.0
"""Default limit of one row's rendering and tokenizing, in CPU seconds of the rendering thread
(a real template takes milliseconds)."""
WALL_FACTOR = 10.0
"""A row also stops after this many times its limit in wall clock, however little CPU it got."""


class TemplateTimeout(SparkforgeError):  # noqa: N818 - the row's skip reason, not a failure
    """A row's template rendering ran past its time limit."""


class _Alarm:
    armed = False
    """A ``RowTimeLimit`` timer is running."""
    budget = 0.0
    """Its limit, in CPU seconds of the main thread."""
    cpu_start = wall_start = 0.0
    """``time.thread_time()`` and ``time.monotonic()`` when it started."""
    installed = False
    """``_on_alarm`` replaced the default handler and stays (``signal.getsignal`` costs more than
    a row's limit otherwise would)."""


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    if _Alarm.armed:
        left = _Alarm.budget - (time.thread_time() - _Alarm.cpu_start)
        if left > 0 and time.monotonic() - _Alarm.wall_start < WALL_FACTOR * _Alarm.budget:
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3))  # the host was busy: wait on
            return
        raise TemplateTimeout
    # Not our timer, while our handler stands in for the default: end the process as it would.
    _Alarm.installed = False
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


class RowTimeLimit:
    """Raise ``TemplateTimeout`` in the ``with`` block once it has used ``seconds`` of CPU.

    The work bounds a row, not the host's load: a wall-clock limit alone kept or dropped the
    same extreme row depending on what else the machine ran. A SIGALRM timer (``setitimer``)
    fires after ``seconds`` of wall clock; if the thread has used less CPU than that, it re-arms
    for the rest, up to ``WALL_FACTOR`` times ``seconds`` of wall clock in all. The exception is
    raised between two Python steps, so it stops Jinja's loops; one long C call (a huge string
    repeat) is stopped when it returns, and the memory the start-up check bounds is not bounded
    here. In place of the default handler
    ours stays installed (a few microseconds a row); a caller's own handler and running
    ITIMER_REAL timer (pytest-timeout's) are restored and re-armed with what the timer had left,
    and a timer due before ``seconds`` is left to fire. Signals reach only the main thread:
    elsewhere (a thread calling the Python API) the block runs unbounded.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._on = False
        self._outer = (0.0, 0.0)
        self._previous: Any = None  # the caller's handler, to restore
        self._started = 0.0

    def __enter__(self) -> None:
        outer = self._outer = signal.getitimer(signal.ITIMER_REAL)
        if threading.current_thread() is not threading.main_thread() or (
                0 < outer[0] <= self.seconds):
            return
        self._on, self._previous = True, None
        if outer[0] or not _Alarm.installed:  # someone else may handle SIGALRM
            previous = signal.signal(signal.SIGALRM, _on_alarm)
            _Alarm.installed = previous is signal.SIG_DFL or previous is _on_alarm
            self._previous = None if _Alarm.installed else previous
        self._started = _Alarm.wall_start = time.monotonic()
        _Alarm.budget, _Alarm.cpu_start = self.seconds, time.thread_time()
        _Alarm.armed = True
        signal.setitimer(signal.ITIMER_REAL, self.seconds)

    def __exit__(self, *exc: object) -> None:
        if not self._on:
            return
        self._on = False
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:  # the alarm may fire before it is disarmed
            _Alarm.armed = False
            if self._previous is not None:
                signal.signal(signal.SIGALRM, self._previous)
            outer, interval = self._outer
            if outer:
                left = max(outer - (time.monotonic() - self._started), 1e-6)
                signal.setitimer(signal.ITIMER_REAL, left, interval)


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
