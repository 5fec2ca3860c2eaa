"""Weighted mixes: shares by weight, seeded repeats and subsamples, rows in sample-id order."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from sparkforge.shared.dataset import DatasetError
from sparkforge.shared.errors import ConfigError
from sparkforge.shared.mix import Draws, MixSource, draw_rows, iter_mix_rows, plan_mix, quotas


@pytest.mark.parametrize(("weights", "num_rows", "expected"), [
    ([1, 1], 10, [5, 5]),
    ([0.6, 0.3, 0.1], 10, [6, 3, 1]),
    ([1, 1, 1], 10, [4, 3, 3]),         # the tie goes to the first source
    ([2, 1], 7, [5, 2]),                # 4.67 / 2.33: the larger remainder rounds up
    ([0.5, 0.5], 1, [1, 0]),
])
def test_quotas_split_rows_by_weight_and_sum_exactly(weights: list[float], num_rows: int,
                                                     expected: list[int]) -> None:
    """Largest remainders, computed by hand."""
    assert quotas(weights, num_rows) == expected


def _listed(draws: Draws) -> list[int]:
    """The row of each draw, in draw order."""
    by_position = {k: row for row in range(draws.available) for k in draws.of_row(row)}
    assert sorted(by_position) == list(range(len(draws)))  # each position drawn exactly once
    return [by_position[k] for k in range(len(draws))]


def test_draws_repeat_whole_then_subsample_without_replacement() -> None:
    """7 of 3 rows: every row twice, one more once; 2 of 5 rows: two distinct rows."""
    draws = _listed(draw_rows(3, 7, seed=0, index=0))
    counts = Counter(draws)
    assert sorted(counts.values()) == [2, 2, 3]
    assert set(counts) == {0, 1, 2}
    assert draws == sorted(draws)
    sub = _listed(draw_rows(5, 2, seed=0, index=1))
    assert len(set(sub)) == 2
    assert sub == sorted(sub)
    assert _listed(draw_rows(5, 2, seed=0, index=1)) == sub  # deterministic
    others = {tuple(_listed(draw_rows(50, 5, seed=s, index=1))) for s in range(5)}
    assert len(others) > 1  # the seed matters


def test_draws_are_those_of_numpy_s_seeded_subsample() -> None:
    """The rows drawn once more are numpy's ``choice`` of the (seed, source) generator, so a mix
    drawn before the draws were held compactly draws the same rows."""
    extra = np.random.default_rng([3, 1]).choice(10, size=4, replace=False)
    assert Counter(_listed(draw_rows(10, 24, seed=3, index=1))) == Counter(
        [*range(10), *range(10), *extra.tolist()])


@pytest.mark.parametrize("num_rows", [10**3, 10**6, 10**12])
def test_a_mix_of_many_rows_costs_no_memory_per_row(tmp_path: Path, num_rows: int) -> None:
    """Planning a mix and reading its first rows allocates the same at 10^3, 10^6 and 10^12
    rows (its draws were once listed: 8 bytes per row, then a dict entry per row)."""
    import itertools
    import tracemalloc

    source = MixSource(data=_source(tmp_path, "a", 16), weight=1.0)
    tracemalloc.start()
    plan = plan_mix([source], num_rows=num_rows, seed=0)
    first = list(itertools.islice(iter_mix_rows(plan), 40))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(plan[0].draws) == num_rows
    assert [r.index for r in first] == list(range(40))
    assert peak < 4 << 20, peak  # the JSONL reader's 1 MiB block, whatever the rows


def _source(tmp_path: Path, name: str, n: int) -> str:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"id": f"{name}{i}"}) + "\n" for i in range(n)))
    return str(path)


def test_mix_rows_come_in_sample_id_order_with_their_source(tmp_path: Path) -> None:
    """A 3-row source weighted 2:1 against a 10-row one in a 9-row mix: drawn 6 (each row
    twice) and 3 (subsampled); sample ids are contiguous per source."""
    plan = plan_mix([MixSource(data=_source(tmp_path, "a", 3), weight=2.0),
                     MixSource(data=_source(tmp_path, "b", 10), weight=1.0, name="bee")],
                    num_rows=9, seed=7)
    rows = list(iter_mix_rows(plan))
    assert [r.index for r in rows] == list(range(9))
    ids = [r.row["id"] for r in rows if r.row is not None]
    assert ids[:6] == ["a0", "a0", "a1", "a1", "a2", "a2"]
    assert len(set(ids[6:])) == 3
    assert all(i.startswith("b") for i in ids[6:])
    assert [e.label for e in plan] == [plan[0].source.data, "bee"]
    again = plan_mix([MixSource(data=plan[0].source.data, weight=2.0),
                      MixSource(data=plan[1].source.data, weight=1.0)], num_rows=9, seed=7)
    assert [r.row for r in iter_mix_rows(again)] == [r.row for r in rows]


def test_wanted_filters_sample_ids_not_source_rows(tmp_path: Path) -> None:
    """Only the wanted sample ids are yielded, with the row each one drew."""
    plan = plan_mix([MixSource(data=_source(tmp_path, "a", 2), weight=1.0)], num_rows=5, seed=0)
    everything = {r.index: r.row for r in iter_mix_rows(plan)}
    some = {r.index: r.row for r in iter_mix_rows(plan, wanted=lambda i: i in (1, 4))}
    assert some == {1: everything[1], 4: everything[4]}


def test_empty_source_and_bad_weight_are_refused(tmp_path: Path) -> None:
    """A source with no rows names itself; a non-positive weight names the entry."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DatasetError, match="empty.jsonl holds no rows"):
        plan_mix([MixSource(data=str(empty), weight=1.0)], num_rows=None, seed=0)



@pytest.mark.parametrize(("fields", "message"), [
    ({"weight": 0}, "weight must be a number in"),
    ({"weight": float("inf")}, "got inf"),
    ({"weight": float("nan")}, "got nan"),
    ({"weight": 1e13}, "got 10000000000000.0"),
    ({"weight": True}, "got True"),
    ({"weight": "1"}, "got '1'"),
    ({"data": ""}, "every entry needs data"),
    ({"data": 7}, "data: expected str, got 7"),
    ({"data_format": "csv"}, "data_format: expected 'auto' or 'jsonl' or 'parquet', got 'csv'"),
    ({"name": 3}, "name: expected str or None, got 3"),
])
def test_a_bad_mix_entry_is_a_config_error(fields: dict[str, object], message: str) -> None:
    """Every field of an entry is checked when it is built (the CLI and the Python API alike)."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        MixSource(**{"data": "x.jsonl", "weight": 1.0, **fields})  # type: ignore[arg-type]


def test_weights_far_apart_still_sum_exactly() -> None:
    """Quotas of the largest weight against a tiny one still add up to the rows."""
    assert quotas([1e12, 1e-300], 10) == [10, 0]
