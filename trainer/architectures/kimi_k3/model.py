"""The Kimi-K3 draft, of every layout: dense pre-norm layers with the MLA attention of vLLM's K3
draft.

Attention is DeepSeek-style multi-head latent attention with a query bottleneck: queries
``q_a_proj -> q_a_layernorm -> q_b_proj`` give each head ``qk_nope_head_dim`` plain and
``qk_rope_head_dim`` rotated channels; keys and values come from one latent per row,
``kv_a_proj_with_mqa`` = [``kv_lora_rank`` latent ; ``qk_rope_head_dim`` key rope part], the
latent normed by ``kv_a_layernorm`` and expanded per head by ``kv_b_proj`` into nope keys and
values, the rope part rotated once and shared by every head. RoPE rotates adjacent channel
pairs; the softmax scale is ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``. The MLP is a
SwiGLU. Context rows enter each layer through the same ``kv_a_proj_with_mqa`` (vLLM projects
them for all layers in one fused matmul), as in every draft.

Parameter names are the checkpoint keys vLLM's ``K3DSparkForCausalLM`` loads: ``context_proj``
and ``context_norm`` project the concatenated target features, ``final_norm`` precedes the
shared lm_head, ``layers.{i}.self_attn.*`` / ``layers.{i}.mlp.*`` as above. Shape suffixes
follow the legend in ``sparkforge.trainer.draft.model``; R is ``qk_rope_head_dim``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from sparkforge.shared.renamed import renamed_attribute
from sparkforge.trainer.architectures.config import DraftConfig
from sparkforge.trainer.architectures.kimi_k3.config import k3_options
from sparkforge.trainer.draft.config import SharedDraftConfig
from sparkforge.trainer.draft.layers import DraftDecoderLayer, RMSNorm, attend_after_context
from sparkforge.trainer.draft.model import DraftModel
from sparkforge.trainer.draft.passes import RopeTables
from sparkforge.trainer.draft.rope import apply_interleaved_rotary


class K3LatentAttention(nn.Module):
    """Block queries over ``[context ; block]`` keys/values expanded from one latent per row."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        opts = k3_options(cfg)
        h, n = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads, self.nope, self.rope = n, opts.qk_nope_head_dim, opts.qk_rope_head_dim
        self.kv_lora_rank, self.v_head_dim = opts.kv_lora_rank, opts.v_head_dim
        self.q_a_proj = nn.Linear(h, opts.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(opts.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(opts.q_lora_rank, n * (self.nope + self.rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, opts.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(opts.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(opts.kv_lora_rank, n * (self.nope + opts.v_head_dim),
                                   bias=False)
        self.o_proj = nn.Linear(n * opts.v_head_dim, h, bias=False)
        self.scale = (self.nope + self.rope) ** -0.5

    def key_values(self, x_BPH: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [B, N, P, nope+R] (rotated rope part shared by the heads), values [B, N, P, v]."""
        b, p, _ = x_BPH.shape
        latent_BPC, k_rope_BPR = self.kv_a_proj_with_mqa(x_BPH).split(
            [self.kv_lora_rank, self.rope], dim=-1)
        kv_BNPX = self.kv_b_proj(self.kv_a_layernorm(latent_BPC)).view(
            b, p, self.num_heads, -1).transpose(1, 2)
        k_nope, v = kv_BNPX.split([self.nope, self.v_head_dim], dim=-1)
        k_rope_B1PR = apply_interleaved_rotary(k_rope_BPR[:, None], cos, sin)
        k = torch.cat([k_nope, k_rope_B1PR.expand(-1, self.num_heads, -1, -1)], dim=-1)
        return k, v

    def forward(self, x_BQH: torch.Tensor, rope_q: RopeTables, ctx_kv: RopeTables,
                mask: object) -> torch.Tensor:
        """Attend block queries over ``[ctx ; block]`` under ``mask`` (None = all visible)."""
        b, nq, _ = x_BQH.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BQH)))
        q = apply_interleaved_rotary(q.view(b, nq, self.num_heads, -1).transpose(1, 2), *rope_q)
        k_blk, v_blk = self.key_values(x_BQH, *rope_q)
        return attend_after_context(q, k_blk, v_blk, ctx_kv, mask, self.scale, self.o_proj)


KimiK3DraftLayer = functools.partial(DraftDecoderLayer, attention=K3LatentAttention)
"""One K3 draft layer: Qwen3's pre-norm block and SwiGLU around the latent attention."""


class KimiK3DraftModel(DraftModel):
    """The Kimi-K3 draft (HF normal init; embed/lm_head from the target).

    Takes ``DraftModel``'s arguments; the config names ``architecture="kimi_k3"``. Its old name
    is ``K3DSparkModel``; the exported ``config.json`` still names vLLM's ``K3DSparkModel``.
    """

    layer_factory = KimiK3DraftLayer
    architecture = "kimi_k3"
    context_names = ("context_proj", "context_norm")
    final_norm_name = "final_norm"
    interleaved_rope = True

    @classmethod
    def rope_dim(cls, config: SharedDraftConfig) -> int:
        """The key's rope part, ``qk_rope_head_dim`` channels shared by every head."""
        return k3_options(config).qk_rope_head_dim


RENAMED = {"K3DSparkModel": "KimiK3DraftModel", "K3DSparkLayer": "KimiK3DraftLayer"}
"""Old names this module still serves, each as its new name (``renamed_attribute``)."""


def __getattr__(name: str) -> Any:
    """An old name of ``RENAMED``, with a FutureWarning naming its replacement."""
    return renamed_attribute(__name__, name, RENAMED)
