"""Write a cache exactly once per unit: claim an attempt, write whole slots, then commit
(``open_unit`` streams a unit sample by sample and row block by row block; ``write_unit`` takes
whole samples)."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zarr

from sparkforge.shared import storage
from sparkforge.shared.commit import committed_units
from sparkforge.shared.dtypes import float_to_storage
from sparkforge.shared.errors import SparkforgeError
from sparkforge.shared.fields import load_json
from sparkforge.shared.header import RunHeader
from sparkforge.shared.layout import (
    HEADER_KEY,
    MAX_ATTEMPTS,
    MAX_UNITS,
    TARGET_PREFIX,
    CacheSpec,
    array_layouts,
    attempt_key,
    commit_key,
    create_arrays,
    first_slot,
    open_arrays,
)
from sparkforge.shared.records import SampleRecord, UnitAccounting
from sparkforge.shared.unit_stream import (
    WRITE_AHEAD_BYTES,
    SlotArrays,
    UnitAlreadyCommitted,
    UnitStream,
    rows_problems,
    start_problems,
)

__all__ = ["CacheMismatchError", "CacheSpec", "CacheWriter", "UnitAlreadyCommitted",
           "UnitStream", "float_to_storage"]

logger = logging.getLogger(__name__)


class CacheMismatchError(SparkforgeError):
    """Raised when a reopened store was created with a different spec or header."""


def diff_json(old: object, new: object, path: str = "") -> list[str]:
    """Dotted paths where two JSON values differ, each with both values."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for k in sorted(set(old) | set(new), key=str)
                for d in diff_json(old.get(k, "<missing>"), new.get(k, "<missing>"),
                                   f"{path}.{k}" if path else str(k))]
    if old != new:
        return [f"{path or '<root>'}: store has {old!r}, got {new!r}"]
    return []


_ZARR_V2_KEYS = (".zgroup", ".zarray")
"""Root keys of a zarr v2 group or array: every sparkforge cache is a zarr v3 group."""


def _refuse_zarr_v2(loc: storage.Location, uri: str) -> None:
    """Refuse a store without a cache header whose root is a zarr v2 node (another dataset, or
    the remains of a creation under ``ZARR_DEFAULT_ZARR_FORMAT=2``, which no sparkforge
    finished): the writer would put a v3 group beside it, which zarr warns about at every open.

    Raises:
        CacheMismatchError: naming the v2 keys found.
    """
    found = [key for key in _ZARR_V2_KEYS if storage.path_exists(loc, f"{loc.root}/{key}")]
    if found:
        raise CacheMismatchError(
            f"{uri} holds zarr v2 metadata ({', '.join(found)}) and no cache header "
            f"({HEADER_KEY}): sparkforge caches are zarr v3 groups, so it is not one; write the "
            "cache to an empty folder, or delete those keys if nothing else is stored there")


class CacheWriter:
    """Writes units into one cache store; safe to run as several processes or threads on disjoint
    units (each thread fills its own shard buffers). A unit's independent requests go out
    together, at most ``max_concurrency`` of the writer's at once."""

    def __init__(self, loc: storage.Location, spec: CacheSpec, group: zarr.Group, *,
                 max_concurrency: int = storage.DEFAULT_MAX_CONCURRENCY,
                 max_in_flight_bytes: int = WRITE_AHEAD_BYTES) -> None:
        self.loc, self.spec = loc, spec
        self._pool = ThreadPoolExecutor(max(1, max_concurrency), thread_name_prefix="unit_writes")
        self._target = SlotArrays(loc, spec, array_layouts(spec), open_arrays(group, spec),
                                  threading.local(), self._pool, max(1, max_concurrency),
                                  max_in_flight_bytes)

    @classmethod
    def open(cls, uri: str, *, spec: CacheSpec, header: RunHeader,
             storage_options: Mapping[str, Any] | None = None,
             max_concurrency: int = storage.DEFAULT_MAX_CONCURRENCY,
             max_in_flight_bytes: int = WRITE_AHEAD_BYTES) -> CacheWriter:
        """Create the store, or reopen it after checking that spec and header are unchanged.

        The header is validated first (it must parse back from its JSON), so a bad header fails
        before anything is written or captured. ``max_concurrency`` bounds the requests the
        writer has in flight at once (slot objects, and a unit's claim beside its commit check);
        ``max_in_flight_bytes`` the encoded slot objects each open unit holds while they are sent
        (at least one, however large).

        Raises:
            ManifestError: naming the first header field that would not parse.
            CacheMismatchError: naming each differing field (dotted path) and both values, or
                the zarr v2 metadata a store without a header holds.
        """
        try:
            wanted = json.loads(json.dumps({"format_version": spec.format_version,
                                            "spec": spec.to_json(), "header": header.to_json()}))
        except (TypeError, ValueError) as exc:
            raise SparkforgeError(f"header must be JSON-serialisable: {exc}") from exc
        RunHeader.from_json(wanted["header"])
        loc = storage.open_location(uri, storage_options)
        fresh = not storage.exists(loc, HEADER_KEY)
        if fresh:
            _refuse_zarr_v2(loc, uri)
        # Caches are zarr v3: without the format, zarr also probes v2's .zgroup, .zattrs and
        # .zmetadata (on S3 a HEAD and a LIST each).
        group = zarr.open_group(storage.zarr_store(loc, read_only=False), mode="a",
                                zarr_format=3)
        if fresh:
            create_arrays(group, spec)
            try:
                storage.exclusive_create(loc, HEADER_KEY, json.dumps(wanted, indent=1).encode())
            except FileExistsError:
                pass  # a concurrent creator won; compare against its header below
        stored = load_json(storage.read_bytes(loc, HEADER_KEY), HEADER_KEY)
        if isinstance(stored, dict) and stored.get("format_version") != spec.format_version:
            raise CacheMismatchError(
                f"cache at {uri} has format_version {stored.get('format_version')!r} and this "
                f"run writes {spec.format_version}: finish it with the sparkforge that started "
                "it, or write a new cache")
        problems = diff_json(stored, wanted)
        if problems:
            raise CacheMismatchError(f"cache at {uri} was created with a different spec/header: "
                                     + "; ".join(problems))
        return cls(loc, spec, group, max_concurrency=max_concurrency,
                   max_in_flight_bytes=max_in_flight_bytes)

    def committed_units(self) -> set[int]:
        """Units whose commit record exists (read fresh from the store)."""
        return committed_units(self.loc, self.spec)

    def is_committed(self, unit: int) -> bool:
        """Whether ``unit``'s commit record exists (read fresh from the store)."""
        return storage.exists(self.loc, commit_key(self.spec, unit))

    def write_target_files(self, files: Mapping[str, bytes]) -> None:
        """Store the target pieces the trainer needs (config, tokenizer, weights); idempotent."""
        for name, data in files.items():
            storage.atomic_write(self.loc, f"{TARGET_PREFIX}/{storage.safe_key(name)}", data)

    def open_unit(self, unit: int) -> UnitStream:
        """Claim a fresh attempt of ``unit`` and return the stream that writes it: samples in
        order, each in blocks of rows; nothing is visible until ``UnitStream.commit``.

        Raises:
            UnitAlreadyCommitted: if the unit is committed already.
        """
        if not 0 <= unit < MAX_UNITS:
            raise SparkforgeError(f"unit must be in [0, {MAX_UNITS}), got {unit}")
        # The claim goes out beside the check: one request latency, not two. A claim of a
        # committed unit is harmless (no record names its attempt) and is not waited for.
        claim = self._pool.submit(self._claim_attempt, unit)
        if self.is_committed(unit):
            raise UnitAlreadyCommitted(f"unit {unit} is already committed")
        attempt = claim.result()
        return UnitStream(self._target, unit=unit, attempt=attempt,
                          first_slot=first_slot(self.spec, unit, attempt))

    def write_unit(self, unit: int, samples: Sequence[SampleRecord],
                   accounting: UnitAccounting) -> None:
        """Write one unit's whole samples into fresh slots, then publish its commit record.

        Raises:
            UnitAlreadyCommitted: if the unit is (or concurrently becomes) committed.
            ValueError: if a sample does not match the spec or the unit (before any write).
        """
        self._check_unit(unit, samples, accounting)
        stream = self.open_unit(unit)
        for s in samples:
            stream.begin(s.start())
            stream.add(s.rows())
            stream.end()
        info = stream.commit(accounting)
        logger.debug("committed unit %d (attempt %d, %d samples, %d slots)",
                     unit, info.attempt, len(info.samples), len(info.slots))

    def _claim_attempt(self, unit: int) -> int:
        """Claim the unit's first free attempt number by exclusive create, probing from 0.

        A claim costs one create per earlier attempt of this unit and lists nothing: on S3,
        listing a unit's missing ``_attempts/`` folder falls back to listing its parent, one
        page per 1,000 units already claimed, so every commit grew with the units before it.
        """
        for attempt in range(MAX_ATTEMPTS):
            try:
                storage.exclusive_create(self.loc, attempt_key(self.spec, unit, attempt), b"")
                return attempt
            except FileExistsError:
                continue
        raise SparkforgeError(f"unit {unit} has used all {MAX_ATTEMPTS} write attempts")

    def _check_unit(self, unit: int, samples: Sequence[SampleRecord],
                    accounting: UnitAccounting) -> None:
        spec = self.spec
        if not 0 <= unit < MAX_UNITS:
            raise SparkforgeError(f"unit must be in [0, {MAX_UNITS}), got {unit}")
        if accounting.input_rows > spec.rows_per_unit or accounting.written != len(samples):
            raise SparkforgeError(f"unit {unit}: accounting {accounting} does not match "
                                  f"{len(samples)} samples and rows_per_unit {spec.rows_per_unit}")
        lo, hi = unit * spec.rows_per_unit, (unit + 1) * spec.rows_per_unit
        if len({s.sample_id for s in samples}) != len(samples):
            raise SparkforgeError(f"unit {unit}: duplicate sample_id")
        for s in samples:
            problems = self._sample_problems(s)
            if not lo <= s.source_row < hi:
                problems.append(f"source_row {s.source_row} outside the unit's rows [{lo}, {hi})")
            if problems:
                raise SparkforgeError(f"unit {unit}, sample {s.sample_id}: " + "; ".join(problems))

    def _sample_problems(self, s: SampleRecord) -> list[str]:
        problems = start_problems(self.spec, s.start()) + rows_problems(self.spec, s.rows())
        if s.rows().num_rows != s.num_tokens:
            problems.append(f"final_hidden has {s.rows().num_rows} rows for {s.num_tokens} tokens")
        return problems
