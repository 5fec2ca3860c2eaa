"""A stop by SIGTERM during ``produce``: abandon the unit in capture, finish the units already
handed to the writer, say so, exit 143.

Without a handler a SIGTERM ended the process at once and silently: committed units were safe
(each commits atomically) but the log said nothing of what was done or lost. :class:`SignalStop`
turns the signal into :class:`StopRequested` in the main thread wherever it lands, except while
the capture loop hands units to the writer queue (``deferred``), where it waits for that hand-off
to end; the run then lets the writer threads commit what they hold and raises
:class:`~sparkforge.shared.errors.Interrupted` naming the units committed and abandoned.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType, TracebackType
from typing import Any

from sparkforge.shared.writer import CacheWriter


class StopRequested(BaseException):
    """Raised in the main thread by a SIGTERM (a BaseException, so no ``except Exception`` on the
    way swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class SignalStop:
    """Turns SIGTERM into :class:`StopRequested` for the ``with`` block (main thread only)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.unit_in_flight: int | None = None
        """The unit being captured (its records are lost if the stop comes now)."""
        self.todo: list[int] = []
        """The units this run set out to capture."""
        self.writer: CacheWriter | None = None
        """The open cache, once there is one."""
        self._deferring = 0
        self._previous: Any = None

    def __enter__(self) -> SignalStop:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        first = self.signum is None
        self.signum = signum
        if first and not self._deferring:
            raise StopRequested(signum)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """A block a stop must not cut (handing units to the writer); a signal that came meanwhile
        stops the run when it ends."""
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
        if self.signum is not None and not self._deferring:
            raise StopRequested(self.signum)
