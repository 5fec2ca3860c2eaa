"""Validate's checks of the bookkeeping: each unit's commit record against the manifest's rows for
it, and index.parquet against the commit records, column by column.

Commit records are read ``max_concurrency`` at a time and folded into columns
(:class:`CommitCollector`), so no object per sample is kept; the index is compared with the one
the records imply as whole columns. At most :data:`MAX_LISTED` problems of one kind are listed.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Final

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkforge.manifests.commits import CommitCollector, read_commits
from sparkforge.manifests.index import check_index
from sparkforge.manifests.schema import CacheManifest
from sparkforge.manifests.units import UnitColumns
from sparkforge.shared import storage
from sparkforge.shared.cache_tables import SlotColumns
from sparkforge.shared.commit import SlotRecord, committed_units
from sparkforge.shared.commit_columns import CommitColumns
from sparkforge.shared.layout import array_layouts, commit_key

MAX_LISTED: Final = 100
"""Problems of one kind listed in full; the rest are counted on one more line."""


def check_commits(loc: storage.Location, m: CacheManifest,
                  tables: tuple[UnitColumns, SlotColumns] | None, problems: list[str],
                  checked: Counter[str], *, max_concurrency: int) -> CommitCollector:
    """Each listed unit's commit record exists, parses and agrees with its unit and slot rows
    (``tables``; None when they cannot be read); returns what the records hold."""
    collector = CommitCollector(tuple(array_layouts(m.storage.spec)))
    listed = range(m.storage.num_units)  # a complete cache's units are 0..n-1
    for unit, record in read_commits(loc, m.storage.spec, listed,
                                     max_concurrency=max_concurrency):
        if isinstance(record, FileNotFoundError):
            problems.append(f"unit {unit}: commit record {commit_key(unit)} is missing")
        elif not isinstance(record, CommitColumns):
            problems.append(f"unit {unit}: {record}")
        else:
            if tables is not None:
                problems += [f"unit {unit}: {_where(m, unit, name)} = {want!r} but the commit "
                             f"record has {have!r}"
                             for name, want, have in _differences(*tables, unit, record)]
            collector.add(record)
            checked["units"] += 1
    for unit in sorted(committed_units(loc) - set(listed)):
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


def committed_index(collector: CommitCollector, problems: list[str]) -> pa.Table | None:
    """The index the commit records imply; None (with the problem) if sample ids repeat."""
    try:
        return collector.index()
    except ValueError as exc:
        problems.append(str(exc))
        return None


def index_problems(loc: storage.Location, m: CacheManifest, committed: pa.Table | None,
                   problems: list[str], checked: Counter[str]) -> Counter[str]:
    """index.parquet matches its sha256, schema and row count, and row for row the index the
    commit records imply; returns the samples per split (of the index when it can be read)."""
    key = m.storage.index_key
    splits = Counter(committed.column("split").to_pylist()) if committed is not None else \
        Counter[str]()
    try:
        raw = storage.read_bytes(loc, key)
    except FileNotFoundError:
        problems.append(f"index {key}: missing")
        return splits
    except ValueError as exc:
        problems.append(f"index {key}: {exc}")
        return splits
    table, found = check_index(raw, m)
    problems += found
    if table is None:
        return splits
    ids = table.column("sample_id").to_numpy()
    if ids.size > 1 and not bool((ids[1:] > ids[:-1]).all()):
        problems.append(f"index {key}: sample_id not unique and increasing")
    if committed is not None:
        problems += _row_problems(table, committed, key)
    tokens = int(pc.sum(table.column("length")).as_py() or 0)
    if tokens != m.storage.totals.tokens:
        problems.append(f"index {key}: lengths sum to {tokens} tokens != manifest "
                        f"storage.totals.tokens {m.storage.totals.tokens}")
    checked["samples"], checked["tokens"] = table.num_rows, tokens
    names, counts = np.unique(table.column("split").to_numpy(zero_copy_only=False),
                              return_counts=True)
    return Counter({str(k): int(v) for k, v in zip(names, counts, strict=True)})


def _row_problems(index: pa.Table, committed: pa.Table, key: str) -> list[str]:
    """Index rows no record holds, records' samples missing from the index, differing fields."""
    ids, cids = index.column("sample_id").to_numpy(), committed.column("sample_id").to_numpy()
    known = np.isin(ids, cids)
    extra = [f"index row sample {r['sample_id']}: references data no listed unit's commit "
             f"record holds (unit {r['unit']}, slot {r['slot']}, row_offset {r['row_offset']})"
             for r in index.filter(pa.array(~known)).slice(0, MAX_LISTED + 1).to_pylist()]
    missing_rows = committed.filter(pa.array(~np.isin(cids, ids)))
    missing = [f"unit {r['unit']}, sample {r['sample_id']}: in the commit record but missing "
               f"from index {key}" for r in missing_rows.slice(0, MAX_LISTED + 1).to_pylist()]
    out = capped(extra, int((~known).sum())) + capped(missing, missing_rows.num_rows)
    mine = np.flatnonzero(known)
    theirs = np.searchsorted(cids, ids[mine])  # committed ids are sorted and unique
    for name in index.schema.names[1:]:
        have = index.column(name).take(pa.array(mine))
        want = committed.column(name).take(pa.array(theirs))
        same = pc.fill_null(pc.equal(have, want), False).to_numpy(zero_copy_only=False)
        differs = np.flatnonzero(~same)
        units = want if name == "unit" else committed.column("unit").take(pa.array(theirs))
        out += capped([f"index row sample {ids[mine[j]]}: {name} = {have[j].as_py()!r} but "
                        f"unit {units[j].as_py()}'s commit record has {want[j].as_py()!r}"
                        for j in differs[:MAX_LISTED + 1].tolist()], differs.size)
    return out


def capped(lines: list[str], total: int) -> list[str]:
    """The first :data:`MAX_LISTED` lines, and one counting the others."""
    if total <= MAX_LISTED:
        return lines
    return [*lines[:MAX_LISTED], f"... and {total - MAX_LISTED} more like the line above"]
