"""The DeepSeek-V4 draft, of every layout: dense pre-norm layers whose attention follows the V4
target.

Attention: Q-LoRA queries (``wq_a -> q_norm -> wq_b``, then a weightless RMS norm per head), one
key/value latent shared by every head (``wkv -> kv_norm``, keys = values), interleaved RoPE on
the trailing ``qk_rope_head_dim`` channels, a learned per-head sink logit in the softmax, the
inverse rotation on the output's rope channels, and the grouped low-rank output projection
(``wo_a`` per head group, then ``wo_b``). The FFN is one dense SwiGLU as wide as the target's
experts, with V4's clamp. There are no hyper-connections, experts, compressed attention or
sliding window.

Parameter names are those of vLLM's built-in V4 DSpark stages (``mtp.{i}.*`` of the target
checkpoint, without the prefix): ``main_proj``/``main_norm`` project the context,
``layers.{i}.{attn_norm, attn.*, ffn_norm, ffn.shared_experts.w1/w2/w3}``, and ``norm``,
``markov_head``, ``confidence_head`` at the top. Shape suffixes follow the legend in
``sparkforge.trainer.draft.model``; R is ``qk_rope_head_dim``, O the group count.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from sparkforge.shared.renamed import renamed_attribute
from sparkforge.trainer.architectures.config import DraftConfig
from sparkforge.trainer.architectures.deepseek_v4.config import v4_options
from sparkforge.trainer.draft.block_conv import around, block_convs
from sparkforge.trainer.draft.config import SharedDraftConfig
from sparkforge.trainer.draft.layers import RMSNorm, compiled_flex
from sparkforge.trainer.draft.model import DraftModel
from sparkforge.trainer.draft.passes import RopeTables
from sparkforge.trainer.draft.rope import apply_interleaved_rotary


def attend_with_sink(q_BNQD: torch.Tensor, kv_B1PD: torch.Tensor, sink_N: torch.Tensor,
                     mask: Any, scale: float) -> torch.Tensor:
    """Attention whose softmax also holds a per-head sink logit with no value ([B, N, Q, D]).

    ``mask``: a dense bool ``[B, 1, Q, P]`` (True = may attend), None (all visible) or a flex
    ``BlockMask``. Under flex the sink is applied afterwards: with the log-sum-exp ``l`` of the
    visible scores, softmax over ``[scores ; sink]`` is the plain output times
    ``sigmoid(l - sink)``.
    """
    from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

    if isinstance(mask, BlockMask):
        fn = compiled_flex() if q_BNQD.is_cuda else flex_attention
        out, aux = fn(q_BNQD, kv_B1PD, kv_B1PD, block_mask=mask, scale=scale, enable_gqa=True,
                      return_aux=AuxRequest(lse=True))
        keep_BNQ = torch.sigmoid(aux.lse.float() - sink_N.float()[:, None])
        sunk: torch.Tensor = (out.float() * keep_BNQ[..., None]).to(q_BNQD.dtype)
        return sunk
    scores = torch.matmul(q_BNQD, kv_B1PD.transpose(-1, -2)).float() * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sink_N.float()[:, None, None].expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(kv_B1PD.dtype), kv_B1PD)


class DeepseekV4DraftAttention(nn.Module):
    """Block queries over ``[context ; block]`` keys of one shared K=V latent (V4 attention)."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        opts = v4_options(cfg)
        h, n, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.num_heads, self.head_dim, self.o_groups = n, d, opts.o_groups
        self.eps = cfg.rms_norm_eps
        self.wq_a = nn.Linear(h, opts.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(opts.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = nn.Linear(opts.q_lora_rank, n * d, bias=False)
        self.wkv = nn.Linear(h, d, bias=False)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.wo_a = nn.Linear(n * d // opts.o_groups, opts.o_groups * opts.o_lora_rank,
                              bias=False)
        self.wo_b = nn.Linear(opts.o_groups * opts.o_lora_rank, h, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(n))

    def key_values(self, x_BPH: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotated latent [B, 1, P, D] of the rows of ``x``, as both keys and values."""
        kv = apply_interleaved_rotary(self.kv_norm(self.wkv(x_BPH))[:, None], cos, sin)
        return kv, kv

    def forward(self, x_BQH: torch.Tensor, rope_q: RopeTables, ctx_kv: RopeTables,
                mask: Any) -> torch.Tensor:
        """Attend block queries over ``[ctx ; block]`` under ``mask`` (None = all visible)."""
        b, nq, _ = x_BQH.shape
        q = self.wq_b(self.q_norm(self.wq_a(x_BQH))).view(b, nq, self.num_heads, self.head_dim)
        q32 = q.float()
        q = (q32 * torch.rsqrt(q32.pow(2).mean(-1, keepdim=True) + self.eps)).to(q.dtype)
        q = apply_interleaved_rotary(q.transpose(1, 2), *rope_q)
        kv_blk, _ = self.key_values(x_BQH, *rope_q)
        kv = torch.cat([ctx_kv[0].to(kv_blk.dtype), kv_blk], dim=2)
        out = attend_with_sink(q, kv, self.attn_sink, mask, self.head_dim ** -0.5)
        # Values carry the keys' rotation (K = V): rotate back by the query's position.
        cos, sin = rope_q
        out = apply_interleaved_rotary(out, cos, -sin).transpose(1, 2)
        groups_BQOI = out.reshape(b, nq, self.o_groups, -1)
        wo_a_OLI = self.wo_a.weight.view(self.o_groups, -1, groups_BQOI.shape[-1])
        low_BQOL = torch.einsum("bqoi,oli->bqol", groups_BQOI, wo_a_OLI)
        res: torch.Tensor = self.wo_b(low_BQOL.flatten(2))
        return res


class ClampedSwiGLU(nn.Module):
    """V4's expert FFN: ``w2(silu(min(w1 x, c)) * clamp(w3 x, -c, c))``, c = ``swiglu_limit``."""

    def __init__(self, hidden: int, inter: int, limit: float | None) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The FFN output for rows ``x [..., H]``."""
        gate, up = self.w1(x), self.w3(x)
        if self.limit is not None:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        out: torch.Tensor = self.w2(F.silu(gate) * up)
        return out


class DeepseekV4DraftLayer(nn.Module):
    """Pre-norm block: attn_norm -> attention -> +res -> ffn_norm -> dense SwiGLU -> +res."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = DeepseekV4DraftAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # A V4 stage's dense part is its shared expert; the draft has no routed experts.
        self.ffn = nn.ModuleDict({"shared_experts": ClampedSwiGLU(
            cfg.hidden_size, cfg.intermediate_size, v4_options(cfg).swiglu_limit)})
        self.attention_conv, self.mlp_conv = block_convs(cfg)  # DFlash2 layouts only

    def key_values(self, x_BPH: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention's keys and values for context rows ``x``."""
        return self.attn.key_values(x_BPH, cos, sin)

    def forward(self, x: torch.Tensor, rope_q: RopeTables, ctx_kv: RopeTables,
                mask: Any) -> torch.Tensor:
        """One residual layer over the block stream."""
        x = x + around(self.attention_conv, lambda h: self.attn(h, rope_q, ctx_kv, mask),
                       self.attn_norm(x))
        out: torch.Tensor = x + around(self.mlp_conv, self.ffn["shared_experts"],
                                       self.ffn_norm(x))
        return out


class DeepseekV4DraftModel(DraftModel):
    """The DeepSeek-V4 draft (PyTorch default init; embed/lm_head from the target).

    Takes ``DraftModel``'s arguments; the config names ``architecture="deepseek_v4"``. Under
    "sdpa" the softmax with the sink runs eagerly over the dense mask; under "flex" the sink is
    applied through the log-sum-exp.
    """

    layer_factory = DeepseekV4DraftLayer
    architecture = "deepseek_v4"
    context_names = ("main_proj", "main_norm")
    interleaved_rope = True
    hf_init = False

    @classmethod
    def rope_dim(cls, config: SharedDraftConfig) -> int:
        """The trailing ``qk_rope_head_dim`` channels of each head."""
        return v4_options(config).qk_rope_head_dim


RENAMED = {"DeepseekV4DSparkModel": "DeepseekV4DraftModel",
           "DeepseekV4DSparkAttention": "DeepseekV4DraftAttention",
           "DeepseekV4DSparkLayer": "DeepseekV4DraftLayer"}
"""Old names this module still serves, each as its new name (``renamed_attribute``)."""


def __getattr__(name: str) -> Any:
    """An old name of ``RENAMED``, with a FutureWarning naming its replacement."""
    return renamed_attribute(__name__, name, RENAMED)
