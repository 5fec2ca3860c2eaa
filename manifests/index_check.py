"""Validate's check of index.parquet against the commit records, one batch of rows at a time.

The stored index is read row group by row group (its sha256 over a streamed read first: on an
object store that read also copies it into a temporary file the row groups are read from) and
merged by sample id with the rows the records imply (:mod:`sparkforge.manifests.index_rows`), so
neither index is ever held whole. At most :data:`MAX_LISTED` problems of one kind are listed.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Final

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from sparkforge.manifests.index import INDEX_SCHEMA
from sparkforge.manifests.index_rows import BATCH_ROWS
from sparkforge.manifests.schema import CacheManifest
from sparkforge.shared import storage

MAX_LISTED: Final = 100
"""Problems of one kind listed in full; the rest are counted on one more line."""


@contextmanager
def stored_index(loc: storage.Location, m: CacheManifest,
                 problems: list[str]) -> Iterator[Iterator[pa.RecordBatch] | None]:
    """index.parquet's batches, after its sha256, schema and row count are checked against the
    manifest (each difference appended to ``problems``); None when it cannot be read."""
    key, recorded = m.storage.index_key, m.storage
    with ExitStack() as stack:
        try:
            path, digest = stack.enter_context(_read_once(loc, key))
        except FileNotFoundError:
            problems.append(f"index {key}: missing")
            yield None
            return
        except ValueError as exc:
            problems.append(f"index {key}: {exc}")
            yield None
            return
        if digest != recorded.index_sha256:
            problems.append(f"index {key}: sha256 {digest} != manifest "
                            f"storage.index_sha256 {recorded.index_sha256}")
        try:
            parquet = pq.ParquetFile(stack.enter_context(path.open("rb")))
        except pa.ArrowException as exc:
            problems.append(f"index {key}: not a readable Parquet file ({exc})")
            yield None
            return
        if not parquet.schema_arrow.equals(INDEX_SCHEMA):
            problems.append(f"index {key}: columns {parquet.schema_arrow.names} != "
                            f"{INDEX_SCHEMA.names}")
            yield None
            return
        if parquet.metadata.num_rows != recorded.totals.samples:
            problems.append(f"index {key}: {parquet.metadata.num_rows} rows != manifest "
                            f"storage.totals.samples {recorded.totals.samples}")
        yield parquet.iter_batches(batch_size=BATCH_ROWS)


@contextmanager
def _read_once(loc: storage.Location, key: str) -> Iterator[tuple[Path, str]]:
    """A local file holding ``key`` and its sha256, the object read once: a local cache's own
    file, or an object store's object streamed into a temporary file as it is hashed (its row
    groups are then read from there, not asked of the store a second time)."""
    path = storage.inside_root(loc, key)
    if loc.is_local:
        with Path(path).open("rb") as f:
            digest = storage.stream_sha256(f)
        yield Path(path), digest
        return
    with tempfile.TemporaryDirectory(prefix="sparkforge-index.") as tmp:
        copy = Path(tmp, "index.parquet")
        with loc.fs.open(path, "rb", block_size=storage.HASH_BLOCK_BYTES) as f, \
                copy.open("wb") as out:
            digest = storage.stream_sha256(f, copy_to=out)
        yield copy, digest


class IndexComparison:
    """The stored index (sorted by sample id) merged with the committed rows, batch by batch."""

    def __init__(self, stored: Iterator[pa.RecordBatch], key: str, *,
                 check_rows: bool = True) -> None:
        self.key = key
        self.check_rows = check_rows
        """False: only the stored rows' order and totals (no committed rows to compare with)."""
        self.in_order = True
        """False once a stored sample id did not exceed the one before it."""
        self.tokens = 0
        self.samples = 0
        self.splits: Counter[str] = Counter()
        self._stored = stored
        self._held = INDEX_SCHEMA.empty_table()
        self._last_id: int | None = None
        self._lines: dict[str, list[str]] = {k: [] for k in ("extra", "missing",
                                                               *INDEX_SCHEMA.names[1:])}
        self._counts: Counter[str] = Counter()

    def compare(self, committed: pa.Table | pa.RecordBatch, *, last: bool = False) -> None:
        """Check the next committed rows (sorted, above every earlier call's) against the stored
        rows up to their last id (``last``: against every stored row left)."""
        if not last and not len(committed):
            return
        top = None if last else committed.column("sample_id")[-1].as_py()
        while self._held.num_rows == 0 or top is None or self._held_last() <= top:
            batch = next(self._stored, None)
            if batch is None:
                break
            self._take_in(batch)
        if top is None:
            stored, self._held = self._held, INDEX_SCHEMA.empty_table()
        else:
            mine = pc.less_equal(self._held.column("sample_id"), top)
            stored, self._held = self._held.filter(mine), self._held.filter(pc.invert(mine))
        if self.check_rows:
            self._row_problems(stored, pa.Table.from_batches([committed]) if isinstance(
                committed, pa.RecordBatch) else committed)

    def problems(self) -> list[str]:
        """Every difference found, at most :data:`MAX_LISTED` of a kind, in a fixed order."""
        out = [] if self.in_order else [f"index {self.key}: sample_id not unique and increasing"]
        for kind, lines in self._lines.items():
            out += capped(lines, self._counts[kind])
        return out

    def _held_last(self) -> int:
        return int(self._held.column("sample_id")[-1].as_py())

    def _take_in(self, batch: pa.RecordBatch) -> None:
        ids = batch.column("sample_id").to_numpy()
        if ids.size and ((ids[1:] <= ids[:-1]).any() or
                         (self._last_id is not None and ids[0] <= self._last_id)):
            self.in_order = False
        if ids.size:
            self._last_id = int(ids[-1])
        self.samples += batch.num_rows
        self.tokens += int(pc.sum(batch.column("length")).as_py() or 0)
        for entry in pc.value_counts(batch.column("split")).to_pylist():
            self.splits[str(entry["values"])] += int(entry["counts"])
        self._held = pa.concat_tables([self._held, pa.Table.from_batches([batch])])

    def _add(self, kind: str, total: int, lines: Iterator[str]) -> None:
        self._counts[kind] += total
        room = MAX_LISTED + 1 - len(self._lines[kind])
        self._lines[kind] += [line for _, line in zip(range(max(room, 0)), lines, strict=False)]

    def _row_problems(self, index: pa.Table, committed: pa.Table) -> None:
        """Index rows no record holds, records' samples missing from the index, differing
        fields (``committed`` sorted by sample id)."""
        ids = index.column("sample_id").to_numpy()
        cids = committed.column("sample_id").to_numpy()
        known = np.isin(ids, cids)
        extra = index.filter(pa.array(~known))
        self._add("extra", extra.num_rows, (
            f"index row sample {r['sample_id']}: references data no listed unit's commit "
            f"record holds (unit {r['unit']}, slot {r['slot']}, row_offset {r['row_offset']})"
            for r in extra.slice(0, MAX_LISTED + 1).to_pylist()))
        missing = committed.filter(pa.array(~np.isin(cids, ids)))
        self._add("missing", missing.num_rows, (
            f"unit {r['unit']}, sample {r['sample_id']}: in the commit record but missing from "
            f"index {self.key}" for r in missing.slice(0, MAX_LISTED + 1).to_pylist()))
        mine = np.flatnonzero(known)
        theirs = np.searchsorted(cids, ids[mine])  # committed ids are sorted and unique
        for name in INDEX_SCHEMA.names[1:]:
            have = index.column(name).take(pa.array(mine))
            want = committed.column(name).take(pa.array(theirs))
            same = pc.fill_null(pc.equal(have, want), False).to_numpy(zero_copy_only=False)
            differs = np.flatnonzero(~same)
            units = want if name == "unit" else committed.column("unit").take(pa.array(theirs))
            self._add(name, differs.size, (
                f"index row sample {ids[mine[j]]}: {name} = {have[j].as_py()!r} but unit "
                f"{units[j].as_py()}'s commit record has {want[j].as_py()!r}"
                for j in differs[:MAX_LISTED + 1].tolist()))


def capped(lines: list[str], total: int) -> list[str]:
    """The first :data:`MAX_LISTED` lines, and one counting the others."""
    if total <= MAX_LISTED:
        return lines
    return [*lines[:MAX_LISTED], f"... and {total - MAX_LISTED} more like the line above"]

