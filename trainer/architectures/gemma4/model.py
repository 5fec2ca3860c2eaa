"""The Gemma4-shaped DSpark draft: the layer stack vLLM's ``Gemma4DSparkForCausalLM`` serves.

Each layer is a Gemma sandwich (input_layernorm -> attention -> post_attention_layernorm -> +res
-> pre_feedforward_layernorm -> GeGLU MLP -> post_feedforward_layernorm -> +res) with
``attention_k_eq_v`` attention: no ``v_proj``, the values are the raw key projection under a
weightless ``v_norm``, q/k are RMS-normed per head, and the softmax scale is 1.0. Every norm
(those of the layers, the context ``hidden_norm`` and the final ``norm``) is Gemma's: weight
applied in fp32 before the cast back. The embedding is scaled by sqrt(H) (rounded to the model
dtype, as served) and the lm_head logits are softcapped as the target's are (both from the draft
config). Context injection, anchors, the Markov and confidence heads, the loss and the metrics
are the shared DSpark ones: only the layer differs from ``DSparkDraftModel``.

Shape suffixes follow the legend in ``sparkforge.trainer.draft.model``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sparkforge.trainer.architectures.config import DSparkDraftConfig
from sparkforge.trainer.draft.layers import MLP, DSparkAttention, GemmaRMSNorm, gelu_tanh
from sparkforge.trainer.draft.model import DSparkDraftModel


class Gemma4DSparkLayer(nn.Module):
    """One Gemma4 draft layer (full attention, ``attention_k_eq_v``, sandwich norms)."""

    def __init__(self, cfg: DSparkDraftConfig) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = DSparkAttention(cfg, k_eq_v=True, softmax_scale=1.0, norm=GemmaRMSNorm)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = MLP(h, cfg.intermediate_size, act=gelu_tanh)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def key_values(
        self, x_BPH: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention's keys and values [B, G, P, D] for context rows ``x``."""
        return self.self_attn.key_values(x_BPH, cos, sin)

    def forward(
        self,
        x: torch.Tensor,
        rope_q: tuple[torch.Tensor, torch.Tensor],
        ctx_kv: tuple[torch.Tensor, torch.Tensor],
        mask: Any,
    ) -> torch.Tensor:
        """One residual layer over the block stream."""
        attn = self.self_attn(self.input_layernorm(x), rope_q, ctx_kv, mask)
        x = x + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(x))
        out: torch.Tensor = x + self.post_feedforward_layernorm(mlp)
        return out


class Gemma4DSparkModel(DSparkDraftModel):
    """The DSpark draft with Gemma4 layers; same batch, outputs and inference API.

    Takes ``DSparkDraftModel``'s arguments (config, embed/lm_head weights, attention
    implementation) except ``layer``.
    """

    def __init__(self, config: DSparkDraftConfig, **kwargs: Any) -> None:
        super().__init__(config, layer=Gemma4DSparkLayer, **kwargs)
        self.hidden_norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
