"""GPU: compiled flex attention and dense SDPA agree in values and gradients for every draft
architecture (CPU flex has no backward in torch 2.13, so the gradient check needs CUDA), and the
deepseek_v4 draft trains in bf16 on both paths."""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch
from draft_helpers import fixed_anchor_steps, recipe_loss

from sparkforge.trainer.architectures import ARCHITECTURES, build_draft
from sparkforge.trainer.architectures.config import DraftConfig
from sparkforge.trainer.architectures.deepseek_v4.tiny import draft_tiny_deepseek_v4
from sparkforge.trainer.draft.draft_batch import FixedAnchors
from sparkforge.trainer.loss import compute_dspark_loss
from sparkforge.trainer.run_config import LossSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _batch(cfg: DraftConfig, b: int = 2, s: int = 64) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.randint(0, cfg.vocab_size, (b, s), device="cuda"),
        "loss_mask": torch.ones(b, s, device="cuda"),
        "target_hidden_states": torch.randn(b, s, cfg.num_features * cfg.hidden_size,
                                            device="cuda"),
        "target_last_hidden_states": torch.randn(b, s, cfg.hidden_size, device="cuda"),
    }


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_flex_and_sdpa_agree_with_gradients(architecture: str) -> None:
    """Same anchors: logits, each architecture's recipe loss and every trainable gradient match
    between the two paths (deepseek_v4's flex path applies its sink through the log-sum-exp;
    kimi_k3's values are narrower than its queries and keys)."""
    cfg = dataclasses.replace(ARCHITECTURES[architecture].tiny(), num_anchors=16)
    spec = recipe_loss(cfg)
    torch.manual_seed(0)
    sdpa = build_draft(cfg).cuda()
    flex = build_draft(cfg, attn_implementation="flex").cuda()
    flex.load_state_dict(sdpa.state_dict())
    batch = _batch(cfg)
    a = sdpa(batch)
    f = flex(batch, FixedAnchors(a.anchor_positions, a.block_keep_mask))
    torch.testing.assert_close(f.draft_logits, a.draft_logits, rtol=1e-3, atol=1e-4)
    la, lf = compute_dspark_loss(a, spec).loss, compute_dspark_loss(f, spec).loss
    la.backward()
    lf.backward()
    torch.testing.assert_close(lf, la, rtol=1e-4, atol=1e-5)
    for name, p in sdpa.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(flex.get_parameter(name).grad, p.grad, rtol=1e-3,
                                       atol=1e-5, msg=name)


@pytest.mark.parametrize("attn", ["sdpa", "flex"])
def test_v4_bf16_training_steps(attn: str) -> None:
    """bf16 autocast steps on a fixed batch: finite losses that fall; inv_freq stays fp32."""
    cfg = dataclasses.replace(draft_tiny_deepseek_v4(), num_anchors=16)
    torch.manual_seed(0)
    model = build_draft(cfg, attn_implementation=attn).cuda()
    batch = _batch(cfg)
    losses, anchors = fixed_anchor_steps(
        model, batch, LossSpec(), 15,
        autocast=functools.partial(torch.autocast, "cuda", dtype=torch.bfloat16))
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.8 * losses[0]
    model.to(torch.bfloat16)
    assert model.rotary_emb.inv_freq.dtype == torch.float32
    out = model({k: v.to(torch.bfloat16) if "hidden" in k else v for k, v in batch.items()},
                anchors)
    assert torch.isfinite(out.draft_logits.float()).all()
