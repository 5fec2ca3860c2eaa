"""Epoch planning: disjoint equal shares, deterministic order, bounded shuffle, padding waste."""

from __future__ import annotations

import numpy as np
import pytest

from sparkforge.trainer.data_plan import (
    EpochPlan,
    SplitIndex,
    batches_per_share,
    pack_rows,
    packed_batches_per_share,
    packing_waste,
    padding_waste,
    plan_epoch,
    shuffle_buffer_order,
)
from sparkforge.trainer.loader_settings import LoaderSettings

PLAN_KEYS = ("epoch", "num_shares", "share", "shuffle", "num_batches")


def _index(num_units: int = 7, per_unit: int = 9, seed: int = 0) -> SplitIndex:
    rng = np.random.default_rng(seed)
    n = num_units * per_unit
    return SplitIndex.from_columns(
        sample_id=np.arange(n) * 3 + 1,
        unit=np.repeat(np.arange(num_units), per_unit),
        length=rng.integers(16, 512, size=n),
    )


def _plan(index: SplitIndex, **kw: object) -> EpochPlan:
    """plan_epoch with the plan's own arguments and the settings' fields mixed in ``kw``."""
    row_tokens = kw.pop("row_tokens", None)
    if row_tokens is not None:
        kw["max_seq_len"] = row_tokens
    settings = LoaderSettings(**{k: v for k, v in kw.items() if k not in PLAN_KEYS})
    return plan_epoch(index, settings, **{k: v for k, v in kw.items()  # type: ignore[arg-type]
                                          if k in PLAN_KEYS})


def _batches(plan: EpochPlan) -> list[np.ndarray]:
    return [plan.batch(b) for b in range(len(plan))]


def _plan_ids(index: SplitIndex, **kw: object) -> list[list[int]]:
    plan = _plan(index, **kw)
    return [index.sample_id[b].tolist() for b in _batches(plan)]


@pytest.mark.parametrize("num_shares", [1, 2, 3, 4, 8])
def test_shares_are_disjoint_equal_and_cover_all_but_remainder(num_shares: int) -> None:
    """Every share gets the same sample count; shares never overlap; < num_shares are left out."""
    index = _index()
    seen: list[int] = []
    counts = []
    for share in range(num_shares):
        ids = [i for b in _plan_ids(index, seed=1, epoch=0, num_shares=num_shares, share=share,
                                    batch_size=4) for i in b]
        counts.append(len(ids))
        seen += ids
    assert len(set(counts)) == 1
    assert len(seen) == len(set(seen))
    assert len(index) - len(seen) < num_shares
    assert set(seen) <= set(index.sample_id.tolist())


def test_plan_is_deterministic_per_epoch_and_changes_across_epochs() -> None:
    """Same (seed, epoch, share) gives the same batches; another epoch or seed reorders."""
    index = _index()
    kw = {"num_shares": 2, "share": 1, "batch_size": 3}
    a = _plan_ids(index, seed=5, epoch=2, **kw)
    assert a == _plan_ids(index, seed=5, epoch=2, **kw)
    assert a != _plan_ids(index, seed=5, epoch=3, **kw)
    assert a != _plan_ids(index, seed=6, epoch=2, **kw)


def test_batch_count_is_the_same_for_every_share() -> None:
    """Equal batch counts keep DDP ranks in lock step (no rank waits on a missing batch)."""
    index = _index(num_units=5, per_unit=11)
    for batching in ("pad", "bucket"):
        lens = {len(_plan(index, seed=0, epoch=0, num_shares=3, share=s, batch_size=4,
                          batching=batching)) for s in range(3)}
        assert lens == {batches_per_share(len(index), num_shares=3, batch_size=4)}


def test_shuffle_buffer_is_a_bounded_permutation() -> None:
    """The i-th emitted sample is always among the first i + buffer_size read (bounded memory)."""
    positions = np.arange(200)
    out = shuffle_buffer_order(positions, 16, np.random.default_rng(0))
    assert sorted(out.tolist()) == positions.tolist()
    assert all(out[i] < i + 16 for i in range(out.size))
    assert out.tolist() != positions.tolist()


def test_eval_plan_keeps_storage_order() -> None:
    """Without shuffle the share is read in unit and sample order."""
    index = _index()
    ids = [i for b in _plan_ids(index, seed=0, epoch=4, num_shares=1, share=0, batch_size=5,
                                shuffle=False) for i in b]
    assert ids == index.sample_id.tolist()


def test_bucketing_wastes_less_padding_than_stream_order() -> None:
    """Length bucketing pads less than pad-to-longest on the same shuffled stream."""
    index = _index(num_units=20, per_unit=50)
    waste = {}
    for batching in ("pad", "bucket"):
        plan = _plan(index, seed=0, epoch=0, num_shares=1, share=0, batch_size=8,
                     batching=batching)
        waste[batching] = padding_waste(plan, index.length)
    assert waste["bucket"] < waste["pad"] / 3


def test_waste_measures_against_hand_computation() -> None:
    """Padding and packing waste match a hand count."""
    lengths = np.array([4, 2, 3, 1])
    plan = EpochPlan(positions=np.arange(4), batch_starts=np.array([0, 2, 4]), row_of=None,
                     unit_order=np.zeros(1), num_dropped=0)
    assert padding_waste(plan, lengths) == pytest.approx(1 - 10 / 14)
    assert packing_waste(lengths, row_tokens=5) == pytest.approx(0.0)
    assert packing_waste(np.array([3, 3]), row_tokens=4) == pytest.approx(1 - 6 / 8)


def test_pack_rows_first_fit_decreasing_per_window() -> None:
    """Inside each window the longest sample goes first into the first row with room."""
    lengths = np.array([5, 4, 3, 6, 2, 9])
    rows = pack_rows(np.arange(6), lengths, row_tokens=10, window=3)
    # window [5, 4, 3]: 5 -> row 0, 4 -> row 0, 3 -> row 1; window [6, 2, 9]: 9 -> row 2,
    # 6 -> row 3, 2 -> row 3.
    assert rows.tolist() == [0, 0, 1, 3, 3, 2]
    too_long = pack_rows(np.arange(2), np.array([12, 3]), row_tokens=10, window=4)
    assert too_long.tolist() == [0, 1]
    shuffled = pack_rows(np.array([4, 0, 2]), np.array([7, 0, 3, 0, 3]), row_tokens=10,
                         window=8)
    assert shuffled.tolist() == [0, 0, 1]  # 7 (sample 0) opens row 0, 3 (sample 4) fits


def test_shuffle_buffer_matches_a_step_by_step_buffer() -> None:
    """The vectorized buffer emits what a buffer replaying the same slot draws emits."""
    positions = np.arange(100, 400)
    out = shuffle_buffer_order(positions, 32, np.random.default_rng(7))
    rng = np.random.default_rng(7)
    slots = rng.integers(32, size=positions.size - 32, dtype=np.int64)
    buf, want = list(positions[:32]), []
    for slot, pos in zip(slots.tolist(), positions[32:].tolist(), strict=True):
        want.append(buf[slot])
        buf[slot] = pos
    want += [buf[i] for i in rng.permutation(32)]
    assert out.tolist() == want


def test_packed_plan_is_a_deterministic_cover_of_full_rows() -> None:
    """Every share sample once, rows within row_tokens, same plan for the same (seed, epoch)."""
    index = _index(num_units=12, per_unit=20)
    kw = {"seed": 4, "epoch": 1, "num_shares": 2, "share": 1, "batch_size": 3,
          "batching": "pack", "shuffle_buffer": 64, "row_tokens": 2048}
    plan = _plan(index, **kw)
    assert plan.row_of is not None
    again = _plan(index, **kw)
    assert np.array_equal(plan.positions, again.positions)
    assert np.array_equal(plan.batch_starts, again.batch_starts)
    other = _plan(index, **{**kw, "epoch": 2})
    assert not np.array_equal(plan.positions, other.positions)
    assert len(set(plan.positions.tolist())) == plan.positions.size == len(index) // 2
    fills = [np.bincount(plan.rows(b), weights=index.length[plan.batch(b)])
             for b in range(len(plan))]
    assert max(f.max() for f in fills) <= 2048
    fill = index.length[plan.positions].sum() / (sum(f.size for f in fills) * 2048)
    assert fill > 0.9


def test_packed_plans_are_cut_to_the_same_batch_count() -> None:
    """num_batches truncates a long share and repeats a short share's first batches; the count
    is exact for share 0 and within a batch of each share's own count."""
    index = _index(num_units=10, per_unit=10)
    kw = {"seed": 0, "epoch": 0, "num_shares": 3, "batch_size": 2, "batching": "pack",
          "shuffle_buffer": 16, "row_tokens": 1024}
    count = packed_batches_per_share(index, LoaderSettings(
        seed=0, batch_size=2, batching="pack", shuffle_buffer=16, max_seq_len=1024),
        num_shares=3)
    plans = [_plan(index, share=s, **kw) for s in range(3)]
    assert count <= len(plans[0])
    assert all(abs(count - len(p)) <= 1 for p in plans)
    short = _plan(index, share=0, num_batches=len(plans[0]) + 2, **kw)
    assert len(short) == len(plans[0]) + 2
    assert np.array_equal(short.batch(len(short) - 2), plans[0].batch(0))
    cut = _plan(index, share=0, num_batches=len(plans[0]) - 1, **kw)
    assert len(cut) == len(plans[0]) - 1
    assert (cut.num_dropped - plans[0].num_dropped
            == plans[0].positions.size - cut.positions.size)


def test_one_share_packs_every_sample() -> None:
    """A single share's count is its own: nothing is cut or repeated."""
    index = _index(num_units=10, per_unit=10)
    settings = LoaderSettings(batch_size=2, batching="pack", shuffle_buffer=16,
                              max_seq_len=1024)
    count = packed_batches_per_share(index, settings, num_shares=1)
    plan = plan_epoch(index, settings, epoch=0, num_shares=1, share=0, num_batches=count)
    assert sorted(plan.positions.tolist()) == list(range(len(index)))


def _plan_peak_bytes(index: SplitIndex, num_shares: int) -> int:
    """Peak bytes allocated while planning share 0 of ``num_shares`` (packed)."""
    import tracemalloc

    settings = LoaderSettings(batch_size=4, batching="pack", max_seq_len=2048)
    tracemalloc.start()
    plan_epoch(index, settings, epoch=0, num_shares=num_shares, share=0)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def test_a_share_is_planned_without_touching_the_others() -> None:
    """Planning one share allocates in proportion to that share (plus one entry per unit): 16
    times the shares, at most a quarter of the bytes. A plan that ordered the whole split
    (as every share's once did) allocates the same whatever the share count."""
    index = _index(num_units=400, per_unit=250)
    few, many = _plan_peak_bytes(index, 4), _plan_peak_bytes(index, 64)
    assert many * 4 < few
