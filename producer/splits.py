"""Assign each input row to the train or eval split, deterministically and independent of order."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import fsspec

from sparkforge.shared.errors import SparkforgeError
from sparkforge.shared.records import Split


def load_eval_ids(uri: str, storage_options: Mapping[str, Any] | None = None) -> frozenset[int]:
    """Read the eval row indices: one integer per line (blank lines ignored).

    Raises:
        ValueError: A line is not a non-negative integer (naming --eval_ids and the line).
    """
    ids = set()
    with fsspec.open(uri, "r", **dict(storage_options or {})) as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                if not line.strip().isdigit():
                    raise SparkforgeError(f"--eval_ids {uri} line {number}: expected a row index, "
                                          f"got {line.strip()!r}")
                ids.add(int(line))
    return frozenset(ids)


@dataclass(frozen=True)
class SplitRule:
    """Eval by fraction (seeded hash of the row's content) or by row index, never both."""

    eval_fraction: float = 0.0
    eval_ids: frozenset[int] | None = None
    """Input row indices (= sample ids) of the eval split."""
    seed: int = 0

    def split_of(self, *, index: int, content_hash: str) -> Split:
        """The split of one row. By fraction, equal rows share a split (no leak across)."""
        if self.eval_ids is not None:
            return "eval" if index in self.eval_ids else "train"
        if self.eval_fraction <= 0.0:
            return "train"
        if self.eval_fraction >= 1.0:  # the hash ratio below can round up to 1.0
            return "eval"
        digest = hashlib.blake2b(f"{self.seed}:{content_hash}".encode(), digest_size=8).digest()
        return "eval" if int.from_bytes(digest) / 2**64 < self.eval_fraction else "train"
