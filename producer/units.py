"""Commit units of whole input rows, and which of them one worker of N owns.

Unit ``u`` covers input rows ``[u * rows_per_unit, (u + 1) * rows_per_unit)``; worker ``w`` of ``N``
owns the units with ``u % N == w`` (interleaved, so shares stay balanced when rows differ in length
along the dataset). The worker index and count default from the scheduler's environment.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

from sparkforge.shared.errors import SparkforgeError

# (index variable, count variable, offset variable) in order of precedence.
_SCHEDULER_VARS = (
    ("SPARKFORGE_WORKER_INDEX", "SPARKFORGE_NUM_WORKERS", None),
    # Kubernetes indexed Jobs set only the index; the pod spec passes the count
    # (spec.completions) as SPARKFORGE_NUM_WORKERS.
    ("JOB_COMPLETION_INDEX", "SPARKFORGE_NUM_WORKERS", None),
    ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_MIN"),
    ("SLURM_PROCID", "SLURM_NTASKS", None),
)


@dataclass(frozen=True)
class WorkerShare:
    """This process's place among the workers of one cache."""

    worker_index: int
    num_workers: int
    origin: str
    """Where the values came from (flags or the environment variable names), for the log."""


def num_units(num_rows: int, rows_per_unit: int) -> int:
    """Units needed to cover ``num_rows`` input rows (the last one may be short)."""
    return -(-num_rows // rows_per_unit)


def unit_rows(unit: int, *, num_rows: int, rows_per_unit: int) -> range:
    """The input row indices of ``unit``."""
    start = unit * rows_per_unit
    return range(start, min(start + rows_per_unit, num_rows))


def owned_units(total_units: int, share: WorkerShare) -> list[int]:
    """The units ``share`` is responsible for, ascending."""
    return list(range(share.worker_index, total_units, share.num_workers))


class _Indexed(Protocol):
    @property
    def index(self) -> int: ...


RowT = TypeVar("RowT", bound=_Indexed)


def rows_by_unit(rows: Iterable[RowT], rows_per_unit: int) -> Iterator[tuple[int, list[RowT]]]:
    """Group an index-ordered row stream into ``(unit, rows)`` batches."""
    current, batch = -1, list[RowT]()
    for row in rows:
        unit = row.index // rows_per_unit
        if unit != current and batch:
            yield current, batch
            batch = []
        current = unit
        batch.append(row)
    if batch:
        yield current, batch


def resolve_share(
    worker_index: int | None, num_workers: int | None, env: Mapping[str, str]
) -> WorkerShare:
    """Explicit flags win; otherwise the first scheduler whose variables are set; else 0 of 1.

    Raises:
        ValueError: The values are inconsistent or half given; the message names the source.
    """
    if worker_index is not None or num_workers is not None:
        if worker_index is None or num_workers is None:
            raise SparkforgeError("--worker_index and --num_workers must be given together")
        return _checked(worker_index, num_workers, "--worker_index/--num_workers")
    for index_var, count_var, offset_var in _SCHEDULER_VARS:
        if index_var not in env:
            continue
        if count_var not in env:
            raise SparkforgeError(
                f"{index_var} is set but {count_var} is not: set {count_var} to the number of "
                "workers, or pass --worker_index/--num_workers"
            )
        try:
            index = int(env[index_var]) - int(env.get(offset_var, "0") if offset_var else 0)
            count = int(env[count_var])
        except ValueError as exc:
            values = {v: env[v] for v in (index_var, count_var, offset_var) if v and v in env}
            raise SparkforgeError(
                f"{index_var}/{count_var}: expected integers, got {values}") from exc
        return _checked(index, count, f"{index_var}/{count_var}")
    return WorkerShare(0, 1, "default")


def _checked(index: int, count: int, origin: str) -> WorkerShare:
    if count < 1 or not 0 <= index < count:
        raise SparkforgeError(f"{origin}: worker index {index} is not in [0, {count})")
    return WorkerShare(index, count, origin)
