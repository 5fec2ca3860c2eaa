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
