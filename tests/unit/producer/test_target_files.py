"""Target pieces for the cache: weight lookup, tied heads, FP8 dequantization, identity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save_file

from sparkforge.producer.engine_options import EngineOptions
from sparkforge.producer.target_files import resolve_model_dir, target_files, target_identity

H, V = 8, 16


def checkpoint(path: Path, tensors: dict[str, torch.Tensor], **config: object) -> Path:
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": V,
        "hidden_size": H, "num_hidden_layers": 2, **config}))
    (path / "tokenizer.json").write_text("{}")
    return path


def test_tied_head_and_layer_norms_are_not_confused(tmp_path: Path) -> None:
    """A tied checkpoint reuses embed_tokens as lm_head; per-layer norms are not the final norm."""
    embed, norm = torch.randn(V, H), torch.randn(H)
    model = checkpoint(tmp_path / "m", {
        "model.embed_tokens.weight": embed, "model.norm.weight": norm,
        "model.layers.0.input_layernorm.weight": torch.ones(H),
    }, tie_word_embeddings=True)
    files = target_files(model, hidden_dtype="float32")
    weights = load_safetensors(files["weights.safetensors"])
    torch.testing.assert_close(weights["lm_head.weight"], embed, rtol=0, atol=0)
    torch.testing.assert_close(weights["norm.weight"], norm, rtol=0, atol=0)
    assert set(files) == {"config.json", "tokenizer.json", "weights.safetensors"}


def test_fp8_block_scaled_head_is_dequantized(tmp_path: Path) -> None:
    """An e4m3 lm_head with 4x4 block scales (weight_scale_inv) is w * scale per block, in bf16."""
    head = torch.randn(V, H).to(torch.float8_e4m3fn)
    scale = torch.arange(1, 9, dtype=torch.float32).reshape(4, 2)  # [V/4, H/4]
    model = checkpoint(tmp_path / "m", {
        "model.embed_tokens.weight": torch.randn(V, H), "model.norm.weight": torch.ones(H),
        "lm_head.weight": head, "lm_head.weight_scale_inv": scale,
    })
    weights = load_safetensors(target_files(model, hidden_dtype="bfloat16")["weights.safetensors"])
    expected = torch.empty(V, H)
    for i in range(V):
        for j in range(H):
            expected[i, j] = head[i, j].float() * scale[i // 4, j // 4]
    assert weights["lm_head.weight"].dtype == torch.bfloat16
    torch.testing.assert_close(weights["lm_head.weight"], expected.to(torch.bfloat16))


def test_missing_weights_are_named(tmp_path: Path) -> None:
    """A checkpoint without lm_head (untied) or final norm is refused, naming what is missing."""
    model = checkpoint(tmp_path / "m", {"model.embed_tokens.weight": torch.randn(V, H)})
    with pytest.raises(ValueError, match=r"\(qwen3 family\) has no lm_head \(a name ending in "
                                         r"lm_head.weight\); norm \(a name ending in "
                                         r"norm.weight\)$"):
        target_files(model, hidden_dtype="float32")


def test_v4_pieces_are_found_by_their_released_names(tmp_path: Path) -> None:
    """A V4 checkpoint's head.weight / embed.weight / hc_head_* are found; MTP copies are not."""
    tensors = {"embed.weight": torch.randn(V, H), "head.weight": torch.randn(V, H),
               "norm.weight": torch.randn(H), "mtp.0.norm.weight": torch.randn(H),
               "hc_head_fn": torch.randn(2, 2 * H), "hc_head_base": torch.randn(2),
               "hc_head_scale": torch.randn(1)}
    model = checkpoint(tmp_path / "m", tensors, model_type="deepseek_v4")
    weights = load_safetensors(target_files(model, hidden_dtype="float32")["weights.safetensors"])
    for ours, theirs in (("lm_head.weight", "head.weight"), ("embed_tokens.weight", "embed.weight"),
                         ("norm.weight", "norm.weight"), ("hc_head.hc_fn", "hc_head_fn")):
        assert torch.equal(weights[ours], tensors[theirs]), ours


def test_v4_missing_hc_head_is_named(tmp_path: Path) -> None:
    """A V4 checkpoint without hc_head weights is refused, naming them."""
    model = checkpoint(tmp_path / "m", {"model.embed_tokens.weight": torch.randn(V, H),
                                        "head.weight": torch.randn(V, H),
                                        "model.norm.weight": torch.randn(H)},
                       model_type="deepseek_v4")
    with pytest.raises(ValueError, match=r"deepseek_v4 family\) has no hc_head.hc_fn \(a name "
                                         r"ending in hc_head.hc_fn or hc_head_fn\)"):
        target_files(model, hidden_dtype="float32")


def test_identity_changes_with_weights(tmp_path: Path) -> None:
    """The content hash follows the weights; the identity reports sizes from config.json."""
    a = checkpoint(tmp_path / "a", {"model.norm.weight": torch.ones(H)})
    b = checkpoint(tmp_path / "b", {"model.norm.weight": torch.zeros(H)})
    ida = target_identity(EngineOptions(model=str(a)), a)
    idb = target_identity(EngineOptions(model=str(b)), b)
    assert ida.content_hash != idb.content_hash
    assert (ida.hidden_size, ida.dtype) == (H, "auto")
    assert ida.architecture == "Qwen3ForCausalLM"


def test_v4_fp8_head_with_e8m0_scale_and_config_blocks(tmp_path: Path) -> None:
    """A V4 e4m3 head.weight with an e8m0 head.scale uses the config's weight_block_size."""
    head = torch.randn(V, H).to(torch.float8_e4m3fn)
    exps = torch.tensor([[126], [129]], dtype=torch.uint8)  # 2**-1, 2**2 per 12x12 block
    model = checkpoint(tmp_path / "m", {
        "model.embed_tokens.weight": torch.randn(V, H), "model.norm.weight": torch.ones(H),
        "head.weight": head, "head.scale": exps.view(torch.float8_e8m0fnu),
        "model.hc_head.hc_fn": torch.randn(2, 2 * H), "model.hc_head.hc_base": torch.randn(2),
        "model.hc_head.hc_scale": torch.randn(1),
    }, model_type="deepseek_v4",
        quantization_config={"quant_method": "fp8", "weight_block_size": [12, 12]})
    weights = load_safetensors(target_files(model, hidden_dtype="float32")["weights.safetensors"])
    expected = torch.empty(V, H)
    for i in range(V):
        for j in range(H):
            expected[i, j] = head[i, j].float() * (0.5 if i < 12 else 4.0)
    torch.testing.assert_close(weights["lm_head.weight"], expected, rtol=0, atol=0)


@pytest.mark.parametrize(("model", "message"), [
    ("/nonexistent", "neither a checkpoint folder nor a Hugging Face model id"),
    ("{tmp}", "the folder holds no config.json"),
    ("org/not-cached", "not a local folder, and the Hugging Face Hub could not provide it"),
])
def test_a_target_that_names_no_checkpoint_is_a_config_error(
        model: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--engine.model naming nothing is one ConfigError (was HFValidationError's traceback)."""
    import huggingface_hub.constants as hub_constants

    from sparkforge.shared.errors import ConfigError

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)  # never the network
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ConfigError, match=message):
        resolve_model_dir(EngineOptions(model=model.format(tmp=tmp_path)))
