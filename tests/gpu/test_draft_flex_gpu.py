"""GPU: compiled flex attention and dense SDPA agree in values and gradients (CPU flex has no
backward in torch 2.13, so the gradient check needs CUDA)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sparkforge.trainer.draft_config import draft_tiny
from sparkforge.trainer.loss import compute_dspark_loss
from sparkforge.trainer.model import DSparkDraftModel
from sparkforge.trainer.run_config import LossSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_flex_and_sdpa_agree_with_gradients() -> None:
    """Same anchors: logits, loss and fc gradient match between the two attention paths."""
    cfg = dataclasses.replace(draft_tiny(), num_anchors=16)
    torch.manual_seed(0)
    sdpa = DSparkDraftModel(cfg).cuda()
    flex = DSparkDraftModel(cfg, attn_implementation="flex").cuda()
    flex.load_state_dict(sdpa.state_dict())
    b, s = 2, 64
    batch = {
        "input_ids": torch.randint(0, cfg.vocab_size, (b, s), device="cuda"),
        "loss_mask": torch.ones(b, s, device="cuda"),
        "target_hidden_states": torch.randn(b, s, 3 * cfg.hidden_size, device="cuda"),
        "target_last_hidden_states": torch.randn(b, s, cfg.hidden_size, device="cuda"),
    }
    a = sdpa(**batch)
    f = flex(**batch, anchor_positions=a.anchor_positions, block_keep_mask=a.block_keep_mask)
    torch.testing.assert_close(f.draft_logits, a.draft_logits, rtol=1e-3, atol=1e-4)
    la, lf = compute_dspark_loss(a, LossSpec()).loss, compute_dspark_loss(f, LossSpec()).loss
    la.backward()
    lf.backward()
    torch.testing.assert_close(lf, la, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(flex.fc.weight.grad, sdpa.fc.weight.grad, rtol=1e-3, atol=1e-5)
