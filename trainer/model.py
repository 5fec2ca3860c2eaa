"""The DSpark draft model: KV-injected non-causal Qwen3-style layers over a block of mask tokens.

Parameter names equal the checkpoint keys vLLM and SGLang load for a Qwen3-shaped DSpark draft, so
export is a plain ``state_dict`` save.

Shape legend of every trainer module: a name ending ``_BAK`` is a tensor of shape [B, A, K].
B batch, S context length, C = S-1 anchor candidates, A anchors, K block size, Q = A*K block
queries, P key/value positions, H hidden, F captured target layers, X = F*H concatenated
features, N attention heads, G kv heads, D head_dim, V vocab, W supervised rows (the slots of
[B, A, K] with weight > 0, flattened), T tokens of one sequence; lowercase letters are counts:
r Markov rank, m verified draft tokens (``m1`` = m + 1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, cast

import torch
from torch import nn

from sparkforge.trainer.anchors import (
    anchor_candidates,
    build_eval_mask,
    label_indices,
    sample_anchors,
)
from sparkforge.trainer.attention_mask import dense_allowed, flex_block_mask
from sparkforge.trainer.draft_config import DSparkDraftConfig
from sparkforge.trainer.heads import ConfidenceHead, MarkovHead
from sparkforge.trainer.layers import DSparkAttention, DSparkLayer, RMSNorm
from sparkforge.trainer.rope import RotaryEmbedding

AttnImpl = Literal["sdpa", "flex"]


class DraftLayer(Protocol):
    """One draft layer: its attention projects context K/V, the layer runs the block stream."""

    self_attn: DSparkAttention

    def __call__(self, x: torch.Tensor, rope_q: tuple[torch.Tensor, torch.Tensor],
                 ctx_kv: tuple[torch.Tensor, torch.Tensor], mask: Any) -> torch.Tensor:
        """The block stream after this layer."""
        ...


@dataclass
class DSparkOutput:
    """One training forward's outputs; ``[B, A, K]`` tensors are indexed (batch, block, slot)."""

    draft_logits: torch.Tensor
    """[B, A, K, V] base logits (softcapped) + Markov bias; slot k predicts anchor+k+1."""
    target_ids: torch.Tensor
    """[B, A, K] data tokens at anchor+k+1 (clamped index, 0 for dummy blocks)."""
    eval_mask: torch.Tensor
    """[B, A, K] bool, prefix-contiguous supervised slots."""
    block_keep_mask: torch.Tensor
    """[B, A] bool, False for dummy anchors."""
    anchor_positions: torch.Tensor
    """[B, A] int64, sorted; 0 for dummy anchors."""
    prev_token_ids: torch.Tensor
    """[B, A, K] teacher-forced previous tokens (anchor, then the true tokens)."""
    confidence_logits: torch.Tensor | None
    """[B, A, K] fp32 logits of the confidence head (None without the head)."""
    target_logits: torch.Tensor | None
    """[B, A, K, V] detached teacher logits at anchor+k (None without last hidden states)."""
    num_valid_anchors: torch.Tensor
    """[B] number of valid anchor candidates per row (sampler statistics)."""
    seq_len: int
    """S, so sampler ratios can count the S-1 candidates per row."""


@dataclass
class DraftContextCache:
    """Per-layer projected context keys/values [B, G, T, D] for positions 0..T-1 (inference)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def length(self) -> int:
        """Number of context positions held."""
        return int(self.keys[0].shape[2]) if self.keys else 0


class DSparkDraftModel(nn.Module):
    """The DSpark draft.

    Args:
        config: The draft config.
        embed_weight: Target ``embed_tokens.weight`` [V, H]; copied and frozen.
        lm_head_weight: Target ``lm_head.weight`` [V, H]; copied and frozen (also the teacher).
        attn_implementation: "sdpa" (dense mask; CPU and reference) or "flex" (BlockMask).
        layer: Builds one draft layer from the config (default: the Qwen3-style layer).
    """

    def __init__(
        self,
        config: DSparkDraftConfig,
        *,
        embed_weight: torch.Tensor | None = None,
        lm_head_weight: torch.Tensor | None = None,
        attn_implementation: AttnImpl = "sdpa",
        layer: Callable[[DSparkDraftConfig], nn.Module] = DSparkLayer,
    ) -> None:
        super().__init__()
        cfg = config
        self.config = cfg
        self.attn_implementation = attn_implementation
        h, v = cfg.hidden_size, cfg.vocab_size
        self.embed_tokens = nn.Embedding(v, h)
        self.fc = nn.Linear(cfg.num_features * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, v, bias=False)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_parameters,
                                          cfg.max_position_embeddings)
        self.markov_head = (
            MarkovHead(v, cfg.markov_rank, h, cfg.markov_head_type) if cfg.markov_rank else None
        )
        with_markov = cfg.confidence_head_with_markov and self.markov_head is not None
        self.confidence_head = (
            ConfidenceHead(h + (cfg.markov_rank if with_markov else 0))
            if cfg.enable_confidence_head else None
        )
        self.apply(self._init_weights)
        self.set_target_weights(embed_weight, lm_head_weight)

    def _init_weights(self, module: nn.Module) -> None:
        # HF default init for Qwen3-style drafts: normal(0, initializer_range), zero biases.
        std = self.config.initializer_range
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @torch.no_grad()
    def set_target_weights(
        self, embed_weight: torch.Tensor | None, lm_head_weight: torch.Tensor | None
    ) -> None:
        """Copy the target's embedding and head (shapes must match) and freeze both."""
        for module, weight, name in ((self.embed_tokens, embed_weight, "embed_tokens"),
                                     (self.lm_head, lm_head_weight, "lm_head")):
            if weight is not None:
                if weight.shape != module.weight.shape:
                    raise ValueError(f"{name}.weight: expected shape "
                                     f"{tuple(module.weight.shape)}, got {tuple(weight.shape)}")
                module.weight.copy_(weight)
            module.weight.requires_grad_(False)

    # ---- shared pieces -------------------------------------------------------------------
    def decoder_layers(self) -> list[DraftLayer]:
        """The draft layers, typed."""
        return [cast(DraftLayer, layer) for layer in self.layers]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Frozen embedding times the target's embedding scale (Gemma: sqrt(H))."""
        out: torch.Tensor = self.embed_tokens(ids) * self.config.embedding_scale
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Frozen lm_head, then the target's final logit softcap if it has one."""
        out = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        return torch.tanh(out / cap) * cap if cap else out

    def project_context(self, target_hidden_BSX: torch.Tensor) -> torch.Tensor:
        """hidden_norm(fc(concat features)): [B, S, F*H] -> [B, S, H]."""
        out: torch.Tensor = self.hidden_norm(self.fc(target_hidden_BSX.to(self.fc.weight.dtype)))
        return out

    def _run_layers(
        self, x: torch.Tensor, pos_BQ: torch.Tensor, ctx_BSH: torch.Tensor | None,
        pos_BS: torch.Tensor | None, cache: DraftContextCache | None, mask: Any,
    ) -> torch.Tensor:
        rope_q = self.rotary_emb(pos_BQ, x.dtype)
        rope_c = self.rotary_emb(pos_BS, x.dtype) if pos_BS is not None else None
        for i, layer in enumerate(self.decoder_layers()):
            if cache is not None:
                ctx_kv = (cache.keys[i], cache.values[i])
            else:
                assert ctx_BSH is not None
                assert rope_c is not None
                ctx_kv = layer.self_attn.key_values(ctx_BSH, *rope_c)
            x = layer(x, rope_q, ctx_kv, mask)
        out: torch.Tensor = self.norm(x)
        return out

    def markov_features(self, prev_ids: torch.Tensor) -> torch.Tensor | None:
        """W1[prev] for the confidence head, or None when it does not read Markov features."""
        cfg = self.config
        if self.markov_head is None or not cfg.confidence_head_with_markov:
            return None
        feats: torch.Tensor = self.markov_head.markov_w1(prev_ids)
        return feats

    def confidence(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor | None:
        """Confidence logits (fp32) for slots with hidden ``[..., H]`` and previous tokens."""
        if self.confidence_head is None:
            return None
        logits: torch.Tensor = self.confidence_head(hidden, self.markov_features(prev_ids))
        return logits

    # ---- training ------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        target_hidden_states: torch.Tensor,
        target_last_hidden_states: torch.Tensor | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        anchor_positions: torch.Tensor | None = None,
        block_keep_mask: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> DSparkOutput:
        """Teacher-forced training forward.

        Args:
            input_ids: [B, S] int, unshifted.
            loss_mask: [B, S] 0/1, aligned with input_ids.
            target_hidden_states: [B, S, F*H] features concatenated in id order.
            target_last_hidden_states: [B, S, H] post-final-norm target states; needed for
                the L1 term, the confidence label and the acceptance metrics.
            attention_mask: [B, S] 1 on real tokens, 0 on right padding. Padding is removed
                from the loss mask, so no anchor and no label lies in it, and context is
                strictly before the anchor, so padding is never visible.
            anchor_positions: [B, A] fixed anchors (with block_keep_mask); sampled if None.
            block_keep_mask: [B, A] bool, required with anchor_positions.
            generator: RNG for anchor sampling (default: the global torch RNG).
        """
        cfg, k = self.config, self.config.block_size
        if attention_mask is not None:
            loss_mask = loss_mask * attention_mask.to(loss_mask.dtype)
        batch, seq_len = input_ids.shape
        if anchor_positions is None:
            anchor_positions, block_keep_mask = sample_anchors(
                loss_mask, cfg.num_anchors, generator=generator)
        assert block_keep_mask is not None, "block_keep_mask is required with anchor_positions"
        anchors, keep = anchor_positions, block_keep_mask
        num_a = anchors.shape[1]
        dev = input_ids.device

        anchor_tok_BA = torch.gather(input_ids, 1, anchors)
        block_ids = torch.full((batch, num_a, k), cfg.mask_token_id, dtype=input_ids.dtype,
                               device=dev)
        block_ids[..., 0] = torch.where(keep, anchor_tok_BA, block_ids[..., 0])
        x_BQH = self.embed(block_ids.view(batch, -1)).to(self.fc.weight.dtype)
        pos_BQ = (anchors[..., None] + torch.arange(k, device=dev)).view(batch, -1)
        pos_BS = torch.arange(seq_len, device=dev).expand(batch, seq_len)
        ctx_BSH = self.project_context(target_hidden_states)
        if self.attn_implementation == "flex":
            mask: Any = flex_block_mask(anchors, keep, seq_len, k)
        else:
            mask = dense_allowed(anchors, keep, seq_len, k)
        h_BAKH = self._run_layers(x_BQH, pos_BQ, ctx_BSH, pos_BS, None, mask).view(
            batch, num_a, k, -1)

        _, safe_BAK = label_indices(anchors, keep, k, seq_len)
        target_ids = torch.gather(input_ids, 1, safe_BAK.flatten(1)).view_as(safe_BAK)
        target_logits = None
        if target_last_hidden_states is not None:
            with torch.no_grad():
                t_idx = (safe_BAK - 1).clamp(min=0).flatten(1)
                t_hid = torch.gather(target_last_hidden_states, 1, t_idx[..., None].expand(
                    -1, -1, target_last_hidden_states.shape[-1]))
                target_logits = self.logits(t_hid.to(self.lm_head.weight.dtype)).view(
                    batch, num_a, k, -1)
        prev_BAK = torch.cat([anchor_tok_BA[..., None], target_ids[..., :-1]], dim=-1)
        draft_logits = self.logits(h_BAKH)
        if self.markov_head is not None:
            draft_logits = draft_logits + self.markov_head(prev_BAK, h_BAKH)
        return DSparkOutput(
            draft_logits=draft_logits,
            target_ids=target_ids,
            eval_mask=build_eval_mask(loss_mask, anchors, keep, k),
            block_keep_mask=keep,
            anchor_positions=anchors,
            prev_token_ids=prev_BAK,
            confidence_logits=self.confidence(h_BAKH, prev_BAK),
            target_logits=target_logits,
            num_valid_anchors=anchor_candidates(loss_mask).sum(dim=1),
            seq_len=seq_len,
        )

    # ---- inference -----------------------------------------------------------------------
    def empty_cache(self) -> DraftContextCache:
        """A context cache holding no positions."""
        return DraftContextCache(keys=[], values=[])

    @torch.no_grad()
    def extend_context(
        self, cache: DraftContextCache, target_hidden_BTX: torch.Tensor
    ) -> DraftContextCache:
        """Append projected context K/V for the next T positions (cache.length ... +T-1)."""
        start, t = cache.length, target_hidden_BTX.shape[1]
        ctx = self.project_context(target_hidden_BTX)
        pos = torch.arange(start, start + t, device=ctx.device).expand(ctx.shape[0], t)
        rope = self.rotary_emb(pos, ctx.dtype)
        keys, values = [], []
        for i, layer in enumerate(self.decoder_layers()):
            k_new, v_new = layer.self_attn.key_values(ctx, *rope)
            keys.append(torch.cat([cache.keys[i], k_new], 2) if cache.keys else k_new)
            values.append(torch.cat([cache.values[i], v_new], 2) if cache.values else v_new)
        return DraftContextCache(keys=keys, values=values)

    @torch.no_grad()
    def draft_block(
        self, anchor_ids_B: torch.Tensor, cache: DraftContextCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One block ``[anchor, MASK x (K-1)]`` at positions ``cache.length + k``.

        The block's own K/V are never stored, which is the "crop back to start" of the doc.

        Returns:
            hidden [B, K, H] (post-norm) and base logits [B, K, V] (softcapped, no Markov bias).
        """
        k, batch = self.config.block_size, anchor_ids_B.shape[0]
        ids = torch.full((batch, k), self.config.mask_token_id, dtype=anchor_ids_B.dtype,
                         device=anchor_ids_B.device)
        ids[:, 0] = anchor_ids_B
        x = self.embed(ids).to(self.fc.weight.dtype)
        pos = torch.arange(cache.length, cache.length + k, device=ids.device).expand(batch, k)
        hidden = self._run_layers(x, pos, None, None, cache, None)
        return hidden, self.logits(hidden)
