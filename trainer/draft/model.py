"""The DSpark draft model: KV-injected non-causal Qwen3-style layers over a block of mask tokens.

Parameter names equal the checkpoint keys vLLM and SGLang load for a Qwen3-shaped DSpark draft, so
export is a plain ``state_dict`` save.

Shape legend of every trainer module: a name ending ``_BAK`` is a tensor of shape [B, A, K].
B batch, S context length, C = S-1 anchor candidates, A anchors, K draft positions per block
(the block size for DSpark, one less for DFlash: see ``block_layout.BlockLayout``), Q block
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
from sparkforge.trainer.draft.block_layout import BLOCK_LAYOUTS
from sparkforge.trainer.draft.config import DraftConfig
from sparkforge.trainer.draft.heads import ConfidenceHead, MarkovHead
from sparkforge.trainer.draft.layers import DSparkLayer, RMSNorm
from sparkforge.trainer.draft.passes import (
    AttnImpl,
    DraftContextCache,
    DSparkOutput,
    dspark_heads,
)
from sparkforge.trainer.draft.rope import RotaryEmbedding

__all__ = ["AttnImpl", "DSparkDraftModel", "DSparkOutput", "DraftContextCache", "DraftModel"]


def hf_normal_init(module: nn.Module, std: float) -> None:
    """HF's default init of one module: Linear/Embedding weights normal(0, std), zero biases."""
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, std=std)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class DraftModel(nn.Module):
    """What every architecture's draft is: the shared DSpark passes over its own modules.

    A subclass registers the modules ``passes.DraftStack`` names (``embed_tokens``, ``layers``,
    ``norm``, ``lm_head``, ``rotary_emb``, ``markov_head``, ``confidence_head``) and defines
    ``project_context``; the training forward, block drafting and the head readouts are the
    shared ones of ``sparkforge.trainer.draft.passes``.

    Args:
        config: The draft config.
        attn_implementation: "sdpa" (dense mask; CPU and reference) or "flex" (BlockMask).

    The block layout (which slots draft, which anchors train) is the config's ``layout``.
    """

    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Linear
    rotary_emb: RotaryEmbedding
    markov_head: MarkovHead | None
    confidence_head: ConfidenceHead | None

    def __init__(self, config: DraftConfig, *, attn_implementation: AttnImpl = "sdpa") -> None:
        super().__init__()
        self.config = config
        self.attn_implementation = attn_implementation
        self.layout = BLOCK_LAYOUTS[config.layout]

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

    def register_stack(self, layer: Callable[..., nn.Module], rotary_emb: RotaryEmbedding, *,
                       context: tuple[str, str] = ("fc", "hidden_norm"),
                       final_norm: str = "norm") -> None:
        """Register the modules every draft has, under the architecture's names.

        The order is fixed: embed_tokens, the context projection and its norm (``context``),
        the layers, the final norm, lm_head, rotary_emb, then the heads. Seeded initialisation
        depends on that order.
        """
        cfg = self.config
        h, v = cfg.hidden_size, cfg.vocab_size
        self.embed_tokens = nn.Embedding(v, h)
        self.context_names = context
        setattr(self, context[0], nn.Linear(cfg.num_features * h, h, bias=False))
        setattr(self, context[1], RMSNorm(h, cfg.rms_norm_eps))
        self.layers = nn.ModuleList(layer(cfg) for _ in range(cfg.num_hidden_layers))
        setattr(self, final_norm, RMSNorm(h, cfg.rms_norm_eps))
        self.lm_head = nn.Linear(h, v, bias=False)
        self.rotary_emb = rotary_emb
        self.markov_head, self.confidence_head = dspark_heads(cfg)

    def project_context(self, target_hidden_BSX: torch.Tensor) -> torch.Tensor:
        """norm(projection(concat features)): [B, S, F*H] -> [B, S, H] (``context`` modules)."""
        proj, norm = (self.get_submodule(name) for name in self.context_names)
        out: torch.Tensor = norm(proj(target_hidden_BSX.to(proj.get_parameter("weight").dtype)))
        return out


class DSparkDraftModel(DraftModel):
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
        config: DraftConfig,
        *,
        embed_weight: torch.Tensor | None = None,
        lm_head_weight: torch.Tensor | None = None,
        attn_implementation: AttnImpl = "sdpa",
        layer: Callable[..., nn.Module] = DSparkLayer,
    ) -> None:
        super().__init__(config, attn_implementation=attn_implementation)
        self.register_stack(layer, RotaryEmbedding(config.head_dim, config.rope_parameters,
                                                   config.max_position_embeddings))
        self.apply(self._init_weights)
        self.set_target_weights(embed_weight, lm_head_weight)

    def _init_weights(self, module: nn.Module) -> None:
        hf_normal_init(module, self.config.initializer_range)
