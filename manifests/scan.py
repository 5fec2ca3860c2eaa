"""Deep checks of committed units: recompute every crc32c and find non-finite hidden values.

Slots are read in row blocks of about :data:`BLOCK_BYTES`, so memory stays bounded for any
shard size; problems name the unit, slot, sample, array and (for ``aux_hidden``) layer slot.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import crc32c
import numpy as np
import numpy.typing as npt
import zarr

from sparkforge.manifests.schema import CacheManifest
from sparkforge.shared.commit import SampleRow, SlotRecord, UnitInfo
from sparkforge.shared.dtypes import storage_to_float32
from sparkforge.shared.layout import array_layouts

BLOCK_BYTES: Final = 64 << 20
"""Rows read per step and array (about 64 MiB decoded)."""


@dataclass
class _Finding:
    """Non-finite values of one (sample, array): how many, first token, which layer slots."""

    count: int = 0
    first_token: int = -1
    layers: set[int] = field(default_factory=set)


def scan_unit(info: UnitInfo, arrays: Mapping[str, zarr.Array[Any]], manifest: CacheManifest,
              checked: Counter[str]) -> list[str]:
    """Every problem in one committed unit's stored rows (empty when its data is intact)."""
    problems = []
    for slot in info.slots:
        samples = [s for s in info.samples if s.slot == slot.slot]
        problems += _scan_slot(info.unit, slot, samples, arrays, manifest, checked)
    return problems


def _scan_slot(unit: int, slot: SlotRecord, samples: Sequence[SampleRow],
               arrays: Mapping[str, zarr.Array[Any]], m: CacheManifest,
               checked: Counter[str]) -> list[str]:
    spec = m.storage.spec
    layouts = array_layouts(spec)
    base = slot.slot * spec.shard_rows
    starts = np.array([s.row_offset - base for s in samples], dtype=np.int64)
    where, problems = f"unit {unit}, slot {slot.slot}", []
    findings: dict[tuple[int, str], _Finding] = {}
    for name, arr in arrays.items():
        crc = 0
        try:
            for lo, block in _blocks(arr, base, slot.num_rows):
                crc = crc32c.crc32c(np.ascontiguousarray(block).data.cast("B"), crc)
                checked["bytes_scanned"] += block.nbytes
                bad = _nonfinite(layouts[name].field, block, spec.hidden_dtype)
                if bad is not None:
                    _record(findings, name, bad, lo, starts, layouts[name].layer)
                if name in ("input_ids", "loss_mask"):
                    problems += _token_problems(name, block, lo, samples, starts, m, where)
        except Exception as exc:  # a corrupt object fails to decode: record it, scan the rest
            problems.append(f"{where}: array {name}: cannot be decoded "
                            f"({type(exc).__name__}: {exc})")
            continue
        expected = slot.crc32c.get(name)
        if crc != expected:
            shown = "none" if expected is None else f"{expected:#010x}"
            problems.append(f"{where}: array {name}: crc32c {crc:#010x} != committed {shown} "
                            "(data corrupted or overwritten)")
    layer_ids = m.capture.layer_ids
    for (i, name), f in sorted(findings.items()):
        layers = (f" (layer slots {sorted(f.layers)} = capture.layer_ids "
                  f"{[layer_ids[j] for j in sorted(f.layers)]})" if f.layers else "")
        problems.append(f"{where}, sample {samples[i].sample_id}: array {name}{layers}: "
                        f"{f.count} non-finite values, first at token {f.first_token}")
    return problems


def _blocks(arr: zarr.Array[Any], base: int,
            num_rows: int) -> Iterator[tuple[int, npt.NDArray[Any]]]:
    """(first row in the slot, decoded rows) in inner-chunk-aligned blocks."""
    row_bytes = arr.dtype.itemsize * int(np.prod(arr.shape[1:], dtype=np.int64))
    chunk = arr.chunks[0]
    step = max(chunk, BLOCK_BYTES // max(row_bytes, 1) // chunk * chunk)
    for lo in range(0, num_rows, step):
        yield lo, np.asarray(arr[base + lo:base + min(lo + step, num_rows)])


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


def _token_problems(name: str, block: npt.NDArray[Any], lo: int, samples: Sequence[SampleRow],
                    starts: npt.NDArray[np.int64], m: CacheManifest, where: str) -> list[str]:
    """Token ids inside the vocabulary; loss mask 0/1 with the committed loss-token count."""
    out = []
    for i, s in enumerate(samples):
        a, b = max(int(starts[i]) - lo, 0), min(int(starts[i]) + s.length - lo, len(block))
        if a >= b:
            continue
        rows = block[a:b]
        if name == "input_ids" and (rows.min() < 0 or rows.max() >= m.target.vocab_size):
            out.append(f"{where}, sample {s.sample_id}: input_ids outside [0, target.vocab_size="
                       f"{m.target.vocab_size}): min {rows.min()}, max {rows.max()}")
        if name == "loss_mask" and rows.max() > 1:
            out.append(f"{where}, sample {s.sample_id}: loss_mask has values other than 0/1")
        if name == "loss_mask" and int(starts[i]) >= lo and b - a == s.length and \
                int(np.count_nonzero(rows)) != s.num_loss_tokens:
            out.append(f"{where}, sample {s.sample_id}: loss_mask has "
                       f"{np.count_nonzero(rows)} loss tokens but the commit record says "
                       f"{s.num_loss_tokens}")
    return out
