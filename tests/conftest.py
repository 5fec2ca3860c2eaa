"""Shared fixtures: a tiny Qwen3-shaped target built locally (no downloads)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer, H=128, head_dim=32, vocab-1024 Qwen3 target with a ChatML+generation template."""
    from sparkforge.producer.tiny_target import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny_target"))


@pytest.fixture(scope="session")
def tiny_target_plain_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same target whose chat template has no {% generation %} markers."""
    from sparkforge.producer.tiny_target import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny_plain"), generation_markers=False)


# ---- trainer fixtures: caches written with the real cache writer from a transformers forward ----

TINY_LAYER_IDS = (1, 3)
"""HF hidden_states indices captured by the tiny caches (DSpark feature ids 0 and 2)."""


def write_tiny_cache(uri: str, target_dir: Path, *, hidden_dtype: str = "bfloat16",
                     num_rows: int = 16, rows_per_unit: int = 4, max_seq_len: int = 96,
                     layer_ids: tuple[int, ...] = TINY_LAYER_IDS,
                     storage_options: dict[str, Any] | None = None, seed: int = 0) -> str:
    """Write and finalize a cache of chat samples whose hidden states come from HF ``forward``.

    Every 4th row is in the eval split. Returns ``uri``.
    """
    import hashlib
    import random

    import numpy as np
    import torch
    from safetensors.torch import save
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from sparkforge.manifests.finalize import finalize_cache
    from sparkforge.producer.tiny_target import synthetic_corpus
    from sparkforge.shared.layout import CacheSpec
    from sparkforge.shared.records import SampleRecord, UnitAccounting
    from sparkforge.shared.writer import CacheWriter, float_to_storage

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    model = Qwen3ForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    cfg = model.config
    spec = CacheSpec(hidden_size=cfg.hidden_size, num_aux_layers=len(layer_ids),
                     hidden_dtype=hidden_dtype, max_seq_len=max_seq_len,  # type: ignore[arg-type]
                     shard_rows=max(256, max_seq_len), rows_per_unit=rows_per_unit)
    header = {
        "producer_config": {"builder": "tests/conftest.py::write_tiny_cache", "seed": seed},
        "target": {"name_or_path": str(target_dir), "revision": None, "content_hash": "ab" * 32,
                   "model_type": "qwen3", "architecture": "Qwen3ForCausalLM",
                   "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
                   "num_hidden_layers": cfg.num_hidden_layers, "dtype": "float32",
                   "quantization": None},
        "capture": {"layer_ids": list(layer_ids), "layer_id_convention": "hf_hidden_states_index",
                    "final_hidden": "post_norm", "engine": "hf", "engine_version": "5.19.0",
                    "tensor_parallel_size": 1, "expert_parallel": False, "data_parallel_size": 1,
                    "max_seq_len": max_seq_len},
        "tokenizer": {"hash": "cd" * 32, "chat_template_sha256": "ef" * 32},
        "data": {"sources": [{"uri": "memory://synthetic", "content_hash": "01" * 32}],
                 "eval_fraction": 0.25, "seed": seed},
    }
    writer = CacheWriter.open(uri, spec=spec, header=header, storage_options=storage_options)
    state = model.state_dict()
    writer.write_target_files({
        "config.json": (target_dir / "config.json").read_bytes(),
        "weights.safetensors": save({"embed_tokens.weight": state["model.embed_tokens.weight"],
                                     "lm_head.weight": state["lm_head.weight"],
                                     "norm.weight": state["model.norm.weight"]}),
    })
    lines, rng = synthetic_corpus(4 * num_rows, seed=seed), random.Random(seed)
    for unit in range(num_rows // rows_per_unit):
        samples = []
        for row in range(unit * rows_per_unit, (unit + 1) * rows_per_unit):
            reply = " ".join(lines[4 * row + 1: 4 * row + 1 + rng.randint(1, 3)])
            enc = tok.apply_chat_template(
                [{"role": "user", "content": lines[4 * row]},
                 {"role": "assistant", "content": reply}],
                tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            ids = torch.tensor(enc["input_ids"][:max_seq_len])
            with torch.no_grad():
                hs = model(ids[None], output_hidden_states=True).hidden_states
            aux = torch.stack([hs[i][0] for i in layer_ids], dim=1).numpy()
            samples.append(SampleRecord(
                sample_id=row, source_row=row,
                source_hash=hashlib.sha256(reply.encode()).hexdigest(),
                split="eval" if row % 4 == 3 else "train", input_ids=ids.numpy().astype(np.int32),
                loss_mask=np.asarray(enc["assistant_masks"][:max_seq_len], dtype=np.uint8),
                aux_hidden=float_to_storage(aux, hidden_dtype),
                final_hidden=float_to_storage(hs[-1][0].numpy(), hidden_dtype)))
        writer.write_unit(unit, samples, UnitAccounting(input_rows=rows_per_unit,
                                                        written=len(samples)))
    finalize_cache(uri, expected_units=num_rows // rows_per_unit, storage_options=storage_options)
    return uri


@pytest.fixture(scope="session")
def tiny_cache(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A finalized bf16 cache (16 samples, 4 units, 4 eval) of the tiny target, on local disk."""
    return write_tiny_cache(str(tmp_path_factory.mktemp("tiny_cache") / "cache"), tiny_target)
