"""Per-unit bookkeeping as columns: attempt, sample and token counts, accounting per unit."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from sparkforge.shared.records import UnitAccounting

ABSENT = -1
"""A count a unit's record does not hold: ``image_rows`` predating the count, or a skip reason
the unit does not list (a listed reason may count 0)."""

Int64s = npt.NDArray[np.int64]


@dataclass(frozen=True, eq=False)
class UnitColumns:
    """One row per committed unit, sorted by unit; ``skipped`` maps each reason any unit lists to
    its per-unit counts (:data:`ABSENT` where a unit does not list it)."""

    unit: Int64s
    attempt: Int64s
    num_samples: Int64s
    num_tokens: Int64s
    input_rows: Int64s
    written: Int64s
    failed: Int64s
    image_rows: Int64s
    """:data:`ABSENT` where a unit did not count them."""
    skipped: dict[str, Int64s]

    def __len__(self) -> int:
        return int(self.unit.shape[0])

    @classmethod
    def from_rows(cls, rows: Iterable[tuple[int, int, int, int, UnitAccounting]]) -> UnitColumns:
        """From ``(unit, attempt, num_samples, num_tokens, accounting)`` per unit, any order."""
        listed = sorted(rows, key=lambda r: r[0])
        accounting = [r[4] for r in listed]
        reasons = sorted({k for a in accounting for k in a.skipped})

        def column(values: Iterable[int]) -> Int64s:
            return np.fromiter(values, dtype=np.int64, count=len(listed))

        return cls(
            unit=column(r[0] for r in listed), attempt=column(r[1] for r in listed),
            num_samples=column(r[2] for r in listed), num_tokens=column(r[3] for r in listed),
            input_rows=column(a.input_rows for a in accounting),
            written=column(a.written for a in accounting),
            failed=column(a.failed for a in accounting),
            image_rows=column(ABSENT if a.image_rows is None else a.image_rows
                              for a in accounting),
            skipped={k: column(a.skipped.get(k, ABSENT) for a in accounting) for k in reasons})

    def accounting(self, i: int) -> UnitAccounting:
        """The accounting of the unit in row ``i``."""
        image_rows = int(self.image_rows[i])
        return UnitAccounting(
            input_rows=int(self.input_rows[i]), written=int(self.written[i]),
            skipped={k: int(v[i]) for k, v in self.skipped.items() if v[i] != ABSENT},
            failed=int(self.failed[i]), image_rows=None if image_rows < 0 else image_rows)

    def total(self) -> UnitAccounting:
        """The accounting of all units (image rows only when every unit counted them)."""
        counted = bool((self.image_rows >= 0).all())
        return UnitAccounting(
            input_rows=int(self.input_rows.sum()), written=int(self.written.sum()),
            skipped={k: int(v[v != ABSENT].sum()) for k, v in self.skipped.items()
                     if (v != ABSENT).any()},
            failed=int(self.failed.sum()),
            image_rows=int(self.image_rows.sum()) if counted else None)
