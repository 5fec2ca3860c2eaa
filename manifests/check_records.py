"""Validate's checks of the bookkeeping: each unit's commit record against the manifest's rows for
it, and index.parquet against the commit records, column by column.

Commit records are read ``max_concurrency`` at a time and folded into unit and slot columns
(:class:`CommitCollector`); their samples are compared with the stored index a batch at a time
as they come (:mod:`sparkforge.manifests.index_check`), so memory does not grow per sample.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from sparkforge.manifests.commits import CommitCollector, read_commits
from sparkforge.manifests.index import INDEX_SCHEMA
from sparkforge.manifests.index_check import IndexComparison, stored_index
from sparkforge.manifests.index_rows import IndexBatches, SortedRows
from sparkforge.manifests.schema import CacheManifest
from sparkforge.manifests.units import UnitColumns
from sparkforge.shared import storage
from sparkforge.shared.cache_tables import SPLITS, SlotColumns
from sparkforge.shared.commit import SlotRecord, committed_units
from sparkforge.shared.commit_columns import CommitColumns
from sparkforge.shared.layout import array_layouts, commit_key


def check_commits(loc: storage.Location, m: CacheManifest,
                  tables: tuple[UnitColumns, SlotColumns] | None, problems: list[str],
                  checked: Counter[str], *, max_concurrency: int,
                  each: Callable[[CommitColumns], None]) -> CommitCollector:
    """Each listed unit's commit record exists, parses and agrees with its unit and slot rows
    (``tables``; None when they cannot be read); ``each`` is called with every record that
    parses, in unit order. Returns what the records hold."""
    collector = CommitCollector(tuple(array_layouts(m.storage.spec)))
    listed = range(m.storage.num_units)  # a complete cache's units are 0..n-1
    for unit, record in read_commits(loc, m.storage.spec, listed,
                                     max_concurrency=max_concurrency):
        if isinstance(record, FileNotFoundError):
            problems.append(f"unit {unit}: commit record {commit_key(m.storage.spec, unit)} is "
                            "missing")
        elif not isinstance(record, CommitColumns):
            problems.append(f"unit {unit}: {record}")
        else:
            if tables is not None:
                problems += [f"unit {unit}: {_where(m, unit, name)} = {want!r} but the commit "
                             f"record has {have!r}"
                             for name, want, have in _differences(*tables, unit, record)]
            collector.add(record)
            each(record)
            checked["units"] += 1
    for unit in sorted(committed_units(loc, m.storage.spec) - set(listed)):
        problems.append(f"unit {unit}: has a commit record but the manifest does not list it "
                        "(re-run `sparkforge finalize`)")
    return collector


def _where(m: CacheManifest, unit: int, name: str) -> str:
    """Where the manifest lists a unit's ``name``: its entry (formats 1-2) or a table."""
    tables = {"slots": m.storage.slot_table, "unit": m.storage.unit_table}
    ref = tables["slots" if name == "slots" else "unit"]
    if ref is None:
        return f"manifest storage.units[{unit}].{name}"
    return f"{ref.key} {name}"


def _differences(units: UnitColumns, slots: SlotColumns, i: int,
                 c: CommitColumns) -> list[tuple[str, Any, Any]]:
    """(field, listed, committed) for each field of unit row ``i`` that its record contradicts."""
    rows = slots.of_unit(c.unit)
    listed = tuple(SlotRecord(slot=s, num_rows=n, crc32c=slots.checksums(k)) for k, s, n in zip(
        range(rows.start, rows.stop), slots.slot[rows].tolist(), slots.num_rows[rows].tolist(),
        strict=True))
    pairs = [("attempt", int(units.attempt[i]), c.attempt),
             ("slots", listed, c.slot_records()),
             ("num_samples", int(units.num_samples[i]), c.num_samples),
             ("num_tokens", int(units.num_tokens[i]), c.num_tokens),
             ("accounting", units.accounting(i), c.accounting)]
    return [(name, want, have) for name, want, have in pairs if want != have]


def check_rows(loc: storage.Location, m: CacheManifest,
               tables: tuple[UnitColumns, SlotColumns] | None, problems: list[str],
               checked: Counter[str], *,
               max_concurrency: int) -> tuple[CommitCollector, Counter[str]]:
    """:func:`check_commits`, and index.parquet row for row against the records as they come
    (the records read again and sorted when their sample ids do not rise with units, or the
    stored ids are out of order). Returns what the records hold and the samples per split (of
    the index when it can be read)."""
    found: list[str] = []
    per_split = np.zeros(len(SPLITS), dtype=np.int64)
    batches = IndexBatches()
    with stored_index(loc, m, found) as stored:
        compare = None if stored is None else IndexComparison(stored, m.storage.index_key)

        def each(record: CommitColumns) -> None:
            per_split[:] += np.bincount(record.samples["split"], minlength=len(SPLITS))
            batch = batches.add(record)
            if batch is not None and compare is not None:
                compare.compare(batch)

        collector = check_commits(loc, m, tables, problems, checked,
                                  max_concurrency=max_concurrency, each=each)
        if compare is not None and batches.in_order:
            rest = batches.rest()
            compare.compare(INDEX_SCHEMA.empty_table() if rest is None else rest, last=True)
    if not batches.in_order or (compare is not None and not compare.in_order):
        return collector, _check_sorted(loc, m, problems, checked, max_concurrency)
    problems += found
    if compare is None:
        return collector, Counter({k: int(n) for k, n in zip(SPLITS, per_split.tolist(),
                                                             strict=True) if n})
    problems += compare.problems() + _totals(m, compare, checked)
    return collector, compare.splits


def _check_sorted(loc: storage.Location, m: CacheManifest, problems: list[str],
                  checked: Counter[str], max_concurrency: int) -> Counter[str]:
    """The index against every committed row at once (the records read again and sorted)."""
    rows = SortedRows()
    for _, record in read_commits(loc, m.storage.spec, range(m.storage.num_units),
                                  max_concurrency=max_concurrency):
        if isinstance(record, CommitColumns):
            rows.add(record)
    try:
        committed: pa.Table | None = rows.table()
    except ValueError as exc:
        problems.append(str(exc))
        committed = None
    found: list[str] = []
    with stored_index(loc, m, found) as stored:
        problems += found
        if stored is None:
            return Counter() if committed is None else Counter(
                committed.column("split").to_pylist())
        compare = IndexComparison(stored, m.storage.index_key, check_rows=committed is not None)
        compare.compare(INDEX_SCHEMA.empty_table() if committed is None else committed, last=True)
    problems += compare.problems() + _totals(m, compare, checked)
    return compare.splits


def _totals(m: CacheManifest, compare: IndexComparison, checked: Counter[str]) -> list[str]:
    """The stored index's tokens against the manifest; counts what was checked."""
    checked["samples"], checked["tokens"] = compare.samples, compare.tokens
    if compare.tokens == m.storage.totals.tokens:
        return []
    return [f"index {m.storage.index_key}: lengths sum to {compare.tokens} tokens != manifest "
            f"storage.totals.tokens {m.storage.totals.tokens}"]
