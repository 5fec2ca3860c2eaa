"""The model card: its header parses as a Hugging Face card; serving command and tables."""

from __future__ import annotations

import dataclasses

import pytest
from huggingface_hub import ModelCard

from sparkforge.trainer.architectures.qwen3.tiny import draft_tiny
from sparkforge.trainer.model_card import model_card, serve_command
from sparkforge.trainer.report import tau_interval

PROVENANCE = {
    "target_name_or_path": "Qwen/Qwen3-8B", "cache_uri": "s3://b/cache",
    "cache_manifest_sha256": "ab" * 32, "target_content_hash": "cd" * 32,
    "data": {"sources": [
        {"uri": "chat.jsonl", "content_hash": "01" * 32},
        {"uri": "hf://org/sg:train", "content_hash": "02" * 32, "hf_dataset": {
            "name": "org/sg", "revision": "f" * 40, "split": "train", "fingerprint": "fp1"}}],
        "mix": [{"name": "chat", "data": "chat.jsonl", "weight": 3.0, "rows": 90,
                 "source_rows": 40}, {"name": "sg", "data": "hf://org/sg:train",
                                      "weight": 1.0, "rows": 30, "source_rows": 500}],
        "mix_seed": 5},
    "training": {"recipe": "dspark", "optimizer": {"lr": 0.001}}, "global_step": 10}
REPORT = {"config": {"temperature": 0.0},
          "speculative": {"tau": 2.5, "tau_ci95": [2.25, 2.75], "rounds": 40, "prompts": 8,
                          "acceptance_by_position": [0.8, 0.5],
                          "calibration": {"ece": 0.1, "brier": 0.2, "auroc": 0.7,
                                          "count": 64}}}


def test_card_header_and_sections() -> None:
    """Header fields via huggingface_hub; data identity, mix, eval and calibration tables."""
    cfg = draft_tiny()
    card = ModelCard(model_card(cfg, PROVENANCE, draft_dir="out/d", eval_report=REPORT))
    assert card.data.base_model == "Qwen/Qwen3-8B"
    assert (card.data.library_name, card.data.pipeline_tag) == ("vllm", "text-generation")
    assert "speculative-decoding" in card.data.tags
    text = card.text
    assert serve_command(cfg, "Qwen/Qwen3-8B", "out/d") in text
    assert "Hugging Face dataset `org/sg` split `train`, revision `" + "f" * 40 in text
    assert "| chat | 3.0 | 90 | 40 |" in text
    assert "seed 5" in text
    assert "**2.500 (95% CI 2.250 - 2.750)**" in text
    assert "| 0 | 0.800 |" in text
    assert "| 1 | 0.500 |" in text
    assert "| 0.100 | 0.200 | 0.700 | 64 |" in text
    assert "lr: 0.001" in text


@pytest.mark.parametrize(("layout", "method", "tokens"), [("dspark", "dspark", 7),
                                                            ("dflash", "dflash", 6)])
def test_serve_command_method_and_tokens(layout: str, method: str, tokens: int) -> None:
    """DSpark drafts the whole block; DFlash the block less its anchor (block_size - 1)."""
    heads = {} if layout != "dflash" else {
        "markov_rank": 0, "enable_confidence_head": False, "confidence_head_with_markov": False}
    cfg = dataclasses.replace(draft_tiny(), block_size=7, layout=layout, **heads)
    assert serve_command(cfg, "t", "d") == (
        "vllm serve t --speculative-config "
        f"'{{\"method\": \"{method}\", \"model\": \"d\", \"num_speculative_tokens\": {tokens}}}'")


def test_tau_interval_resamples_prompts() -> None:
    """Equal prompts give a point; two prompts of 2 and 4 tokens per round give resampled taus
    in {2, 3, 4}, so the interval lies in [2, 4] around tau = 3; one prompt gives none."""
    assert tau_interval([[3, 3], [3, 3]]) == (3.0, 3.0)
    lo, hi = tau_interval([[2, 2], [4, 4]])  # type: ignore[misc]
    assert 2.0 <= lo < 3.0 < hi <= 4.0
    assert tau_interval([[2, 2], [4, 4]]) == (lo, hi)  # seeded
    assert tau_interval([[5]]) is None
