"""Round trip of real hidden states (tiny Qwen3 target, plain HF forward) through the cache."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from sparkforge.manifests.finalize import finalize_cache
from sparkforge.manifests.open import open_cache
from sparkforge.shared.header import RunHeader
from sparkforge.shared.layout import CacheSpec
from sparkforge.shared.records import SampleRecord, UnitAccounting
from sparkforge.shared.writer import CacheWriter

LAYER_IDS = (1, 2, 3)
PROMPTS = ["the cache shard holds one layer", "a draft model reads the block anchor token",
           "train loss on value sum list graph", "no", "what is the number of years since then"]


@pytest.fixture(scope="module")
def hidden_states(tiny_target: Path) -> list[dict[str, torch.Tensor]]:
    """Per prompt: ids, aux [T, 3, H] and post-norm final [T, H] (float32) from a HF forward."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target)
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for text in PROMPTS:
            ids = torch.tensor([tok(text)["input_ids"]])
            res = model(ids, output_hidden_states=True)
            final = res.hidden_states[-1][0]
            # hidden_states[-1] is what lm_head consumes: the post-norm state.
            torch.testing.assert_close(model.lm_head(final), res.logits[0])
            out.append({"ids": ids[0].int(), "final": final,
                        "aux": torch.stack([res.hidden_states[k][0] for k in LAYER_IDS], 1)})
    return out


def _header(tiny_target: Path, spec: CacheSpec) -> dict[str, Any]:
    return {
        "producer_config": {"target": str(tiny_target)},
        "target": {"name_or_path": str(tiny_target), "revision": None, "content_hash": "00" * 32,
                   "model_type": "qwen3", "architecture": "Qwen3ForCausalLM", "vocab_size": 1024,
                   "hidden_size": 128, "num_hidden_layers": 4, "dtype": "float32",
                   "quantization": None},
        "capture": {"layer_ids": list(LAYER_IDS), "layer_id_convention": "hf_hidden_states_index",
                    "final_hidden": "post_norm", "engine": "hf", "engine_version": "5",
                    "tensor_parallel_size": 1, "expert_parallel": False,
                    "data_parallel_size": 1, "max_seq_len": spec.max_seq_len},
        "tokenizer": {"hash": "11" * 32, "chat_template_sha256": None},
        "data": {"sources": [{"uri": "inline", "content_hash": "22" * 32}], "seed": 0},
    }


def _storage(t: torch.Tensor, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _write(uri: str, tiny_target: Path, states: list[dict[str, torch.Tensor]], *, dtype: str,
           aux_codec: str = "lossless") -> None:
    spec = CacheSpec(hidden_size=128, num_aux_layers=3, hidden_dtype=dtype,  # type: ignore[arg-type]
                     max_seq_len=64, aux_codec=aux_codec,  # type: ignore[arg-type]
                     shard_rows=64, rows_per_unit=3)
    header = RunHeader.from_json(_header(tiny_target, spec))
    writer = CacheWriter.open(uri, spec=spec, header=header)
    for unit in range(2):
        rows = range(unit * 3, min(unit * 3 + 3, len(states)))
        samples = [SampleRecord(
            sample_id=r, source_row=r, source_hash=hashlib.sha256(PROMPTS[r].encode()).hexdigest(),
            split="train", input_ids=states[r]["ids"].numpy(),
            loss_mask=np.ones(len(states[r]["ids"]), np.uint8),
            aux_hidden=_storage(states[r]["aux"], dtype),
            final_hidden=_storage(states[r]["final"], dtype)) for r in rows]
        writer.write_unit(unit, samples, UnitAccounting(input_rows=3, written=len(samples),
                                                        skipped={"past_end": 3 - len(samples)}))
    finalize_cache(uri, expected_units=2)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_real_hidden_states_round_trip_bit_exact(tmp_path: Path, tiny_target: Path,
                                                  hidden_states: list, dtype: str) -> None:
    """bf16 and fp32 caches of real activations read back bit-exact as torch tensors."""
    _write(str(tmp_path / "c"), tiny_target, hidden_states, dtype=dtype)
    reader = open_cache(str(tmp_path / "c"), verify=True)
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    seen = []
    for unit in reader.unit_ids().tolist():
        for sample in reader.read_unit(unit):
            t, ref = sample.to_torch(), hidden_states[sample.sample_id]
            assert t["aux_hidden"].dtype == torch_dtype
            assert torch.equal(t["aux_hidden"], ref["aux"].to(torch_dtype))
            assert torch.equal(t["final_hidden"], ref["final"].to(torch_dtype))
            assert torch.equal(t["input_ids"], ref["ids"])
            seen.append(sample.sample_id)
    assert seen == list(range(len(PROMPTS)))


@pytest.mark.slow
def test_fp8_aux_within_documented_error(tmp_path: Path, tiny_target: Path,
                                         hidden_states: list) -> None:
    """fp8 aux matches a per-token-per-layer e4m3 hand computation; final stays lossless."""
    _write(str(tmp_path / "c"), tiny_target, hidden_states, dtype="bfloat16", aux_codec="fp8")
    reader = open_cache(str(tmp_path / "c"), verify=True)
    assert reader.manifest.storage.spec.aux_codec == "fp8"
    rel_errors = []
    for sid, ref in enumerate(hidden_states):
        got = reader.read_sample(sid).to_torch()
        x = ref["aux"].to(torch.bfloat16).float()
        scale = x.abs().amax(-1, keepdim=True) / 448.0
        hand = ((x / scale).to(torch.float8_e4m3fn).float() * scale).to(torch.bfloat16)
        assert torch.equal(got["aux_hidden"], hand)
        assert torch.equal(got["final_hidden"], ref["final"].to(torch.bfloat16))
        rel_errors.append((got["aux_hidden"].float() - x).norm(dim=-1) / x.norm(dim=-1))
    rel = torch.cat(rel_errors)
    assert rel.mean() < 0.035, rel.mean()
    assert rel.max() < 0.06, rel.max()
