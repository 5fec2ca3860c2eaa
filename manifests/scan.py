"""Deep checks of committed slots: recompute every crc32c and find non-finite hidden values.

Every slot object is read whole, once, ``max_concurrency`` at a time and at most
:data:`READ_AHEAD_BYTES` ahead (an object store answers each read in tens of milliseconds, so
one at a time leaves it idle), then decoded from memory in row blocks of about
:data:`BLOCK_BYTES`, so memory stays bounded for any shard size; problems name the unit, slot,
sample, array and (for ``aux_hidden``) layer slot.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Final

import crc32c
import numpy as np
import numpy.typing as npt
import zarr
from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.core.sync import sync as zarr_sync
from zarr.storage import WrapperStore

from sparkforge.manifests.schema import CacheManifest
from sparkforge.shared import storage
from sparkforge.shared.dtypes import storage_to_float32
from sparkforge.shared.layout import CacheSpec, array_layouts, open_arrays, row_selection, slot_key

BLOCK_BYTES: Final = 64 << 20
"""Rows decoded per step and array (about 64 MiB)."""
READ_AHEAD_BYTES: Final = 1 << 30
"""Slot objects held in memory ahead of the decoding, at most (plus the slot being decoded)."""

Int64s = npt.NDArray[np.int64]


@dataclass(frozen=True, eq=False)
class SlotToScan:
    """One committed slot as its commit record has it, with the samples holding rows of it in
    storage order (a sample spanning slots is listed in each; its ``row_offset`` may lie in an
    earlier slot)."""

    unit: int
    slot: int
    num_rows: int
    crc32c: dict[str, int]
    sample_id: Int64s
    row_offset: Int64s
    length: Int64s
    num_loss_tokens: Int64s


@dataclass
class _Finding:
    """Non-finite values of one (sample, array): how many, first token, which layer slots."""

    count: int = 0
    first_token: int = -1
    layers: set[int] = field(default_factory=set)


class _Prefetched(WrapperStore):  # type: ignore[type-arg]
    """A read-only store that answers from objects already fetched (whole) and falls back to the
    store it wraps (zarr metadata; an object that could not be fetched reads as zarr reads it)."""

    def __init__(self, store: Any) -> None:
        super().__init__(store)
        self.objects: dict[str, bytes] = {}

    async def get(self, key: str, prototype: BufferPrototype,
                  byte_range: Any = None) -> Buffer | None:
        data = self.objects.get(key)
        if data is None:
            return await super().get(key, prototype, byte_range)
        if isinstance(byte_range, RangeByteRequest):
            data = data[byte_range.start:byte_range.end]
        elif isinstance(byte_range, OffsetByteRequest):
            data = data[byte_range.offset:]
        elif isinstance(byte_range, SuffixByteRequest):
            data = data[-byte_range.suffix:] if byte_range.suffix else b""
        return prototype.buffer.from_bytes(data)


def scan_slots(loc: storage.Location, slots: Iterable[SlotToScan], m: CacheManifest,
               checked: Counter[str], *, slot_bytes: Callable[[int], int],
               max_concurrency: int = storage.DEFAULT_MAX_CONCURRENCY,
               ) -> Iterator[tuple[SlotToScan, list[str]]]:
    """Each slot with every problem in its stored rows (empty when its data is intact), in the
    order given; ``slot_bytes`` (slot -> bytes of its objects, from a listing) bounds the bytes
    read ahead."""
    store = _Prefetched(storage.zarr_store(loc, read_only=True))
    arrays = open_arrays(zarr.open_group(store, mode="r", zarr_format=3), m.storage.spec)
    partial: dict[int, tuple[int, int]] = {}  # samples spanning slots: (rows, loss tokens) seen
    for slot, objects in _fetched(loc, slots, arrays, m.storage.spec, slot_bytes,
                                  max_concurrency):
        store.objects.update(objects)
        try:
            yield slot, _scan_slot(slot, arrays, m, checked, partial)
        finally:
            for key in objects:
                store.objects.pop(key, None)


def _fetched(loc: storage.Location, slots: Iterable[SlotToScan],
             arrays: Mapping[str, zarr.Array[Any]], spec: CacheSpec,
             slot_bytes: Callable[[int], int],
             max_concurrency: int) -> Iterator[tuple[SlotToScan, dict[str, bytes]]]:
    """Each slot with its objects' bytes (those that could be read; a missing object is left to
    zarr, which reads it back as zeros: a crc32c mismatch), fetched ahead in order, a slot's
    objects sent as one batch."""
    ahead: deque[tuple[SlotToScan, int, list[str], Future[list[storage.ReadResult]]]] = deque()
    held = 0

    def done() -> tuple[SlotToScan, dict[str, bytes]]:
        nonlocal held
        slot, size, keys, results = ahead.popleft()
        held -= size
        return slot, {k: v for k, v in zip(keys, results.result(), strict=True)
                      if isinstance(v, bytes)}

    with storage.read_batches(loc, max_concurrency=max_concurrency) as send:
        for slot in slots:
            keys = [slot_key(name, arr, slot.slot, spec) for name, arr in arrays.items()]
            size = slot_bytes(slot.slot)
            while ahead and (held + size > READ_AHEAD_BYTES
                             or len(ahead) * len(keys) >= 2 * max_concurrency):
                yield done()
            ahead.append((slot, size, keys, send(keys)))
            held += size
        while ahead:
            yield done()


def _scan_slot(slot: SlotToScan, arrays: Mapping[str, zarr.Array[Any]], m: CacheManifest,
               checked: Counter[str], partial: dict[int, tuple[int, int]]) -> list[str]:
    spec = m.storage.spec
    layouts = array_layouts(spec)
    starts = slot.row_offset - slot.slot * spec.shard_rows
    where, problems = f"unit {slot.unit}, slot {slot.slot}", []
    findings: dict[tuple[int, str], _Finding] = {}
    crcs: dict[str, int] = {}
    broken: set[str] = set()
    for name, lo, block in _blocks(arrays, m, slot):
        if name in broken:
            continue
        if isinstance(block, BaseException):  # a corrupt object fails to decode: scan the rest
            problems.append(f"{where}: array {name}: cannot be decoded "
                            f"({type(block).__name__}: {block})")
            broken.add(name)
            continue
        crcs[name] = crc32c.crc32c(np.ascontiguousarray(block).data.cast("B"), crcs.get(name, 0))
        checked["bytes_scanned"] += block.nbytes
        bad = _nonfinite(layouts[name].field, block, spec.hidden_dtype)
        if bad is not None:
            _record(findings, name, bad, lo, starts, layouts[name].layer)
        if name in ("input_ids", "loss_mask"):
            problems += _token_problems(name, block, lo, slot, starts, m, where, partial)
    for name in arrays.keys() - broken:
        crc, expected = crcs.get(name, 0), slot.crc32c.get(name)
        if crc != expected:
            shown = "none" if expected is None else f"{expected:#010x}"
            problems.append(f"{where}: array {name}: crc32c {crc:#010x} != committed {shown} "
                            "(data corrupted or overwritten)")
    layer_ids = m.capture.layer_ids
    for (i, name), f in sorted(findings.items()):
        layers = (f" (layer slots {sorted(f.layers)} = capture.layer_ids "
                  f"{[layer_ids[j] for j in sorted(f.layers)]})" if f.layers else "")
        problems.append(f"{where}, sample {int(slot.sample_id[i])}: array {name}{layers}: "
                        f"{f.count} non-finite values, first at token {f.first_token}")
    return problems


def _blocks(arrays: Mapping[str, zarr.Array[Any]], m: CacheManifest,
            slot: SlotToScan) -> Iterator[tuple[str, int, npt.NDArray[Any] | BaseException]]:
    """(array, first row in the slot, decoded rows or the error decoding them) for every
    array's used rows of the slot in inner-chunk-aligned blocks, array by array; blocks are
    decoded together until they add up to :data:`BLOCK_BYTES` (one zarr call for a small slot)."""
    spec, base = m.storage.spec, slot.slot * m.storage.spec.shard_rows
    batch: list[tuple[str, int, int]] = []
    size = 0
    for name, layout in array_layouts(spec).items():
        row_bytes = layout.dtype.itemsize * int(np.prod(layout.row_shape, dtype=np.int64))
        chunk = arrays[name].chunks[-1 - len(layout.row_shape)]
        step = max(chunk, BLOCK_BYTES // max(row_bytes, 1) // chunk * chunk)
        for lo in range(0, slot.num_rows, step):
            hi = min(lo + step, slot.num_rows)
            batch.append((name, lo, hi))
            size += (hi - lo) * row_bytes
            if size >= BLOCK_BYTES:
                yield from _decode(arrays, spec, base, batch)
                batch, size = [], 0
    yield from _decode(arrays, spec, base, batch)


def _decode(arrays: Mapping[str, zarr.Array[Any]], spec: CacheSpec, base: int,
            jobs: list[tuple[str, int, int]],
            ) -> Iterator[tuple[str, int, npt.NDArray[Any] | BaseException]]:
    """Rows ``[lo, hi)`` of the slot at row ``base`` for each job, in one zarr call."""
    reads = [arrays[name].async_array.getitem(row_selection(spec, base + lo, base + hi))
             for name, lo, hi in jobs]
    results = zarr_sync(_gather(reads)) if reads else []
    for (name, lo, _), result in zip(jobs, results, strict=True):
        yield name, lo, result if isinstance(result, BaseException) else np.asarray(result)


async def _gather(jobs: list[Any]) -> list[Any]:
    """Every job's result or exception, in order."""
    return list(await asyncio.gather(*jobs, return_exceptions=True))


def _nonfinite(field: str, block: npt.NDArray[Any],
               hidden_dtype: str) -> npt.NDArray[Any] | None:
    """Per row (and per layer slot for format-1 aux arrays): True where a value is NaN or
    infinite."""
    if field == "aux_hidden" and block.dtype == np.uint8:
        bad = ((block & 0x7F) == 0x7F).any(axis=-1)  # e4m3fn NaN codes
    elif field in ("aux_hidden", "final_hidden"):
        bad = ~np.isfinite(storage_to_float32(block, hidden_dtype)).all(axis=-1)
    elif field == "aux_scale":
        bad = ~np.isfinite(block)
    else:
        return None
    return np.asarray(bad, dtype=np.bool_)


def _record(findings: dict[tuple[int, str], _Finding], name: str, bad: npt.NDArray[Any],
            lo: int, starts: npt.NDArray[np.int64], layer: int | None) -> None:
    """Count each bad row per sample; the layer slot comes from the hit (one array holding
    every layer) or from the array (one array per layer)."""
    hits = np.argwhere(bad)
    for hit in hits:
        row = lo + int(hit[0])
        i = int(np.searchsorted(starts, row, side="right")) - 1
        f = findings.setdefault((i, name), _Finding())
        f.count += 1
        if f.first_token < 0:
            f.first_token = row - int(starts[i])
        if len(hit) > 1:
            f.layers.add(int(hit[1]))
        elif layer is not None:
            f.layers.add(layer)


def _token_problems(name: str, block: npt.NDArray[Any], lo: int, slot: SlotToScan,
                    starts: Int64s, m: CacheManifest, where: str,
                    partial: dict[int, tuple[int, int]]) -> list[str]:
    """Token ids inside the vocabulary; loss mask 0/1 with the committed loss-token count (a
    sample's rows counted block by block, in ``partial`` while it continues past the block)."""
    out = []
    for i, (sample, length, loss) in enumerate(zip(slot.sample_id.tolist(), slot.length.tolist(),
                                                   slot.num_loss_tokens.tolist(), strict=True)):
        a, b = max(int(starts[i]) - lo, 0), min(int(starts[i]) + length - lo, len(block))
        if a >= b:
            continue
        rows = block[a:b]
        if name == "input_ids" and (rows.min() < 0 or rows.max() >= m.target.vocab_size):
            out.append(f"{where}, sample {sample}: input_ids outside [0, target.vocab_size="
                       f"{m.target.vocab_size}): min {rows.min()}, max {rows.max()}")
        if name != "loss_mask":
            continue
        if rows.max() > 1:
            out.append(f"{where}, sample {sample}: loss_mask has values other than 0/1")
        seen, counted = partial.pop(sample, (0, 0))
        seen, counted = seen + b - a, counted + int(np.count_nonzero(rows))
        if seen < length:
            partial[sample] = (seen, counted)
        elif counted != loss:
            out.append(f"{where}, sample {sample}: loss_mask has {counted} loss tokens but "
                       f"the commit record says {loss}")
    return out
