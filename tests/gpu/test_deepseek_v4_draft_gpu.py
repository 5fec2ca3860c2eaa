"""GPU: the deepseek_v4 draft's compiled flex path (sink through the log-sum-exp) against the
dense path in values and gradients, and bf16 training steps."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from sparkforge.trainer.architectures import build_draft
from sparkforge.trainer.draft_config import draft_tiny_deepseek_v4
from sparkforge.trainer.loss import compute_dspark_loss
from sparkforge.trainer.run_config import LossSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _batch(vocab: int, features: int, hidden: int) -> dict[str, torch.Tensor]:
    b, s = 2, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    return {
        "input_ids": torch.randint(0, vocab, (b, s), device="cuda", generator=g),
        "loss_mask": torch.ones(b, s, device="cuda"),
        "target_hidden_states": torch.randn(b, s, features * hidden, device="cuda", generator=g),
        "target_last_hidden_states": torch.randn(b, s, hidden, device="cuda", generator=g),
    }


def test_v4_flex_and_dense_agree_with_gradients() -> None:
    """Same anchors: logits, loss and the main_proj / sink gradients match between the paths."""
    cfg = dataclasses.replace(draft_tiny_deepseek_v4(), num_anchors=16)
    torch.manual_seed(0)
    dense = build_draft(cfg).cuda()
    with torch.no_grad():
        for layer in dense.layers:
            layer.attn.attn_sink.normal_(0.0, 1.0)   # a sink that matters
    flex = build_draft(cfg, attn_implementation="flex").cuda()
    flex.load_state_dict(dense.state_dict())
    batch = _batch(cfg.vocab_size, cfg.num_features, cfg.hidden_size)
    a = dense(**batch)
    f = flex(**batch, anchor_positions=a.anchor_positions, block_keep_mask=a.block_keep_mask)
    torch.testing.assert_close(f.draft_logits, a.draft_logits, rtol=1e-3, atol=1e-4)
    la, lf = compute_dspark_loss(a, LossSpec()).loss, compute_dspark_loss(f, LossSpec()).loss
    la.backward()
    lf.backward()
    torch.testing.assert_close(lf, la, rtol=1e-4, atol=1e-5)
    for name in ("main_proj.weight", "layers.0.attn.attn_sink", "layers.0.attn.wkv.weight"):
        torch.testing.assert_close(flex.get_parameter(name).grad,
                                   dense.get_parameter(name).grad, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "flex"])
def test_v4_bf16_training_steps(attn: str) -> None:
    """bf16 autocast steps on a fixed batch: finite losses that fall; inv_freq stays fp32."""
    cfg = dataclasses.replace(draft_tiny_deepseek_v4(), num_anchors=16)
    torch.manual_seed(0)
    model = build_draft(cfg, attn_implementation=attn).cuda()
    batch = _batch(cfg.vocab_size, cfg.num_features, cfg.hidden_size)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        first = model(**batch)
    anchors = {"anchor_positions": first.anchor_positions,
               "block_keep_mask": first.block_keep_mask}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-3)
    losses = []
    for _ in range(15):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compute_dspark_loss(model(**batch, **anchors), LossSpec()).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.8 * losses[0]
    model.to(torch.bfloat16)
    assert model.rotary_emb.inv_freq.dtype == torch.float32
    out = model(**{k: v.to(torch.bfloat16) if "hidden" in k else v for k, v in batch.items()},
                **anchors)
    assert torch.isfinite(out.draft_logits.float()).all()
