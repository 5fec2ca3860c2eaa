"""Read committed units of a cache: whole-slot sequential reads, optional crc32c verification."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np
import pyarrow as pa
import zarr

from sparkforge.shared import storage
from sparkforge.shared.commit import SampleRow, SlotRecord, UnitInfo, checksum
from sparkforge.shared.dtypes import dequantize_e4m3, float_to_storage
from sparkforge.shared.layout import TARGET_PREFIX, CacheSpec, open_arrays

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)
M = TypeVar("M")
LAYERED = ("aux_hidden", "aux_scale")
"""Arrays whose second axis is the captured layer (what ``aux_layers`` selects from)."""


class ChecksumError(ValueError):
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


class CacheReader(Generic[M]):
    """Reads only committed units, through the rows their commit records name.

    Built by ``sparkforge.manifests.open.open_cache``, which binds the parsed manifest.
    ``aux_layers`` (positions along ``aux_hidden``'s layer axis, increasing) keeps only those
    captured layers in every sample; None keeps all.
    """

    def __init__(self, loc: storage.Location, spec: CacheSpec, units: Sequence[UnitInfo],
                 index: pa.Table, manifest: M, *, verify: bool = False,
                 aux_layers: Sequence[int] | None = None) -> None:
        self.loc, self.spec, self.manifest, self.verify = loc, spec, manifest, verify
        self.aux_layers = None if aux_layers is None else [int(p) for p in aux_layers]
        self._units = {u.unit: u for u in units}
        self._index = index
        self._rows = {s.sample_id: (u.unit, s) for u in units for s in u.samples}
        group = zarr.open_group(storage.zarr_store(loc, read_only=True), mode="r")
        self._arrays = open_arrays(group, spec)

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
            ChecksumError: with ``verify``, naming unit, slot and array.
        """
        info = self._units[unit]
        by_slot: dict[int, list[SampleRow]] = {}
        for s in info.samples:
            by_slot.setdefault(s.slot, []).append(s)
        out = []
        for slot in info.slots:
            data = self._read_rows(slot.slot * self.spec.shard_rows, slot.num_rows)
            if self.verify:
                self._check(info.unit, slot, data)
            data = self._select(data)
            base = slot.slot * self.spec.shard_rows
            out += [self._sample(s, data, s.row_offset - base) for s in by_slot.get(slot.slot, [])]
        return out

    def read_sample(self, sample_id: int) -> CachedSample:
        """One sample; with ``verify`` its whole slot is read and checked first."""
        unit, row = self._rows[sample_id]
        if not self.verify:
            return self._sample(row, self._select(self._read_rows(row.row_offset, row.length)), 0)
        slot = next(s for s in self._units[unit].slots if s.slot == row.slot)
        base = slot.slot * self.spec.shard_rows
        data = self._read_rows(base, slot.num_rows)
        self._check(unit, slot, data)
        return self._sample(row, self._select(data), row.row_offset - base)

    def target_file(self, name: str) -> bytes:
        """A stored target file, e.g. ``config.json`` or ``weights.safetensors``."""
        return storage.read_bytes(self.loc, f"{TARGET_PREFIX}/{storage.safe_key(name)}")

    def _read_rows(self, start: int, count: int) -> dict[str, np.ndarray]:
        return {name: np.asarray(arr[start:start + count]) for name, arr in self._arrays.items()}

    def _select(self, data: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Rows narrowed to ``aux_layers`` after reading them whole: with token-major chunks every
        layer's bytes are read anyway, and zarr's orthogonal selection measured ~8x slower than
        a whole read (benchmarks/bench_cache.py)."""
        if self.aux_layers is None:
            return data
        return {name: values[:, self.aux_layers] if name in LAYERED else values
                for name, values in data.items()}

    def _check(self, unit: int, slot: SlotRecord, data: dict[str, np.ndarray]) -> None:
        for name, values in data.items():
            actual, expected = checksum(values), slot.crc32c.get(name)
            if actual != expected:
                raise ChecksumError(
                    f"unit {unit}, slot {slot.slot}, array {name!r}: crc32c {actual:#010x} "
                    f"!= committed {expected if expected is None else f'{expected:#010x}'}")

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
