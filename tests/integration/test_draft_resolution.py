"""Drafts for GLM, Kimi and DeepSeek targets resolve in vLLM to the DSpark class, not an MTP one.

vLLM rewrites a draft config's ``model_type`` of deepseek/glm/kimi targets into its MTP or V4
drafters, so the exporter must never copy the target's type. Each draft is derived from the
tiny target's own config (``from_target_config``), exported with random weights and resolved by
vLLM's speculative config next to a Qwen3 stand-in target of the same hidden size (vLLM 0.32 on
CPU starts none of these targets). The same exports with the target's ``model_type`` written in
are the control: vLLM sends those elsewhere.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from export_helpers import resolve_in_vllm

TARGET_TYPES = {"glm_moe_dsa": "glm_moe_dsa", "kimi_linear": "kimi_k3",
                "deepseek_v4": "deepseek_v4"}
"""Tiny target model type -> the model_type a copied target config would carry (Kimi-K3's
checkpoints say ``kimi_k3`` at the top, its text model is ``kimi_linear``)."""


def _export(target: Path, out: Path) -> Path:
    """A random-weight draft derived from ``target``'s config, exported for vLLM."""
    from transformers import AutoConfig

    from sparkforge.trainer.architectures import build_draft
    from sparkforge.trainer.draft.config import from_target_config
    from sparkforge.trainer.export import export_draft

    cfg = from_target_config(AutoConfig.from_pretrained(target), mask_token_id=3,
                             target_layer_ids=(0, 1, 2), num_hidden_layers=1, block_size=4,
                             num_anchors=8, markov_rank=16, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, intermediate_size=128)
    return export_draft(cfg, build_draft(cfg).state_dict(), out, engine="vllm")


def _with_model_type(draft: Path, out: Path, model_type: str) -> Path:
    shutil.copytree(draft, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    return out


def test_exported_drafts_resolve_to_dspark(tmp_path: Path,
                                           tiny_family: Callable[[str], Path]) -> None:
    """glm/kimi/deepseek-target exports resolve to Qwen3DSparkModel; the target's type does not."""
    from sparkforge.app.tiny_target import build_tiny_target

    drafts, controls = {}, {}
    for target_type, copied_type in TARGET_TYPES.items():
        draft = _export(tiny_family(target_type), tmp_path / target_type)
        assert json.loads((draft / "sparkforge_export.json").read_text())[
            "draft_config"]["target_model_type"] == target_type
        drafts[target_type] = draft
        controls[target_type] = _with_model_type(draft, tmp_path / f"{target_type}_copied",
                                                 copied_type)
    stand_in = build_tiny_target(tmp_path / "qwen3_stand_in", hidden_size=64, head_dim=32)
    resolved = resolve_in_vllm(stand_in, [*drafts.values(), *controls.values()])
    for target_type, draft in drafts.items():
        assert resolved[str(draft)] == {"method": "dspark", "model_type": "qwen3",
                                        "architectures": ["Qwen3DSparkModel"]}, target_type
    for target_type, control in controls.items():
        assert resolved[str(control)].get("architectures") != ["Qwen3DSparkModel"], target_type
