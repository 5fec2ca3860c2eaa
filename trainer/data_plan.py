"""Plan one epoch of the training stream from the cache's sample index alone (no hidden states).

The plan is a pure function of (index, seed, epoch, share): units are visited in a per-epoch
shuffled order, the epoch's sample sequence is cut into equal contiguous shares (one per
data-parallel rank x dataloader worker), each share passes through a bounded shuffle buffer and is
cut into micro-batches (``pack``: first packed into rows of whole samples, then cut). Because only
sample ids and lengths are needed, a resumed run recomputes the same plan and skips the batches
already consumed without reading them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

Batching = Literal["pad", "bucket", "pack"]


@dataclass(frozen=True)
class SplitIndex:
    """The samples of one split, in storage order (unit, then slot, then row offset)."""

    sample_id: np.ndarray
    """int64, one per sample: its global sample id."""
    unit: np.ndarray
    """int64, one per sample: the commit unit holding it."""
    length: np.ndarray
    """int64, one per sample: its length in tokens."""
    num_loss_tokens: np.ndarray | None = None
    """int64, one per sample: its supervised tokens (None when not read)."""

    def __len__(self) -> int:
        return int(self.sample_id.shape[0])

    @classmethod
    def from_columns(
        cls,
        *,
        sample_id: Sequence[int] | np.ndarray,
        unit: Sequence[int] | np.ndarray,
        length: Sequence[int] | np.ndarray,
        num_loss_tokens: Sequence[int] | np.ndarray | None = None,
        order_key: np.ndarray | None = None,
    ) -> SplitIndex:
        """Build from index columns; rows are sorted by ``order_key`` (default: unit, sample id)."""
        sid = np.asarray(sample_id, dtype=np.int64)
        uni = np.asarray(unit, dtype=np.int64)
        ln = np.asarray(length, dtype=np.int64)
        if order_key is None:
            order = np.lexsort((sid, uni))
        else:
            order = np.argsort(order_key, kind="stable")
        loss = None if num_loss_tokens is None else np.asarray(num_loss_tokens,
                                                               dtype=np.int64)[order]
        return cls(sample_id=sid[order], unit=uni[order], length=ln[order],
                   num_loss_tokens=loss)


@dataclass(frozen=True)
class EpochPlan:
    """The micro-batches one share consumes in one epoch, as row positions into the SplitIndex."""

    batches: list[np.ndarray]
    rows: list[np.ndarray] | None
    """``pack`` only: for each batch, the row of each of its samples (samples of one row are
    contiguous and in row order); None when every sample is its own row."""
    unit_order: np.ndarray
    """Units in the order this share reads them (only those holding its samples)."""
    num_dropped: int
    """Samples left out this epoch so every share gets the same count (< num_shares)."""


def epoch_unit_order(units: np.ndarray, *, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Distinct units in a deterministic per-epoch order (sorted when ``shuffle`` is False)."""
    distinct = np.unique(units)
    if not shuffle:
        return distinct
    return np.random.default_rng([seed, epoch, 0]).permutation(distinct)


def share_positions(
    index: SplitIndex, unit_order: np.ndarray, *, num_shares: int, share: int
) -> tuple[np.ndarray, int]:
    """Row positions of ``share``: an equal contiguous cut of the epoch's unit-ordered sequence.

    Returns:
        The positions (in stream order) and the number of samples dropped by the equal cut.
    """
    rank_of_unit = np.empty(int(unit_order.max()) + 1 if unit_order.size else 0, dtype=np.int64)
    rank_of_unit[unit_order] = np.arange(unit_order.size)
    stream = np.argsort(rank_of_unit[index.unit], kind="stable")
    per_share = len(index) // num_shares
    start = share * per_share
    return stream[start : start + per_share], len(index) - per_share * num_shares


def shuffle_buffer_order(positions: np.ndarray, buffer_size: int,
                         rng: np.random.Generator) -> np.ndarray:
    """Emission order of a streaming shuffle buffer holding at most ``buffer_size`` samples."""
    if buffer_size <= 1:
        return positions.copy()
    out = np.empty_like(positions)
    buf: list[int] = []
    n = 0
    for pos in positions.tolist():
        if len(buf) < buffer_size:
            buf.append(pos)
            continue
        j = int(rng.integers(buffer_size))
        out[n], buf[j] = buf[j], pos
        n += 1
    out[n:] = np.asarray(buf, dtype=positions.dtype)[rng.permutation(len(buf))]
    return out


def cut_batches(
    order: np.ndarray,
    lengths: np.ndarray,
    *,
    batch_size: int,
    batching: Batching,
    pool_batches: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Cut a stream into micro-batches of ``batch_size`` samples (the last may be smaller).

    ``pad`` keeps stream order; ``bucket`` sorts each pool of ``pool_batches`` batches by length
    so samples of similar length share a batch, then shuffles the batch order inside the pool.
    Both give ``ceil(len(order) / batch_size)`` batches, so equal shares give equal batch counts.
    """
    if batching == "pad":
        return [order[i : i + batch_size] for i in range(0, order.size, batch_size)]
    pool = batch_size * pool_batches
    batches: list[np.ndarray] = []
    for start in range(0, order.size, pool):
        chunk = order[start : start + pool]
        chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
        cut = [chunk[i : i + batch_size] for i in range(0, chunk.size, batch_size)]
        batches += [cut[i] for i in rng.permutation(len(cut))]
    return batches


def pack_rows(order: np.ndarray, lengths: np.ndarray, *, row_tokens: int,
              buffer_size: int) -> list[np.ndarray]:
    """Fill rows of at most ``row_tokens`` tokens with whole samples, first fit from a buffer.

    The buffer holds the next ``buffer_size`` samples of ``order``; each row starts with the
    oldest one, then takes, in buffer order, every sample that still fits. A sample longer than
    a row gets a row of its own. The rows are a pure function of the arguments.
    """
    lens = dict(zip(order.tolist(), lengths[order].tolist(), strict=True))
    stream = iter(order.tolist())
    buf: list[int] = []
    rows: list[np.ndarray] = []
    while True:
        buf += [pos for _, pos in zip(range(buffer_size - len(buf)), stream, strict=False)]
        if not buf:
            return rows
        room = row_tokens
        row: list[int] = []
        rest: list[int] = []
        for pos in buf:
            if lens[pos] <= room or not row:
                row.append(pos)
                room -= lens[pos]
            else:
                rest.append(pos)
        rows.append(np.asarray(row, dtype=order.dtype))
        buf = rest


def rows_to_batches(rows: list[np.ndarray], batch_size: int
                    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Group packed rows ``batch_size`` at a time: each batch's samples and their row numbers."""
    batches, row_of = [], []
    for i in range(0, len(rows), batch_size):
        group = rows[i:i + batch_size]
        batches.append(np.concatenate(group))
        row_of.append(np.repeat(np.arange(len(group)), [r.size for r in group]))
    return batches, row_of


def plan_epoch(
    index: SplitIndex,
    *,
    seed: int,
    epoch: int,
    num_shares: int,
    share: int,
    batch_size: int,
    batching: Batching = "bucket",
    shuffle: bool = True,
    shuffle_buffer: int = 256,
    pool_batches: int = 16,
    row_tokens: int = 0,
    num_batches: int | None = None,
) -> EpochPlan:
    """The deterministic micro-batch schedule of one share for one epoch.

    ``pack`` (training only) fills rows of ``row_tokens`` tokens (see ``pack_rows``), and a
    batch is ``batch_size`` rows. Packed shares differ in row count, so ``num_batches`` (see
    ``packed_batches_per_share``) cuts every share to the same count, repeating a short share's
    first batches.
    """
    assert 0 <= share < num_shares, (share, num_shares)
    unit_order = epoch_unit_order(index.unit, seed=seed, epoch=epoch, shuffle=shuffle)
    positions, dropped = share_positions(index, unit_order, num_shares=num_shares, share=share)
    rng = np.random.default_rng([seed, epoch, 1, share])
    order = shuffle_buffer_order(positions, shuffle_buffer, rng) if shuffle else positions
    rows = None
    if batching == "pack" and shuffle:
        assert row_tokens > 0, "pack needs row_tokens"
        batches, rows = rows_to_batches(
            pack_rows(order, index.length, row_tokens=row_tokens, buffer_size=shuffle_buffer),
            batch_size)
        if num_batches is not None:
            dropped += sum(b.size for b in batches[num_batches:])
            reps = -(-num_batches // max(len(batches), 1))
            batches, rows = (batches * reps)[:num_batches], (rows * reps)[:num_batches]
    else:
        batches = cut_batches(
            order, index.length, batch_size=batch_size,
            batching="pad" if not shuffle or batching == "pack" else batching,
            pool_batches=pool_batches, rng=rng,
        )
    mine = np.unique(index.unit[positions])
    return EpochPlan(batches=batches, rows=rows,
                     unit_order=unit_order[np.isin(unit_order, mine)], num_dropped=dropped)


def packed_batches_per_share(index: SplitIndex, *, seed: int, num_shares: int, batch_size: int,
                             shuffle_buffer: int, row_tokens: int) -> int:
    """Packed micro-batches every share yields per epoch: the fewest any share packs in epoch 0."""
    return min(len(plan_epoch(index, seed=seed, epoch=0, num_shares=num_shares, share=share,
                              batch_size=batch_size, batching="pack",
                              shuffle_buffer=shuffle_buffer, row_tokens=row_tokens).batches)
               for share in range(num_shares))


def batches_per_share(num_samples: int, *, num_shares: int, batch_size: int) -> int:
    """Micro-batches each share yields per epoch (identical for every share)."""
    return -(-(num_samples // num_shares) // batch_size)


def padding_waste(batches: Sequence[np.ndarray], lengths: np.ndarray) -> float:
    """Fraction of computed token slots that are padding when each batch pads to its longest."""
    real = sum(int(lengths[b].sum()) for b in batches)
    computed = sum(int(lengths[b].max()) * b.size for b in batches if b.size)
    return 1.0 - real / computed if computed else 0.0


def packing_waste(lengths: np.ndarray, *, row_tokens: int) -> float:
    """Padding fraction of first-fit-decreasing packing into rows of ``row_tokens`` tokens."""
    free: list[int] = []
    for length in sorted(lengths.tolist(), reverse=True):
        for i, room in enumerate(free):
            if room >= length:
                free[i] -= length
                break
        else:
            free.append(row_tokens - length)
    computed = len(free) * row_tokens
    return 1.0 - int(lengths.sum()) / computed if computed else 0.0
