"""Units of whole rows and the worker share: every unit owned exactly once, env defaults."""

from __future__ import annotations

import pytest

from sparkforge.producer.units import (
    WorkerShare,
    num_units,
    owned_units,
    resolve_share,
    rows_by_unit,
    unit_rows,
)
from sparkforge.shared.dataset import RawRow


@pytest.mark.parametrize(
    ("rows", "per_unit", "units"), [(0, 4, 0), (1, 4, 1), (8, 4, 2), (9, 4, 3)]
)
def test_unit_count(rows: int, per_unit: int, units: int) -> None:
    """Units cover every row; the last unit may be short."""
    assert num_units(rows, per_unit) == units
    covered = [r for u in range(units) for r in unit_rows(u, num_rows=rows, rows_per_unit=per_unit)]
    assert covered == list(range(rows))


@pytest.mark.parametrize("workers", [1, 2, 3, 7])
def test_shares_partition_the_units(workers: int) -> None:
    """The shares of N workers are disjoint and together cover every unit."""
    shares = [owned_units(10, WorkerShare(w, workers, "t")) for w in range(workers)]
    assert sorted(u for s in shares for u in s) == list(range(10))


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, (0, 1)),
        ({"SPARKFORGE_WORKER_INDEX": "2", "SPARKFORGE_NUM_WORKERS": "4"}, (2, 4)),
        ({"JOB_COMPLETION_INDEX": "1", "SPARKFORGE_NUM_WORKERS": "3"}, (1, 3)),
        ({"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "3"},
         (2, 4)),
        ({"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2"}, (1, 2)),
        ({"SLURM_PROCID": "3", "SLURM_NTASKS": "8"}, (3, 8)),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_ARRAY_TASK_ID": "1",
          "SLURM_ARRAY_TASK_COUNT": "2"}, (1, 2)),
    ],
)
def test_share_from_environment(env: dict, expected: tuple[int, int]) -> None:
    """Kubernetes indexed jobs and Slurm arrays/tasks set the share; arrays win over procid."""
    share = resolve_share(None, None, env)
    assert (share.worker_index, share.num_workers) == expected


def test_flags_override_environment() -> None:
    """Explicit --worker_index/--num_workers win over the scheduler's variables."""
    share = resolve_share(1, 2, {"SLURM_PROCID": "3", "SLURM_NTASKS": "8"})
    assert (share.worker_index, share.num_workers) == (1, 2)
    assert share.origin == "--worker_index/--num_workers"


@pytest.mark.parametrize(
    ("flags", "env", "match"),
    [
        ((1, None), {}, "together"),
        ((2, 2), {}, r"not in \[0, 2\)"),
        ((None, None), {"JOB_COMPLETION_INDEX": "0"}, "SPARKFORGE_NUM_WORKERS"),
        ((None, None), {"SLURM_PROCID": "x", "SLURM_NTASKS": "2"}, "SLURM_PROCID.*'x'"),
    ],
)
def test_bad_shares_are_refused(flags: tuple, env: dict, match: str) -> None:
    """Half-given, out-of-range or non-integer shares raise a ValueError naming the source."""
    with pytest.raises(ValueError, match=match):
        resolve_share(*flags, env)


def test_rows_by_unit_groups_an_ordered_stream() -> None:
    """Rows are grouped by unit in stream order; gaps (units not wanted) just do not appear."""
    rows = [RawRow(index=i, row={}, content_hash="h") for i in (0, 1, 2, 6, 7, 9)]
    grouped = [(u, [r.index for r in batch]) for u, batch in rows_by_unit(rows, 3)]
    assert grouped == [(0, [0, 1, 2]), (2, [6, 7]), (3, [9])]
