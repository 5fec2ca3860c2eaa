"""One unit's attempt written sample by sample, each sample in blocks of rows as they are captured.

The writer packs a unit's samples in order into the attempt's slots and encodes each slot as soon
as it is full, so memory holds one slot of rows per array (plus the encoded objects still being
sent, at most ``SlotArrays.max_bytes``), and a capture that hands a long sample over a chunk at a
time never holds the sample whole. Slot objects are sent several at once, while the next slot fills.
Nothing is visible until ``commit``, once every slot object is durable, publishes the unit's commit
record (an exclusive create); a crash or an error before it leaves only slot objects of an attempt
no record names, which readers never read and a re-run does not reuse.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import zarr
from zarr.core.metadata import ArrayV3Metadata
from zarr.storage import MemoryStore, StorePath

from sparkforge.shared import storage
from sparkforge.shared.commit import SampleRow, SlotRecord, UnitInfo, checksum
from sparkforge.shared.dtypes import STORAGE_DTYPES, quantize_e4m3, storage_to_float32
from sparkforge.shared.errors import SparkforgeError
from sparkforge.shared.layout import ArrayLayout, CacheSpec, commit_key, slot_block, slot_key
from sparkforge.shared.records import SampleRows, SampleStart, UnitAccounting

WRITE_AHEAD_BYTES: Final = 256 << 20
"""Encoded slot objects one stream may hold while they are sent, by default (at least one,
however large)."""


class UnitAlreadyCommitted(SparkforgeError):
    """Raised when a unit is written whose commit record already exists."""


@dataclass(frozen=True)
class SlotArrays:
    """Where a stream writes: the store, its spec, its arrays, the calling thread's state and the
    pool that sends slot objects."""

    loc: storage.Location
    spec: CacheSpec
    layouts: dict[str, ArrayLayout]
    arrays: dict[str, zarr.Array[Any]]
    local: threading.local
    """Per thread: the shard buffers it reuses from slot to slot, and their dirty rows."""
    pool: ThreadPoolExecutor
    max_in_flight: int
    """Slot objects one stream sends at once."""
    max_bytes: int = WRITE_AHEAD_BYTES
    """Encoded bytes of the slot objects one stream holds while they are sent."""


def start_problems(spec: CacheSpec, s: SampleStart) -> list[str]:
    """What is wrong with a sample's identity, ids and mask (empty: nothing)."""
    t = s.num_tokens
    problems = [f"{name} must be ({t},) {dtype}, got {arr.shape} {arr.dtype}"
                for name, dtype in (("input_ids", np.int32), ("loss_mask", np.uint8))
                if (arr := getattr(s, name)).shape != (t,) or arr.dtype != dtype]
    if not 1 <= t <= spec.max_seq_len:
        problems.append(f"length {t} must be in [1, max_seq_len={spec.max_seq_len}]")
    if not s.source_hash or s.source_hash.strip("0123456789abcdef"):
        problems.append(f"source_hash must be a lowercase hex digest, got {s.source_hash!r}")
    if s.split not in ("train", "eval"):
        problems.append(f"split must be 'train' or 'eval', got {s.split!r}")
    return problems


def rows_problems(spec: CacheSpec, r: SampleRows) -> list[str]:
    """What is wrong with a block of captured rows (empty: nothing)."""
    n, f, h, k = r.num_rows, spec.num_aux_layers, spec.hidden_size, spec.topk
    hidden = STORAGE_DTYPES[spec.hidden_dtype]
    expected: dict[str, tuple[tuple[int, ...], np.dtype[Any]]] = {
        "aux_hidden": ((n, f, h), hidden), "final_hidden": ((n, h), hidden)}
    if r.aux_scale is not None:  # already quantised: e4m3 codes and their scales
        expected |= {"aux_hidden": ((n, f, h), np.dtype(np.uint8)),
                     "aux_scale": ((n, f), np.dtype(np.float32))}
    if k:
        expected |= {"topk_ids": ((n, k), np.dtype(np.int32)),
                     "topk_logprobs": ((n, k), np.dtype(np.float32))}
    problems = [f"{name} must be {shape} {dtype}, got "
                + (f"{arr.shape} {arr.dtype}" if arr is not None else "None")
                for name, (shape, dtype) in expected.items()
                if (arr := getattr(r, name)) is None or arr.shape != shape or arr.dtype != dtype]
    if r.aux_scale is not None and spec.aux_codec != "fp8":
        problems.append(f"has fp8 aux_scale but the cache spec has aux_codec={spec.aux_codec!r}")
    if not k and (r.topk_ids is not None or r.topk_logprobs is not None):
        problems.append("has topk arrays but the cache spec has topk=0")
    return problems


@dataclass
class _OpenSample:
    start: SampleStart
    slot: int
    used: int
    """Where the sample's first row goes: a rewind point if it is abandoned."""
    num_slots: int
    """Slots already written when it began."""
    done: int = 0


class UnitStream:
    """Writes one claimed attempt of a unit: ``begin`` a sample, ``add`` its rows in blocks,
    ``end`` it (or ``abandon`` it: its rows are dropped), then ``commit`` the unit. Use from one
    thread (the stream fills that thread's shard buffers)."""

    def __init__(self, target: SlotArrays, *, unit: int, attempt: int, first_slot: int) -> None:
        self._t, self.unit, self.attempt = target, unit, attempt
        self._slot, self._used = first_slot, 0
        self._slots: list[SlotRecord] = []
        self._rows: list[SampleRow] = []
        self._ids: set[int] = set()
        self._open: _OpenSample | None = None
        self._buffers = _shard_buffers(target)
        # Slot objects are not fsynced on local disk, as when zarr's local store wrote them:
        # a killed writer leaves each whole or absent; the commit record is fsynced.
        self._writes = storage.PendingWrites(target.loc, target.pool,
                                             max_in_flight=target.max_in_flight,
                                             max_bytes=target.max_bytes, sync=False)

    def _fail(self, sample_id: int, problems: list[str]) -> None:
        if problems:
            raise SparkforgeError(f"unit {self.unit}, sample {sample_id}: " + "; ".join(problems))

    def begin(self, start: SampleStart) -> None:
        """Start a sample: it takes the current slot's free rows if it fits them, else a fresh
        slot and as many after it as its length needs."""
        assert self._open is None, "the previous sample was neither ended nor abandoned"
        spec = self._t.spec
        lo, hi = self.unit * spec.rows_per_unit, (self.unit + 1) * spec.rows_per_unit
        problems = start_problems(spec, start)
        if not lo <= start.source_row < hi:
            problems.append(f"source_row {start.source_row} outside the unit's rows [{lo}, {hi})")
        if start.sample_id in self._ids:
            problems.append("duplicate sample_id")
        self._fail(start.sample_id, problems)
        if self._used and self._used + start.num_tokens > spec.shard_rows:
            self._next_slot()
        self._open = _OpenSample(start, self._slot, self._used, len(self._slots))

    def add(self, rows: SampleRows) -> None:
        """The open sample's next ``rows.num_rows`` rows; full slots are written at once."""
        o = self._open
        assert o is not None, "add() before begin()"
        n, spec = rows.num_rows, self._t.spec
        problems = rows_problems(spec, rows)
        if o.done + n > o.start.num_tokens:
            problems.append(f"{o.done} + {n} rows passes its length {o.start.num_tokens}")
        self._fail(o.start.sample_id, problems)
        values = _stored_fields(spec, rows)
        values["input_ids"] = o.start.input_ids[o.done:o.done + n]
        values["loss_mask"] = o.start.loss_mask[o.done:o.done + n]
        sr, local, done = spec.shard_rows, self._t.local, 0
        while done < n:
            if self._used == sr:
                self._next_slot()
            m = min(sr - self._used, n - done)
            local.dirty_rows = max(local.dirty_rows, self._used + m)
            for name, buf in self._buffers.items():
                a = self._t.layouts[name]
                field = values[a.field] if a.layer is None else values[a.field][:, a.layer]
                buf[self._used:self._used + m] = field[done:done + m]
            self._used, done = self._used + m, done + m
        o.done += n

    def end(self) -> None:
        """Close the open sample; it must have received all its rows."""
        o = self._open
        assert o is not None, "end() before begin()"
        s = o.start
        if o.done != s.num_tokens:
            self._fail(s.sample_id, [f"ended after {o.done} of its {s.num_tokens} rows"])
        self._rows.append(SampleRow(
            sample_id=s.sample_id, slot=o.slot, row_offset=o.slot * self._t.spec.shard_rows
            + o.used, length=s.num_tokens, num_loss_tokens=int(np.count_nonzero(s.loss_mask)),
            source_row=s.source_row, source_hash=s.source_hash, split=s.split))
        self._ids.add(s.sample_id)
        self._open = None

    def abandon(self) -> None:
        """Drop the open sample: the next one is written where it began (slots it filled are
        written over, or left unnamed by the commit record)."""
        o = self._open
        assert o is not None, "abandon() before begin()"
        self._slot, self._used = o.slot, o.used
        del self._slots[o.num_slots:]
        self._open = None

    def commit(self, accounting: UnitAccounting) -> UnitInfo:
        """Write the last slot, wait until every slot object is durable, then publish the unit's
        commit record.

        Raises:
            UnitAlreadyCommitted: if another attempt committed the unit meanwhile.
            SparkforgeError: if the accounting does not match the samples written.
        """
        assert self._open is None, "commit() with a sample open"
        spec = self._t.spec
        if accounting.input_rows > spec.rows_per_unit or accounting.written != len(self._rows):
            raise SparkforgeError(f"unit {self.unit}: accounting {accounting} does not match "
                                  f"{len(self._rows)} samples and rows_per_unit "
                                  f"{spec.rows_per_unit}")
        if self._used:
            self._slots.append(self._write_slot())
            self._used = 0
        self._writes.wait()
        info = UnitInfo(unit=self.unit, attempt=self.attempt, slots=tuple(self._slots),
                        samples=tuple(self._rows), accounting=accounting)
        try:
            storage.exclusive_create(self._t.loc, commit_key(spec, self.unit),
                                     info.to_bytes(spec.format_version))
        except FileExistsError as exc:
            raise UnitAlreadyCommitted(f"unit {self.unit} was committed by another attempt "
                                       f"while attempt {self.attempt} wrote it") from exc
        return info

    def _next_slot(self) -> None:
        self._slots.append(self._write_slot())
        self._slot, self._used = self._slot + 1, 0

    def _write_slot(self) -> SlotRecord:
        """Encode each array's whole slot object and send it (at most ``max_in_flight`` at once).

        Rows past ``used`` that an earlier slot filled are cleared first; a failed write leaves
        the larger count, so nothing stale ever reaches the next slot.
        """
        spec, local, used = self._t.spec, self._t.local, self._used
        crcs = {}
        for name, buf in self._buffers.items():
            buf[used:local.dirty_rows] = 0
            arr = self._t.arrays[name]
            data = encode_slot(arr, slot_block(spec, self._t.layouts[name]), buf)
            self._writes.write(slot_key(name, arr, self._slot, spec), data)
            crcs[name] = checksum(buf[:used])
        local.dirty_rows = used
        return SlotRecord(slot=self._slot, num_rows=used, crc32c=crcs)


def encode_slot(arr: zarr.Array[Any], block: tuple[int, ...], rows: np.ndarray) -> bytes:
    """The object zarr stores for one whole slot of ``arr`` (its shard, or the one chunk of an
    unsharded array), encoded in memory by an array of one slot with the same metadata.

    Written through the store instead, zarr's sharding codec first reads the shard's object
    back (on S3: a HEAD and a LIST for an object that does not exist yet). Every slot gets its
    object, even an all-zero one (e.g. pre-tokenized ids that are all 0): readers and validate
    treat a missing object as lost data, never as zeros.
    """
    metadata = arr.metadata.update_shape(block)
    assert isinstance(metadata, ArrayV3Metadata), "caches are zarr v3 arrays"
    objects: dict[str, Any] = {}
    one = zarr.AsyncArray(metadata=metadata, store_path=StorePath(MemoryStore(objects)),
                          config={"write_empty_chunks": True})
    zarr.Array(one)[...] = rows.reshape(block)
    data: bytes = objects[metadata.encode_chunk_key((0,) * len(block))].to_bytes()
    return data


def _stored_fields(spec: CacheSpec, r: SampleRows) -> dict[str, Any]:
    """A block's fields as stored: rows in the hidden dtype are quantised here with the numpy
    reference when the cache is fp8 (the producer hands codes and scales quantised in torch
    where the activations were)."""
    values: dict[str, Any] = {"aux_hidden": r.aux_hidden, "final_hidden": r.final_hidden,
                              "aux_scale": r.aux_scale, "topk_ids": r.topk_ids,
                              "topk_logprobs": r.topk_logprobs}
    if spec.aux_codec == "fp8" and r.aux_scale is None:
        wide = storage_to_float32(r.aux_hidden, spec.hidden_dtype)
        values["aux_hidden"], values["aux_scale"] = quantize_e4m3(wide)
    return values


def _shard_buffers(target: SlotArrays) -> dict[str, np.ndarray]:
    """The calling thread's shard buffers, one per array (zeroed when first allocated), reused
    from slot to slot: the writer holds one slot of rows, whatever the samples' length."""
    local = target.local
    if not hasattr(local, "buffers"):
        sr = target.spec.shard_rows
        local.buffers = {name: np.zeros((sr, *a.row_shape), dtype=a.dtype)
                         for name, a in target.layouts.items()}
        local.dirty_rows = 0
    buffers: dict[str, np.ndarray] = local.buffers
    return buffers
