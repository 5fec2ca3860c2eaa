"""The DFlash2 recipe: block convolution, candidate selector, objective and gradients against an
independent reference on every backbone, the serving walk, recipe and export."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch
from conftest import make_batch, off_identity
from dflash2_reference import (
    SUBLAYERS,
    Reference,
    conv_reference,
    served_acceptance_reference,
)

from sparkforge.shared.errors import SparkforgeError
from sparkforge.trainer.architectures import ARCHITECTURES, build_draft, tiny_draft
from sparkforge.trainer.draft.block_conv import block_causal_conv
from sparkforge.trainer.draft.draft_batch import FixedAnchors
from sparkforge.trainer.draft.selector import (
    CandidateSelector,
    sample_with_selector,
    served_acceptance,
    training_candidates,
)
from sparkforge.trainer.export import config_from_hf, draft_tensors, export_draft, key_problems
from sparkforge.trainer.lit_module import DraftLitModule
from sparkforge.trainer.loss import compute_dspark_loss
from sparkforge.trainer.metrics import metric_ratios, metric_sums
from sparkforge.trainer.run_config import DraftSpec, LossSpec

GAMMA = 4.0


def test_block_conv_equals_a_slot_by_slot_reference() -> None:
    """The vectorised block convolution equals the tap-by-tap sum, never reading across blocks."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3 * 5, 32, generator=g)
    base, delta = torch.randn(3, 32, generator=g), torch.randn(2, 15, 3, 4, generator=g)
    got = block_causal_conv(x, delta, base, block_size=5)
    torch.testing.assert_close(got, conv_reference(x, base, delta, block=5, group=8),
                               rtol=0, atol=1e-6)
    poked = x.clone()
    poked[:, 4] += 100.0   # the last slot of block 0: block 1 must not see it
    assert torch.equal(block_causal_conv(poked, delta, base, 5)[:, 5:], got[:, 5:])


def test_a_fresh_dflash2_draft_is_its_dflash_draft() -> None:
    """Identity-initialised convolutions: a new DFlash2 draft's base logits equal the DFlash
    draft's with the same backbone weights (the public init rule)."""
    cfg = tiny_draft("qwen3", "dflash2")
    torch.manual_seed(0)
    dflash2 = build_draft(cfg)
    dflash = build_draft(dataclasses.replace(cfg, layout="dflash"))
    dflash.load_state_dict(dflash2.state_dict(), strict=False)
    batch = make_batch(cfg)
    torch.manual_seed(1)
    a = dflash2(batch)
    b = dflash(batch, FixedAnchors(a.anchor_positions, a.block_keep_mask))
    torch.testing.assert_close(a.draft_logits, b.draft_logits, rtol=0, atol=0)


def test_the_reference_table_covers_every_backbone() -> None:
    """The reference knows every architecture's sublayers, so a new backbone fails until added."""
    assert set(SUBLAYERS) == set(ARCHITECTURES)


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_forward_loss_and_gradients_equal_the_reference(architecture: str) -> None:
    """On each backbone the DFlash2 draft's base logits, served candidate scores, loss and every
    parameter's gradient equal the independent reference's within fp32 noise."""
    torch.manual_seed(0)
    model = off_identity(build_draft(tiny_draft(architecture, "dflash2")))
    ref = Reference(model)
    batch = make_batch(model.config)
    torch.manual_seed(2)
    out = model(batch)
    anchors = FixedAnchors(out.anchor_positions, out.block_keep_mask)
    spec = LossSpec(objective="dflash2", loss_decay_gamma=GAMMA)
    res = compute_dspark_loss(out, spec)
    want = ref.forward_loss(batch, anchors, GAMMA, spec.selector_loss_alpha or 0.0)
    res.loss.backward()
    want["loss"].backward()
    assert torch.equal(out.candidate_ids, want["cand"])
    diffs = {"logits": (out.draft_logits - want["unary"]).abs().max(),
             "scores": (out.candidate_scores[..., :-1] - want["served"]).abs().max(),
             "loss": (res.loss - want["loss"]).abs()}
    grads = dict(model.named_parameters())
    for name, p in ref.parameters().items():
        assert grads[name].grad is not None, name
        diffs[name] = (grads[name].grad - p.grad).abs().max() / (p.grad.abs().max() + 1e-12)
    assert set(ref.parameters()) == {n for n, p in grads.items() if p.requires_grad}
    worst = {k: float(v.detach()) for k, v in diffs.items() if float(v.detach()) > 2e-5}
    assert not worst, worst
    assert float(res.selector_loss) > 0


def test_training_candidates_put_a_missing_target_last() -> None:
    """The data token keeps its place among the top-k; a missing one replaces the last."""
    cand = torch.tensor([[5, 2, 9], [5, 2, 9]])
    scores = torch.tensor([[1.0, 2.0, 3.0, 2.0], [1.0, 2.0, 3.0, 7.0]])
    logits, label, hit = training_candidates(cand, scores, torch.tensor([2, 4]))
    assert label.tolist() == [1, 2]
    assert hit.tolist() == [True, False]
    assert logits.tolist() == [[1.0, 2.0, 3.0], [1.0, 2.0, 7.0]]


def test_served_acceptance_is_the_overlap_of_the_candidate_law_and_the_teacher() -> None:
    """sum_c min(p(c), q(c)) over the candidates, computed in row chunks; its ceilings are the
    teacher's probability on the candidates and the teacher's own top-k mass."""
    g = torch.Generator().manual_seed(0)
    teacher, scores = torch.randn(7, 50, generator=g), torch.randn(7, 4, generator=g)
    cand = torch.stack([torch.randperm(50, generator=g)[:4] for _ in range(7)])
    served = served_acceptance(cand, scores, teacher, chunk_rows=3)
    torch.testing.assert_close(served.accept, served_acceptance_reference(scores, cand, teacher),
                               rtol=1e-5, atol=1e-6)
    p = teacher.double().softmax(-1)
    torch.testing.assert_close(served.candidate_mass.double(), p.gather(-1, cand).sum(-1))
    torch.testing.assert_close(served.top_k_mass.double(),
                               p.sort(-1, descending=True).values[:, :4].sum(-1))
    assert bool((served.accept <= served.candidate_mass + 1e-6).all())
    assert bool((served.candidate_mass <= served.top_k_mass + 1e-6).all())


def test_the_serving_walk_drafts_after_its_own_previous_token() -> None:
    """Greedy: slot j's token is the best candidate after slot j-1's drafted token (the anchor
    first); its law is zero off the top-k candidates."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    sel = CandidateSelector(40, 8, rank=6, top_k=5, init_std=0.5)
    base, hidden = torch.randn(1, 3, 40, generator=g), torch.randn(1, 3, 8, generator=g)
    tokens, law = sample_with_selector(sel, base, torch.tensor([7]), hidden, 0.0)
    prev = 7
    for j in range(3):
        cand = base[0, j].topk(5).indices
        scores = base[0, j, cand] + ((sel.predecessor_codebook[prev]
                                      * sel.hidden_projection(hidden[0, j]))
                                     * sel.successor_codebook[cand]).sum(-1)
        prev = int(cand[scores.argmax()])
        assert int(tokens[0, j]) == prev
        assert torch.isinf(law[0, j]).sum() == 40 - 5
    sampled, _ = sample_with_selector(sel, base, torch.tensor([7]), hidden, 1.0,
                                      torch.Generator().manual_seed(3))
    assert all(int(sampled[0, j]) in base[0, j].topk(5).indices.tolist() for j in range(3))


def test_metrics_report_the_selectors_tau_beside_tau() -> None:
    """Training metrics hold tau (base distribution), selector_tau (as served), the top-k
    recall of the data token and the teacher's mass the candidates could serve."""
    torch.manual_seed(0)
    model = build_draft(tiny_draft("qwen3", "dflash2"))
    out = model(make_batch(model.config))
    res = compute_dspark_loss(out, LossSpec(objective="dflash2"))
    ratios = metric_ratios(metric_sums(out, res.accept_rate, res.weights, res.selector))
    assert 1.0 <= ratios["selector_tau"] <= 4.0
    assert 1.0 <= ratios["tau"] <= 4.0
    assert {f"selector_accept_rate@{k}" for k in range(3)} <= set(ratios)
    assert 0.0 <= ratios["candidate_recall"] <= 1.0
    assert (ratios["selector_accept_rate"] <= ratios["candidate_teacher_mass"]
            <= ratios["teacher_top_k_mass"] < 1.0)


def test_recipe_sets_the_layout_and_refuses_what_it_has_not() -> None:
    """--model.recipe dflash2: layout dflash2, no heads; its loss is CE + selector CE; a head,
    an L1 weight or a selector weight of 0 is refused naming the field."""
    spec = DraftSpec(mask_token_id=3, hidden_size=64, vocab_size=256, num_target_layers=4)
    assert spec.for_recipe("dflash2").layout == "dflash2"
    assert spec.for_recipe("dflash2").markov_rank == 0
    loss = LossSpec().with_objective("dflash2")
    assert (loss.ce_loss_alpha, loss.l1_loss_alpha, loss.selector_loss_alpha) == (1.0, 0.0, 1.0)
    with pytest.raises(SparkforgeError, match="model.draft.markov_rank=16"):
        DraftLitModule(draft=dataclasses.replace(spec, markov_rank=16), recipe="dflash2")
    with pytest.raises(SparkforgeError, match="model.loss.l1_loss_alpha=0.5"):
        LossSpec(objective="dflash2", l1_loss_alpha=0.5)
    with pytest.raises(SparkforgeError, match="selector_loss_alpha=1.0: only the dflash2"):
        LossSpec(objective="dflash", selector_loss_alpha=1.0)
    with pytest.raises(SparkforgeError, match="selector_loss_alpha must be > 0"):
        DraftLitModule(draft=spec, recipe="dflash2", loss=LossSpec(selector_loss_alpha=0.0))


def test_config_refuses_fields_its_layout_does_not_read() -> None:
    """Selector and conv fields on another layout, or that do not fit, are refused by name."""
    with pytest.raises(SparkforgeError, match="selector_top_k=8: layout 'dflash' does not"):
        dataclasses.replace(tiny_draft("qwen3", "dflash"), selector_top_k=8)
    with pytest.raises(SparkforgeError, match="conv_group_size=24 must divide hidden_size=64"):
        dataclasses.replace(tiny_draft("qwen3", "dflash2"), conv_group_size=24)
    with pytest.raises(SparkforgeError, match=r"conv_kernel_size=5 must be in \[1, block_size"):
        dataclasses.replace(tiny_draft("qwen3", "dflash2"), conv_kernel_size=5)


def test_export_writes_the_dflash2_format_and_reads_it_back(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The export's config.json is DFlash2DraftModel with the DFlash2 fields in dflash_config,
    its key set is exact, it reads back as the same draft, and the CPU-runner limit is logged."""
    cfg = dataclasses.replace(tiny_draft("qwen3", "dflash2"), selector_top_k=8, selector_rank=32)
    torch.manual_seed(0)
    model = build_draft(cfg)
    tensors = draft_tensors(model.state_dict(), prefix="")
    assert key_problems(cfg, tensors) == []
    assert key_problems(cfg, {k: v for k, v in tensors.items() if "mlp_conv" not in k})
    with caplog.at_level(logging.WARNING):
        out = export_draft(cfg, tensors, tmp_path / "draft", engine="vllm")
    assert "CPU (V1) runner refuses" in caplog.text
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert config["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": [0, 1, 2],
                                       "conv_kernel_size": 2, "conv_group_size": 16,
                                       "selector_rank": 32, "selector_top_k": 8}
    assert config_from_hf(config).to_dict() == dataclasses.replace(cfg, num_anchors=8).to_dict()
    assert "CPU (V1) runner refuses" in (out / "README.md").read_text()
