"""Assign each input row to the train or eval split, deterministically and independent of order."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import fsspec

from sparkforge.shared.records import Split


def load_eval_ids(uri: str, storage_options: Mapping[str, Any] | None = None) -> frozenset[str]:
    """Read an id list: one id per line (blank lines ignored)."""
    with fsspec.open(uri, "r", **dict(storage_options or {})) as f:
        return frozenset(line.strip() for line in f if line.strip())


@dataclass(frozen=True)
class SplitRule:
    """Eval by fraction (seeded hash of the row's content) or by id, never both."""

    eval_fraction: float = 0.0
    eval_ids: frozenset[str] | None = None
    """Ids matched against the row's ``id`` field, or its row index when it has none."""
    seed: int = 0

    def split_of(self, *, index: int, content_hash: str, row: Mapping[str, Any] | None) -> Split:
        """The split of one row. Equal rows share a split, so duplicates never leak across."""
        if self.eval_ids is not None:
            row_id = row.get("id") if row is not None else None
            key = str(row_id) if row_id is not None else str(index)
            return "eval" if key in self.eval_ids else "train"
        if self.eval_fraction <= 0.0:
            return "train"
        digest = hashlib.blake2b(f"{self.seed}:{content_hash}".encode(), digest_size=8).digest()
        return "eval" if int.from_bytes(digest) / 2**64 < self.eval_fraction else "train"
