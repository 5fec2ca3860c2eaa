"""Estimate a cache's size before capture: bytes per token, total bytes, shards and objects.

The estimate uses the writer's own layout (:func:`array_layouts`, slot packing per unit) and
measured compression ratios per array, so it tracks what ``CacheWriter`` actually produces.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from sparkforge.shared.layout import CacheSpec, array_layouts
from sparkforge.shared.target_config import parse_target_config

LOSSLESS_RATIO: Final[dict[str, float]] = {"bfloat16": 1.45, "float16": 1.2, "float32": 1.15}
"""Blosc zstd-1 + byte shuffle on hidden states. bf16: 1.45 measured on real activations
(2 vCPU, entropy bound ~1.48); float16 / float32: estimates from the same exponent-byte argument
(one compressible byte of 2, of 4), kept conservative."""
FP8_CODE_RATIO: Final = 1.18
"""zstd on e4m3 codes: fp8 + per-token scale measured 2.33x smaller than raw bf16, i.e. the
1-byte codes compress ~1.18x."""
SMALL_ARRAY_RATIO: Final[dict[str, float]] = {"input_ids": 3.4, "loss_mask": 100.0,
                                              "aux_scale": 1.0, "topk_ids": 1.0,
                                              "topk_logprobs": 1.0}
"""zstd-3 on the per-token arrays: token ids 3.4x and loss masks >100x measured; the rest 1.0."""
WRITER_MB_S_PER_CORE: Final = 165.0
"""Raw hidden-state MB one writer core compresses and writes per CPU second through zarr (Blosc
zstd-1 + byte shuffle, bf16, local disk, crc32c included), measured by benchmarks/bench_writer.py
on a 2-vCPU x86_64 host: 230-323 MB per CPU-s idle, 140-223 when shared with other jobs; the figure
is the loaded one, so the cores it asks for keep up on a busy inference node. fp8 codes are
assumed to cost the same per stored byte."""
FIXED_OBJECTS: Final = 6
"""zarr.json of the group, _meta/header.json, index.parquet, manifest.json, and the unit and slot
tables the manifest names (units.parquet, slots.parquet; plus target files)."""


@dataclass(frozen=True, kw_only=True)
class TargetShape:
    """What the estimate needs from a target config."""

    hidden_size: int
    num_hidden_layers: int
    dtype: str = "bfloat16"


def target_shape_from_config(path: str | Path) -> TargetShape:
    """Read ``hidden_size``, ``num_hidden_layers`` and dtype from a HF ``config.json``.

    Multimodal configs are read from their ``text_config``.

    Raises:
        ValueError: naming the missing or mistyped field.
    """
    config = parse_target_config(Path(path).read_bytes(), str(path))
    text = config.text
    dtype = str(text.get("torch_dtype") or text.get("dtype") or "bfloat16")
    return TargetShape(hidden_size=config.positive_int("hidden_size"),
                       num_hidden_layers=config.positive_int("num_hidden_layers"),
                       dtype=dtype if dtype in LOSSLESS_RATIO else "bfloat16")


def array_ratio(field: str, spec: CacheSpec) -> float:
    """The compression ratio assumed for the array(s) of one sample field."""
    if field in SMALL_ARRAY_RATIO:
        return SMALL_ARRAY_RATIO[field]
    if field == "aux_hidden" and spec.aux_codec == "fp8":
        return FP8_CODE_RATIO
    return LOSSLESS_RATIO[spec.hidden_dtype]


def slots_per_unit(unit_tokens: float, mean_seq_len: float, shard_rows: int) -> int:
    """Slots one unit's samples fill: greedy packing wastes about half a sample per slot; a
    sample longer than a slot starts one and spans ``ceil(length / shard_rows)``."""
    if unit_tokens <= 0:
        return 0
    if mean_seq_len > shard_rows:
        return math.ceil(unit_tokens / mean_seq_len) * math.ceil(mean_seq_len / shard_rows)
    return math.ceil(unit_tokens / max(shard_rows - mean_seq_len / 2, 1.0))


def writer_cores(spec: CacheSpec, tokens_per_s: float) -> dict[str, float]:
    """Writer cores needed to keep up with ``tokens_per_s`` captured tokens per second.

    The writer compresses the stored hidden states (aux codes or values, and final) at
    ``WRITER_MB_S_PER_CORE`` raw MB/s per core; the per-token arrays are negligible.
    """
    layouts = array_layouts(spec)
    raw = sum(a.dtype.itemsize * math.prod(a.row_shape) for a in layouts.values()
              if a.field in ("aux_hidden", "final_hidden"))
    mb_per_s = raw * tokens_per_s / 1e6
    return {"tokens_per_s": tokens_per_s, "hidden_mb_per_s": mb_per_s,
            "mb_per_s_per_core": WRITER_MB_S_PER_CORE,
            "cores": math.ceil(mb_per_s / WRITER_MB_S_PER_CORE)}


def plan_cache(spec: CacheSpec, *, num_tokens: int, mean_seq_len: float,
               tokens_per_s: float | None = None) -> dict[str, Any]:
    """The size estimate of a cache with ``spec`` holding ``num_tokens`` tokens.

    Args:
        spec: The cache spec the producer will use.
        num_tokens: Tokens to capture.
        mean_seq_len: Mean sample length in tokens (sets samples, units and packing waste).
        tokens_per_s: Capture speed of one producer (e.g. one GPU's prefill tokens/s); adds the
            writer cores it needs.
    """
    layouts = array_layouts(spec)
    arrays: dict[str, dict[str, Any]] = {}  # per sample field: all layers of aux_hidden together
    for a in layouts.values():
        raw = a.dtype.itemsize * math.prod(a.row_shape)
        entry = arrays.setdefault(a.field, {"raw_bytes_per_token": 0,
                                            "ratio": array_ratio(a.field, spec),
                                            "bytes_per_token": 0.0})
        entry["raw_bytes_per_token"] += raw
        entry["bytes_per_token"] += raw / entry["ratio"]
    num_samples = math.ceil(num_tokens / mean_seq_len) if num_tokens else 0
    full_units, rest = divmod(num_samples, spec.rows_per_unit)
    slots = (full_units * slots_per_unit(spec.rows_per_unit * mean_seq_len, mean_seq_len,
                                         spec.shard_rows)
             + slots_per_unit(rest * mean_seq_len, mean_seq_len, spec.shard_rows))
    units = full_units + (rest > 0)
    per_token = sum(a["bytes_per_token"] for a in arrays.values())
    raw_per_token = sum(a["raw_bytes_per_token"] for a in arrays.values())
    return {
        "hidden_size": spec.hidden_size, "num_aux_layers": spec.num_aux_layers,
        "hidden_dtype": spec.hidden_dtype, "aux_codec": spec.aux_codec, "topk": spec.topk,
        "num_tokens": num_tokens, "num_samples": num_samples, "mean_seq_len": mean_seq_len,
        "raw_bytes_per_token": raw_per_token, "bytes_per_token": per_token,
        "compression_ratio": raw_per_token / per_token,
        "total_bytes": int(per_token * num_tokens), "num_units": units, "num_shards": slots,
        "mean_shard_bytes": int(per_token * num_tokens / slots) if slots else 0,
        "objects": slots * len(layouts) + 2 * units + len(layouts) + FIXED_OBJECTS,
        "arrays": arrays,
        "writer": None if tokens_per_s is None else writer_cores(spec, tokens_per_s),
    }


def plan_table(plan: Mapping[str, Any]) -> str:
    """A readable table of :func:`plan_cache`'s estimate."""
    lines = [f"{'array':<14} {'raw B/tok':>10} {'ratio':>6} {'B/tok':>10}"]
    for name, a in plan["arrays"].items():
        lines.append(f"{name:<14} {a['raw_bytes_per_token']:>10,} {a['ratio']:>6.2f} "
                     f"{a['bytes_per_token']:>10,.0f}")
    lines += ["", f"target          H={plan['hidden_size']}, {plan['num_aux_layers']} aux layers "
              f"+ final, {plan['hidden_dtype']}, aux codec {plan['aux_codec']}",
              *([f"layers          hidden_states {plan['layer_ids']} (feature ids "
                 f"{plan['feature_ids']})"] if "layer_ids" in plan else []),
              f"tokens          {plan['num_tokens']:,} in ~{plan['num_samples']:,} samples "
              f"(mean {plan['mean_seq_len']:g})",
              f"bytes/token     {plan['bytes_per_token']:,.0f} "
              f"(raw {plan['raw_bytes_per_token']:,}, ratio {plan['compression_ratio']:.2f})",
              f"total           {human_bytes(plan['total_bytes'])} ({plan['total_bytes']:,} bytes)",
              f"units / shards  {plan['num_units']:,} / {plan['num_shards']:,} "
              f"(~{human_bytes(plan['mean_shard_bytes'])} per shard, all arrays)",
              f"objects         {plan['objects']:,} (+ target files)"]
    if plan.get("writer"):
        w = plan["writer"]
        lines.append(f"writer cores    {w['cores']:.0f} to keep up with {w['tokens_per_s']:,.0f} "
                     f"tok/s ({w['hidden_mb_per_s']:,.0f} MB/s of hidden states at "
                     f"{w['mb_per_s_per_core']:.0f} MB/s per core, measured on a 2-vCPU host)")
    return "\n".join(lines)


def human_bytes(n: float) -> str:
    """Bytes in decimal units, e.g. '1.4 GB'."""
    if abs(n) < 1000:
        return f"{int(n)} B"
    for unit in ("KB", "MB", "GB"):
        n /= 1000
        if abs(n) < 1000:
            return f"{n:.1f} {unit}"
    return f"{n / 1000:.1f} TB"

