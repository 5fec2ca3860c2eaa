"""Weighted data mixes: several chat sources, each drawn to its share of the rows.

Source ``j`` of weight ``w_j`` gets ``n_j`` of the mix's ``num_rows`` rows (``num_rows * w_j /
sum(w)``, largest remainders rounded up, so the counts sum exactly). With ``N_j`` rows available it
is repeated ``n_j // N_j`` times whole, and ``n_j % N_j`` further rows are drawn without
replacement from a generator seeded with ``(seed, j)``: deterministic, and a source smaller than
its share is repeated, a larger one subsampled. The mix lists source 0's draws first (row order
kept, a repeated row next to itself), then source 1's, ...; so the sample ids of source ``j`` are
the contiguous range ``[first_sample_j, first_sample_j + n_j)``, which is what the per-source
accounting of ``inspect`` reads back. The trainer shuffles units every epoch, so the order on
disk never reaches the draft. The draws are held as the repeat count and the subsample (at most
``N_j`` ids), never listed, so a mix of many rows costs no more memory than its sources.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sparkforge.shared.config_types import type_problems
from sparkforge.shared.dataset import (
    MAX_LINE_BYTES,
    DataFormat,
    DatasetError,
    DataSource,
    RawRow,
    describe_sources,
    iter_rows,
)
from sparkforge.shared.errors import ConfigError
from sparkforge.shared.header import MAX_MIX_WEIGHT


@dataclass(frozen=True, kw_only=True)
class MixSource:
    """One source of a weighted mix (an entry of ``--mix``)."""

    data: str
    """Chat data: a JSONL/Parquet file, folder or glob (any fsspec URI), ``hf://<name>[:split]``
    or a ``save_to_disk`` folder."""
    weight: float
    """Relative share of the mix's rows (the weights need not sum to 1)."""
    data_format: DataFormat = "auto"
    """File format; auto reads it from the suffix."""
    column: str | None = None
    """Hugging Face datasets: the conversation column (None: messages, else conversations)."""
    name: str | None = None
    """Label in the summary and ``inspect`` (default: ``data``)."""

    def __post_init__(self) -> None:
        typed = type_problems(self, prefix="")
        if typed:
            raise ConfigError(f"mix: {self.data!r}: " + "; ".join(typed))
        if not self.data:
            raise ConfigError("mix: every entry needs data (a path or URI)")
        if not 0 < self.weight <= MAX_MIX_WEIGHT:
            raise ConfigError(f"mix: {self.data}: weight must be a number in (0, "
                              f"{MAX_MIX_WEIGHT:g}] (weights are relative), got {self.weight!r}")


@dataclass(frozen=True)
class Draws:
    """The rows one source gives a mix, without listing them: every row ``repeats`` times, and
    each row of ``extra`` once more (next to its other draws)."""

    available: int
    """Rows the source holds."""
    repeats: int
    extra: np.ndarray
    """[< available] distinct row indices, ascending."""

    def __len__(self) -> int:
        return self.repeats * self.available + len(self.extra)

    def of_row(self, row: int) -> range:
        """Positions of ``row``'s draws among the source's draws."""
        k = int(np.searchsorted(self.extra, row))
        first = self.repeats * row + k
        once_more = k < len(self.extra) and int(self.extra[k]) == row
        return range(first, first + self.repeats + once_more)


@dataclass(frozen=True, kw_only=True)
class MixEntry:
    """A mix source resolved: its files and the rows drawn from them."""

    source: MixSource
    files: list[DataSource]
    draws: Draws
    """The ``n_j`` rows drawn from ``files``."""

    @property
    def label(self) -> str:
        """The entry's name, else its data."""
        return self.source.name or self.source.data

    @property
    def source_rows(self) -> int:
        """Rows the source holds."""
        return sum(f.num_rows for f in self.files)


def quotas(weights: Sequence[float], num_rows: int) -> list[int]:
    """Rows per source: shares of ``num_rows`` by weight, largest remainders rounded up."""
    total = float(sum(weights))
    exact = [num_rows * w / total for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda j: (counts[j] - exact[j], j))
    for j in by_remainder[:num_rows - sum(counts)]:
        counts[j] += 1
    return counts


def draw_rows(available: int, wanted: int, *, seed: int, index: int) -> Draws:
    """``wanted`` draws of ``available`` rows: whole repeats, then a seeded subsample."""
    repeats, rest = divmod(wanted, available)
    rng = np.random.default_rng([seed, index])
    extra = np.sort(rng.choice(available, size=rest, replace=False))
    return Draws(available=available, repeats=repeats, extra=extra)


def plan_mix(sources: Sequence[MixSource], *, num_rows: int | None, seed: int,
             storage_options: Mapping[str, Any] | None = None,
             max_line_bytes: int = MAX_LINE_BYTES) -> list[MixEntry]:
    """Describe every source and draw its rows.

    Raises:
        DatasetError: a source holds no rows.
    """
    files = [describe_sources(s.data, data_format=s.data_format, storage_options=storage_options,
                              column=s.column, max_line_bytes=max_line_bytes) for s in sources]
    available = [sum(f.num_rows for f in group) for group in files]
    for spec, count in zip(sources, available, strict=True):
        if not count:
            raise DatasetError(f"mix: {spec.data} holds no rows")
    total = sum(available) if num_rows is None else num_rows
    counts = quotas([s.weight for s in sources], total)
    return [MixEntry(source=spec, files=group,
                     draws=draw_rows(avail, count, seed=seed, index=j))
            for j, (spec, group, avail, count) in enumerate(
                zip(sources, files, available, counts, strict=True))]


def iter_mix_rows(plan: Sequence[MixEntry], *, wanted: Callable[[int], bool] | None = None,
                  batch_rows: int = 1024,
                  storage_options: Mapping[str, Any] | None = None) -> Iterator[RawRow]:
    """The mix's rows in sample-id order (see the module docstring); ``wanted`` filters ids."""
    offset = 0
    for entry in plan:

        def sample_ids(row: int, base: int = offset, draws: Draws = entry.draws) -> Iterator[int]:
            return (base + k for k in draws.of_row(row) if wanted is None or wanted(base + k))

        def row_wanted(row: int, ids: Callable[[int], Iterator[int]] = sample_ids) -> bool:
            return next(ids(row), None) is not None

        ids = range(offset, offset + len(entry.draws))
        if any(wanted is None or wanted(i) for i in ids):  # else its files are not read at all
            for raw in iter_rows(entry.files, wanted=row_wanted, batch_rows=batch_rows,
                                 storage_options=storage_options):
                for sample_id in sample_ids(raw.index):
                    yield dataclasses.replace(raw, index=sample_id)
        offset += len(ids)
