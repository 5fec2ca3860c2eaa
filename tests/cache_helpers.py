"""Test helpers for cache tests: a valid run header and deterministic synthetic samples."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from sparkforge.shared.layout import CacheSpec
from sparkforge.shared.records import SampleRecord, UnitAccounting
from sparkforge.shared.writer import float_to_storage

SMALL_SPEC = CacheSpec(hidden_size=16, num_aux_layers=2, hidden_dtype="bfloat16", max_seq_len=16,
                       shard_rows=32, rows_per_unit=5)
"""A tiny lossless bf16 spec: 3 units of 5 rows (4 written, 1 skipped) pack into 6 slots."""
SMALL_FP8_SPEC = dataclasses.replace(SMALL_SPEC, aux_codec="fp8", topk=2)


def build_cache(path: Path, spec: CacheSpec = SMALL_SPEC, units: int = 3) -> Path:
    """A finalized cache of ``make_unit`` samples written by the real writer."""
    from sparkforge.manifests.finalize import finalize_cache
    from sparkforge.shared.writer import CacheWriter

    w = CacheWriter.open(str(path), spec=spec, header=make_header(spec))
    for u in range(units):
        w.write_unit(u, *make_unit(spec, u))
    finalize_cache(str(path), expected_units=units)
    return path


def make_header(spec: CacheSpec, *, num_hidden_layers: int = 4) -> dict[str, Any]:
    """A run header consistent with ``spec`` (layer ids 1..F)."""
    return {
        "producer_config": {"model": "tiny", "batch_size": 4},
        "target": {"name_or_path": "tiny-qwen3", "revision": None, "content_hash": "ab" * 32,
                   "model_type": "qwen3", "architecture": "Qwen3ForCausalLM", "vocab_size": 1024,
                   "hidden_size": spec.hidden_size, "num_hidden_layers": num_hidden_layers,
                   "dtype": "bfloat16", "quantization": None},
        "capture": {"layer_ids": list(range(1, spec.num_aux_layers + 1)),
                    "layer_id_convention": "hf_hidden_states_index", "final_hidden": "post_norm",
                    "engine": "hf", "engine_version": "5.19.0", "tensor_parallel_size": 1,
                    "expert_parallel": False, "data_parallel_size": 1,
                    "max_seq_len": spec.max_seq_len},
        "tokenizer": {"hash": "cd" * 32, "chat_template_sha256": "ef" * 32},
        "data": {"sources": [{"uri": "memory://chat.jsonl", "content_hash": "01" * 32}],
                 "eval_fraction": 0.25, "seed": 0},
    }


def make_unit(spec: CacheSpec, unit: int, *, seed: int = 0,
              skip_every: int = 5) -> tuple[list[SampleRecord], UnitAccounting]:
    """Deterministic samples for every input row of ``unit`` (every ``skip_every``-th skipped)."""
    samples = []
    rows = range(unit * spec.rows_per_unit, (unit + 1) * spec.rows_per_unit)
    for row in rows:
        if row % skip_every == skip_every - 1:
            continue
        rng = np.random.default_rng([seed, row])
        t = int(rng.integers(1, spec.max_seq_len + 1))
        scale = rng.uniform(0.5, 8.0, size=(t, 1, 1)).astype(np.float32)
        aux = rng.standard_normal((t, spec.num_aux_layers, spec.hidden_size)).astype(np.float32)
        final = rng.standard_normal((t, spec.hidden_size)).astype(np.float32)
        topk = spec.topk > 0
        samples.append(SampleRecord(
            sample_id=row, source_row=row,
            source_hash=hashlib.sha256(str(row).encode()).hexdigest(),
            split="eval" if row % 4 == 0 else "train",
            input_ids=rng.integers(0, 1024, t).astype(np.int32),
            loss_mask=(rng.random(t) < 0.6).astype(np.uint8),
            aux_hidden=float_to_storage(aux * scale, spec.hidden_dtype),
            final_hidden=float_to_storage(final, spec.hidden_dtype),
            topk_ids=rng.integers(0, 1024, (t, spec.topk)).astype(np.int32) if topk else None,
            topk_logprobs=-rng.random((t, spec.topk)).astype(np.float32) if topk else None))
    skipped = spec.rows_per_unit - len(samples)
    return samples, UnitAccounting(input_rows=spec.rows_per_unit, written=len(samples),
                                   skipped={"too_long": skipped} if skipped else {})
