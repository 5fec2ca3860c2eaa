"""Validate a cache: manifest schema, then the store against it (commits, index, arrays, objects).

Every check appends one human-readable problem naming the field, unit, slot or sample; nothing
stops at the first problem except a manifest that cannot be parsed at all (there is then nothing
to check the store against). ``deep`` adds :mod:`sparkforge.manifests.scan` (checksums, finite
values, token ranges).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import zarr
from tqdm import tqdm

from sparkforge.manifests.check_records import check_rows
from sparkforge.manifests.commits import read_commits, slots_to_scan
from sparkforge.manifests.contract import EMPTY_TRAIN_SPLIT, RunContract, contract_problems
from sparkforge.manifests.finalize import read_run_header
from sparkforge.manifests.index_check import MAX_LISTED, capped
from sparkforge.manifests.objects import (
    MAX_LISTINGS_IN_FLIGHT,
    MAX_PARITY_BYTES,
    escaping_links,
    existing_location,
    group_folder,
    group_listings,
    irregular_objects,
    listing_parent,
    read_json,
    slot_folders,
)
from sparkforge.manifests.open import read_manifest
from sparkforge.manifests.parity import parse_parity
from sparkforge.manifests.promises import promise_problems
from sparkforge.manifests.scan import SlotToScan, scan_slots
from sparkforge.manifests.schema import CacheManifest
from sparkforge.manifests.tables import read_tables
from sparkforge.shared import storage
from sparkforge.shared.cache_tables import SlotColumns
from sparkforge.shared.commit import committed_units
from sparkforge.shared.commit_columns import CommitColumns
from sparkforge.shared.fields import shorten
from sparkforge.shared.layout import (
    PARITY_FILE,
    TARGET_PREFIX,
    CacheSpec,
    array_layouts,
    array_shape,
    describe_codecs,
    slot_block,
    slot_key,
)
from sparkforge.shared.writer import diff_json

MAX_PROBLEM_CHARS = 500
"""Longest problem line: values quoted from a hostile cache are cut, never printed whole."""


@dataclass
class ValidationReport:
    """The outcome of one validation: problems (one line each) and what was checked."""

    uri: str
    deep: bool
    problems: list[str] = field(default_factory=list)
    checked: Counter[str] = field(default_factory=Counter)
    """Counts of what was looked at: units, slots, samples, tokens, objects, bytes_scanned."""
    against: str | None = None

    @property
    def valid(self) -> bool:
        """True when no problem was found."""
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        """``{"valid", "problems", "uri", "deep", "against", "checked"}``."""
        return {"valid": self.valid, "problems": list(self.problems), "uri": self.uri,
                "deep": self.deep, "against": self.against, "checked": dict(self.checked)}


def validate_cache(uri: str, *, deep: bool = False, against: RunContract | None = None,
                   storage_options: Mapping[str, Any] | None = None, progress: bool = False,
                   max_concurrency: int = storage.DEFAULT_MAX_CONCURRENCY) -> ValidationReport:
    """Check a cache and (optionally) its fit with a training run.

    Args:
        uri: local path or fsspec URI of the cache.
        deep: also re-read every committed slot (checksums, finite values, token ranges).
        against: a training run's contract to check the manifest against.
        storage_options: fsspec options (e.g. S3 endpoint and credentials).
        progress: show a tqdm bar (tokens/s, ETA) over the deep scan.
        max_concurrency: reads in flight at once (commit records, slot objects), and folders
            listed at once (at most :data:`~sparkforge.manifests.objects.MAX_LISTINGS_IN_FLIGHT`).

    Raises:
        CacheNotFoundError: if nothing exists at ``uri``.
    """
    loc = existing_location(uri, storage_options)
    report = ValidationReport(uri=uri, deep=deep)
    links, irregular = escaping_links(loc), irregular_objects(loc)
    report.problems += [f"{key}: a link to {target}, outside the cache root (a cache holds its "
                        "own objects; nothing behind it is read)" for key, target in links.items()]
    report.problems += [f"{key}: {kind}, not a regular file (never opened; replace it with the "
                        "real file)" for key, kind in irregular.items()]
    reported = set(links) | set(irregular)
    manifest = None if "manifest.json" in reported else _manifest(loc, report)
    if manifest is not None:
        _check_store(loc, manifest, report, deep=deep and not reported, against=against,
                     progress=progress, reported=reported, max_concurrency=max_concurrency)
    report.problems = [shorten(p, MAX_PROBLEM_CHARS) for p in report.problems]
    return report


def _check_store(loc: storage.Location, manifest: CacheManifest, report: ValidationReport, *,
                 deep: bool, against: RunContract | None, progress: bool, reported: set[str],
                 max_concurrency: int) -> None:
    """Everything after the manifest parsed: header, commits, index, parity, arrays, objects;
    ``reported`` keys (links out, special files) are already problems and are not opened."""
    _check_header(loc, manifest, report)
    try:
        tables = read_tables(loc, manifest)
    except ValueError as exc:  # the records are still checked, against nothing listed
        report.problems.append(str(exc))
        tables = None
    collector, splits = check_rows(loc, manifest, tables, report.problems, report.checked,
                                   max_concurrency=max_concurrency)
    slots = collector.slots()
    _check_logical_bytes(manifest, report)
    if not splits.get("train"):
        report.problems.append(EMPTY_TRAIN_SPLIT)
    _check_parity(loc, manifest, report)
    arrays = _check_arrays(loc, manifest, report)
    if arrays is not None:
        slot_bytes = _check_objects(loc, manifest.storage.spec, slots, arrays, report, reported,
                                    min(max_concurrency, MAX_LISTINGS_IN_FLIGHT))
        if deep:
            _deep_scan(loc, manifest, report, slots, slot_bytes, progress=progress,
                       max_concurrency=max_concurrency)
    if against is not None:
        report.problems += [p for p in contract_problems(manifest, against, split_counts=splits)
                            if p not in report.problems]


def _deep_scan(loc: storage.Location, m: CacheManifest, report: ValidationReport,
               slots: SlotColumns, slot_bytes: npt.NDArray[np.int64], *, progress: bool,
               max_concurrency: int) -> None:
    def size(slot: int) -> int:  # slot ids rise with units: the column is sorted
        k = min(int(slots.slot.searchsorted(slot)), len(slots) - 1)
        return int(slot_bytes[k]) if len(slots) and slots.slot[k] == slot else 0

    # A unit's record is one read against its slots' many: a sixteenth of the reads in flight.
    record_reads = max(1, max_concurrency // 16)
    with tqdm(total=int(slots.num_rows.sum()), unit="tok", unit_scale=True, desc="deep scan",
              disable=not progress) as bar:
        for slot, problems in scan_slots(loc, _slots_to_scan(loc, m, record_reads), m,
                                         report.checked, slot_bytes=size,
                                         max_concurrency=max(1, max_concurrency - record_reads)):
            report.problems += problems
            bar.update(slot.num_rows)


def _slots_to_scan(loc: storage.Location, m: CacheManifest,
                   max_concurrency: int) -> Iterator[SlotToScan]:
    """Every committed slot with its samples, from the commit records read once more as the scan
    goes (holding them all would cost tens of bytes per sample); a record that does not parse
    is a problem already."""
    for _, record in read_commits(loc, m.storage.spec, range(m.storage.num_units),
                                  max_concurrency=max_concurrency):
        if isinstance(record, CommitColumns):
            yield from slots_to_scan(record, m.storage.spec.shard_rows)


def _manifest(loc: storage.Location, report: ValidationReport) -> CacheManifest | None:
    try:
        return read_manifest(loc)
    except ValueError as exc:
        report.problems.append(f"manifest: {exc} ({_commits_present(loc)})")
        return None


def _commits_present(loc: storage.Location) -> str:
    """How many commit records a cache without a readable manifest holds, found where its run
    header's layout puts them."""
    try:
        spec, _ = read_run_header(loc)
    except ValueError:
        return "no readable run header to find its commit records by"
    return f"{len(committed_units(loc, spec))} unit commit records present"


def _check_header(loc: storage.Location, m: CacheManifest, report: ValidationReport) -> None:
    try:
        spec, header = read_run_header(loc)
    except ValueError as exc:
        report.problems.append(f"_meta/header.json: {exc}")
        return
    stored = {"spec": spec, "header": header}
    recorded = {"spec": m.storage.spec, "header": m.header}
    for d in diff_json(_plain(stored), _plain(recorded)):
        report.problems.append(f"_meta/header.json vs manifest: {d.replace('got', 'manifest has')}")
    report.problems += promise_problems(header, m)


def _plain_json(value: Any) -> str:
    return json.dumps(dataclasses.asdict(value), sort_keys=True)


def _plain(value: Mapping[str, Any]) -> Any:
    return json.loads(json.dumps({k: dataclasses.asdict(v) for k, v in value.items()}))


def _check_parity(loc: storage.Location, m: CacheManifest, report: ValidationReport) -> None:
    """The manifest's parity section is a copy of target/parity.json (finalize copies it)."""
    key = f"{TARGET_PREFIX}/{PARITY_FILE}"
    try:
        stored = parse_parity(read_json(loc, key, max_bytes=MAX_PARITY_BYTES), key)
    except FileNotFoundError:
        if m.parity is not None:
            report.problems.append(f"manifest parity: reports a parity check (passed="
                                   f"{m.parity.passed}) but {key} does not exist")
        return
    except ValueError as exc:
        report.problems.append(f"{key}: {exc}")
        return
    if m.parity is None or _plain_json(stored) != _plain_json(m.parity):  # NaN-safe compare
        report.problems.append(f"manifest parity: differs from {key} (passed={stored.passed} "
                               "there); re-run `sparkforge finalize`")


def _check_arrays(loc: storage.Location, m: CacheManifest,
                  report: ValidationReport) -> dict[str, zarr.Array[Any]] | None:
    """Each array exists with the manifest's dtype, row shape, capacity, chunking and codec."""
    spec: CacheSpec = m.storage.spec
    try:
        storage.check_zarr_metadata(loc, array_layouts(spec))
        group = zarr.open_group(storage.zarr_store(loc, read_only=True), mode="r",
                                zarr_format=3)
    except Exception as exc:  # zarr raises many types (RecursionError too) for bad metadata
        report.problems.append(f"store: not a zarr group ({type(exc).__name__}: {exc})")
        return None
    arrays, before = {}, len(report.problems)
    for name, layout in array_layouts(spec).items():
        try:
            arr = group.get(name)
        except Exception as exc:  # as above
            report.problems.append(f"array {name}: metadata cannot be read "
                                   f"({type(exc).__name__}: {exc})")
            continue
        if not isinstance(arr, zarr.Array):
            report.problems.append(f"array {name}: missing from the store")
            continue
        shape, lead = array_shape(spec, layout), arr.ndim - len(layout.row_shape)
        checks = [("dtype", str(arr.dtype), str(layout.dtype)),
                  ("row shape", arr.shape[lead:], layout.row_shape),
                  ("rows", arr.shape[:lead], shape[:len(shape) - len(layout.row_shape)]),
                  ("shard shape" if layout.blosc else "chunk shape",
                   arr.shards if layout.blosc else arr.chunks, slot_block(spec, layout)),
                  ("dtype_logical attribute", arr.attrs.get("dtype_logical"),
                   layout.dtype_logical),
                  ("codec", describe_codecs(arr.compressors, sharded=arr.shards is not None),
                   m.storage.codecs[name])]
        report.problems += [f"array {name}: {what} is {have!r} but the manifest implies {want!r}"
                            for what, have, want in checks if have != want]
        arrays[name] = arr
    return arrays if len(report.problems) == before else None


def _check_logical_bytes(m: CacheManifest, report: ValidationReport) -> None:
    row_bytes = sum(a.dtype.itemsize * math.prod(a.row_shape)
                    for a in array_layouts(m.storage.spec).values())
    if m.storage.totals.logical_bytes != m.storage.totals.tokens * row_bytes:
        report.problems.append(f"manifest storage.totals.logical_bytes = "
                               f"{m.storage.totals.logical_bytes} but tokens x row bytes = "
                               f"{m.storage.totals.tokens * row_bytes}")


def _check_objects(loc: storage.Location, spec: CacheSpec, slots: SlotColumns,
                   arrays: Mapping[str, zarr.Array[Any]], report: ValidationReport,
                   reported: set[str], max_listings: int) -> npt.NDArray[np.int64]:
    """Every committed slot has its object in every array (missing ones would read as zeros);
    an object already ``reported`` (a link out, a special file) is not called missing too.
    Each array is listed as :func:`group_listings` streams it, ``max_listings`` arrays at once,
    so only a group's objects per array are held. Returns the bytes of each slot's objects (0
    for a missing one), in the rows of ``slots``."""
    def check(name: str) -> _ArrayObjects:
        return _check_array_objects(loc, spec, slots, name, arrays[name], reported)

    slot_bytes = np.zeros(len(slots), dtype=np.int64)
    lines: dict[str, list[str]] = {"missing": [], "empty": []}
    counts: Counter[str] = Counter()
    for _, found in storage.map_ahead(check, list(arrays), max_concurrency=max_listings,
                                      name="list"):
        slot_bytes += found.slot_bytes
        counts += found.counts
        for kind, more in found.lines.items():
            lines[kind] += more[:MAX_LISTED + 1 - len(lines[kind])]
    for kind, listed in lines.items():
        report.problems += capped(listed, counts[kind])
    report.checked["objects"] += len(slots) * len(arrays)
    report.checked["slots"] = len(slots)
    return slot_bytes


@dataclass
class _ArrayObjects:
    """One array's objects against the slots: bytes per slot row, and the missing and empty
    ones (counted, the first lines kept)."""

    slot_bytes: npt.NDArray[np.int64]
    counts: Counter[str]
    lines: dict[str, list[str]]


def _check_array_objects(loc: storage.Location, spec: CacheSpec, slots: SlotColumns, name: str,
                         arr: zarr.Array[Any], reported: set[str]) -> _ArrayObjects:
    """:func:`_check_objects` of one array, its group folders in listing order."""
    out = _ArrayObjects(np.zeros(len(slots), dtype=np.int64), Counter(),
                        {"missing": [], "empty": []})

    def key(slot: int) -> str:
        return slot_key(name, arr, slot, spec)

    folders = sorted(((group_folder(name, key(int(slots.slot[rows.start])), spec), rows)
                      for rows in slot_folders(slots, spec)), key=lambda f: f"{f[0]}/")
    listings = group_listings(loc, listing_parent(name, spec), (f for f, _ in folders))
    for (_, rows), present in zip(folders, listings, strict=True):
        for i, slot in enumerate(slots.slot[rows].tolist(), start=rows.start):
            size = present.get(k := key(slot))
            out.slot_bytes[i] = size or 0
            kind = None if k in reported else "missing" if size is None else \
                "empty" if size == 0 else None
            if kind is not None:
                out.counts[kind] += 1
                if len(out.lines[kind]) <= MAX_LISTED:
                    out.lines[kind].append(f"unit {slots.unit[i]}, slot {slot}: object {k} " + (
                        "is missing (it would read back as zeros)" if kind == "missing"
                        else "is empty"))
    return out
