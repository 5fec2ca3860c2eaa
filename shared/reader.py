"""Read committed units of a cache: whole-slot sequential reads, checked before they are used.

Every slot read checks that each array's object exists (zarr reads a missing one back as zeros
silently), names the unit, slot and array of an object that cannot be decoded, checks token ids
against the vocabulary and, with ``verify``, each array's crc32c. An optional ``check_unit``
callback cross-checks a unit's sample boundaries (from the index) with its commit record.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np
import pyarrow as pa
import zarr

from sparkforge.shared import storage
from sparkforge.shared.commit import SampleRow, SlotRecord, UnitInfo, checksum
from sparkforge.shared.dtypes import dequantize_e4m3, float_to_storage
from sparkforge.shared.errors import SparkforgeError
from sparkforge.shared.layout import (
    LAYERED,
    TARGET_PREFIX,
    CacheSpec,
    array_layouts,
    open_arrays,
    slot_key,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)
M = TypeVar("M")


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
        group = zarr.open_group(storage.zarr_store(loc, read_only=True), mode="r")
        return open_arrays(group, spec, names)
    except Exception as exc:  # zarr raises many types (RecursionError too) for bad metadata
        raise CacheDataError(f"{loc.uri}: zarr metadata cannot be read ({type(exc).__name__}: "
                             f"{str(exc)[:200]}); run `sparkforge validate`") from exc


class CacheReader(Generic[M]):
    """Reads only committed units, through the rows their commit records name.

    Built by ``sparkforge.manifests.open.open_cache``, which binds the parsed manifest.
    ``aux_layers`` (positions along ``aux_hidden``'s layer axis) keeps only those captured layers,
    in that order, in every sample; None keeps all. With one array per layer (format 2) only
    those layers' arrays are read (and checksummed); format 1 reads every layer and narrows.
    """

    def __init__(self, loc: storage.Location, spec: CacheSpec, units: Sequence[UnitInfo],
                 index: pa.Table, manifest: M, *, vocab_size: int, verify: bool = True,
                 check_unit: Callable[[UnitInfo], None] | None = None,
                 aux_layers: Sequence[int] | None = None) -> None:
        self.loc, self.spec, self.manifest, self.verify = loc, spec, manifest, verify
        self.vocab_size = vocab_size
        self.aux_layers = None if aux_layers is None else [int(p) for p in aux_layers]
        self._units = {u.unit: u for u in units}
        self._index = index
        self._rows = {s.sample_id: (u.unit, s) for u in units for s in u.samples}
        self._check_unit = check_unit
        self._checked: set[int] = set()
        self._layouts = array_layouts(spec)
        self._arrays = read_arrays(loc, spec, [
            name for name, a in self._layouts.items()
            if a.layer is None or self.aux_layers is None or a.layer in self.aux_layers])

    def units(self) -> list[UnitInfo]:
        """Committed units in unit order."""
        return [self._units[u] for u in sorted(self._units)]

    def sample_index(self) -> pa.Table:
        """index.parquet: one row per sample, sorted by sample_id."""
        return self._index

    def read_unit(self, unit: int) -> list[CachedSample]:
        """All samples of a committed unit in storage order (one sequential read per slot).

        Raises:
            KeyError: if the unit is not committed.
            CacheDataError: naming unit, slot and array (or sample): a missing object, one that
                cannot be decoded, a token id outside the vocabulary, a crc32c mismatch
                (``verify``), or sample boundaries that disagree with the commit record.
        """
        info = self._unit(unit)
        by_slot: dict[int, list[SampleRow]] = {}
        for s in info.samples:
            by_slot.setdefault(s.slot, []).append(s)
        out = []
        for slot in info.slots:
            base = slot.slot * self.spec.shard_rows
            data = self._read_rows(info.unit, slot, by_slot.get(slot.slot, []), start=base,
                                   count=slot.num_rows)
            data = self._fields(data)
            out += [self._sample(s, data, s.row_offset - base) for s in by_slot.get(slot.slot, [])]
        return out

    def read_sample(self, sample_id: int) -> CachedSample:
        """One sample; with ``verify`` its whole slot is read (and checked) first."""
        unit, row = self._rows[sample_id]
        info = self._unit(unit)
        slot = next(s for s in info.slots if s.slot == row.slot)
        if not self.verify:
            return self._sample(row, self._fields(self._read_rows(
                unit, slot, [row], start=row.row_offset, count=row.length)), 0)
        base = slot.slot * self.spec.shard_rows
        data = self._read_rows(unit, slot, [s for s in info.samples if s.slot == row.slot],
                               start=base, count=slot.num_rows)
        return self._sample(row, self._fields(data), row.row_offset - base)

    def target_file(self, name: str) -> bytes:
        """A stored target file, e.g. ``config.json`` or ``weights.safetensors``."""
        key = f"{TARGET_PREFIX}/{storage.safe_key(name)}"
        try:
            return storage.read_bytes(self.loc, key)
        except FileNotFoundError as exc:
            raise CacheDataError(f"{key} is missing; the cache cannot be trained on") from exc

    def _unit(self, unit: int) -> UnitInfo:
        """The unit, cross-checked once with its commit record when a checker is set."""
        info = self._units[unit]
        if self._check_unit is not None and unit not in self._checked:
            self._check_unit(info)
            self._checked.add(unit)
        return info

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

    def _read_rows(self, unit: int, slot: SlotRecord, samples: Sequence[SampleRow], *,
                   start: int, count: int) -> dict[str, np.ndarray]:
        """Rows of every array inside one slot, checked (see the module docstring); the crc32c
        is checked when ``verify`` is set, which needs the slot's whole used rows."""
        where = f"unit {unit}, slot {slot.slot}"
        whole = start == slot.slot * self.spec.shard_rows and count == slot.num_rows
        data = {}
        for name, arr in self._arrays.items():
            key = slot_key(name, arr, slot.slot)
            try:
                storage.inside_root(self.loc, key)
            except (storage.UnsafeKeyError, storage.IrregularObjectError) as exc:
                raise CacheDataError(f"{where}: array {name}: {exc}") from exc
            if not storage.exists(self.loc, key):
                raise CacheDataError(f"{where}: array {name}: object {key} is missing (it would "
                                     "read back as zeros); run `sparkforge validate`")
            try:
                data[name] = np.asarray(arr[start:start + count])
            except Exception as exc:  # any codec error: name where it happened, not how
                raise CacheDataError(f"{where}: array {name}: cannot be decoded "
                                     f"({type(exc).__name__}: {exc})") from exc
            if self.verify and whole:
                actual, expected = checksum(data[name]), slot.crc32c.get(name)
                if actual != expected:
                    shown = "none" if expected is None else f"{expected:#010x}"
                    raise ChecksumError(f"{where}: array {name}: crc32c {actual:#010x} != "
                                        f"committed {shown} (data corrupted or overwritten)")
        self._check_token_ids(where, data, start, samples)
        return data

    def _check_token_ids(self, where: str, data: dict[str, np.ndarray], start: int,
                         samples: Sequence[SampleRow]) -> None:
        """Token ids (and top-k ids) inside ``[0, vocab_size)`` and ``loss_mask`` 0 or 1 (the
        loss reads the mask as a weight): one min/max per array."""
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
            sample = next((s.sample_id for s in samples
                           if s.row_offset <= row < s.row_offset + s.length), None)
            raise CacheDataError(
                f"{where}, sample {sample}: {name} {what}: min {values.min()}, max {values.max()}")

    def _sample(self, row: SampleRow, data: dict[str, np.ndarray], start: int) -> CachedSample:
        rows = slice(start, start + row.length)
        aux: Any = data["aux_hidden"][rows]
        if self.spec.aux_codec == "fp8":
            aux = float_to_storage(dequantize_e4m3(aux, data["aux_scale"][rows]),
                                   self.spec.hidden_dtype)
        top = self.spec.topk > 0
        return CachedSample(
            sample_id=row.sample_id, split=row.split, input_ids=data["input_ids"][rows],
            loss_mask=data["loss_mask"][rows], aux_hidden=aux,
            final_hidden=data["final_hidden"][rows],
            topk_ids=data["topk_ids"][rows] if top else None,
            topk_logprobs=data["topk_logprobs"][rows] if top else None,
            hidden_dtype=self.spec.hidden_dtype)
