"""Export: the layout vLLM and SGLang load, exact key set, refusals, lossless round trip."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from export_helpers import foreign_checkpoint
from safetensors.torch import load_file

from sparkforge.trainer.architectures.config import DraftConfig
from sparkforge.trainer.architectures.qwen3.model import Qwen3DraftModel
from sparkforge.trainer.architectures.tiny import draft_tiny
from sparkforge.trainer.checkpoint import CheckpointError, load_checkpoint
from sparkforge.trainer.draft.draft_batch import FixedAnchors
from sparkforge.trainer.export import (
    ExportError,
    export_checkpoint,
    export_draft,
    key_problems,
    load_draft,
    read_checkpoint,
)


def _draft(cfg: DraftConfig | None = None) -> Qwen3DraftModel:
    torch.manual_seed(0)
    model = Qwen3DraftModel(cfg or draft_tiny())
    with torch.no_grad():  # bf16-representable weights make the bf16 export lossless
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model.eval()


def _ckpt(model: Qwen3DraftModel, path: Path) -> Path:
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, "draft_config": model.config.to_dict(), "global_step": 3},
               path)
    return path


def _batch(cfg: DraftConfig) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    s = 24
    return {"input_ids": torch.randint(0, cfg.vocab_size, (2, s), generator=g),
            "loss_mask": (torch.arange(s) >= 6).long().expand(2, s).contiguous(),
            "target_hidden_states": torch.randn(2, s, cfg.num_features * cfg.hidden_size,
                                                generator=g),
            "target_last_hidden_states": torch.randn(2, s, cfg.hidden_size, generator=g)}


def test_export_reloads_with_identical_logits(tmp_path: Path) -> None:
    """Checkpoint -> export -> reload gives bit-identical draft logits and confidences."""
    model = _draft()
    out = export_checkpoint(_ckpt(model, tmp_path / "a.ckpt"), tmp_path / "draft")
    reloaded = load_draft(out)
    batch = _batch(model.config)
    anchors = torch.tensor([[6, 9, 15, 20], [7, 8, 12, 21]])
    keep = torch.ones_like(anchors, dtype=torch.bool)
    a = model(batch, FixedAnchors(anchors, keep))
    b = reloaded(batch, FixedAnchors(anchors, keep))
    assert torch.equal(a.draft_logits, b.draft_logits)
    assert a.confidence_logits is not None
    assert b.confidence_logits is not None
    assert torch.equal(a.confidence_logits, b.confidence_logits)


def test_exported_layout_is_the_serving_format(tmp_path: Path) -> None:
    """config.json carries the section 1.2 fields; tensors are bare bf16 keys, 11 L_d + 7 + 2."""
    model = _draft()
    out = export_draft(model.config, model.state_dict(), tmp_path / "d")
    cfg = json.loads((out / "config.json").read_text())
    c = model.config
    expected = {
        "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "tie_word_embeddings": False,
        "hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers,
        "layer_types": ["full_attention"] * c.num_hidden_layers, "block_size": c.block_size,
        "mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids),
        "num_target_layers": c.num_target_layers, "markov_rank": c.markov_rank,
        "markov_head_type": "vanilla", "enable_confidence_head": True,
        "confidence_head_with_markov": True, "hidden_act": "silu", "dtype": "bfloat16",
        "vocab_size": c.vocab_size,
    }
    assert {k: cfg[k] for k in expected} == expected
    tensors = load_file(str(out / "model.safetensors"))
    assert len(tensors) == 11 * c.num_hidden_layers + 7 + 2
    assert not any(k.startswith("model.") for k in tensors)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert tensors["confidence_head.proj.weight"].shape == (1, c.hidden_size + c.markov_rank)
    assert (out / "sparkforge_export.json").exists()


@pytest.mark.parametrize(("change", "engine", "reason"), [
    ({"markov_head_type": "gated"}, "vllm", "vanilla Markov head"),
    ({"markov_head_type": "rnn"}, "any", "vanilla Markov head"),
    ({"markov_rank": 0, "confidence_head_with_markov": False}, "vllm", "rank-0"),
    ({"target_layer_ids": (0, 3)}, "any", "3, the last layer: SGLang cannot capture it"),
    ({"target_layer_ids": (0, 3)}, "sglang", "3, the last layer: SGLang cannot capture it"),
    ({"target_layer_ids": (-1, 2)}, "vllm", "-1 \\(the embeddings\\)"),
    ({"enable_confidence_head": False}, "sglang", "SGLang"),
    ({"final_logit_softcapping": 30.0}, "any", "softcap"),
])
def test_unservable_drafts_are_refused(tmp_path: Path, change: dict, engine: str,
                                       reason: str) -> None:
    """A draft the engine would reject or serve wrongly is refused, naming why; nothing written."""
    cfg = dataclasses.replace(draft_tiny(), **change)
    model = Qwen3DraftModel(cfg)
    with pytest.raises(ExportError, match=reason):
        export_draft(cfg, model.state_dict(), tmp_path / "d", engine=engine)  # type: ignore[arg-type]
    assert not (tmp_path / "d").exists()


def test_last_layer_feature_exports_for_vllm(tmp_path: Path) -> None:
    """vLLM serves feature id L-1 as the last layer's raw output, what the cache holds: exported."""
    cfg = dataclasses.replace(draft_tiny(), target_layer_ids=(0, 3))
    assert cfg.num_target_layers == 4
    export_draft(cfg, Qwen3DraftModel(cfg).state_dict(), tmp_path / "d", engine="vllm")
    assert json.loads((tmp_path / "d" / "config.json").read_text())["target_layer_ids"] == [0, 3]


def test_gated_head_exports_for_sglang_only(tmp_path: Path) -> None:
    """SGLang serves gated heads, so an sglang-only export of one is allowed."""
    cfg = dataclasses.replace(draft_tiny(), markov_head_type="gated")
    tensors = Qwen3DraftModel(cfg).state_dict()
    with pytest.raises(ExportError, match="unexpected tensor markov_head.gate_proj"):
        export_draft(cfg, tensors, tmp_path / "d", engine="sglang")


def test_key_set_check_catches_what_vllm_would_silently_accept() -> None:
    """Missing Markov weights, a model. prefix and a wrong shape each fail the self-check."""
    cfg = draft_tiny()
    good = Qwen3DraftModel(cfg).state_dict()
    assert key_problems(cfg, good) == []
    no_markov = {k: v for k, v in good.items() if not k.startswith("markov_head")}
    assert any("missing tensor markov_head.markov_w1" in p for p in key_problems(cfg, no_markov))
    prefixed = {f"model.{k}": v for k, v in good.items()}
    assert any("unexpected tensor model.fc.weight" in p for p in key_problems(cfg, prefixed))
    bad_fc = {**good, "fc.weight": torch.zeros(cfg.hidden_size, cfg.hidden_size)}
    assert any(p.startswith("fc.weight: shape") for p in key_problems(cfg, bad_fc))


def test_non_empty_output_is_not_overwritten_by_default(tmp_path: Path) -> None:
    """An existing export is kept unless --overwrite is given."""
    model = _draft()
    out = export_draft(model.config, model.state_dict(), tmp_path / "d")
    with pytest.raises(ExportError, match="overwrite"):
        export_draft(model.config, model.state_dict(), out)
    export_draft(model.config, model.state_dict(), out, overwrite=True)
    # A link is neither replaced nor written through, even with --overwrite (it used to fail
    # with "path ?"), and a file is no folder.
    link, file = tmp_path / "link", tmp_path / "file"
    link.symlink_to(out)
    file.write_text("kept")
    for target, message in ((link, f"{link} is a symbolic link (to {out})"),
                            (file, f"{file} exists and is not a folder")):
        with pytest.raises(ExportError, match=re.escape(message)):
            export_draft(model.config, model.state_dict(), target, overwrite=True)
    assert link.is_symlink()
    assert (out / "model.safetensors").is_file()
    assert file.read_text() == "kept"


class _Payload:
    """Stands for any non-tensor object a foreign pickle could carry."""


def test_checkpoint_with_arbitrary_pickled_objects_is_refused(tmp_path: Path) -> None:
    """Export loads checkpoints weights-only: a pickled object is a CheckpointError, never run."""
    path = tmp_path / "foreign.ckpt"
    torch.save({"draft_config": draft_tiny().to_dict(), "state_dict": {}, "x": _Payload()}, path)
    with pytest.raises(CheckpointError, match="foreign.ckpt"):
        read_checkpoint(path)


@pytest.mark.parametrize("kind", ["random_bytes", "code_running_pickle"])
def test_a_foreign_file_is_one_line_and_runs_nothing(tmp_path: Path, kind: str) -> None:
    """The check export and train --ckpt_path share: one line naming the file, no code run."""
    path = foreign_checkpoint(kind, tmp_path / "foreign.ckpt")
    with pytest.raises(CheckpointError, match=r"foreign.ckpt: not a sparkforge train checkpoint"):
        load_checkpoint(path)
    assert not path.with_suffix(".ran").exists()


def test_every_config_architecture_has_a_table_entry() -> None:
    """The torch-free name list a config validates against is exactly the architecture table."""
    from sparkforge.trainer.architectures import ARCHITECTURES
    from sparkforge.trainer.architectures.config import DRAFT_ARCHITECTURES
    from sparkforge.trainer.draft.block_layout import BLOCK_LAYOUTS, LAYOUTS

    assert set(DRAFT_ARCHITECTURES) == set(ARCHITECTURES)
    assert all(name == arch.name for name, arch in ARCHITECTURES.items())
    assert set(LAYOUTS) == set(BLOCK_LAYOUTS)
    assert all(set(arch.formats) <= set(LAYOUTS) for arch in ARCHITECTURES.values())


def test_unknown_architecture_is_a_config_error() -> None:
    """A draft config naming no known architecture is refused, naming the field."""
    with pytest.raises(ValueError, match="architecture='llama4' not in"):
        dataclasses.replace(draft_tiny(), architecture="llama4")


def _calibration_report(temperatures: list[float]) -> dict[str, object]:
    row = {"teacher_forced": {"ece": 0.08}}
    return {"confidence_calibration": {
        "fit_blocks": 50, "test_blocks": 40, "temperatures": {"head": temperatures},
        "estimators": {"head": row, "head + STS": {"teacher_forced": {"ece": 0.02}}}}}


def test_export_writes_the_calibration_engines_read(tmp_path: Path) -> None:
    """An eval report's STS fit travels into the draft folder as confidence_calibration.json,
    one temperature per draft slot under both key spellings."""
    model = _draft()
    k = model.config.block_size   # a DSpark draft drafts its whole block
    temps = [1.0 + 0.1 * j for j in range(k)]
    out = export_draft(model.config, model.state_dict(), tmp_path / "d",
                       eval_report=_calibration_report(temps))
    written = json.loads((out / "confidence_calibration.json").read_text())
    assert written["sts_temperatures"] == written["temperatures"] == temps
    assert (written["ece_before"], written["ece_after"]) == (0.08, 0.02)


def test_export_refuses_another_drafts_calibration(tmp_path: Path) -> None:
    """Temperatures for another number of slots (another draft's fit) stop the export."""
    model = _draft()
    with pytest.raises(ExportError, match="calibration has 2 temperatures"):
        export_draft(model.config, model.state_dict(), tmp_path / "d",
                     eval_report=_calibration_report([1.0, 1.0]))
    assert not (tmp_path / "d").exists()
