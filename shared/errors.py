"""The project's error root: every refusal sparkforge raises on purpose subclasses it.

``SparkforgeError`` is a ``ValueError`` (bad input is a bad value), so callers that catch
``ValueError`` keep working. The ``sparkforge`` command line turns it into one line on stderr; an
exception outside it is a bug and keeps its traceback.
"""

from __future__ import annotations


class SparkforgeError(ValueError):
    """A refusal with a one-line message naming what is wrong and what to do."""


class ConfigError(SparkforgeError):
    """The command line or a config file asks for something unusable (the CLI exits 2)."""


class Interrupted(SparkforgeError):
    """A job stopped by a signal before it finished; what it saved resumes it. The CLI exits
    128 + the signal's number (143 for SIGTERM), what a shell and a scheduler report for a job
    the signal ended, so a requeue-on-failure policy requeues it."""

    def __init__(self, message: str, *, signum: int) -> None:
        super().__init__(message)
        self.signum = signum
        """The signal that stopped the job."""
