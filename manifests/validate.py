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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import zarr
from tqdm import tqdm

from sparkforge.manifests.contract import EMPTY_TRAIN_SPLIT, RunContract, contract_problems
from sparkforge.manifests.finalize import read_run_header
from sparkforge.manifests.index import check_index
from sparkforge.manifests.objects import (
    MAX_COMMIT_BYTES,
    MAX_PARITY_BYTES,
    escaping_links,
    existing_location,
    irregular_objects,
    read_json,
    stored_objects,
)
from sparkforge.manifests.open import read_manifest
from sparkforge.manifests.parity import parse_parity
from sparkforge.manifests.promises import promise_problems
from sparkforge.manifests.scan import scan_unit
from sparkforge.manifests.schema import CacheManifest, UnitEntry
from sparkforge.shared import storage
from sparkforge.shared.commit import SampleRow, UnitInfo, committed_units, parse_commit_bytes
from sparkforge.shared.fields import shorten
from sparkforge.shared.layout import (
    PARITY_FILE,
    TARGET_PREFIX,
    CacheSpec,
    array_layouts,
    capacity_rows,
    commit_key,
    describe_codecs,
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
                   storage_options: Mapping[str, Any] | None = None,
                   progress: bool = False) -> ValidationReport:
    """Check a cache and (optionally) its fit with a training run.

    Args:
        uri: local path or fsspec URI of the cache.
        deep: also re-read every committed slot (checksums, finite values, token ranges).
        against: a training run's contract to check the manifest against.
        storage_options: fsspec options (e.g. S3 endpoint and credentials).
        progress: show a tqdm bar (tokens/s, ETA) over the deep scan.

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
                     progress=progress, reported=reported)
    report.problems = [shorten(p, MAX_PROBLEM_CHARS) for p in report.problems]
    return report


def _check_store(loc: storage.Location, manifest: CacheManifest, report: ValidationReport, *,
                 deep: bool, against: RunContract | None, progress: bool,
                 reported: set[str]) -> None:
    """Everything after the manifest parsed: header, commits, index, parity, arrays, objects;
    ``reported`` keys (links out, special files) are already problems and are not opened."""
    _check_header(loc, manifest, report)
    units = _check_commits(loc, manifest, report)
    splits = _check_index(loc, manifest, units, report)
    if not splits.get("train"):
        report.problems.append(EMPTY_TRAIN_SPLIT)
    _check_parity(loc, manifest, report)
    arrays = _check_arrays(loc, manifest, report)
    if arrays is not None:
        _check_objects(loc, manifest, arrays, report, reported)
        if deep:
            _deep_scan(units, arrays, manifest, report, progress=progress)
    if against is not None:
        report.problems += [p for p in contract_problems(manifest, against, split_counts=splits)
                            if p not in report.problems]


def _deep_scan(units: Mapping[int, UnitInfo], arrays: Mapping[str, zarr.Array[Any]],
               m: CacheManifest, report: ValidationReport, *, progress: bool) -> None:
    total = sum(u.num_tokens for u in units.values())
    with tqdm(total=total, unit="tok", unit_scale=True, desc="deep scan",
              disable=not progress) as bar:
        for info in units.values():
            report.problems += scan_unit(info, arrays, m, report.checked)
            bar.update(info.num_tokens)


def _manifest(loc: storage.Location, report: ValidationReport) -> CacheManifest | None:
    try:
        return read_manifest(loc)
    except ValueError as exc:
        commits = len(committed_units(loc))
        report.problems.append(f"manifest: {exc} ({commits} unit commit records present)")
        return None


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


def _check_commits(loc: storage.Location, m: CacheManifest,
                   report: ValidationReport) -> dict[int, UnitInfo]:
    """Each listed unit's commit record exists, parses and agrees with its manifest entry."""
    spec, units = m.storage.spec, {}
    for i, entry in enumerate(m.storage.units):
        where = f"unit {entry.unit}"
        try:
            raw = storage.read_bytes(loc, commit_key(entry.unit), max_bytes=MAX_COMMIT_BYTES)
            info = parse_commit_bytes(raw, unit=entry.unit, spec=spec)
        except FileNotFoundError:
            report.problems.append(f"{where}: commit record {commit_key(entry.unit)} is missing")
            continue
        except ValueError as exc:
            report.problems.append(f"{where}: {exc}")
            continue
        report.problems += [f"{where}: manifest storage.units[{i}].{p}"
                            for p in _entry_diff(entry, info)]
        units[entry.unit] = info
        report.checked["units"] += 1
    listed = {e.unit for e in m.storage.units}
    for unit in sorted(committed_units(loc) - listed):
        report.problems.append(f"unit {unit}: has a commit record but the manifest does not "
                               "list it (re-run `sparkforge finalize`)")
    return units


def _entry_diff(entry: UnitEntry, info: UnitInfo) -> list[str]:
    pairs = [("attempt", entry.attempt, info.attempt),
             ("slots", entry.slots, info.slots),
             ("num_samples", entry.num_samples, len(info.samples)),
             ("num_tokens", entry.num_tokens, info.num_tokens),
             ("accounting", entry.accounting, info.accounting)]
    return [f"{name} = {want!r} but the commit record has {have!r}"
            for name, want, have in pairs if want != have]


def _check_index(loc: storage.Location, m: CacheManifest, units: Mapping[int, UnitInfo],
                 report: ValidationReport) -> Counter[str]:
    """The index matches its sha256 and schema, and row for row the commit records."""
    key = m.storage.index_key
    splits: Counter[str] = Counter(s.split for u in units.values() for s in u.samples)
    try:
        raw = storage.read_bytes(loc, key)
    except FileNotFoundError:
        report.problems.append(f"index {key}: missing")
        return splits
    except ValueError as exc:
        report.problems.append(f"index {key}: {exc}")
        return splits
    table, problems = check_index(raw, m)
    report.problems += problems
    if table is None:
        return splits
    rows = table.to_pylist()
    ids = [r["sample_id"] for r in rows]
    if ids != sorted(set(ids)):
        report.problems.append(f"index {key}: sample_id not unique and increasing")
    committed = {s.sample_id: (u.unit, s) for u in units.values() for s in u.samples}
    for r in rows:
        report.problems += _row_diff(r, committed.get(r["sample_id"]))
    for sid in sorted(committed.keys() - set(ids)):
        report.problems.append(f"unit {committed[sid][0]}, sample {sid}: in the commit record "
                               f"but missing from index {key}")
    tokens = sum(r["length"] for r in rows)
    if tokens != m.storage.totals.tokens:
        report.problems.append(f"index {key}: lengths sum to {tokens} tokens != manifest "
                               f"storage.totals.tokens {m.storage.totals.tokens}")
    row_bytes = sum(a.dtype.itemsize * math.prod(a.row_shape)
                    for a in array_layouts(m.storage.spec).values())
    if m.storage.totals.logical_bytes != m.storage.totals.tokens * row_bytes:
        report.problems.append(f"manifest storage.totals.logical_bytes = "
                               f"{m.storage.totals.logical_bytes} but tokens x row bytes = "
                               f"{m.storage.totals.tokens * row_bytes}")
    report.checked["samples"], report.checked["tokens"] = len(rows), tokens
    return Counter(str(r["split"]) for r in rows)


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


def _row_diff(row: dict[str, Any], committed: tuple[int, SampleRow] | None) -> list[str]:
    where = f"index row sample {row['sample_id']}"
    if committed is None:
        return [f"{where}: references data no listed unit's commit record holds (unit "
                f"{row['unit']}, slot {row['slot']}, row_offset {row['row_offset']})"]
    unit, sample = committed
    have = {"unit": unit, **{k: getattr(sample, k) for k in row if k != "unit"}}
    return [f"{where}: {k} = {row[k]!r} but unit {unit}'s commit record has {have[k]!r}"
            for k in row if row[k] != have[k]]


def _check_arrays(loc: storage.Location, m: CacheManifest,
                  report: ValidationReport) -> dict[str, zarr.Array[Any]] | None:
    """Each array exists with the manifest's dtype, row shape, capacity, chunking and codec."""
    spec: CacheSpec = m.storage.spec
    try:
        storage.check_zarr_metadata(loc, array_layouts(spec))
        group = zarr.open_group(storage.zarr_store(loc, read_only=True), mode="r")
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
        block = (spec.shard_rows, *layout.row_shape)
        checks = [("dtype", str(arr.dtype), str(layout.dtype)),
                  ("row shape", arr.shape[1:], layout.row_shape),
                  ("rows", arr.shape[0], capacity_rows(spec)),
                  ("shard shape" if layout.blosc else "chunk shape",
                   arr.shards if layout.blosc else arr.chunks, block),
                  ("dtype_logical attribute", arr.attrs.get("dtype_logical"),
                   layout.dtype_logical),
                  ("codec", describe_codecs(arr.compressors, sharded=arr.shards is not None),
                   m.storage.codecs[name])]
        report.problems += [f"array {name}: {what} is {have!r} but the manifest implies {want!r}"
                            for what, have, want in checks if have != want]
        arrays[name] = arr
    return arrays if len(report.problems) == before else None


def _check_objects(loc: storage.Location, m: CacheManifest, arrays: Mapping[str, zarr.Array[Any]],
                   report: ValidationReport, reported: set[str]) -> None:
    """Every committed slot has its object in every array (missing ones would read as zeros);
    an object already ``reported`` (a link out, a special file) is not called missing too."""
    for name, arr in arrays.items():
        present = stored_objects(loc, name)
        for entry in m.storage.units:
            for slot in entry.slots:
                key = slot_key(name, arr, slot.slot)
                report.checked["objects"] += 1
                if key in reported:
                    continue
                if key not in present:
                    report.problems.append(f"unit {entry.unit}, slot {slot.slot}: object {key} "
                                           "is missing (it would read back as zeros)")
                elif present[key] == 0:
                    report.problems.append(f"unit {entry.unit}, slot {slot.slot}: object {key} "
                                           "is empty")
    report.checked["slots"] = sum(len(e.slots) for e in m.storage.units)
