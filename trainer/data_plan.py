"""Plan one epoch of the training stream from the cache's sample index alone (no hidden states).

The plan is a pure function of (index, settings, epoch, share): units are visited in a per-epoch
shuffled order, the epoch's sample sequence is cut into equal contiguous shares (one per
data-parallel rank x dataloader worker), each share passes through a bounded shuffle buffer and is
cut into micro-batches (``pack``: first packed into rows of whole samples, then cut). Because only
sample ids and lengths are needed, a resumed run recomputes the same plan and skips the batches
already consumed without reading them.

Every step is numpy over whole columns, and a share is planned without looking at any other:
planning costs O(units + share samples), whatever the number of shares.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from sparkforge.shared.cache_tables import group_starts
from sparkforge.trainer.loader_settings import Batching, LoaderSettings


@dataclass(frozen=True)
class SplitIndex:
    """The samples of one split, in storage order (unit, then sample id)."""

    sample_id: np.ndarray
    """int64, one per sample: its global sample id."""
    unit: np.ndarray
    """int32, one per sample: the commit unit holding it."""
    length: np.ndarray
    """int32, one per sample: its length in tokens."""
    num_loss_tokens: np.ndarray | None = None
    """int32, one per sample: its supervised tokens (None when not read)."""
    units: np.ndarray = field(init=False)
    """Distinct units, increasing."""
    unit_starts: np.ndarray = field(init=False)
    """``len(units) + 1`` offsets: the samples of ``units[k]`` are rows
    ``unit_starts[k]:unit_starts[k + 1]``."""

    def __post_init__(self) -> None:
        units, starts = group_starts(self.unit)
        object.__setattr__(self, "units", units)
        object.__setattr__(self, "unit_starts", starts)

    def __len__(self) -> int:
        return int(self.sample_id.shape[0])

    def positions_in_unit(self, unit: int, sample_ids: np.ndarray) -> np.ndarray:
        """The positions of a unit's samples (-1 for an id the split does not hold there)."""
        k = int(np.searchsorted(self.units, unit))
        if k == self.units.size or int(self.units[k]) != unit:
            return np.full(sample_ids.shape, -1, dtype=np.int64)
        lo, hi = int(self.unit_starts[k]), int(self.unit_starts[k + 1])
        at = lo + np.searchsorted(self.sample_id[lo:hi], sample_ids)
        found = at < hi
        found[found] = self.sample_id[at[found]] == sample_ids[found]
        return np.where(found, at, -1)

    @classmethod
    def from_columns(
        cls,
        *,
        sample_id: Sequence[int] | np.ndarray,
        unit: Sequence[int] | np.ndarray,
        length: Sequence[int] | np.ndarray,
        num_loss_tokens: Sequence[int] | np.ndarray | None = None,
    ) -> SplitIndex:
        """Build from index columns; rows are sorted by (unit, sample id) unless already so."""
        sid = np.asarray(sample_id, dtype=np.int64)
        uni = np.asarray(unit, dtype=np.int32)
        ordered = sid.size < 2 or bool(((uni[1:] > uni[:-1]) | (
            (uni[1:] == uni[:-1]) & (sid[1:] > sid[:-1]))).all())
        order = slice(None) if ordered else np.lexsort((sid, uni))
        loss = None if num_loss_tokens is None else np.asarray(num_loss_tokens, np.int32)[order]
        return cls(sample_id=sid[order], unit=uni[order],
                   length=np.asarray(length, dtype=np.int32)[order], num_loss_tokens=loss)


@dataclass(frozen=True)
class EpochPlan:
    """The micro-batches one share consumes in one epoch: batch ``b`` is
    ``positions[batch_starts[b]:batch_starts[b + 1]]`` (row positions into the SplitIndex)."""

    positions: np.ndarray
    batch_starts: np.ndarray
    row_of: np.ndarray | None
    """``pack`` only: aligned with ``positions``, the row inside its batch of each sample
    (samples of one row are contiguous, rows in order); None when every sample is its own row."""
    unit_order: np.ndarray
    """Units in the order this share reads them (only those holding its samples)."""
    num_dropped: int
    """Samples left out this epoch so every share yields the same count."""
    period: int | None = None
    """Batch ``b + period`` repeats batch ``b`` (a short packed share repeating its first
    batches); None when no batch repeats. Inside a period each sample appears once."""

    def __len__(self) -> int:
        return int(self.batch_starts.size - 1)

    def last_use(self, b: int) -> bool:
        """Whether batch ``b`` is the last one that holds its samples."""
        return self.period is None or b + self.period >= len(self)

    def batch(self, b: int) -> np.ndarray:
        """The positions of batch ``b``."""
        return self.positions[int(self.batch_starts[b]):int(self.batch_starts[b + 1])]

    def rows(self, b: int) -> np.ndarray | None:
        """The row of each sample of batch ``b`` (``pack``), else None."""
        if self.row_of is None:
            return None
        return self.row_of[int(self.batch_starts[b]):int(self.batch_starts[b + 1])]

    def batch_of(self) -> np.ndarray:
        """The batch number of each entry of ``positions``."""
        return np.repeat(np.arange(len(self)), np.diff(self.batch_starts))


def epoch_unit_order(index: SplitIndex, *, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Positions into ``index.units`` in a deterministic per-epoch order (increasing when
    ``shuffle`` is False)."""
    count = index.units.size
    if not shuffle:
        return np.arange(count)
    return np.random.default_rng([seed, epoch, 0]).permutation(count)


def ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + c) for s, c in zip(starts, counts)])``, without a loop."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(counts)
    step = np.ones(total, dtype=np.int64)
    nonempty = counts > 0
    first = (ends - counts)[nonempty]
    step[0] = starts[nonempty][0]
    step[first[1:]] = (np.asarray(starts)[nonempty][1:]
                       - (np.asarray(starts)[nonempty][:-1] + counts[nonempty][:-1] - 1))
    return np.cumsum(step)


def share_span(num_samples: int, *, num_shares: int, share: int) -> tuple[int, int, int]:
    """The stream positions ``[start, stop)`` of ``share`` and the samples the equal cut drops."""
    per_share = num_samples // num_shares
    return share * per_share, (share + 1) * per_share, num_samples - per_share * num_shares


def share_positions(index: SplitIndex, unit_order: np.ndarray, *, num_shares: int,
                    share: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Row positions of ``share``: an equal contiguous cut of the epoch's unit-ordered stream.

    Returns:
        The positions (in stream order), the share's units (positions into ``index.units``, in
        reading order) and the number of samples dropped by the equal cut.
    """
    counts = np.diff(index.unit_starts)[unit_order]
    ends = np.cumsum(counts)
    start, stop, dropped = share_span(len(index), num_shares=num_shares, share=share)
    first = int(np.searchsorted(ends, start, "right"))
    last = int(np.searchsorted(ends, stop, "left")) + 1 if stop > start else first
    mine = unit_order[first:last]
    begin = index.unit_starts[mine].copy()
    take = counts[first:last].copy()
    if mine.size:
        skip = start - int(ends[first] - counts[first])
        begin[0] += skip
        take[0] -= skip
        take[-1] -= int(ends[last - 1]) - stop
    return ranges(begin, take), mine[take > 0], dropped


def shuffle_buffer_order(positions: np.ndarray, buffer_size: int,
                         rng: np.random.Generator) -> np.ndarray:
    """Emission order of a streaming shuffle buffer holding at most ``buffer_size`` samples.

    The buffer fills with the first ``buffer_size`` samples; each next sample replaces a random
    slot, whose occupant is emitted; the rest leave in a random order. Vectorized: the occupant
    a step emits is the last sample written to its slot before it.
    """
    n = positions.size
    if buffer_size <= 1 or n <= 1:
        return positions.copy()
    if n <= buffer_size:
        return positions[rng.permutation(n)]
    steps = n - buffer_size
    slot = rng.integers(buffer_size, size=steps, dtype=np.int64)
    # Grouped by slot, in step order (radix sort for small buffers).
    by_slot = np.argsort(slot.astype(np.uint16) if buffer_size <= 1 << 16 else slot,
                         kind="stable")
    grouped = slot[by_slot]
    first = np.r_[True, grouped[1:] != grouped[:-1]]
    written = positions[buffer_size:]
    emitted = np.empty(steps, dtype=positions.dtype)
    emitted[by_slot] = np.where(first, positions[grouped],
                                written[np.r_[0, by_slot[:-1]]])
    last = np.r_[grouped[1:] != grouped[:-1], True]
    left = positions[:buffer_size].copy()
    left[grouped[last]] = written[by_slot[last]]
    return np.concatenate([emitted, left[rng.permutation(buffer_size)]])


def cut_batches(order: np.ndarray, lengths: np.ndarray, *, batch_size: int,
                batching: Batching, pool_batches: int,
                rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Cut a stream into micro-batches of ``batch_size`` samples (the last may be smaller).

    ``pad`` keeps stream order; ``bucket`` sorts each pool of ``pool_batches`` batches by length
    so samples of similar length share a batch, then shuffles the batch order inside the pool.
    Both give ``ceil(len(order) / batch_size)`` batches, so equal shares give equal batch counts.

    Returns:
        The positions batch after batch, and the ``num_batches + 1`` batch offsets.
    """
    n = order.size
    starts = np.r_[np.arange(0, n, batch_size), n].astype(np.int64)
    if batching == "pad" or n == 0:
        return order.copy(), starts
    pool = np.arange(n) // (batch_size * pool_batches)
    by_length = order[np.lexsort((lengths[order], pool))]
    sizes = np.diff(starts)
    batch_pool = starts[:-1] // (batch_size * pool_batches)
    shuffled = np.lexsort((rng.random(sizes.size), batch_pool))
    positions = by_length[ranges(starts[:-1][shuffled], sizes[shuffled])]
    return positions, np.r_[0, np.cumsum(sizes[shuffled])].astype(np.int64)


def pack_rows(order: np.ndarray, lengths: np.ndarray, *, row_tokens: int,
              window: int) -> np.ndarray:
    """Fill rows of at most ``row_tokens`` tokens with whole samples, first fit decreasing per
    window.

    The stream is cut into windows of ``window`` consecutive samples; inside a window the
    samples, longest first, each go into the first row that still has room (a new row when
    none has; a sample longer than a row gets one of its own). Rows are numbered window after
    window, in the order they were opened. All windows are filled at once, one sample rank at a
    time, so the work is numpy over ``len(order) / window`` windows per step.

    Returns:
        The row of each sample of ``order``.
    """
    n = order.size
    num_windows = -(-n // window)
    by_length = np.lexsort((-lengths[order], np.arange(n) // window))
    flat = np.zeros(num_windows * window, dtype=np.int64)
    flat[:n] = lengths[order][by_length]
    lens = flat.reshape(num_windows, window)
    room = np.full((num_windows, window), row_tokens, dtype=np.int64)
    used = np.zeros((num_windows, window), dtype=bool)
    row = np.zeros((num_windows, window), dtype=np.int64)
    windows = np.arange(num_windows)
    num_open = 0  # rows opened by the fullest window so far: only those (and one more) can fit
    for t in range(window):
        need = lens[:, t]
        span = min(num_open + 1, window)
        pick = ((room[:, :span] >= need[:, None]) | ~used[:, :span]).argmax(axis=1)
        room[windows, pick] -= need
        used[windows, pick] |= need > 0
        row[:, t] = pick
        num_open = max(num_open, int(pick.max()) + 1)
    offset = np.r_[0, np.cumsum(used.sum(axis=1))[:-1]]
    out = np.empty(n, dtype=np.int64)
    out[by_length] = (row + offset[:, None]).reshape(-1)[:n]
    return out


def rows_to_batches(order: np.ndarray, row: np.ndarray, batch_size: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Group packed rows ``batch_size`` at a time.

    Returns:
        The positions (row after row, each row in stream order), the batch offsets and each
        sample's row inside its batch.
    """
    by_row = np.argsort(row, kind="stable")
    row = row[by_row]
    counts = np.bincount(row // batch_size) if row.size else np.zeros(0, dtype=np.int64)
    return order[by_row], np.r_[0, np.cumsum(counts)].astype(np.int64), row % batch_size


def cut_to(order: np.ndarray, starts: np.ndarray, row_of: np.ndarray, num_batches: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Exactly ``num_batches`` packed batches: the extra ones cut, or a short share's batches
    repeated from its first one. Returns the batches and the samples cut."""
    have = starts.size - 1
    if num_batches <= have:
        end = int(starts[num_batches])
        return order[:end], starts[:num_batches + 1], row_of[:end], order.size - end
    if not have:
        return order, starts, row_of, 0
    reps = -(-num_batches // have)
    sizes = np.tile(np.diff(starts), reps)[:num_batches]
    end = int(sizes.sum())
    return (np.tile(order, reps)[:end], np.r_[0, np.cumsum(sizes)].astype(np.int64),
            np.tile(row_of, reps)[:end], 0)


def plan_epoch(index: SplitIndex, settings: LoaderSettings, *, epoch: int, num_shares: int,
               share: int, shuffle: bool = True, num_batches: int | None = None) -> EpochPlan:
    """The deterministic micro-batch schedule of one share for one epoch.

    A shuffled (training) plan uses ``settings.batching`` and ``batch_size``; an unshuffled
    (validation) plan keeps storage order, one sample per row, ``eval_batch_size`` per batch.
    ``pack`` fills rows of ``max_seq_len`` tokens (see ``pack_rows``), and a batch is
    ``batch_size`` rows; ``num_batches`` (see ``packed_batches_per_share``) cuts every share to
    the same count.
    """
    assert 0 <= share < num_shares, (share, num_shares)
    s = settings
    unit_order = epoch_unit_order(index, seed=s.seed, epoch=epoch, shuffle=shuffle)
    positions, mine, dropped = share_positions(index, unit_order, num_shares=num_shares,
                                               share=share)
    rng = np.random.default_rng([s.seed, epoch, 1, share])
    order = shuffle_buffer_order(positions, s.shuffle_buffer, rng) if shuffle else positions
    row_of, period = None, None
    if s.batching == "pack" and shuffle:
        row = pack_rows(order, index.length, row_tokens=s.max_seq_len, window=s.shuffle_buffer)
        order, starts, row_of = rows_to_batches(order, row, s.batch_size)
        if num_batches is not None:
            period = starts.size - 1 if 0 < starts.size - 1 < num_batches else None
            order, starts, row_of, cut = cut_to(order, starts, row_of, num_batches)
            dropped += cut
        row_of = row_of.astype(np.int16 if s.batch_size < 1 << 15 else np.int32)
    else:
        order, starts = cut_batches(
            order, index.length, batch_size=s.batch_size if shuffle else s.eval_batch_size,
            batching=s.batching if shuffle and s.batching != "pack" else "pad",
            pool_batches=s.pool_batches, rng=rng)
    # Compact: a plan lives for its epoch (4 + 2 bytes per sample, not 8 + 8).
    order = order.astype(np.int32 if len(index) < 1 << 31 else np.int64)
    return EpochPlan(positions=order, batch_starts=starts, row_of=row_of,
                     unit_order=index.units[mine], num_dropped=dropped, period=period)


def packed_batches_per_share(index: SplitIndex, settings: LoaderSettings, *,
                             num_shares: int) -> int:
    """Packed micro-batches every share yields per epoch, the same on every rank without any
    communication and without planning any share but share 0.

    Share 0's epoch-0 plan gives its rows per token; each share's rows are estimated as its
    epoch-0 tokens at that rate (exact for share 0, and for a single share), and the count is
    the fewest batches over the shares. The token sums come from one pass over the lengths. A
    share packing more batches cuts the extra ones; one packing fewer repeats its first ones.
    """
    s = settings
    tokens = share_tokens(index, s, num_shares=num_shares)
    if not len(index) or not tokens[0]:
        return 0
    plan = plan_epoch(index, s, epoch=0, num_shares=num_shares, share=0)
    assert plan.row_of is not None, "a packed plan"
    last = plan.rows(len(plan) - 1)
    rows0 = (len(plan) - 1) * s.batch_size + int(last.max()) + 1 if last is not None else 0
    rows = -(-(rows0 * tokens) // tokens[0])
    return int((-(-rows // s.batch_size)).min())


def share_tokens(index: SplitIndex, settings: LoaderSettings, *, num_shares: int) -> np.ndarray:
    """Tokens of each share in epoch 0 (a sample longer than a packed row counts as one row)."""
    order = epoch_unit_order(index, seed=settings.seed, epoch=0, shuffle=True)
    cum = np.r_[0, np.cumsum(np.minimum(index.length, settings.max_seq_len), dtype=np.int64)]
    first, counts = index.unit_starts[order], np.diff(index.unit_starts)[order]
    ends = np.r_[0, np.cumsum(counts)]
    before = np.r_[0, np.cumsum(cum[first + counts] - cum[first])]
    bounds = np.arange(num_shares + 1) * (len(index) // num_shares)
    k = np.clip(np.searchsorted(ends, bounds, "right") - 1, 0, max(order.size - 1, 0))
    at = before[k] + cum[first[k] + bounds - ends[k]] - cum[first[k]]
    return np.diff(at)


def batches_per_share(num_samples: int, *, num_shares: int, batch_size: int) -> int:
    """Micro-batches each share yields per epoch (identical for every share)."""
    return -(-(num_samples // num_shares) // batch_size)


def padding_waste(plan: EpochPlan, lengths: np.ndarray) -> float:
    """Fraction of computed token slots that are padding when each batch pads to its longest."""
    if not plan.positions.size:
        return 0.0
    lens = lengths[plan.positions].astype(np.int64)
    starts = plan.batch_starts[:-1][np.diff(plan.batch_starts) > 0]
    longest = np.maximum.reduceat(lens, starts)
    computed = int((longest * np.diff(np.r_[starts, lens.size])).sum())
    return 1.0 - int(lens.sum()) / computed


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
