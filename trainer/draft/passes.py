"""The DSpark passes every draft architecture shares: teacher-forced training and block drafting.

An architecture supplies its layer stack (a ``DraftStack``); the block of mask tokens, the
anchors, labels, teacher logits, Markov bias and confidence are the same for all, so they live
here once and each architecture's ``forward`` calls ``training_forward``.

Shape suffixes follow the legend in ``sparkforge.trainer.draft.model``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, cast

import torch
from torch import nn

from sparkforge.shared.errors import SparkforgeError
from sparkforge.shared.renamed import renamed_attribute
from sparkforge.trainer.draft.anchor_chunks import anchor_chunk_size, run_layers_by_anchor_chunks
from sparkforge.trainer.draft.anchors import (
    anchor_candidates,
    build_eval_mask,
    label_indices,
)
from sparkforge.trainer.draft.attention_mask import dense_allowed, flex_block_mask
from sparkforge.trainer.draft.block_layout import BlockLayout
from sparkforge.trainer.draft.config import SharedDraftConfig
from sparkforge.trainer.draft.draft_batch import (
    Blocks,
    DraftBatch,
    FixedAnchors,
    RowGeometry,
    place_blocks,
    row_geometry,
)
from sparkforge.trainer.draft.heads import ConfidenceHead, MarkovHead
from sparkforge.trainer.draft.rope import RotaryEmbedding
from sparkforge.trainer.draft.selector import CandidateSelector, candidate_scores

RopeTables = tuple[torch.Tensor, torch.Tensor]
AttnImpl = Literal["sdpa", "flex"]


@dataclass
class DraftOutput:
    """One training forward's outputs; ``[B, A, K]`` tensors are indexed (batch, block, slot)."""

    draft_logits: torch.Tensor
    """[B, A, K, V] base logits (softcapped) + Markov bias; draft position k predicts
    anchor+k+1."""
    target_ids: torch.Tensor
    """[B, A, K] data tokens at anchor+k+1 (clamped index, 0 for dummy blocks)."""
    eval_mask: torch.Tensor
    """[B, A, K] bool, supervised draft positions (prefix-contiguous for DSpark)."""
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
    candidate_ids: torch.Tensor | None = None
    """[B, A, K, C] the candidate selector's serving candidates: the top-C base logits of each
    draft position (None without the selector)."""
    candidate_scores: torch.Tensor | None = None
    """[B, A, K, C+1] the selector's scores of those candidates and, last, of the data token
    (``target_ids``), after the teacher-forced previous token (None without the selector)."""


@dataclass
class DraftContextCache:
    """Per-layer projected context keys/values [B, G, T, D] for positions 0..T-1 (inference)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def length(self) -> int:
        """Number of context positions held."""
        return int(self.keys[0].shape[2]) if self.keys else 0


class DraftLayer(Protocol):
    """One draft layer: attends block queries over ``[context ; block]``."""

    def __call__(self, x_BQH: torch.Tensor, rope_q: RopeTables, ctx_kv: RopeTables,
                 mask: Any) -> torch.Tensor:
        """The block stream after this layer."""

    def key_values(self, x_BPH: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values [B, G, P, D] of the rows of ``x``."""


class DraftStack(Protocol):
    """What an architecture's model provides to the shared passes (read-only)."""

    @property
    def config(self) -> SharedDraftConfig:
        """The draft config."""

    @property
    def layout(self) -> BlockLayout:
        """Which block slots draft and which anchors train (DSpark's, or DFlash's)."""

    @property
    def attn_implementation(self) -> AttnImpl:
        """"sdpa" (dense bool mask) or "flex" (BlockMask)."""

    @property
    def embed_tokens(self) -> nn.Embedding:
        """The frozen target embedding."""

    @property
    def lm_head(self) -> nn.Linear:
        """The frozen target output head (also the teacher)."""

    @property
    def rotary_emb(self) -> RotaryEmbedding:
        """cos/sin tables in the layers' layout."""

    @property
    def layers(self) -> nn.ModuleList:
        """``DraftLayer`` modules, in order."""

    @property
    def norm(self) -> nn.Module:
        """The norm before lm_head."""

    @property
    def markov_head(self) -> MarkovHead | None:
        """The Markov head (None for rank 0)."""

    @property
    def confidence_head(self) -> ConfidenceHead | None:
        """The confidence head (None when disabled)."""

    @property
    def candidate_selector(self) -> CandidateSelector | None:
        """The candidate selector head (None unless the layout has one)."""

    def project_context(self, target_hidden_BSX: torch.Tensor) -> torch.Tensor:
        """The draft's context rows [B, S, H] from the concatenated target features."""


def dspark_heads(cfg: SharedDraftConfig) -> tuple[MarkovHead | None, ConfidenceHead | None]:
    """The Markov head (None for rank 0) and the confidence head (None when disabled)."""
    h = cfg.hidden_size
    markov = MarkovHead(cfg.vocab_size, cfg.markov_rank, h, cfg.markov_head_type) \
        if cfg.markov_rank else None
    with_markov = cfg.confidence_head_with_markov and markov is not None
    conf = ConfidenceHead(h + (cfg.markov_rank if with_markov else 0)) \
        if cfg.enable_confidence_head else None
    return markov, conf


def selector_head(cfg: SharedDraftConfig, layout: BlockLayout) -> CandidateSelector | None:
    """The candidate selector of a layout that has one (DFlash2), else None."""
    if not layout.candidate_selector:
        return None
    return CandidateSelector(cfg.vocab_size, cfg.hidden_size, rank=cfg.selector_rank,
                             top_k=cfg.selector_top_k, init_std=cfg.initializer_range)


def num_draft_tokens(stack: DraftStack) -> int:
    """Draft tokens per block (K of the output shapes)."""
    return stack.layout.num_drafts(stack.config.block_size)


def empty_cache(stack: DraftStack) -> DraftContextCache:
    """A context cache holding no positions."""
    return DraftContextCache(keys=[], values=[])


def _layers(stack: DraftStack) -> list[DraftLayer]:
    return [cast(DraftLayer, layer) for layer in stack.layers]


@torch.no_grad()
def set_target_weights(stack: DraftStack, embed_weight: torch.Tensor | None,
                       lm_head_weight: torch.Tensor | None) -> None:
    """Copy the target's embedding and head (shapes must match) and freeze both."""
    for module, weight, name in ((stack.embed_tokens, embed_weight, "embed_tokens"),
                                 (stack.lm_head, lm_head_weight, "lm_head")):
        if weight is not None:
            if weight.shape != module.weight.shape:
                raise SparkforgeError(f"{name}.weight: expected shape "
                                 f"{tuple(module.weight.shape)}, got {tuple(weight.shape)}")
            module.weight.copy_(weight)
        module.weight.requires_grad_(False)


def embed(stack: DraftStack, ids: torch.Tensor) -> torch.Tensor:
    """Frozen embedding times the target's embedding scale (Gemma: sqrt(H)), the scale rounded
    to the embedding's dtype first as transformers and vLLM do (in bf16 sqrt(H) is off by up to
    a quarter percent)."""
    table = stack.embed_tokens(ids)
    out: torch.Tensor = table * torch.tensor(stack.config.embedding_scale, dtype=table.dtype,
                                             device=table.device)
    return out.to(stack.lm_head.weight.dtype)


def logits(stack: DraftStack, hidden: torch.Tensor) -> torch.Tensor:
    """Frozen lm_head, then the target's final logit softcap if it has one."""
    out: torch.Tensor = stack.lm_head(hidden)
    cap = stack.config.final_logit_softcapping
    return torch.tanh(out / cap) * cap if cap else out


def confidence(stack: DraftStack, hidden: torch.Tensor,
               prev_ids: torch.Tensor) -> torch.Tensor | None:
    """Confidence logits (fp32) for slots with hidden ``[..., H]`` and previous tokens."""
    if stack.confidence_head is None:
        return None
    feats = None
    if stack.markov_head is not None and stack.config.confidence_head_with_markov:
        feats = stack.markov_head.markov_w1(prev_ids)
    out: torch.Tensor = stack.confidence_head(hidden, feats)
    return out


def run_layers(
    stack: DraftStack, x: torch.Tensor, pos_BQ: torch.Tensor, ctx_BSH: torch.Tensor | None,
    pos_BS: torch.Tensor | None, cache: DraftContextCache | None, mask: Any,
) -> torch.Tensor:
    """The block stream through every layer (context K/V from ``ctx`` or ``cache``), normed."""
    rope_q = stack.rotary_emb(pos_BQ, x.dtype)
    rope_c = stack.rotary_emb(pos_BS, x.dtype) if pos_BS is not None else None
    for i, layer in enumerate(_layers(stack)):
        if cache is not None:
            ctx_kv = (cache.keys[i], cache.values[i])
        else:
            assert ctx_BSH is not None
            assert rope_c is not None
            ctx_kv = layer.key_values(ctx_BSH, *rope_c)
        x = layer(x, rope_q, ctx_kv, mask)
    out: torch.Tensor = stack.norm(x)
    return out


def block_hidden(stack: DraftStack, target_hidden_states: torch.Tensor, rows: RowGeometry,
                 blocks: Blocks) -> torch.Tensor:
    """[B, A, K', H] normed hidden states of every block's draft slots over its context."""
    cfg, k, layout = stack.config, stack.config.block_size, stack.layout
    anchors, keep, starts_BA = blocks.anchors, blocks.keep, blocks.starts_BA
    (batch, num_a), seq_len = anchors.shape, rows.positions_BS.shape[1]
    dev = blocks.anchor_ids_BA.device
    block_ids = torch.full((batch, num_a, k), cfg.mask_token_id,
                           dtype=blocks.anchor_ids_BA.dtype, device=dev)
    block_ids[..., 0] = torch.where(keep, blocks.anchor_ids_BA, block_ids[..., 0])
    x_BQH = embed(stack, block_ids.view(batch, -1))
    pos_BS = rows.positions_BS
    pos_BQ = (torch.gather(pos_BS, 1, anchors)[..., None] + torch.arange(k, device=dev)).view(
        batch, -1)
    ctx_BSH = stack.project_context(target_hidden_states)
    chunk = anchor_chunk_size(num_a, k, seq_len)
    if stack.attn_implementation == "flex":
        h_BQH = run_layers(stack, x_BQH, pos_BQ, ctx_BSH, pos_BS, None,
                           flex_block_mask(anchors, keep, seq_len, k, starts_BA))
    elif chunk is None:
        h_BQH = run_layers(stack, x_BQH, pos_BQ, ctx_BSH, pos_BS, None,
                           dense_allowed(anchors, keep, seq_len, k, starts_BA))
    else:  # a long row: never the whole [A*K, S+A*K] grid at once
        h_BQH = run_layers_by_anchor_chunks(stack, x_BQH, pos_BQ, ctx_BSH, pos_BS, anchors, keep,
                                            starts_BA, chunk=chunk)
    return h_BQH.view(batch, num_a, k, -1)[:, :, layout.first_draft_slot:]


@torch.no_grad()
def teacher_logits(stack: DraftStack, target_last_hidden_states: torch.Tensor,
                   anchors: torch.Tensor, safe_BAK: torch.Tensor) -> torch.Tensor:
    """[B, A, K', V] detached teacher logits: the target's hidden state before each label,
    never before the anchor's own document."""
    batch, num_a, num_drafts = safe_BAK.shape
    t_idx = torch.maximum(safe_BAK - 1, anchors[..., None]).flatten(1)
    t_hid = torch.gather(target_last_hidden_states, 1, t_idx[..., None].expand(
        -1, -1, target_last_hidden_states.shape[-1]))
    return logits(stack, t_hid.to(stack.lm_head.weight.dtype)).view(batch, num_a, num_drafts, -1)


@dataclass(frozen=True)
class BlockLabels:
    """What each block's draft slots are trained towards, and the tokens they follow."""

    target_ids: torch.Tensor
    """[B, A, K] data tokens at anchor+k+1 (clamped index, 0 for dummy blocks)."""
    prev_ids: torch.Tensor
    """[B, A, K] teacher-forced previous tokens (anchor, then the true tokens)."""
    teacher_logits: torch.Tensor | None
    """[B, A, K, V] detached teacher logits (None without last hidden states)."""


def block_labels(stack: DraftStack, batch: DraftBatch, blocks: Blocks) -> BlockLabels:
    """The labels, previous tokens and teacher logits of every block's draft slots."""
    anchors, seq_len = blocks.anchors, batch.input_ids.shape[1]
    _, safe_BAK = label_indices(anchors, blocks.keep, num_draft_tokens(stack), seq_len,
                                blocks.ends_BA)
    target_ids = torch.gather(batch.input_ids, 1, safe_BAK.flatten(1)).view_as(safe_BAK)
    last = batch.target_last_hidden_states
    return BlockLabels(
        target_ids=target_ids,
        prev_ids=torch.cat([blocks.anchor_ids_BA[..., None], target_ids[..., :-1]], dim=-1),
        teacher_logits=None if last is None else teacher_logits(stack, last, anchors, safe_BAK))


def draft_logits(stack: DraftStack, h_BAKH: torch.Tensor, labels: BlockLabels,
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """[B, A, K, V] base logits + Markov bias of the draft slots, and the candidate selector's
    candidates and scores (None without the selector)."""
    out = logits(stack, h_BAKH)
    if stack.markov_head is not None:
        out = out + stack.markov_head(labels.prev_ids, h_BAKH)
    if stack.candidate_selector is None:
        return out, None, None
    cand, scores = candidate_scores(stack.candidate_selector, out, h_BAKH, labels.prev_ids,
                                    labels.target_ids)
    return out, cand, scores


def training_forward(stack: DraftStack, batch: DraftBatch | Mapping[str, torch.Tensor],
                     anchors: FixedAnchors | None = None,
                     generator: torch.Generator | None = None) -> DraftOutput:
    """Teacher-forced training forward (every architecture's ``forward``).

    Args:
        stack: The draft.
        batch: The batch's tensors, or a collated batch holding them (``DraftBatch.of``).
        anchors: Fixed anchors; sampled (``num_anchors`` per row) if None.
        generator: RNG for anchor sampling (default: the global torch RNG).
    """
    batch, layout, cfg = DraftBatch.of(batch), stack.layout, stack.config
    rows = row_geometry(batch)
    candidates_BC = anchor_candidates(rows.loss_mask, layout, block_size=cfg.block_size,
                                      ends_BS=rows.ends_BS)
    blocks = place_blocks(batch.input_ids, rows, candidates_BC, cfg.num_anchors, anchors,
                          generator)
    h_BAKH = block_hidden(stack, batch.target_hidden_states, rows, blocks)
    labels = block_labels(stack, batch, blocks)
    out_logits, cand, scores = draft_logits(stack, h_BAKH, labels)
    return DraftOutput(
        draft_logits=out_logits, target_ids=labels.target_ids,
        eval_mask=build_eval_mask(rows.loss_mask, blocks.anchors, blocks.keep,
                                  num_draft_tokens(stack), prefix=layout.prefix_mask,
                                  ends_BA=blocks.ends_BA),
        block_keep_mask=blocks.keep, anchor_positions=blocks.anchors,
        prev_token_ids=labels.prev_ids,
        confidence_logits=confidence(stack, h_BAKH, labels.prev_ids),
        target_logits=labels.teacher_logits, num_valid_anchors=candidates_BC.sum(dim=1),
        seq_len=batch.input_ids.shape[1], candidate_ids=cand, candidate_scores=scores)


@torch.no_grad()
def extend_context(stack: DraftStack, cache: DraftContextCache,
                   target_hidden_BTX: torch.Tensor) -> DraftContextCache:
    """Append projected context K/V for the next T positions (cache.length ... +T-1)."""
    start, t = cache.length, target_hidden_BTX.shape[1]
    ctx = stack.project_context(target_hidden_BTX)
    pos = torch.arange(start, start + t, device=ctx.device).expand(ctx.shape[0], t)
    rope = stack.rotary_emb(pos, ctx.dtype)
    keys, values = [], []
    for i, layer in enumerate(_layers(stack)):
        k_new, v_new = layer.key_values(ctx, *rope)
        keys.append(torch.cat([cache.keys[i], k_new], 2) if cache.keys else k_new)
        values.append(torch.cat([cache.values[i], v_new], 2) if cache.values else v_new)
    return DraftContextCache(keys=keys, values=values)


@torch.no_grad()
def draft_block(stack: DraftStack, anchor_ids_B: torch.Tensor,
                cache: DraftContextCache) -> tuple[torch.Tensor, torch.Tensor]:
    """One block ``[anchor, MASK x (block_size-1)]`` at positions ``cache.length + k``.

    The block's own K/V are never stored, which is the "crop back to start" of the doc.

    Returns:
        hidden [B, K, H] (post-norm) and base logits [B, K, V] (softcapped, no Markov bias)
        of the K draft positions (the DFlash anchor slot is left out).
    """
    k, batch = stack.config.block_size, anchor_ids_B.shape[0]
    ids = torch.full((batch, k), stack.config.mask_token_id, dtype=anchor_ids_B.dtype,
                     device=anchor_ids_B.device)
    ids[:, 0] = anchor_ids_B
    x = embed(stack, ids)
    pos = torch.arange(cache.length, cache.length + k, device=ids.device).expand(batch, k)
    hidden = run_layers(stack, x, pos, None, None, cache, None)[:, stack.layout.first_draft_slot:]
    return hidden, logits(stack, hidden)


RENAMED = {"DSparkOutput": "DraftOutput"}
"""Old names this module still serves, each as its new name (``renamed_attribute``)."""


def __getattr__(name: str) -> Any:
    """An old name of ``RENAMED``, with a FutureWarning naming its replacement."""
    return renamed_attribute(__name__, name, RENAMED)
