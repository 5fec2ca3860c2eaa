"""Write a cache exactly once per unit: claim an attempt, write whole slots, then commit."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import zarr

from sparkforge.shared import storage
from sparkforge.shared.commit import SampleRow, SlotRecord, UnitInfo, checksum, committed_units
from sparkforge.shared.dtypes import (
    STORAGE_DTYPES,
    float_to_storage,
    quantize_e4m3,
    storage_to_float32,
)
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
    row_selection,
)
from sparkforge.shared.records import SampleRecord, UnitAccounting

__all__ = ["CacheMismatchError", "CacheSpec", "CacheWriter", "UnitAlreadyCommitted",
           "float_to_storage"]

logger = logging.getLogger(__name__)


class CacheMismatchError(SparkforgeError):
    """Raised when a reopened store was created with a different spec or header."""


class UnitAlreadyCommitted(SparkforgeError):
    """Raised when a unit is written whose commit record already exists."""


def diff_json(old: object, new: object, path: str = "") -> list[str]:
    """Dotted paths where two JSON values differ, each with both values."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for k in sorted(set(old) | set(new), key=str)
                for d in diff_json(old.get(k, "<missing>"), new.get(k, "<missing>"),
                                   f"{path}.{k}" if path else str(k))]
    if old != new:
        return [f"{path or '<root>'}: store has {old!r}, got {new!r}"]
    return []


class CacheWriter:
    """Writes units into one cache store; safe to run as several processes or threads on disjoint
    units (each thread fills its own shard buffers)."""

    def __init__(self, loc: storage.Location, spec: CacheSpec, group: zarr.Group) -> None:
        self.loc, self.spec = loc, spec
        self._layouts = array_layouts(spec)
        # Every committed slot gets its object, even an all-zero one (e.g. pre-tokenized ids that
        # are all 0): readers and validate treat a missing object as lost data, never as zeros.
        self._arrays = {name: arr.with_config({"write_empty_chunks": True})
                        for name, arr in open_arrays(group, spec).items()}
        self._local = threading.local()

    @classmethod
    def open(cls, uri: str, *, spec: CacheSpec, header: RunHeader,
             storage_options: Mapping[str, Any] | None = None) -> CacheWriter:
        """Create the store, or reopen it after checking that spec and header are unchanged.

        The header is validated first (it must parse back from its JSON), so a bad header fails
        before anything is written or captured.

        Raises:
            ManifestError: naming the first header field that would not parse.
            CacheMismatchError: naming each differing field (dotted path) and both values.
        """
        try:
            wanted = json.loads(json.dumps({"format_version": spec.format_version,
                                            "spec": spec.to_json(), "header": header.to_json()}))
        except (TypeError, ValueError) as exc:
            raise SparkforgeError(f"header must be JSON-serialisable: {exc}") from exc
        RunHeader.from_json(wanted["header"])
        loc = storage.open_location(uri, storage_options)
        group = zarr.open_group(storage.zarr_store(loc, read_only=False), mode="a")
        if not storage.exists(loc, HEADER_KEY):
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
        return cls(loc, spec, group)

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

    def write_unit(self, unit: int, samples: Sequence[SampleRecord],
                   accounting: UnitAccounting) -> None:
        """Write one unit's samples into fresh slots, then publish its commit record.

        Raises:
            UnitAlreadyCommitted: if the unit is (or concurrently becomes) committed.
            ValueError: if a sample does not match the spec or the unit.
        """
        self._check_unit(unit, samples, accounting)
        if self.is_committed(unit):
            raise UnitAlreadyCommitted(f"unit {unit} is already committed")
        attempt = self._claim_attempt(unit)
        slots, rows = self._write_samples(first_slot(self.spec, unit, attempt), samples)
        info = UnitInfo(unit=unit, attempt=attempt, slots=tuple(slots), samples=tuple(rows),
                        accounting=accounting)
        try:
            storage.exclusive_create(self.loc, commit_key(self.spec, unit),
                                     info.to_bytes(self.spec.format_version))
        except FileExistsError as exc:
            raise UnitAlreadyCommitted(f"unit {unit} was committed by another attempt while "
                                       f"attempt {attempt} wrote it") from exc
        logger.debug("committed unit %d (attempt %d, %d samples, %d slots)",
                     unit, attempt, len(rows), len(slots))

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

    def _write_samples(self, slot: int, samples: Sequence[SampleRecord]
                       ) -> tuple[list[SlotRecord], list[SampleRow]]:
        """Pack the samples in order into slots from ``slot`` on, each written as soon as it is
        full, so memory holds one slot of rows whatever the samples' length.

        A sample starts a fresh slot unless it fits the current slot's free rows; one longer
        than a slot then runs over the next ones (the index records its first slot).
        """
        sr = self.spec.shard_rows
        buffers = self._shard_buffers()
        slots, rows, used = [], [], 0
        for s in samples:
            if used and used + s.num_tokens > sr:
                slots.append(self._write_slot(slot, buffers, used))
                slot, used = slot + 1, 0
            rows.append(SampleRow(
                sample_id=s.sample_id, slot=slot, row_offset=slot * sr + used,
                length=s.num_tokens, num_loss_tokens=int(np.count_nonzero(s.loss_mask)),
                source_row=s.source_row, source_hash=s.source_hash, split=s.split))
            values, done = self._stored_fields(s), 0
            while done < s.num_tokens:
                if used == sr:
                    slots.append(self._write_slot(slot, buffers, used))
                    slot, used = slot + 1, 0
                n = min(sr - used, s.num_tokens - done)
                self._local.dirty_rows = max(self._local.dirty_rows, used + n)
                for name, buf in buffers.items():
                    a = self._layouts[name]
                    field = values[a.field] if a.layer is None else values[a.field][:, a.layer]
                    buf[used:used + n] = field[done:done + n]
                used, done = used + n, done + n
        if used:
            slots.append(self._write_slot(slot, buffers, used))
        return slots, rows

    def _write_slot(self, slot: int, buffers: dict[str, np.ndarray], used: int) -> SlotRecord:
        """One setitem per array covering the whole shard, so each shard object lands whole.

        Rows past ``used`` that an earlier slot filled are cleared first; a failed write leaves
        the larger count, so nothing stale ever reaches the next slot.
        """
        sr = self.spec.shard_rows
        crcs = {}
        for name, buf in buffers.items():
            buf[used:self._local.dirty_rows] = 0
            self._arrays[name][row_selection(self.spec, slot * sr, (slot + 1) * sr)] = buf
            crcs[name] = checksum(buf[:used])
        self._local.dirty_rows = used
        return SlotRecord(slot=slot, num_rows=used, crc32c=crcs)

    def _stored_fields(self, s: SampleRecord) -> dict[str, Any]:
        """The sample's fields as stored: a record in the hidden dtype is quantised here with
        the numpy reference when the cache is fp8 (the producer hands codes and scales
        quantised in torch where the activations were)."""
        values = {name: getattr(s, name) for name in {a.field for a in self._layouts.values()}}
        if self.spec.aux_codec == "fp8" and s.aux_scale is None:
            wide = storage_to_float32(s.aux_hidden, self.spec.hidden_dtype)
            values["aux_hidden"], values["aux_scale"] = quantize_e4m3(wide)
        return values

    def _shard_buffers(self) -> dict[str, np.ndarray]:
        """This thread's shard buffers, one per array (zeroed when first allocated), reused
        from slot to slot: the writer holds one slot of rows, whatever the samples' length."""
        local = self._local
        if not hasattr(local, "buffers"):
            sr = self.spec.shard_rows
            local.buffers = {name: np.zeros((sr, *a.row_shape), dtype=a.dtype)
                             for name, a in self._layouts.items()}
            local.dirty_rows = 0
        buffers: dict[str, np.ndarray] = local.buffers
        return buffers

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
        spec, t = self.spec, s.num_tokens
        hidden = STORAGE_DTYPES[spec.hidden_dtype]
        f, h, k = spec.num_aux_layers, spec.hidden_size, spec.topk
        expected: dict[str, tuple[tuple[int, ...], np.dtype[Any]]] = {
            "input_ids": ((t,), np.dtype(np.int32)), "loss_mask": ((t,), np.dtype(np.uint8)),
            "aux_hidden": ((t, f, h), hidden), "final_hidden": ((t, h), hidden)}
        if s.aux_scale is not None:  # already quantised: e4m3 codes and their scales
            expected |= {"aux_hidden": ((t, f, h), np.dtype(np.uint8)),
                         "aux_scale": ((t, f), np.dtype(np.float32))}
        if k:
            expected |= {"topk_ids": ((t, k), np.dtype(np.int32)),
                         "topk_logprobs": ((t, k), np.dtype(np.float32))}
        problems = [f"{name} must be {shape} {dtype}, got "
                    + (f"{arr.shape} {arr.dtype}" if arr is not None else "None")
                    for name, (shape, dtype) in expected.items()
                    if (arr := getattr(s, name)) is None or arr.shape != shape
                    or arr.dtype != dtype]
        if not 1 <= t <= spec.max_seq_len:
            problems.append(f"length {t} must be in [1, max_seq_len={spec.max_seq_len}]")
        if s.aux_scale is not None and spec.aux_codec != "fp8":
            problems.append("has fp8 aux_scale but the cache spec has aux_codec="
                            f"{spec.aux_codec!r}")
        if not k and (s.topk_ids is not None or s.topk_logprobs is not None):
            problems.append("has topk arrays but the cache spec has topk=0")
        if not s.source_hash or s.source_hash.strip("0123456789abcdef"):
            problems.append(f"source_hash must be a lowercase hex digest, got {s.source_hash!r}")
        if s.split not in ("train", "eval"):
            problems.append(f"split must be 'train' or 'eval', got {s.split!r}")
        return problems

