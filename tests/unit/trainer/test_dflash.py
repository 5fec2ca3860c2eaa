"""The DFlash recipe: block layout, objective (against a hand computation), recipe, export, and
the old ``architecture: dflash`` spelling (still read as qwen3 + ``layout: dflash``)."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from conftest import make_batch
from safetensors.torch import load_file

from sparkforge.shared.errors import SparkforgeError
from sparkforge.trainer.architectures import SERVED_PAIRS, build_draft, tiny_draft
from sparkforge.trainer.architectures.config import DraftConfig
from sparkforge.trainer.architectures.qwen3.model import Qwen3DraftModel
from sparkforge.trainer.architectures.tiny import draft_tiny
from sparkforge.trainer.cli import train_cli
from sparkforge.trainer.draft.anchors import anchor_candidates
from sparkforge.trainer.draft.block_layout import DFLASH_LAYOUT, NO_HEADS
from sparkforge.trainer.draft.draft_batch import FixedAnchors
from sparkforge.trainer.draft.model import DraftOutput
from sparkforge.trainer.export import (
    ExportError,
    draft_tensors,
    export_checkpoint,
    export_draft,
    key_problems,
    load_draft,
)
from sparkforge.trainer.loss import compute_dspark_loss
from sparkforge.trainer.run_config import DraftSpec, LossSpec

ROOT = Path(__file__).resolve().parents[3]
OLD_SPELLING = "architecture: qwen3, layout: dflash"


def _dflash_cfg(**overrides: object) -> DraftConfig:
    return dataclasses.replace(draft_tiny(), layout="dflash", **NO_HEADS, block_size=5,
                               **overrides)


def _pair() -> tuple[Qwen3DraftModel, Qwen3DraftModel]:
    """A DFlash draft and a head-free DSpark draft holding the same weights."""
    cfg = _dflash_cfg()
    torch.manual_seed(0)
    dflash = build_draft(cfg).eval()
    dspark = Qwen3DraftModel(dataclasses.replace(cfg, layout="dspark")).eval()
    dspark.load_state_dict(dflash.state_dict())
    return dflash, dspark


def test_dflash_loss_matches_a_hand_computation() -> None:
    """DFlash objective: sum_s exp(-(s-1)/gamma) CE_s / sum_s exp(-(s-1)/gamma) over the
    supervised block slots s >= 1; teacher logits and unsupervised slots contribute nothing."""
    # One block of K=4 slots: draft positions 0, 1, 2 are block slots 1, 2, 3; position 1 is
    # unsupervised (DFlash masks each position alone, so slot 3 still trains).
    logits = torch.tensor([[[[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]]])
    out = DraftOutput(
        draft_logits=logits.requires_grad_(), target_ids=torch.tensor([[[0, 2, 1]]]),
        eval_mask=torch.tensor([[[True, False, True]]]), block_keep_mask=torch.tensor([[True]]),
        anchor_positions=torch.zeros(1, 1, dtype=torch.long),
        prev_token_ids=torch.zeros(1, 1, 3, dtype=torch.long), confidence_logits=None,
        target_logits=torch.tensor([[[[9.0, -9.0, 0.0]] * 3]]),
        num_valid_anchors=torch.tensor([1]), seq_len=8)
    gamma = 7.0
    ce_slot1 = math.log(math.exp(2) + 2) - 2      # target 0 under logits [2, 0, 0]
    ce_slot3 = math.log(3)                        # target 1 under logits [0, 0, 0]
    w1, w3 = math.exp(-(1 - 1) / gamma), math.exp(-(3 - 1) / gamma)
    want = (w1 * ce_slot1 + w3 * ce_slot3) / (w1 + w3 + 1e-6)
    res = compute_dspark_loss(out, LossSpec(objective="dflash", loss_decay_gamma=gamma))
    assert float(res.loss.detach()) == pytest.approx(want, rel=1e-6)
    assert float(res.ce_loss) == pytest.approx(want, rel=1e-6)
    assert float(res.l1_loss) == 0.0
    assert float(res.confidence_loss) == 0.0
    assert res.weights[0, 0].tolist() == pytest.approx([w1, 0.0, w3])


def test_dflash_objective_is_cross_entropy_only() -> None:
    """objective dflash takes weights 1 / 0 / 0 and refuses an L1 or confidence weight."""
    spec = LossSpec(objective="dflash")
    assert (spec.ce_loss_alpha, spec.l1_loss_alpha, spec.confidence_head_alpha) == (1.0, 0.0, 0.0)
    assert LossSpec().with_objective("dspark").l1_loss_alpha == 0.9
    with pytest.raises(ValueError, match="l1_loss_alpha=0.9: the dflash objective"):
        LossSpec(objective="dflash", l1_loss_alpha=0.9)
    with pytest.raises(ValueError, match="model.loss.objective='dspark'"):
        LossSpec(objective="dspark").with_objective("dflash")


def test_dflash_recipe_fills_the_draft_and_refuses_heads() -> None:
    """recipe dflash sets layout dflash and no heads on the run's architecture (default qwen3);
    a Markov rank or a dspark layout set against it fails."""
    spec = DraftSpec(mask_token_id=3, hidden_size=64, vocab_size=256, num_target_layers=4)
    got = spec.for_recipe("dflash")
    assert (got.architecture, got.layout, got.markov_rank, got.enable_confidence_head,
            got.confidence_head_with_markov) == ("qwen3", "dflash", 0, False, False)
    gemma4 = dataclasses.replace(spec, architecture="gemma4").for_recipe("dflash")
    assert (gemma4.architecture, gemma4.layout) == ("gemma4", "dflash")
    dspark = spec.for_recipe("dspark")
    assert (dspark.architecture, dspark.layout, dspark.markov_rank,
            dspark.enable_confidence_head) == ("qwen3", "dspark", 256, True)
    with pytest.raises(ValueError, match="model.draft.markov_rank=16: the dflash recipe needs 0"):
        dataclasses.replace(spec, markov_rank=16).for_recipe("dflash")
    with pytest.raises(ValueError, match="model.draft.layout='dspark': the dflash recipe needs"):
        dataclasses.replace(spec, layout="dspark").for_recipe("dflash")


@pytest.mark.parametrize("architecture", ["qwen3", "gemma4"])
def test_dflash_layout_refuses_heads_and_a_one_slot_block(architecture: str) -> None:
    """A dflash layout with a Markov rank, a confidence head or K=1 is refused by name, on any
    backbone; an unknown layout is refused naming the field."""
    with pytest.raises(ValueError, match="invalid DraftConfig") as err:
        dataclasses.replace(tiny_draft(architecture), layout="dflash", block_size=1)
    for field in ("markov_rank=16", "enable_confidence_head", "block_size=1"):
        assert field in str(err.value)
    with pytest.raises(ValueError, match="layout='medusa' not in"):
        dataclasses.replace(draft_tiny(), layout="medusa")


def test_full_block_anchor_rule() -> None:
    """DFlash anchors: supervised token with the whole block inside the row's real length."""
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    got = anchor_candidates(loss_mask, DFLASH_LAYOUT, block_size=3,
                            ends_BS=torch.tensor([[6] * 8, [8] * 8]))
    # row 0: anchors 1..3 (anchor+2 <= 5); row 1: anchors 0..5 (anchor+2 <= 7)
    assert got.tolist() == [[False, True, True, True, False, False, False],
                            [True, True, True, True, True, True, False]]


def test_dflash_position_k_is_block_slot_k_plus_1() -> None:
    """With fixed anchors, DFlash draft position k equals the same weights' block slot k+1, is
    labelled with the token at anchor+k+1, and is masked without a cumulative product."""
    dflash, dspark = _pair()
    cfg = dflash.config
    b = make_batch(cfg, seq_len=24)
    anchors = torch.tensor([[5, 9, 15], [6, 10, 14]])
    keep = torch.ones(2, 3, dtype=torch.bool)
    fl = dflash(b, FixedAnchors(anchors, keep))
    sp = dspark(b, FixedAnchors(anchors, keep))
    assert fl.draft_logits.shape[2] == dflash.num_draft_tokens == cfg.block_size - 1 == 4
    # DSpark slot k predicts anchor+k+1 from block slot k; DFlash's position k sits at slot k+1.
    # Both see the same block tokens and context, so DFlash position k = DSpark slot k+1's logits.
    torch.testing.assert_close(fl.draft_logits, sp.draft_logits[:, :, 1:])
    for j in range(4):
        assert torch.equal(fl.target_ids[..., j], torch.gather(b["input_ids"], 1, anchors + j + 1))
    # loss_mask has a hole at position 12: anchor 9's position 2 (label 12) is off, 3 still on.
    assert fl.eval_mask[0, 1].tolist() == [True, True, False, True]
    assert sp.eval_mask[0, 1].tolist() == [True, True, False, False, False]


def test_dflash_draft_block_drafts_the_mask_slots() -> None:
    """Inference: a DFlash block drafts K-1 tokens, those of block slots 1..K-1."""
    dflash, dspark = _pair()
    cfg = dflash.config
    b = make_batch(cfg, seq_len=10)
    cache_f = dflash.extend_context(dflash.empty_cache(), b["target_hidden_states"][:1])
    cache_s = dspark.extend_context(dspark.empty_cache(), b["target_hidden_states"][:1])
    anchor = b["input_ids"][:1, 3]
    h_f, logits_f = dflash.draft_block(anchor, cache_f)
    h_s, logits_s = dspark.draft_block(anchor, cache_s)
    assert logits_f.shape[1] == cfg.block_size - 1
    torch.testing.assert_close(logits_f, logits_s[:, 1:])


def test_dflash_export_key_set_config_and_round_trip(tmp_path: Path) -> None:
    """The DFlash export holds exactly the backbone keys, a DFlashDraftModel config with
    dflash_config, and loads back as the same DFlash draft."""
    dflash, _ = _pair()
    cfg = dflash.config
    tensors = {k: v for k, v in dflash.state_dict().items() if not k.startswith("rotary_emb.")}
    out = export_draft(cfg, tensors, tmp_path / "draft", engine="vllm")
    saved = load_file(str(out / "model.safetensors"))
    backbone = {"fc.weight", "hidden_norm.weight", "norm.weight", "embed_tokens.weight",
                "lm_head.weight"} | {f"layers.0.{n}.weight" for n in (
                    "input_layernorm", "post_attention_layernorm", "self_attn.q_proj",
                    "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                    "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj",
                    "mlp.down_proj")}
    assert set(saved) == backbone
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["DFlashDraftModel"]
    assert conf["model_type"] == "qwen3"
    assert conf["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": [0, 1, 2]}
    assert conf["block_size"] == 5
    assert conf["num_target_layers"] == 4
    assert conf["layer_types"] == ["full_attention"]
    assert not {"markov_rank", "enable_confidence_head"} & set(conf)
    back = load_draft(out)
    assert back.config == dataclasses.replace(cfg, num_anchors=cfg.num_anchors)
    assert back.num_draft_tokens == 4
    for name, value in saved.items():
        assert torch.equal(back.state_dict()[name], value.float()), name


def test_unserved_pair_trains_and_export_refuses_it_in_one_line(tmp_path: Path) -> None:
    """gemma4 + dflash trains (finite loss, gradients on the backbone) but no engine serves it:
    export refuses it in one line naming the pair and the pairs that serve, writing nothing."""
    cfg = tiny_draft("gemma4", "dflash")
    torch.manual_seed(0)
    model = build_draft(cfg)
    out = model(make_batch(cfg))
    assert out.draft_logits.shape[2] == cfg.block_size - 1
    compute_dspark_loss(out, LossSpec(objective="dflash")).loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    assert ("gemma4", "dflash") not in SERVED_PAIRS
    with pytest.raises(SparkforgeError) as err:
        export_draft(cfg, draft_tensors(model.state_dict(), prefix=""), tmp_path / "draft")
    message = str(err.value)
    assert "\n" not in message
    assert "architecture='gemma4' with layout='dflash': no engine serves this pair" in message
    assert "qwen3 + dflash" in message
    assert "gemma4 + dspark" in message
    assert not (tmp_path / "draft").exists()


def test_old_spelling_checkpoint_exports_as_qwen3_dflash(tmp_path: Path) -> None:
    """A checkpoint whose stored draft config says ``architecture: dflash`` reads as qwen3 +
    dflash with one FutureWarning naming the new spelling and 0.3.0, and exports the same
    config.json and model.safetensors bytes as the new spelling's config."""
    dflash, _ = _pair()
    cfg = dflash.config
    old = {**cfg.to_dict(), "architecture": "dflash"}
    del old["layout"]
    state = {f"model.{k}": v for k, v in dflash.state_dict().items()}
    torch.save({"draft_config": old, "state_dict": state}, tmp_path / "old.ckpt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_checkpoint(tmp_path / "old.ckpt", tmp_path / "old", engine="vllm")
    messages = [str(w.message) for w in caught if w.category is FutureWarning]
    assert len(messages) == 1
    assert OLD_SPELLING in messages[0]
    assert "0.3.0" in messages[0]
    saved = json.loads((tmp_path / "old" / "sparkforge_export.json").read_text())["draft_config"]
    assert (saved["architecture"], saved["layout"]) == ("qwen3", "dflash")
    new = export_draft(cfg, draft_tensors(state), tmp_path / "new", engine="vllm")
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "old" / name).read_bytes() == (new / name).read_bytes(), name


def test_old_spelling_still_loads_from_a_train_yaml(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A train YAML with ``architecture: dflash`` (and ``recipe: dflash``) still parses and builds
    a qwen3 draft with layout dflash, warning once with the new spelling."""
    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load((ROOT / "trainer" / "examples" / "tiny.yaml").read_text())
    config["model"]["recipe"] = "dflash"
    del config["model"]["draft"]["markov_rank"]
    config["model"]["draft"]["architecture"] = "dflash"
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = train_cli(["--config", str(path)])
    target = {"model_type": "qwen3", "hidden_size": 128, "vocab_size": 1024,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 32, "intermediate_size": 256}
    with pytest.warns(FutureWarning, match=OLD_SPELLING) as caught:
        cfg = cli.model.draft.draft_config(target)
    assert len([w for w in caught if w.category is FutureWarning]) == 1
    assert (cfg.architecture, cfg.layout, cfg.markov_rank) == ("qwen3", "dflash", 0)
    assert cli.model.loss_spec.objective == "dflash"


def test_dflash_export_refuses_missing_and_head_tensors(tmp_path: Path) -> None:
    """A missing backbone tensor or a Markov head tensor is refused before anything is written."""
    dflash, _ = _pair()
    cfg = dflash.config
    tensors = {k: v for k, v in dflash.state_dict().items() if not k.startswith("rotary_emb.")}
    del tensors["layers.0.mlp.up_proj.weight"]
    tensors["markov_head.markov_w1.weight"] = torch.zeros(cfg.vocab_size, 16)
    problems = key_problems(cfg, tensors)
    assert "missing tensor layers.0.mlp.up_proj.weight [128, 64]" in problems
    assert "unexpected tensor markov_head.markov_w1.weight" in problems
    with pytest.raises(ExportError):
        export_draft(cfg, tensors, tmp_path / "draft")
    assert not (tmp_path / "draft").exists()
