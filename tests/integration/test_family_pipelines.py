"""Each seed target family goes produce -> validate -> train -> export -> eval via the CLI.

Every family of ``FAMILIES`` (``shared/target_families.py``) but those ``ELSEWHERE`` names runs
as a tiny random target (``tiny_families``); the draft is the Qwen3-shaped DSpark draft for all
of them. The vLLM CPU build (0.32) starts Qwen3-MoE, so it is captured by vLLM with
``enable_expert_parallel`` passed through, and Qwen3-Next (in bf16, which its CPU Gated DeltaNet
kernel requires, with 64-wide linear-attention heads) with the lm_head-input plugin giving the
final state, since its final norm scales by ``1 + w``; both pass ``parity`` first. It does not
start GLM-5 (``glm_moe_dsa``), Kimi-K3 (``kimi_linear``) or MiniMax-M3 VL
(``test_vllm_cpu_refusals.py`` records why), which the HF backend captures. The MiniMax-M3 VL case
runs the multimodal top level on text-only rows; rows with an image part are counted as
``image_content`` skips.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from export_helpers import eval_report
from tiny_families import COMPOSITES, MODEL_TYPES, tiny_settings

from sparkforge.app.cli import main
from sparkforge.shared.target_families import FAMILIES, TargetFamily, family_of

IMAGE_ROW = {"messages": [
    {"role": "user", "content": [{"type": "text", "text": "What is drawn here?"},
                                 {"type": "image_url",
                                  "image_url": {"url": "data:image/png;base64,AA=="}}]},
    {"role": "assistant", "content": "A cache shard."}]}
VLLM_CASES: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"engine": {"enable_expert_parallel": True, "max_model_len": 512,
                             "enforce_eager": True}},
    "qwen3_next": {"dtype": "bfloat16", "engine": {"max_model_len": 512, "enforce_eager": True}},
}
"""The model types vLLM's CPU build captures, with their engine settings; every other family's
first model type that ``tiny_families`` builds is captured by the HF backend."""
ELSEWHERE = {
    "gemma": "tests/integration/test_gemma4_pipeline.py",  # the Qwen3-shaped draft: refused
    "deepseek_v4": "tests/integration/test_deepseek_v4_pipeline.py",  # vLLM cannot parse it
    "deepseek_v41": None,  # no tiny DeepSeek-V4.1 target: tiny_families builds none
}
"""Families this test does not run, and the pipeline test that does (None: none)."""


def _model_type(family: TargetFamily) -> str:
    """The family's model type this test builds: its vLLM case, else its first tiny one."""
    types = [t for t in family.model_types if t in VLLM_CASES] or [
        t for t in family.model_types if t in MODEL_TYPES]
    assert types, f"family {family.name}: tiny_families builds none of {family.model_types}"
    return types[0]


FAMILY_TYPES = [pytest.param(_model_type(f), id=f.name,
                             marks=[pytest.mark.slow] if _model_type(f) in VLLM_CASES else [])
                for f in FAMILIES if f.name not in ELSEWHERE]


def test_families_run_elsewhere_exist() -> None:
    """``ELSEWHERE`` names families of the table and pipeline tests that exist."""
    assert set(ELSEWHERE) <= {f.name for f in FAMILIES}
    root = Path(__file__).parents[2]
    assert all(path is None or (root / path).is_file() for path in ELSEWHERE.values())


def _write_yaml(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


def _train_config(out: Path, cache: Path, model_type: str, hidden_size: int) -> Path:
    draft = {"mask_token_id": 3, "hidden_size": hidden_size, "vocab_size": 1024,
             "num_target_layers": 4, "target_layer_ids": [0, 1, 2], "num_hidden_layers": 1,
             "block_size": 4, "num_anchors": 8, "markov_rank": 16,
             "target_model_type": model_type}
    return _write_yaml(out / "train.yaml", {
        "seed_everything": 0, "model": {"draft": draft, "attn_implementation": "sdpa"},
        "data": {"uri": str(cache), "max_seq_len": 512, "batch_size": 4, "num_workers": 0},
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 3,
                    "default_root_dir": str(out / "train"), "logger": False,
                    "enable_progress_bar": False}})


@pytest.mark.parametrize("model_type", FAMILY_TYPES)  # a vLLM case: ~2 min on 2 cores
def test_family_runs_every_stage(model_type: str, tmp_path: Path,
                                 tiny_family: Callable[[str], Path]) -> None:
    """A tiny target of the family feeds a Qwen3-shaped draft that trains, exports and evaluates."""
    from sparkforge.app.tiny_text import demo_conversations

    vllm = VLLM_CASES.get(model_type)
    case = {"backend": "hf", "engine": {}} if vllm is None else {"backend": "vllm", **vllm}
    target = tiny_family(model_type)
    rows = [*demo_conversations(12), *([IMAGE_ROW] * 2 if model_type in COMPOSITES else [])]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cache = tmp_path / "cache"
    producer = _write_yaml(tmp_path / "producer.yaml", {
        "backend": case["backend"], "data": str(data), "output": str(cache),
        "layer_ids": [0, 1, 2], "hidden_dtype": case.get("dtype", "float32"), "rows_per_unit": 8,
        "shard_rows": 1024, "max_seq_len": 512, "eval_fraction": 0.25, "overlong": "truncate",
        "parity_samples": 4 if case["backend"] == "vllm" else 0,
        "engine": {"model": str(target), "dtype": case.get("dtype", "float32"), **case["engine"]}})
    assert main(["produce", "--config", str(producer)]) == 0
    manifest = json.loads((cache / "manifest.json").read_text())
    # The cache records the text model's type (a VL top level's text_config.model_type).
    text_type = COMPOSITES.get(model_type, model_type)
    assert manifest["target"]["model_type"] == text_type
    if model_type in COMPOSITES:
        assert manifest["accounting"]["skipped"] == {"image_content": 2}
    assert manifest["capture"]["engine"] == case["backend"]
    assert manifest["capture"]["expert_parallel"] is ("enable_expert_parallel" in case["engine"])
    assert manifest["capture"]["final_hidden"] == family_of(text_type).final_state
    if case["backend"] == "vllm":
        assert manifest["parity"]["passed"], manifest["parity"]

    train = _train_config(tmp_path, cache, text_type, tiny_settings(text_type)["hidden_size"])
    assert main(["validate", str(cache), "--deep", "--against", str(train)]) == 0
    assert main(["train", "--config", str(train)]) == 0
    ckpt = next((tmp_path / "train").rglob("*.ckpt"))
    draft = tmp_path / "draft"
    assert main(["export", str(ckpt), str(draft), "--engine", "vllm"]) == 0
    config = json.loads((draft / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("qwen3", ["Qwen3DSparkModel"])
    report = eval_report(draft, target, cache, tmp_path / "eval")
    assert report["speculative"]["tau"] >= 1.0
    assert report["teacher_forced"]["metrics"]["tau"] >= 1.0
