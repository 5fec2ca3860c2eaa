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

import functools
from collections.abc import Callable
from typing import Any, ClassVar, cast

import torch
from torch import nn

from sparkforge.shared.errors import ConfigError
from sparkforge.shared.renamed import renamed_attribute
from sparkforge.trainer.draft import passes
from sparkforge.trainer.draft.block_conv import BlockConv
from sparkforge.trainer.draft.block_layout import BLOCK_LAYOUTS
from sparkforge.trainer.draft.config import SharedDraftConfig
from sparkforge.trainer.draft.heads import ConfidenceHead, MarkovHead
from sparkforge.trainer.draft.layers import DraftDecoderLayer, RMSNorm
from sparkforge.trainer.draft.passes import (
    AttnImpl,
    DraftContextCache,
    DraftOutput,
    dspark_heads,
    selector_head,
)
from sparkforge.trainer.draft.rope import RotaryEmbedding
from sparkforge.trainer.draft.selector import CandidateSelector

__all__ = ["AttnImpl", "DraftContextCache", "DraftModel", "DraftOutput"]


def hf_normal_init(module: nn.Module, std: float) -> None:
    """HF's default init of one module: Linear/Embedding weights normal(0, std), zero biases."""
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, std=std)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class DraftModel(nn.Module):
    """What every architecture's draft is: the shared DSpark passes over its own modules.

    The constructor registers the modules ``passes.DraftStack`` names in a fixed order:
    ``embed_tokens``, the context projection and its norm (``context_names``), ``layers``, the
    final norm, ``lm_head``, ``rotary_emb``, then the Markov and confidence heads and the
    candidate selector; seeded initialisation depends on that order. The class attributes'
    defaults build the Qwen3-shaped draft (``architectures/qwen3/model.py::Qwen3DraftModel``
    changes none); another architecture's subclass states only what differs. The training
    forward, block drafting and the head readouts are the shared ones of
    ``sparkforge.trainer.draft.passes``.

    Args:
        config: The draft config.
        embed_weight: Target ``embed_tokens.weight`` [V, H]; copied and frozen.
        lm_head_weight: Target ``lm_head.weight`` [V, H]; copied and frozen (also the teacher).
        attn_implementation: "sdpa" (dense mask; CPU and reference) or "flex" (BlockMask).

    The block layout (which slots draft, which anchors train) is the config's ``layout``.

    Raises:
        ConfigError: the config names another architecture than ``architecture``.
    """

    layer_factory: ClassVar[Callable[..., nn.Module]] = DraftDecoderLayer
    """Builds one draft layer from the config (the pre-norm Qwen3-style ``DraftDecoderLayer``
    unless an architecture configures another)."""
    architecture: ClassVar[str | None] = None
    """The config ``architecture`` this model builds (None: any)."""
    context_names: ClassVar[tuple[str, str]] = ("fc", "hidden_norm")
    """Names of the context projection and of its norm."""
    final_norm_name: ClassVar[str] = "norm"
    """Name of the norm before lm_head (read through ``norm`` whatever its name)."""
    norm_class: ClassVar[type[RMSNorm]] = RMSNorm
    """Class of the context norm and the final norm."""
    interleaved_rope: ClassVar[bool] = False
    """RoPE tables for adjacent channel pairs instead of two halves."""
    hf_init: ClassVar[bool] = True
    """HF's normal init (``hf_normal_init``); False keeps PyTorch's default init."""

    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    lm_head: nn.Linear
    rotary_emb: RotaryEmbedding
    markov_head: MarkovHead | None
    confidence_head: ConfidenceHead | None
    candidate_selector: CandidateSelector | None

    def __init__(
        self,
        config: SharedDraftConfig,
        *,
        embed_weight: torch.Tensor | None = None,
        lm_head_weight: torch.Tensor | None = None,
        attn_implementation: AttnImpl = "sdpa",
    ) -> None:
        super().__init__()
        got = getattr(config, "architecture", None)
        if self.architecture is not None and got != self.architecture:
            raise ConfigError(f"architecture={got!r}: {type(self).__name__} builds "
                              f"architecture {self.architecture!r}")
        self.config = config
        self.attn_implementation = attn_implementation
        self.layout = BLOCK_LAYOUTS[config.layout]
        h, v, eps = config.hidden_size, config.vocab_size, config.rms_norm_eps
        self.embed_tokens = nn.Embedding(v, h)
        setattr(self, self.context_names[0], nn.Linear(config.num_features * h, h, bias=False))
        setattr(self, self.context_names[1], self.norm_class(h, eps))
        make_layer = type(self).layer_factory
        self.layers = nn.ModuleList(make_layer(config) for _ in range(config.num_hidden_layers))
        setattr(self, self.final_norm_name, self.norm_class(h, eps))
        self.lm_head = nn.Linear(h, v, bias=False)
        self.rotary_emb = RotaryEmbedding(
            self.rope_dim(config), config.rope_parameters,
            config.max_position_embeddings, interleaved=self.interleaved_rope)
        self.markov_head, self.confidence_head = dspark_heads(config)
        self.candidate_selector = selector_head(config, self.layout)
        if self.hf_init:
            self.apply(functools.partial(hf_normal_init, std=config.initializer_range))
        for module in self.modules():
            if isinstance(module, BlockConv):  # a fresh block convolution is the identity
                module.reset_parameters()
        self.set_target_weights(embed_weight, lm_head_weight)

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

    @classmethod
    def rope_dim(cls, config: SharedDraftConfig) -> int:
        """The width RoPE rotates: the whole head here; an architecture rotating part of it
        overrides this."""
        return config.head_dim

    @property
    def norm(self) -> nn.Module:
        """The norm before lm_head (registered as ``final_norm_name``)."""
        return cast(nn.Module, self._modules[self.final_norm_name])

    def project_context(self, target_hidden_BSX: torch.Tensor) -> torch.Tensor:
        """norm(projection(concat features)): [B, S, F*H] -> [B, S, H] (``context`` modules)."""
        proj, norm = (self.get_submodule(name) for name in self.context_names)
        out: torch.Tensor = norm(proj(target_hidden_BSX.to(proj.get_parameter("weight").dtype)))
        return out


RENAMED = {"DSparkOutput": "DraftOutput", "DSparkDraftModel": "DraftModel"}
"""Old names this module still serves, each as its new name (``renamed_attribute``)."""


def __getattr__(name: str) -> Any:
    """An old name of ``RENAMED``, with a FutureWarning naming its replacement."""
    return renamed_attribute(__name__, name, RENAMED)
