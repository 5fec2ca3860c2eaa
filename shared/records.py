"""Plain records that cross the producer -> cache boundary: one sample, one unit's accounting."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from sparkforge.shared.errors import SparkforgeError

Split = Literal["train", "eval"]


@dataclass(frozen=True, kw_only=True)
class SampleRecord:
    """One captured sample, row-aligned and unshifted, in the cache's storage dtypes."""

    sample_id: int
    """Global and deterministic: the source row index in the input dataset."""
    source_row: int
    """Row index in the input dataset."""
    source_hash: str
    """Hex digest of the raw input row (for an image row: of the row and its image bytes), so a
    changed dataset, or a changed image behind an unchanged path, is detected."""
    split: Split
    input_ids: np.ndarray
    """[T] int32 token ids."""
    loss_mask: np.ndarray
    """[T] uint8, 1 on assistant tokens."""
    aux_hidden: np.ndarray
    """[T, F, H] residual stream after each captured layer (bf16 bits, float16 or float32), or,
    with ``aux_scale``, its uint8 fp8 e4m3 codes (an fp8 cache, quantised where it was captured)."""
    final_hidden: np.ndarray
    """[T, H] post-final-norm hidden state (what lm_head consumes), same dtype rule."""
    aux_scale: np.ndarray | None = None
    """[T, F] float32 per-token, per-layer fp8 scales when ``aux_hidden`` holds e4m3 codes."""
    topk_ids: np.ndarray | None = None
    """Optional [T, k] int32: top-k ids of the distribution computed from row t (predicting t+1)."""
    topk_logprobs: np.ndarray | None = None
    """Optional [T, k] float32 log-probabilities matching ``topk_ids``."""

    @property
    def num_tokens(self) -> int:
        """Sequence length T."""
        return int(self.input_ids.shape[0])

    def start(self) -> SampleStart:
        """What the writer needs before the sample's rows: its identity, ids and mask."""
        return SampleStart(sample_id=self.sample_id, source_row=self.source_row,
                           source_hash=self.source_hash, split=self.split,
                           input_ids=self.input_ids, loss_mask=self.loss_mask)

    def rows(self) -> SampleRows:
        """All the sample's captured rows as one block."""
        return SampleRows(aux_hidden=self.aux_hidden, final_hidden=self.final_hidden,
                          aux_scale=self.aux_scale, topk_ids=self.topk_ids,
                          topk_logprobs=self.topk_logprobs)


@dataclass(frozen=True, kw_only=True)
class SampleStart:
    """A sample as the writer takes it before its captured rows: fields as in SampleRecord."""

    sample_id: int
    source_row: int
    source_hash: str
    split: Split
    input_ids: np.ndarray
    loss_mask: np.ndarray

    @property
    def num_tokens(self) -> int:
        """Sequence length T."""
        return int(self.input_ids.shape[0])


@dataclass(frozen=True, kw_only=True)
class SampleRows:
    """A block of consecutive captured rows of one sample, in the cache's storage dtypes (the
    fields of SampleRecord, with n rows instead of T)."""

    aux_hidden: np.ndarray
    final_hidden: np.ndarray
    aux_scale: np.ndarray | None = None
    topk_ids: np.ndarray | None = None
    topk_logprobs: np.ndarray | None = None

    @property
    def num_rows(self) -> int:
        """Rows n in the block."""
        return int(self.final_hidden.shape[0])


@dataclass(frozen=True, kw_only=True)
class UnitAccounting:
    """What happened to every input row of one commit unit."""

    input_rows: int
    written: int
    skipped: dict[str, int] = field(default_factory=dict)
    """Reason -> count, e.g. {"empty_assistant": 2, "too_long": 1}."""
    failed: int = 0
    """Rows whose capture failed after retries."""
    image_rows: int | None = field(default=None, metadata={"optional_in_json": True})
    """Written rows that are image rows, captured with their pixels (None: not counted; records
    written before this field)."""

    def __post_init__(self) -> None:
        total = self.written + sum(self.skipped.values()) + self.failed
        if total != self.input_rows:
            raise SparkforgeError(
                f"unit accounting does not add up: written {self.written} + skipped "
                f"{sum(self.skipped.values())} + failed {self.failed} "
                f"!= input_rows {self.input_rows}"
            )
        if self.image_rows is not None and not 0 <= self.image_rows <= self.written:
            raise SparkforgeError(f"unit accounting: image_rows {self.image_rows} is not "
                                  f"between 0 and written {self.written}")


def sum_accounting(parts: Sequence[UnitAccounting]) -> UnitAccounting:
    """The accounting of several units (image rows counted only if every part counts them)."""
    skipped: dict[str, int] = {}
    for p in parts:
        for reason, count in p.skipped.items():
            skipped[reason] = skipped.get(reason, 0) + count
    counted = [p.image_rows for p in parts if p.image_rows is not None]
    return UnitAccounting(input_rows=sum(p.input_rows for p in parts),
                          written=sum(p.written for p in parts), skipped=skipped,
                          failed=sum(p.failed for p in parts),
                          image_rows=sum(counted) if len(counted) == len(parts) else None)
