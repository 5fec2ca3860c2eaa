"""The DSpark draft model: KV-injected non-causal Qwen3-style layers over a block of mask tokens.

Parameter names equal the checkpoint keys vLLM and SGLang load for a Qwen3-shaped DSpark draft, so
export is a plain ``state_dict`` save.

Shape legend of every trainer module: a name ending ``_BAK`` is a tensor of shape [B, A, K].
B batch, S context length, C = S-1 anchor candidates, A anchors, K draft positions per block
(the block size for DSpark, one less for DFlash: see ``anchors.BlockLayout``), Q block
queries, P key/value positions, H hidden, F captured target layers, X = F*H concatenated
features, N attention heads, G kv heads, D head_dim, V vocab, W supervised rows (the slots of
[B, A, K] with weight > 0, flattened), T tokens of one sequence; lowercase letters are counts:
r Markov rank, m verified draft tokens (``m1`` = m + 1).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from sparkforge.trainer.draft import passes
from sparkforge.trainer.draft.anchors import DSPARK_LAYOUT, BlockLayout
from sparkforge.trainer.draft.config import DSparkDraftConfig
from sparkforge.trainer.draft.layers import DSparkLayer, RMSNorm
from sparkforge.trainer.draft.passes import (
    AttnImpl,
    DraftContextCache,
    DSparkOutput,
    dspark_heads,
)
from sparkforge.trainer.draft.rope import RotaryEmbedding

__all__ = ["AttnImpl", "DSparkDraftModel", "DSparkOutput", "DraftContextCache"]


def hf_normal_init(module: nn.Module, std: float) -> None:
    """HF's default init of one module: Linear/Embedding weights normal(0, std), zero biases."""
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, std=std)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class DSparkDraftModel(nn.Module):
    """The DSpark draft.

    Args:
        config: The draft config.
        embed_weight: Target ``embed_tokens.weight`` [V, H]; copied and frozen.
        lm_head_weight: Target ``lm_head.weight`` [V, H]; copied and frozen (also the teacher).
        attn_implementation: "sdpa" (dense mask; CPU and reference) or "flex" (BlockMask).
        layout: Which block slots draft and which anchors train (DSpark's, or DFlash's).
        layer: Builds one draft layer from the config (default: the Qwen3-style layer).
    """

    def __init__(
        self,
        config: DSparkDraftConfig,
        *,
        embed_weight: torch.Tensor | None = None,
        lm_head_weight: torch.Tensor | None = None,
        attn_implementation: AttnImpl = "sdpa",
        layout: BlockLayout = DSPARK_LAYOUT,
        layer: Callable[[DSparkDraftConfig], nn.Module] = DSparkLayer,
    ) -> None:
        super().__init__()
        cfg = config
        self.config = cfg
        self.attn_implementation = attn_implementation
        self.layout = layout
        h, v = cfg.hidden_size, cfg.vocab_size
        self.embed_tokens = nn.Embedding(v, h)
        self.fc = nn.Linear(cfg.num_features * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, v, bias=False)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_parameters,
                                          cfg.max_position_embeddings)
        self.markov_head, self.confidence_head = dspark_heads(cfg)
        self.apply(self._init_weights)
        self.set_target_weights(embed_weight, lm_head_weight)

    def _init_weights(self, module: nn.Module) -> None:
        hf_normal_init(module, self.config.initializer_range)

    # ---- the shared DSpark passes (sparkforge.trainer.draft.passes) ----------------------
    num_draft_tokens = property(passes.num_draft_tokens)
    set_target_weights = passes.set_target_weights
    embed = passes.embed
    logits = passes.logits
    confidence = passes.confidence
    forward = passes.training_forward
    extend_context = passes.extend_context
    draft_block = passes.draft_block
    empty_cache = passes.empty_cache

    def project_context(self, target_hidden_BSX: torch.Tensor) -> torch.Tensor:
        """hidden_norm(fc(concat features)): [B, S, F*H] -> [B, S, H]."""
        out: torch.Tensor = self.hidden_norm(self.fc(target_hidden_BSX.to(self.fc.weight.dtype)))
        return out
