"""Read committed units of a cache: whole-slot reads, all of a unit's objects at once, checked.

Every slot read checks that each array's object exists (zarr reads a missing one back as zeros
silently; the GET itself tells, so no existence request precedes it), names the unit, slot and
array of an object that cannot be decoded, checks token ids against the vocabulary and, with
``verify``, each array's crc32c. An optional ``check_unit`` callback cross-checks a unit's
sample boundaries (from the index columns) with its commit record.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np
import zarr
from zarr.abc.store import OffsetByteRequest
from zarr.core.sync import sync as zarr_sync
from zarr.storage import WrapperStore

from sparkforge.shared import storage
from sparkforge.shared.cache_tables import SPLITS, SampleColumns, SlotColumns
from sparkforge.shared.commit import checksum
from sparkforge.shared.dtypes import dequantize_e4m3, float_to_storage
from sparkforge.shared.errors import SparkforgeError
from sparkforge.shared.layout import (
    LAYERED,
    TARGET_PREFIX,
    CacheSpec,
    array_layouts,
    open_arrays,
    row_selection,
    sample_slots,
    slot_key,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)
M = TypeVar("M")
_Read = tuple[int, np.ndarray, int, int]
"""Slot row ``k``, the sample positions it serves, first row and row count of one read."""


class CacheDataError(SparkforgeError):
    """Raised when committed data cannot be used: missing, undecodable or out-of-range values."""


class ChecksumError(CacheDataError):
    """Raised when data read back does not match the crc32c in its unit's commit record."""


@dataclass(frozen=True)
class CachedSample:
    """One sample as stored (hidden states in the storage dtype; fp8 already dequantised)."""

    sample_id: int
    split: str
    input_ids: np.ndarray
    loss_mask: np.ndarray
    aux_hidden: np.ndarray
    final_hidden: np.ndarray
    topk_ids: np.ndarray | None
    topk_logprobs: np.ndarray | None
    hidden_dtype: str = "bfloat16"

    def to_torch(self) -> dict[str, torch.Tensor]:
        """Tensors sharing memory with the numpy arrays; bf16 bits are viewed as bfloat16."""
        import torch

        def hidden(x: np.ndarray) -> torch.Tensor:
            t = torch.from_numpy(x)
            return t.view(torch.bfloat16) if self.hidden_dtype == "bfloat16" else t

        out = {"input_ids": torch.from_numpy(self.input_ids),
               "loss_mask": torch.from_numpy(self.loss_mask),
               "aux_hidden": hidden(self.aux_hidden), "final_hidden": hidden(self.final_hidden)}
        if self.topk_ids is not None and self.topk_logprobs is not None:
            out["topk_ids"] = torch.from_numpy(self.topk_ids)
            out["topk_logprobs"] = torch.from_numpy(self.topk_logprobs)
        return out


def read_arrays(loc: storage.Location, spec: CacheSpec,
                names: Iterable[str] | None = None) -> dict[str, zarr.Array[Any]]:
    """The spec's arrays of an existing cache (only ``names`` when given), opened read-only.

    Raises:
        CacheDataError: the group or an array is missing, or its metadata cannot be read.
        IrregularObjectError, UnsafeKeyError: a metadata file is no regular file inside the root.
    """
    names = list(array_layouts(spec) if names is None else names)
    storage.check_zarr_metadata(loc, names)
    try:
        group = zarr.open_group(StrictStore(storage.zarr_store(loc, read_only=True)), mode="r",
                                zarr_format=3)
        return open_arrays(group, spec, names)
    except Exception as exc:  # zarr raises many types (RecursionError too) for bad metadata
        raise CacheDataError(f"{loc.uri}: zarr metadata cannot be read ({type(exc).__name__}: "
                             f"{str(exc)[:200]}); run `sparkforge validate`") from exc


class MissingObjectError(CacheDataError):
    """Raised (by :class:`StrictStore`) when a slot object that should exist is absent."""


class StrictStore(WrapperStore):  # type: ignore[type-arg]
    """A read-only zarr store on which a missing chunk or shard object is an error, not zeros.

    zarr reads an absent object back as the fill value; a reader checking existence first
    would spend one request (a HEAD on object stores) per object before its GET. This store
    turns the GET's own "not found" into :class:`MissingObjectError` naming the key, so a read
    costs only its GETs.
    """

    async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
        chunk = "/c/" in key
        # A whole-object read as the range "from byte 0": s3fs sends one ranged GET for it,
        # where a plain whole-object read first asks the object's size (a HEAD).
        buf = await super().get(key, prototype,
                                OffsetByteRequest(0) if chunk and byte_range is None
                                else byte_range)
        if buf is None and chunk:
            raise MissingObjectError(key)
        return buf


class CacheReader(Generic[M]):
    """Reads only committed units, through the rows the index and slot table name.

    Built by ``sparkforge.manifests.open.open_cache``, which binds the parsed manifest. The
    bookkeeping is columns (``units``: the committed units, some of which may hold no sample;
    :class:`SampleColumns`, :class:`SlotColumns`), no object per sample or slot. Storage
    handles are opened per process on first use, so a reader built before DataLoader workers
    fork is shared with them (the columns copy-on-write, untouched) and each worker opens only
    its own store. ``aux_layers`` (positions along ``aux_hidden``'s layer
    axis) keeps only those captured layers, in that order, in every sample; None keeps all.
    With one array per layer (format 2) only those layers' arrays are read (and checksummed);
    format 1 reads every layer and narrows.
    """

    def __init__(self, loc: storage.Location, spec: CacheSpec, units: np.ndarray,
                 samples: SampleColumns, slots: SlotColumns, manifest: M, *, vocab_size: int,
                 verify: bool = True,
                 check_unit: Callable[[int, CacheReader[M]], None] | None = None,
                 aux_layers: Sequence[int] | None = None) -> None:
        self.loc, self.spec, self.manifest, self.verify = loc, spec, manifest, verify
        self.units, self.samples, self.slots = np.sort(units), samples, slots
        self.vocab_size = vocab_size
        self.aux_layers = None if aux_layers is None else [int(p) for p in aux_layers]
        self._check_unit = check_unit
        self._checked: set[int] = set()
        self._layouts = array_layouts(spec)
        self._names = [name for name, a in self._layouts.items()
                       if a.layer is None or self.aux_layers is None or a.layer in self.aux_layers]
        self._crc_columns = [slots.arrays.index(name) for name in self._names]
        self._arrays: dict[str, zarr.Array[Any]] = read_arrays(loc, spec, self._names)
        self._pid = os.getpid()

    def with_layers(self, aux_layers: Sequence[int] | None) -> CacheReader[M]:
        """A reader of the same cache and columns keeping only ``aux_layers``."""
        return CacheReader(self.loc, self.spec, self.units, self.samples, self.slots,
                           self.manifest,
                           vocab_size=self.vocab_size, verify=self.verify,
                           check_unit=self._check_unit, aux_layers=aux_layers)

    def unit_ids(self) -> np.ndarray:
        """Committed units, increasing."""
        return self.units

    def read_unit(self, unit: int) -> list[CachedSample]:
        """All samples of a committed unit in storage order (every slot read at once).

        Raises:
            KeyError: if the unit is not committed.
            CacheDataError: naming unit, slot and array (or sample): a missing object, one that
                cannot be decoded, a token id outside the vocabulary, a crc32c mismatch
                (``verify``), or sample boundaries that disagree with the commit record.
        """
        rows = self._unit(unit, check=False)
        positions = self.samples.of_unit(unit)
        reads = self._whole_slots(range(rows.start, rows.stop), positions)
        with self._checking(unit):
            parts, starts = self._parts(reads)
        return [self._joined(p, parts, starts) for p in positions.tolist()]

    def read_sample(self, sample_id: int) -> CachedSample:
        """One sample; with ``verify`` each slot holding its rows is read (and checked) whole."""
        (pos,) = self.samples.positions([sample_id]).tolist()
        unit = int(self.samples.unit[pos])
        rows = self._unit(unit)
        (first,), (last,) = self._slot_range(np.array([pos]))
        ids = self.slots.slot[rows]
        ks = range(rows.start + int(np.searchsorted(ids, first)),
                   rows.start + int(np.searchsorted(ids, last, "right")))
        if self.verify:
            reads = self._whole_slots(ks, self.samples.of_unit(unit))
        else:
            begin = int(self.samples.row_offset[pos])
            end = begin + int(self.samples.length[pos])
            spans = [(max(begin, self._slot_start(k)),
                      min(end, self._slot_start(k) + int(self.slots.num_rows[k]))) for k in ks]
            reads = [(k, np.array([pos]), a, max(b - a, 0))
                     for k, (a, b) in zip(ks, spans, strict=True)]
        return self._joined(pos, *self._parts(reads))

    def target_file(self, name: str) -> bytes:
        """A stored target file, e.g. ``config.json`` or ``weights.safetensors``."""
        key = f"{TARGET_PREFIX}/{storage.safe_key(name)}"
        self._handles()
        try:
            return storage.read_bytes(self.loc, key)
        except FileNotFoundError as exc:
            raise CacheDataError(f"{key} is missing; the cache cannot be trained on") from exc

    def _slot_start(self, k: int) -> int:
        return int(self.slots.slot[k]) * self.spec.shard_rows

    def _slot_range(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """First and last slot holding each sample's rows."""
        return sample_slots(self.spec, self.samples.row_offset[positions],
                            self.samples.length[positions].astype(np.int64))

    def _whole_slots(self, ks: Iterable[int], positions: np.ndarray) -> list[_Read]:
        """A read of each slot row's used rows, with those of ``positions`` holding rows of it
        (for the checks' messages)."""
        first, last = self._slot_range(positions)
        return [(k, positions[(first <= s) & (s <= last)], self._slot_start(k),
                 int(self.slots.num_rows[k])) for k in ks for s in [int(self.slots.slot[k])]]

    def _parts(self, reads: Sequence[_Read]
               ) -> tuple[list[tuple[int, dict[str, np.ndarray]]], np.ndarray]:
        """Each read's first row and its fields, and the first rows as an array."""
        parts = [(start, self._fields(values)) for (_, _, start, _), values in
                 zip(reads, self._read_slots(reads), strict=True)]
        return parts, np.array([start for start, _ in parts], dtype=np.int64)

    def _joined(self, pos: int, parts: Sequence[tuple[int, dict[str, np.ndarray]]],
                starts: np.ndarray) -> CachedSample:
        """The sample at ``pos`` from ``parts`` (the first row of each read and its fields,
        in row order): a view into the one part holding it, or its rows of the consecutive
        parts it spans joined.

        Raises:
            CacheDataError: some of its rows are in no part (a slot the unit does not list).
        """
        begin = int(self.samples.row_offset[pos])
        end = begin + int(self.samples.length[pos])
        pieces = []
        for start, fields in parts[max(int(np.searchsorted(starts, begin, "right")) - 1, 0):]:
            if start >= end:
                break
            a, b = max(begin - start, 0), min(end - start, len(fields["input_ids"]))
            if a < b:
                pieces.append((a, b, fields))
        if sum(b - a for a, b, _ in pieces) != end - begin:
            raise CacheDataError(f"sample {int(self.samples.sample_id[pos])}: rows [{begin}, "
                                 f"{end}) are not all in its unit's committed slots")
        if len(pieces) == 1:
            return self._sample(pos, pieces[0][2], pieces[0][0])
        joined = {name: np.concatenate([fields[name][a:b] for a, b, fields in pieces])
                  for name in pieces[0][2]}
        return self._sample(pos, joined, 0)

    def _unit(self, unit: int, *, check: bool = True) -> slice:
        """The unit's slot rows, cross-checked once with its commit record when a checker is set
        (unless ``check`` is False: the caller checks, see :meth:`_checking`).

        Raises:
            KeyError: the unit is not committed.
        """
        k = int(np.searchsorted(self.units, unit))
        if k == self.units.size or int(self.units[k]) != unit:
            raise KeyError(f"unit {unit} is not committed")
        if check:
            self._check(unit)
        return self.slots.of_unit(unit)

    def _check(self, unit: int) -> None:
        if self._check_unit is not None and unit not in self._checked:
            self._handles()  # the check reads the commit record through this process's store
            self._check_unit(unit, self)
            self._checked.add(unit)

    @contextmanager
    def _checking(self, unit: int) -> Iterator[None]:
        """Check ``unit`` against its commit record on a thread while the block reads its
        slots, so the record's GET overlaps theirs (one request latency per unit, not two);
        the check's error is raised when the block ends, ahead of any error of the block's."""
        if self._check_unit is None or unit in self._checked:
            yield
            return
        self._handles()
        checked: Future[None] = Future()

        def run() -> None:
            try:
                self._check(unit)
                checked.set_result(None)
            except BaseException as exc:  # handed to the reading thread, which raises it
                checked.set_exception(exc)

        threading.Thread(target=run, name="commit-check", daemon=True).start()
        try:
            yield
        finally:
            checked.result()

    def _handles(self) -> dict[str, zarr.Array[Any]]:
        """This process's location and open arrays (reopened once in a forked or unpickled
        copy: object-store clients are not fork-safe)."""
        if self._pid != os.getpid():
            self.loc = storage.open_location(self.loc.uri, self.loc.storage_options)
            self._arrays, self._pid = read_arrays(self.loc, self.spec, self._names), os.getpid()
        return self._arrays

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pid": -1, "_arrays": {}}

    def _fields(self, data: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The arrays read from one slot as sample fields holding ``aux_layers``: per-layer
        arrays (format 2) are stacked on the layer axis; a format-1 field is read with every
        layer and narrowed here."""
        out: dict[str, np.ndarray] = {}
        layers: dict[str, dict[int, np.ndarray]] = {}
        for name, values in data.items():
            a = self._layouts[name]
            if a.layer is not None:
                layers.setdefault(a.field, {})[a.layer] = values
            elif a.field in LAYERED and self.aux_layers is not None:
                out[name] = values[:, self.aux_layers]
            else:
                out[name] = values
        for field, parts in layers.items():
            order = sorted(parts) if self.aux_layers is None else self.aux_layers
            out[field] = np.stack([parts[k] for k in order], axis=1)
        return out

    def _read_slots(self, reads: Sequence[_Read]) -> list[dict[str, np.ndarray]]:
        """Rows ``[start, start + count)`` of every array in each slot row ``k``, all requested
        at once, then checked (see the module docstring); the crc32c is checked when ``verify``
        is set and a read covers its slot's used rows."""
        arrays = self._handles()
        for k, *_ in reads:
            for name, arr in arrays.items():
                try:
                    key = slot_key(name, arr, int(self.slots.slot[k]), self.spec)
                    storage.inside_root(self.loc, key)
                except (storage.UnsafeKeyError, storage.IrregularObjectError) as exc:
                    raise CacheDataError(f"{self._where(k)}: array {name}: {exc}") from exc
        results = zarr_sync(_gather([arr.async_array.getitem(row_selection(self.spec, start,
                                                                           start + count))
                                     for _, _, start, count in reads
                                     for arr in arrays.values()]))
        out, at = [], 0
        for k, mine, start, count in reads:
            data = {}
            for j, name in enumerate(arrays):
                data[name] = self._checked_values(k, j, name, results[at], start=start,
                                                  count=count)
                at += 1
            self._check_token_ids(self._where(k), data, start, mine)
            out.append(data)
        return out

    def _where(self, k: int) -> str:
        return f"unit {int(self.slots.unit[k])}, slot {int(self.slots.slot[k])}"

    def _checked_values(self, k: int, j: int, name: str, result: object, *, start: int,
                        count: int) -> np.ndarray:
        """One array's rows of slot row ``k``, or the error its read raised, named."""
        where = f"{self._where(k)}: array {name}"
        if isinstance(result, MissingObjectError):
            raise CacheDataError(f"{where}: object {result} is missing (it would read back as "
                                 "zeros); run `sparkforge validate`") from result
        if isinstance(result, BaseException):  # any codec error: name where, not how
            raise CacheDataError(f"{where}: cannot be decoded ({type(result).__name__}: "
                                 f"{result})") from result
        values = np.asarray(result)
        whole = start == self._slot_start(k) and count == int(self.slots.num_rows[k])
        if self.verify and whole:
            actual = checksum(values)
            expected = int(self.slots.crc32c[k, self._crc_columns[j]])
            if actual != expected:
                raise ChecksumError(f"{where}: crc32c {actual:#010x} != committed "
                                    f"{expected:#010x} (data corrupted or overwritten)")
        return values

    def _check_token_ids(self, where: str, data: dict[str, np.ndarray], start: int,
                         positions: np.ndarray) -> None:
        """Token ids (and top-k ids) inside ``[0, vocab_size)`` and ``loss_mask`` 0 or 1 (the
        loss reads the mask as a weight): one min/max per array; an error names the sample."""
        allowed = {"input_ids": (self.vocab_size, f"outside [0, target.vocab_size="
                                                  f"{self.vocab_size})"),
                   "topk_ids": (self.vocab_size, f"outside [0, target.vocab_size="
                                                 f"{self.vocab_size})"),
                   "loss_mask": (2, "not 0 or 1")}
        for name, (end, what) in allowed.items():
            values = data.get(name)
            if values is None or not values.size:
                continue
            if int(values.min()) >= 0 and int(values.max()) < end:
                continue
            bad = (values < 0) | (values >= end)
            row = start + int(np.argmax(bad.reshape(len(values), -1).any(axis=1)))
            first = self.samples.row_offset[positions]
            hit = positions[(first <= row) & (row < first + self.samples.length[positions])]
            sample = int(self.samples.sample_id[hit[0]]) if hit.size else None
            raise CacheDataError(
                f"{where}, sample {sample}: {name} {what}: min {values.min()}, max {values.max()}")

    def _sample(self, pos: int, data: dict[str, np.ndarray], start: int) -> CachedSample:
        rows = slice(start, start + int(self.samples.length[pos]))
        aux: Any = data["aux_hidden"][rows]
        if self.spec.aux_codec == "fp8":
            aux = float_to_storage(dequantize_e4m3(aux, data["aux_scale"][rows]),
                                   self.spec.hidden_dtype)
        top = self.spec.topk > 0
        return CachedSample(
            sample_id=int(self.samples.sample_id[pos]),
            split=SPLITS[int(self.samples.split[pos])], input_ids=data["input_ids"][rows],
            loss_mask=data["loss_mask"][rows], aux_hidden=aux,
            final_hidden=data["final_hidden"][rows],
            topk_ids=data["topk_ids"][rows] if top else None,
            topk_logprobs=data["topk_logprobs"][rows] if top else None,
            hidden_dtype=self.spec.hidden_dtype)


async def _gather(jobs: Sequence[Awaitable[Any]]) -> list[Any]:
    """Every job's result or exception, in order."""
    return list(await asyncio.gather(*jobs, return_exceptions=True))
