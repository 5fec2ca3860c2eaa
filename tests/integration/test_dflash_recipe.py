"""The DFlash recipe end to end: from the DSpark draft's tiny cache, train, export in the DFlash
serving format, load it through vLLM's DFlash class, evaluate it."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
from export_helpers import load_in_vllm

from sparkforge.app.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY_YAML = ROOT / "trainer" / "examples" / "tiny.yaml"


@pytest.fixture(scope="module")
def dflash_run(tiny_cache: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """30 steps of the DFlash recipe on the cache the DSpark tests train from (tiny.yaml sets a
    Markov rank, which the recipe has none of: it is unset here)."""
    out = tmp_path_factory.mktemp("dflash")
    assert main(["train", "--config", str(TINY_YAML), "--data.uri", tiny_cache,
                 "--model.recipe", "dflash", "--model.draft.markov_rank", "null",
                 "--model.draft.block_size", "5", "--model.scheduler.total_steps", "60",
                 "--trainer.max_steps", "30", "--trainer.log_every_n_steps", "1",
                 "--trainer.check_val_every_n_epoch", "5",
                 "--trainer.logger.init_args.save_dir", str(out)]) == 0
    return sorted(out.glob("dspark/version_*"))[-1]


@pytest.mark.slow
def test_dflash_trains_exports_loads_in_vllm_and_evaluates(
        dflash_run: Path, tiny_target: Path, tiny_cache: str, tmp_path: Path) -> None:
    """The DFlash draft's CE falls, it exports as DFlashDraftModel, vLLM's DFlash class loads
    every parameter equal to its source tensor, and eval reports 4 draft positions."""
    with (dflash_run / "metrics.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/loss")]
    losses = {int(r["step"]): float(r["train/loss"]) for r in rows}
    assert sorted(losses) == list(range(1, 31))
    assert all(math.isfinite(v) for v in losses.values())
    assert all(float(r["train/l1_loss"]) == 0.0 == float(r["train/confidence_loss"])
               for r in rows)   # CE only
    first = sum(losses[s] for s in range(1, 6)) / 5
    last = sum(losses[s] for s in range(26, 31)) / 5
    assert last < first - 0.1, (first, last)

    ckpt = dflash_run / "checkpoints" / "last.ckpt"
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert saved["hyper_parameters"]["recipe"] == "dflash"
    assert (saved["draft_config"]["architecture"], saved["draft_config"]["layout"]) == (
        "qwen3", "dflash")
    assert not any(k.startswith(("model.markov_head", "model.confidence_head"))
                   for k in saved["state_dict"])
    draft = tmp_path / "draft"
    assert main(["export", str(ckpt), str(draft), "--engine", "vllm"]) == 0
    config = json.loads((draft / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert json.loads((draft / "sparkforge_export.json").read_text())["loss"]["objective"] == (
        "dflash")

    res = load_in_vllm(tiny_target, draft, method="dflash", timeout=300)
    assert res["method"] == "dflash"
    assert res["model_class"] == "DFlashQwen3ForCausalLM"
    assert res["aux_layer_ids"] == [1, 3]   # feature ids [0, 2] + 1
    assert res["num_speculative_tokens"] == 4
    assert res["mask_token_id"] == 3
    assert res["params_without_tensor"] == ["model.mask_embedding"]   # vLLM drops it by design
    assert res["params_not_equal"] == []
    assert res["tensors_not_loaded"] == []

    report_dir = tmp_path / "eval"
    assert main(["eval", "--draft", str(draft), "--target", str(tiny_target), "--cache", tiny_cache,
                 "--out_dir", str(report_dir), "--num_prompts", "3",
                 "--max_new_tokens", "12", "--temperature", "1.0"]) == 0
    report = json.loads((report_dir / "eval_report.json").read_text())
    assert report["loss_settings"]["objective"] == "dflash"
    spec = report["speculative"]
    assert spec["rounds"] > 0
    assert spec["tau"] > 1.0
    assert len(spec["acceptance_by_position"]) == 4
    assert "calibration" not in spec
    forced = report["teacher_forced"]
    assert forced["metrics"]["tau"] >= 1.0
    assert len(forced["accept_rate_by_position"]) == 4
