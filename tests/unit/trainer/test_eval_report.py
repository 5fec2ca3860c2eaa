"""eval: prompts from a chat file, the training run's loss settings, the verification policies."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from sparkforge.app.tiny_text import demo_conversations
from sparkforge.trainer.architectures.config import from_target_config
from sparkforge.trainer.architectures.qwen3.model import Qwen3DraftModel
from sparkforge.trainer.eval.forced import sample_tau_sums
from sparkforge.trainer.eval.run import EvalConfig, run_eval
from sparkforge.trainer.export import export_checkpoint, training_loss_settings
from sparkforge.trainer.run_config import LossSpec


def _checkpoint(target_dir: Path, path: Path, loss: LossSpec) -> Path:
    """A sparkforge-train-shaped checkpoint of a seeded draft, recording ``loss``."""
    target = AutoModelForCausalLM.from_pretrained(target_dir)
    cfg = from_target_config(target.config, mask_token_id=3, target_layer_ids=(0, 2),
                             num_hidden_layers=1, block_size=4, num_anchors=8, markov_rank=8)
    torch.manual_seed(0)
    model = Qwen3DraftModel(cfg, embed_weight=target.model.embed_tokens.weight,
                             lm_head_weight=target.lm_head.weight)
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                "draft_config": cfg.to_dict(), "global_step": 1,
                "hyper_parameters": {"loss": dataclasses.asdict(loss)}}, path)
    return path


def _eval(tmp_path: Path, name: str, **kw: Any) -> dict[str, Any]:
    return run_eval(EvalConfig(out_dir=str(tmp_path / name), num_prompts=3, max_new_tokens=8,
                               temperature=1.0, policy_thresholds=(0.3, 0.6), **kw))


def test_loss_settings_travel_from_checkpoint_through_export(tiny_target: Path,
                                                             tmp_path: Path) -> None:
    """The run's model.loss is read back from the checkpoint and from the exported directory."""
    loss = LossSpec(ce_loss_alpha=1.0, l1_loss_alpha=0.5, loss_decay_gamma=None)
    ckpt = _checkpoint(tiny_target, tmp_path / "a.ckpt", loss)
    assert training_loss_settings(ckpt) == dataclasses.asdict(loss)
    out = export_checkpoint(ckpt, tmp_path / "draft")
    assert training_loss_settings(out) == dataclasses.asdict(loss)
    (out / "sparkforge_export.json").unlink()
    assert training_loss_settings(out) is None


def test_eval_uses_the_run_loss_settings(tiny_target: Path, tiny_cache: str,
                                         tmp_path: Path) -> None:
    """Decay gamma changes the weighted calibration error, never the acceptance itself."""
    reports = {}
    for gamma in (None, 4.0):
        ckpt = _checkpoint(tiny_target, tmp_path / f"g{gamma}.ckpt",
                           LossSpec(loss_decay_gamma=gamma))
        reports[gamma] = _eval(tmp_path, f"g{gamma}", draft=str(ckpt), target=str(tiny_target),
                               cache=tiny_cache)
        assert reports[gamma]["loss_settings"]["source"] == "training run"
        assert reports[gamma]["loss_settings"]["loss_decay_gamma"] == gamma
    flat, decayed = (reports[g]["teacher_forced"]["metrics"] for g in (None, 4.0))
    assert flat["accept_rate"] == pytest.approx(decayed["accept_rate"])
    assert flat["confidence_abs_error"] != pytest.approx(decayed["confidence_abs_error"])


def _check_buckets(view: dict[str, Any], count: int | None, tau: float,
                   trials: list[float] | None) -> None:
    """The context buckets partition the view's blocks: their counts, tau and trials add up."""
    buckets = view["by_context"]
    assert [b["bucket"] for b in buckets] == ["<24", "24-48", ">=48"]
    blocks = sum(b["blocks"] for b in buckets)
    if count is not None:
        assert blocks == count
    assert sum(b["tau"] * b["blocks"] for b in buckets) / blocks == pytest.approx(tau)
    if trials is not None:
        assert [sum(t) for t in zip(*(b["position_trials"] for b in buckets), strict=True)] == \
            trials
    for b in buckets:
        if b["tau_ci95"] is not None:
            assert b["tau_ci95"][0] <= b["tau"] <= b["tau_ci95"][1]


def test_eval_decodes_prompts_from_a_chat_file(tiny_target: Path, tiny_cache: str,
                                               tmp_path: Path) -> None:
    """--prompts decodes the file's prompts; the cache still gives the policy table."""
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in demo_conversations(5)))
    ckpt = _checkpoint(tiny_target, tmp_path / "a.ckpt", LossSpec())
    report = _eval(tmp_path, "file", draft=str(ckpt), target=str(tiny_target),
                   cache=tiny_cache, prompts=str(chats), context_buckets=(24, 48))
    spec = report["speculative"]
    _check_buckets(spec, spec["rounds"], spec["tau"], spec["position_trials"])
    forced = report["teacher_forced"]
    _check_buckets(forced, None, forced["metrics"]["tau"], None)
    # the tiny chats neither think nor call tools: every turn is of the "no" kinds
    for turns, unit, total, tau in (
            (spec["by_turn"], "prompts", spec["prompts"], spec["tau"]),
            (forced["by_turn"], "samples", forced["samples"], forced["metrics"]["tau"])):
        assert (turns["thinking"][unit], turns["tool_call"][unit]) == (0, 0)
        assert turns["no_thinking"][unit] == turns["no_tool_call"][unit] == total
        assert turns["no_thinking"]["tau"] == pytest.approx(tau)
    assert spec["prompts"] == 3
    assert spec["rounds"] > 0
    # tau and its interval come from the same per-prompt sums
    assert sum(spec["prompt_tokens"]) / sum(spec["prompt_rounds"]) == pytest.approx(spec["tau"])
    assert len(spec["prompt_rounds"]) == 3
    assert spec["tau_ci95"][0] <= spec["tau"] <= spec["tau_ci95"][1]
    assert [a / t if t else 0.0 for a, t in zip(spec["position_accepted"],
                                                 spec["position_trials"], strict=True)] == \
        pytest.approx(spec["acceptance_by_position"])
    forced = report["teacher_forced"]
    assert forced["samples"] >= 1
    assert forced["tau_ci95"][0] <= forced["metrics"]["tau"] <= forced["tau_ci95"][1]
    assert forced["calibration"]["temperature"] == 1.0
    full = forced["full_blocks"]
    assert full["blocks"] > 0
    assert full["tau_ci95"][0] <= full["tau"] <= full["tau_ci95"][1]
    # the tiny cache's data was written by hand, not regenerated: no verdict, and why
    assert report["matched"]["matched"] is None
    assert "not regenerated" in report["matched"]["note"]
    cal = spec["calibration"]
    assert cal["temperature"] == 1.0
    assert 0.0 <= cal["abs_error"] <= 1.0
    assert cal["count"] == sum(spec["position_trials"])
    assert 0.0 <= cal["ece"] <= 1.0
    assert 0.0 <= cal["brier"] <= 1.0
    policies = [p["policy"] for p in report["teacher_forced"]["policies"]]
    assert policies == ["fixed 1", "fixed 2", "fixed 3", "fixed 4", "confidence >= 0.3",
                        "confidence >= 0.6"]
    only_file = _eval(tmp_path, "only", draft=str(ckpt), target=str(tiny_target),
                      prompts=str(chats))
    assert only_file["teacher_forced"] == {}
    assert only_file["speculative"]["prompts"] == 3


def test_eval_needs_a_cache_or_prompts() -> None:
    """Without either source of prompts the config is refused, naming both flags."""
    with pytest.raises(ValueError, match="--cache or --prompts"):
        EvalConfig(draft="d", target="t", out_dir="o")


def test_full_block_sums_leave_out_blocks_cut_by_the_sample_end() -> None:
    """By hand: a cut block counts its missing slots as rejections in the headline sums and is
    left out of the full-block sums; a block not kept is in neither."""
    eval_mask = torch.tensor([[[1, 1, 1], [1, 0, 0]], [[1, 1, 1], [1, 1, 1]]])
    accept = torch.tensor([[[0.5, 0.5, 0.5], [0.8, 0.9, 0.9]], [[0.7, 0.7, 0.7], [1.0, 0.0, 1.0]]])
    keep = torch.tensor([[True, True], [False, True]])
    out = SimpleNamespace(eval_mask=eval_mask, block_keep_mask=keep)
    num, den, full_num, full_den = sample_tau_sums(out, accept)
    # sample 0: 1 + .5 + .25 + .125 (full) and 1 + .8 (cut); sample 1: 1 + 1 + 0 + 0 (full)
    assert num.tolist() == pytest.approx([1.875 + 1.8, 2.0])
    assert den.tolist() == [2.0, 1.0]
    assert full_num.tolist() == pytest.approx([1.875, 2.0])
    assert full_den.tolist() == [1.0, 1.0]
