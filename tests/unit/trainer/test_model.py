"""Every draft: shapes, frozen pieces, determinism, RoPE pin, attention paths, padding (the DSpark
model checklist, run once per (architecture, layout) pair of the tables, ``DRAFT_PAIRS``)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import PAIR_IDS, build_tiny
from draft_helpers import recipe_loss

from sparkforge.shared.errors import ConfigError
from sparkforge.trainer.architectures import ARCHITECTURES, DRAFT_PAIRS, build_draft, draft_class
from sparkforge.trainer.architectures.qwen3.model import Qwen3DraftModel
from sparkforge.trainer.draft.block_layout import BLOCK_LAYOUTS
from sparkforge.trainer.draft.draft_batch import DraftBatch, FixedAnchors
from sparkforge.trainer.draft.rope import compute_inv_freq
from sparkforge.trainer.loss import compute_dspark_loss

Build = Callable[..., Any]


@pytest.fixture(params=DRAFT_PAIRS, ids=PAIR_IDS)
def build(request: pytest.FixtureRequest, build: Build) -> Build:
    """The conftest factory, once per (architecture, layout) pair."""
    architecture, layout = request.param
    return functools.partial(build, architecture=architecture, layout=layout)


# Head settings: every one on a layout with heads (DSpark), the headless default on the others.
HEAD_CASES = {"vanilla": {}, "gated": {"markov_head_type": "gated"},
              "rnn": {"markov_head_type": "rnn"},
              "rank0": {"markov_rank": 0, "confidence_head_with_markov": False},
              "conf_no_markov": {"confidence_head_with_markov": False},
              "no_conf": {"enable_confidence_head": False}}
FORWARD_CASES = [(arch, layout, name) for arch, layout in DRAFT_PAIRS for name in HEAD_CASES
                 if BLOCK_LAYOUTS[layout].heads or name == "vanilla"]


@pytest.mark.parametrize(("architecture", "layout", "case"), FORWARD_CASES,
                         ids=["-".join(c) for c in FORWARD_CASES])
def test_forward_shapes_and_finite(architecture: str, layout: str, case: str) -> None:
    """logits/teacher [B,A,K,V] (K = the layout's drafts per block: 4 of a DSpark block of 4,
    3 of a DFlash or DFlash2 one); ids, eval, confidence [B,A,K]; keep [B,A]; all finite."""
    overrides = HEAD_CASES[case]
    model, batch = build_tiny(architecture=architecture, layout=layout, **overrides)
    out = model(batch)
    b, a, k, v = 2, 8, BLOCK_LAYOUTS[layout].num_drafts(4), 256
    assert out.draft_logits.shape == out.target_logits.shape == (b, a, k, v)
    for t in (out.target_ids, out.eval_mask, out.prev_token_ids):
        assert t.shape == (b, a, k)
    assert out.block_keep_mask.shape == out.anchor_positions.shape == (b, a)
    assert torch.isfinite(out.draft_logits).all()
    assert torch.isfinite(out.target_logits).all()
    if model.confidence_head is None:
        assert out.confidence_logits is None
    else:
        assert out.confidence_logits.shape == (b, a, k)
        assert out.confidence_logits.dtype == torch.float32
        assert torch.isfinite(out.confidence_logits).all()
    assert (model.markov_head is None) == (overrides.get("markov_rank") == 0
                                           or not BLOCK_LAYOUTS[layout].heads)


def test_labels_teacher_index_and_prev_tokens(build: Build) -> None:
    """Draft position k: target = ids[a+k+1], teacher = lm_head(last[a+k]), prev = ids[a+k]."""
    model, batch = build()
    out = model(batch)
    ids, last = batch["input_ids"], batch["target_last_hidden_states"]
    assert out.eval_mask.any()
    for b, n in zip(*out.eval_mask[..., 0].nonzero(as_tuple=True), strict=True):
        a = int(out.anchor_positions[b, n])
        for k in out.eval_mask[b, n].nonzero().flatten().tolist():
            assert out.target_ids[b, n, k] == ids[b, a + k + 1]
            assert out.prev_token_ids[b, n, k] == ids[b, a + k]
            torch.testing.assert_close(out.target_logits[b, n, k], model.lm_head(last[b, a + k]))


def test_embeddings_and_head_frozen_copies(build: Build) -> None:
    """embed_tokens/lm_head equal the given target tensors, get no grad; the context projection
    (fc / main_proj) gets a finite grad."""
    model, batch = build()
    emb, head = torch.randn(256, 64), torch.randn(256, 64)
    model.set_target_weights(emb, head)
    assert torch.equal(model.embed_tokens.weight, emb)
    assert torch.equal(model.lm_head.weight, head)
    compute_dspark_loss(model(batch), recipe_loss(model.config)).loss.backward()
    assert model.embed_tokens.weight.grad is None
    assert model.lm_head.weight.grad is None
    assert not model.embed_tokens.weight.requires_grad
    assert not model.lm_head.weight.requires_grad
    # The context projection (fc / main_proj / context_proj): the one [H, F*H] weight.
    h, x = model.config.hidden_size, model.config.num_features * model.config.hidden_size
    (proj,) = [p for p in model.parameters() if tuple(p.shape) == (h, x)]
    assert proj.grad is not None
    assert torch.isfinite(proj.grad).all()
    assert proj.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="embed_tokens.weight"):
        model.set_target_weights(torch.zeros(255, 64), None)


def test_every_trainable_parameter_gets_a_finite_gradient(build: Build) -> None:
    """The loss reaches every trainable parameter (backbone, Markov, confidence), finitely."""
    for head_type in ("vanilla", "gated", "rnn"):
        model, batch = build(markov_head_type=head_type)
        compute_dspark_loss(model(batch), recipe_loss(model.config)).loss.backward()
        for name, p in model.named_parameters():
            if p.requires_grad:
                assert p.grad is not None, name
                assert torch.isfinite(p.grad).all(), name
                assert p.grad.abs().sum() > 0, name


def test_forward_is_deterministic_under_a_seed(build: Build) -> None:
    """Same seed -> same anchors, logits and loss; another seed -> other anchors."""
    outs = []
    for seed in (0, 0, 1):
        model, batch = build(seed=0)
        torch.manual_seed(seed)
        out = model(batch)
        loss = compute_dspark_loss(out, recipe_loss(model.config)).loss
        outs.append((out.anchor_positions, out.draft_logits, loss))
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1], outs[1][1])
    assert torch.equal(outs[0][2], outs[1][2])
    assert not torch.equal(outs[0][0], outs[2][0])


@pytest.mark.parametrize(
    "cast",
    [lambda m: m.to(torch.bfloat16), lambda m: m.bfloat16(),
     lambda m: m.half().float().to(torch.bfloat16), lambda m: m.double().to(torch.bfloat16)],
    ids=["to_bf16", "bfloat16", "half_float_bf16", "double_bf16"],
)
def test_inv_freq_stays_fp32_through_casts(build: Build, cast: Callable[[Any], Any]) -> None:
    """inv_freq stays fp32 (rel 1e-6 of the reference) while the parameters become bf16."""
    model, batch = build(rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    cast(model)
    rope_dim = model.rope_dim(model.config)
    ref, _ = compute_inv_freq(rope_dim, {"rope_type": "default", "rope_theta": 1_000_000.0},
                              40_960)
    inv = model.rotary_emb.inv_freq
    assert inv.dtype == torch.float32
    torch.testing.assert_close(inv, ref, rtol=1e-6, atol=0)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    bf16_inv = ref.to(torch.bfloat16).float()
    assert not torch.allclose(bf16_inv, ref, rtol=1e-6, atol=0)  # the pin matters
    out = model(batch)
    assert torch.isfinite(out.draft_logits.float()).all()


# Eager flex on CPU warns that it is unfused; that is expected here.
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_sdpa_and_flex_agree(build: Build) -> None:
    """The dense-mask SDPA path and the flex BlockMask path give the same outputs."""
    # On CPU torch 2.13 flex attention runs forward only ("FlexAttention does not support
    # backward on CPU"), so this compares forward values under no_grad.
    sdpa, batch = build(seed=3, markov_head_type="gated")
    flex = build_draft(sdpa.config, attn_implementation="flex")
    flex.load_state_dict(sdpa.state_dict())
    with torch.no_grad():
        a = sdpa(batch)
        b = flex(batch, FixedAnchors(a.anchor_positions, a.block_keep_mask))
    torch.testing.assert_close(b.draft_logits, a.draft_logits, rtol=1e-4, atol=1e-5)
    assert (a.confidence_logits is None) == (sdpa.confidence_head is None)
    if sdpa.confidence_head is not None:
        torch.testing.assert_close(b.confidence_logits, a.confidence_logits, rtol=1e-4,
                                   atol=1e-5)


def test_training_block_equals_cached_inference_block(build: Build) -> None:
    """A training block equals draft_block over a context cache of positions 0..anchor-1."""
    # So it sees exactly the context before its anchor (KV injection, RoPE at anchor+k).
    model, batch = build(seed=4)
    with torch.no_grad():
        out = model(batch)
        for n in range(3):
            a = int(out.anchor_positions[0, n])
            cache = model.extend_context(model.empty_cache(),
                                         batch["target_hidden_states"][:1, :a])
            hid, base = model.draft_block(batch["input_ids"][:1, a], cache)
            head = model.markov_head
            bias = 0.0 if head is None else head(out.prev_token_ids[:1, n], hid)
            torch.testing.assert_close(base + bias, out.draft_logits[:1, n], rtol=1e-4,
                                       atol=1e-5)


def test_right_padding_is_invisible(build: Build) -> None:
    """Right padding (attention_mask 0) never changes supervised logits or the loss."""
    model, batch = build(seed=5)
    attn = torch.ones_like(batch["loss_mask"])
    attn[1, 18:] = 0
    torch.manual_seed(0)
    ref = model(batch | {"attention_mask": attn})
    assert not (ref.anchor_positions[1][ref.block_keep_mask[1]] >= 17).any()
    noisy = {k: v.clone() for k, v in batch.items()}
    noisy["input_ids"][1, 18:] = 7
    noisy["target_hidden_states"][1, 18:] = 1e4
    noisy["target_last_hidden_states"][1, 18:] = -1e4
    noisy["loss_mask"][1, 18:] = 1  # padding rows carry loss_mask 1: attention_mask wins
    torch.manual_seed(0)
    got = model(noisy | {"attention_mask": attn})
    assert torch.equal(got.anchor_positions, ref.anchor_positions)
    m = ref.eval_mask
    torch.testing.assert_close(got.draft_logits[m], ref.draft_logits[m])
    spec = recipe_loss(model.config)
    torch.testing.assert_close(compute_dspark_loss(got, spec).loss,
                               compute_dspark_loss(ref, spec).loss)


def test_dummy_blocks_give_no_nan(build: Build) -> None:
    """With no valid anchor (all dummy blocks) forward, loss and gradients stay finite."""
    model, batch = build()
    batch["loss_mask"] = torch.zeros_like(batch["loss_mask"])
    out = model(batch)
    assert not out.block_keep_mask.any()
    assert torch.isfinite(out.draft_logits).all()
    loss = compute_dspark_loss(out, recipe_loss(model.config))
    loss.loss.backward()
    assert loss.loss.item() == 0.0
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads   # the backward reached the draft, so a NaN there would show
    assert all(torch.isfinite(g).all() for g in grads)


def test_softcap_applies_to_base_and_teacher_logits(build: Build) -> None:
    """With a final logit softcap every base and teacher logit lies within +-cap."""
    model, batch = build(final_logit_softcapping=0.5, markov_rank=0,
                         confidence_head_with_markov=False)
    out = model(batch)
    assert out.draft_logits.abs().max() <= 0.5
    assert out.target_logits.abs().max() <= 0.5


def test_embedding_scale_multiplies_the_block_embedding(build: Build) -> None:
    """embedding_scale (Gemma sqrt(H)) scales the frozen embedding output."""
    model, _ = build(embedding_scale=8.0)
    ids = torch.tensor([[1, 2]])
    torch.testing.assert_close(model.embed(ids), model.embed_tokens(ids) * 8.0)


def test_layer_id_convention_matches_hf(tiny_target: Any) -> None:
    """Feature id l = HF hidden_states[l+1]; the post-norm last state gives the target logits."""
    from transformers import AutoModelForCausalLM

    from sparkforge.trainer.architectures.config import from_target_config

    target = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    captured: dict[int, torch.Tensor] = {}
    hooks = [layer.register_forward_hook(
        lambda _m, _i, o, i=i: captured.__setitem__(i, o[0] if isinstance(o, tuple) else o))
        for i, layer in enumerate(target.model.layers)]
    ids = torch.randint(4, 1024, (1, 16))
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    for h in hooks:
        h.remove()
    for layer_id in range(3):
        torch.testing.assert_close(out.hidden_states[layer_id + 1], captured[layer_id])
    cfg = dataclasses.replace(
        from_target_config(target.config, mask_token_id=3, target_layer_ids=(0, 1, 2)),
        num_hidden_layers=1, num_anchors=4, markov_rank=8)
    draft = Qwen3DraftModel(cfg, embed_weight=target.model.embed_tokens.weight,
                             lm_head_weight=target.lm_head.weight)
    with torch.no_grad():
        d = draft(DraftBatch(ids, torch.ones(1, 16), torch.cat(out.hidden_states[1:4], -1),
                             out.hidden_states[-1]))
    for n in range(4):
        a = int(d.anchor_positions[0, n])
        for k in range(int(d.eval_mask[0, n].sum())):
            torch.testing.assert_close(d.target_logits[0, n, k], out.logits[0, a + k])


@pytest.mark.parametrize("name", [name for name, arch in ARCHITECTURES.items()
                                  if getattr(draft_class(arch.tiny()), "architecture", None)])
def test_a_model_refuses_another_architectures_config(name: str) -> None:
    """A model class bound to one architecture refuses a config naming another, in one line."""
    cls = draft_class(ARCHITECTURES[name].tiny())
    other = next(arch for n, arch in ARCHITECTURES.items() if n != name).tiny()
    with pytest.raises(ConfigError, match=f"^architecture={other.architecture!r}: "
                                          f"{cls.__name__} builds architecture {name!r}$"):
        cls(other)
