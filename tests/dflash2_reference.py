"""Test helper: an independent DFlash2 reference, written from the public description.

DFlash2 (vLLM's ``DFlash2Qwen3ForCausalLM``, speculators' DFlash2 training path) is the DFlash
draft plus (1) around every attention and MLP sublayer, a causal convolution along the block
whose tap-t coefficient at slot p and channel c is ``base[t, c] + delta[p, t, c // group]``,
``delta`` projected from the sublayer's input at slot p (one projection gives both sides' taps),
and (2) a candidate selector scoring each of the top-k base-logit tokens c after the previous
token a as ``U(c) + sum_r P[a, r] (W h)[r] S[c, r]``, trained with a k-way cross-entropy to the
data token (put in the last candidate place when the top-k misses it), weighted like the
DFlash CE and added to it.

The reference runs the same backbone as a plain DFlash draft (its sublayers are checked against
transformers elsewhere) and applies the convolutions through forward hooks on the sublayers,
slot by slot and tap by tap; the selector, its candidates and the loss are written out here.
Nothing in it calls the trainer's block convolution, selector or loss code.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from sparkforge.trainer.architectures import build_draft
from sparkforge.trainer.draft.draft_batch import FixedAnchors

SUBLAYERS: Mapping[str, tuple[str, str]] = {
    "qwen3": ("self_attn", "mlp"), "gemma4": ("self_attn", "mlp"),
    "kimi_k3": ("self_attn", "mlp"), "deepseek_v4": ("attn", "ffn.shared_experts")}
"""Each backbone's attention and MLP sublayer (module paths inside a layer)."""


def conv_reference(x: torch.Tensor, base: torch.Tensor, delta: torch.Tensor,
                   block: int, group: int) -> torch.Tensor:
    """``out[.., p, c] = sum_{t <= p} (base[t, c] + delta[.., p, t, c // group]) x[.., p-t, c]``
    over blocks of ``block`` rows of ``x [B, Q, H]``; ``delta [B, Q, T, G]``, ``base [T, H]``."""
    b, q, h = x.shape
    taps = base.shape[0]
    xs = x.reshape(b, q // block, block, h)
    ds = delta.reshape(b, q // block, block, taps, -1).repeat_interleave(group, dim=-1)
    slots = []
    for p in range(block):
        acc = torch.zeros_like(xs[:, :, 0])
        for t in range(min(taps, p + 1)):
            acc = acc + (base[t] + ds[:, :, p, t]) * xs[:, :, p - t]
        slots.append(acc)
    return torch.stack(slots, dim=2).reshape(b, q, h)


class Reference:
    """The reference DFlash2 draft built from a DFlash2 draft's weights (copied: its gradients
    are its own)."""

    def __init__(self, model: Any) -> None:
        cfg = model.config
        self.cfg = cfg
        self.backbone = build_draft(dataclasses.replace(cfg, layout="dflash", conv_kernel_size=2,
                                                        conv_group_size=16, selector_rank=256,
                                                        selector_top_k=16))
        own = {k: v for k, v in model.state_dict().items()
               if "_conv." not in k and not k.startswith("candidate_selector.")}
        missing, unexpected = self.backbone.load_state_dict(own, strict=False)
        assert not unexpected
        assert all(k.startswith("rotary_emb") for k in missing), missing
        self.extra = {k: nn.Parameter(v.detach().clone()) for k, v in model.named_parameters()
                      if "_conv." in k or k.startswith("candidate_selector.")}
        self.hidden: list[torch.Tensor] = []
        self.backbone.norm.register_forward_hook(lambda m, a, out: self.hidden.append(out))
        attn, mlp = SUBLAYERS[cfg.architecture]
        for i, layer in enumerate(self.backbone.layers):
            for side, path in (("attention_conv", attn), ("mlp_conv", mlp)):
                self._wrap(layer.get_submodule(path), f"layers.{i}.{side}.")

    def _wrap(self, sublayer: nn.Module, prefix: str) -> None:
        base = self.extra[prefix + "base_kernel"]
        proj = self.extra[prefix + "kernel_projection.weight"]
        taps, block, group = base.shape[1], self.cfg.block_size, self.cfg.conv_group_size
        saved: dict[str, torch.Tensor] = {}

        def before(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            x = args[0]
            delta = (x @ proj.T).reshape(*x.shape[:2], 2, taps, -1)
            saved["out"] = delta[:, :, 1]
            return (conv_reference(x, base[0], delta[:, :, 0], block, group), *args[1:])

        def after(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
            return conv_reference(out, base[1], saved.pop("out"), block, group)

        sublayer.register_forward_pre_hook(before)
        sublayer.register_forward_hook(after)

    def parameters(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter by its name in the DFlash2 draft."""
        backbone = {k: p for k, p in self.backbone.named_parameters() if p.requires_grad}
        return backbone | self.extra

    def forward_loss(self, batch: Mapping[str, torch.Tensor], anchors: FixedAnchors,
                     gamma: float, selector_alpha: float) -> dict[str, torch.Tensor]:
        """Unary logits, candidate scores and the DFlash2 loss on ``anchors``."""
        self.hidden.clear()
        out = self.backbone(batch, anchors)
        b, a, k, v = out.draft_logits.shape
        hidden = self.hidden[-1].view(b, a, self.cfg.block_size, -1)[:, :, 1:]
        unary = out.draft_logits
        top = self.cfg.selector_top_k
        cand = unary.detach().topk(top, dim=-1).indices
        pred, succ = (self.extra[f"candidate_selector.{n}_codebook"]
                      for n in ("predecessor", "successor"))
        proj = self.extra["candidate_selector.hidden_projection.weight"]
        context = pred[out.prev_token_ids] * (hidden @ proj.T)          # [B, A, K, r]
        served = unary.gather(-1, cand) + (context[..., None, :] * succ[cand]).sum(-1)
        target = out.target_ids
        inside = (cand == target[..., None]).any(-1)
        train_cand = cand.clone()
        train_cand[..., -1] = torch.where(inside, cand[..., -1], target)
        train = unary.gather(-1, train_cand) + (context[..., None, :] * succ[train_cand]).sum(-1)
        label = (train_cand == target[..., None]).long().argmax(-1)
        weight = out.eval_mask.float() * torch.exp(-torch.arange(k).float() / gamma)
        ce = F.cross_entropy(unary.reshape(-1, v), target.flatten(), reduction="none")
        ce_sel = F.cross_entropy(train.reshape(-1, top), label.flatten(), reduction="none")
        total = (weight.flatten() * (ce + selector_alpha * ce_sel)).sum()
        loss = total / (weight.sum() + 1e-6)
        return {"unary": unary, "served": served, "cand": cand, "loss": loss}


def served_acceptance_reference(served: torch.Tensor, cand: torch.Tensor,
                                teacher: torch.Tensor) -> torch.Tensor:
    """``sum_c min(p(c), q(c))``, q the softmax of the candidates' scores, p the teacher's
    softmax, one row at a time."""
    out = torch.zeros(served.shape[:-1])
    for i in itertools.product(*(range(n) for n in served.shape[:-1])):
        q = torch.exp(served[i] - served[i].max())
        q = q / q.sum()
        p = torch.exp(teacher[i] - torch.logsumexp(teacher[i], 0))[cand[i]]
        out[i] = sum(min(float(pc), float(qc)) for pc, qc in zip(p, q, strict=True))
    return out

