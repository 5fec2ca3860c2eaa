"""Epoch planning: disjoint equal shares, deterministic order, bounded shuffle, padding waste."""

from __future__ import annotations

import numpy as np
import pytest

from sparkforge.trainer.data_plan import (
    SplitIndex,
    batches_per_share,
    pack_rows,
    packed_batches_per_share,
    packing_waste,
    padding_waste,
    plan_epoch,
    shuffle_buffer_order,
)


def _index(num_units: int = 7, per_unit: int = 9, seed: int = 0) -> SplitIndex:
    rng = np.random.default_rng(seed)
    n = num_units * per_unit
    return SplitIndex.from_columns(
        sample_id=np.arange(n) * 3 + 1,
        unit=np.repeat(np.arange(num_units), per_unit),
        length=rng.integers(16, 512, size=n),
    )


def _plan_ids(index: SplitIndex, **kw: object) -> list[list[int]]:
    plan = plan_epoch(index, **kw)  # type: ignore[arg-type]
    return [index.sample_id[b].tolist() for b in plan.batches]


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
        lens = {len(plan_epoch(index, seed=0, epoch=0, num_shares=3, share=s, batch_size=4,
                               batching=batching).batches) for s in range(3)}
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
        plan = plan_epoch(index, seed=0, epoch=0, num_shares=1, share=0, batch_size=8,
                          batching=batching)
        waste[batching] = padding_waste(plan.batches, index.length)
    assert waste["bucket"] < waste["pad"] / 3


def test_waste_measures_against_hand_computation() -> None:
    """Padding and packing waste match a hand count."""
    lengths = np.array([4, 2, 3, 1])
    batches = [np.array([0, 1]), np.array([2, 3])]
    assert padding_waste(batches, lengths) == pytest.approx(1 - 10 / 14)
    assert packing_waste(lengths, row_tokens=5) == pytest.approx(0.0)
    assert packing_waste(np.array([3, 3]), row_tokens=4) == pytest.approx(1 - 6 / 8)


def test_pack_rows_first_fit_from_the_buffer() -> None:
    """Each row starts with the buffer's oldest sample and takes, in order, those that fit."""
    lengths = np.array([5, 4, 3, 6, 2, 9])
    rows = pack_rows(np.arange(6), lengths, row_tokens=10, buffer_size=3)
    # buffer [0,1,2] -> row [0(5),1(4)]; buffer [2,3,4] -> [2(3),3(6)]; [4,5] -> [4]; [5].
    assert [r.tolist() for r in rows] == [[0, 1], [2, 3], [4], [5]]
    too_long = pack_rows(np.arange(2), np.array([12, 3]), row_tokens=10, buffer_size=4)
    assert [r.tolist() for r in too_long] == [[0], [1]]


def test_packed_plan_is_a_deterministic_cover_of_full_rows() -> None:
    """Every share sample once, rows within row_tokens, same plan for the same (seed, epoch)."""
    index = _index(num_units=12, per_unit=20)
    kw = {"seed": 4, "epoch": 1, "num_shares": 2, "share": 1, "batch_size": 3,
          "batching": "pack", "shuffle_buffer": 64, "row_tokens": 2048}
    plan = plan_epoch(index, **kw)  # type: ignore[arg-type]
    assert plan.rows is not None
    again = plan_epoch(index, **kw)  # type: ignore[arg-type]
    assert all(np.array_equal(a, b) for a, b in zip(plan.batches, again.batches, strict=True))
    other = plan_epoch(index, **{**kw, "epoch": 2})  # type: ignore[arg-type]
    assert not all(np.array_equal(a, b) for a, b in zip(plan.batches, other.batches,
                                                        strict=False))
    flat = np.concatenate(plan.batches)
    assert len(set(flat.tolist())) == flat.size == len(index) // 2
    fills = [np.bincount(r, weights=index.length[b]) for b, r in zip(plan.batches, plan.rows,
                                                                     strict=True)]
    assert max(f.max() for f in fills) <= 2048
    fill = index.length[flat].sum() / (sum(f.size for f in fills) * 2048)
    assert fill > 0.9


def test_packed_plans_are_cut_to_the_same_batch_count() -> None:
    """num_batches truncates a long share and repeats a short share's first batches."""
    index = _index(num_units=10, per_unit=10)
    kw = {"seed": 0, "epoch": 0, "num_shares": 3, "batch_size": 2, "batching": "pack",
          "shuffle_buffer": 16, "row_tokens": 1024}
    count = packed_batches_per_share(index, seed=0, num_shares=3, batch_size=2,
                                     shuffle_buffer=16, row_tokens=1024)
    plans = [plan_epoch(index, share=s, **kw) for s in range(3)]  # type: ignore[arg-type]
    assert count == min(len(p.batches) for p in plans)
    short = plan_epoch(index, share=0, num_batches=len(plans[0].batches) + 2,
                       **kw)  # type: ignore[arg-type]
    assert len(short.batches) == len(plans[0].batches) + 2
    assert np.array_equal(short.batches[-2], plans[0].batches[0])
