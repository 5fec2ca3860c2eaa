"""The run's draft and loss settings, and how they become a draft config and a cache contract."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sparkforge.manifests.contract import (
    RunContract,
    default_target_layer_ids,
    expected_semantics,
)
from sparkforge.shared.target_families import FeatureSemantics, FinalSemantics
from sparkforge.trainer.draft_config import DSparkDraftConfig, MarkovHeadType, from_target_config


@dataclass(frozen=True, kw_only=True)
class DraftSpec:
    """The draft to train. Target-facing fields are checked against the cache before training.

    Defaults are the draft config's own (the paper recipe), so the two cannot drift apart.
    """

    mask_token_id: int
    """Unused in-vocabulary id for the masked block slots (Qwen3: 151669); the same id serves."""
    hidden_size: int
    """The target's hidden size (checked against the cache)."""
    vocab_size: int
    """The target's vocabulary size (checked against the cache)."""
    num_target_layers: int
    """The target's num_hidden_layers (checked against the cache)."""
    target_layer_ids: tuple[int, ...] | None = None
    """0-based DSpark feature ids (id l = HF hidden_states[l+1]); the cache must hold exactly
    these. None: the DFlash spacing rule for the draft depth."""
    num_hidden_layers: int = DSparkDraftConfig.num_hidden_layers
    """Draft depth."""
    block_size: int = DSparkDraftConfig.block_size
    """K: tokens drafted per pass."""
    num_anchors: int = DSparkDraftConfig.num_anchors
    """A: blocks sampled per sequence per step."""
    markov_rank: int = DSparkDraftConfig.markov_rank
    """r: rank of the Markov bigram bias; 0 disables the head."""
    markov_head_type: MarkovHeadType = DSparkDraftConfig.markov_head_type
    """vanilla (the only type serving engines build), gated or rnn."""
    enable_confidence_head: bool = DSparkDraftConfig.enable_confidence_head
    """Train the per-slot acceptance predictor (needs loss.confidence_head_alpha > 0)."""
    confidence_head_with_markov: bool = DSparkDraftConfig.confidence_head_with_markov
    """Confidence features [h ; W1[prev]] (needs markov_rank > 0); h alone when false."""
    target_model_type: str | None = None
    """Expected target model_type (checked against the cache when set)."""
    target_features: FeatureSemantics | None = None
    """What a feature is (``residual`` or ``hc_mean``); None: the target family's."""
    target_final: FinalSemantics | None = None
    """What the final state is (``post_norm`` or ``lm_head_input``); None: the target family's."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Other DSparkDraftConfig fields to change (e.g. {"intermediate_size": 2048})."""

    def layer_ids(self) -> tuple[int, ...]:
        """The configured ids, or the default rule's."""
        if self.target_layer_ids is not None:
            return tuple(self.target_layer_ids)
        return default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)

    def contract(self, *, max_seq_len: int, need_eval_split: bool) -> RunContract:
        """What this draft needs from a cache."""
        features, final_hidden = expected_semantics(
            self.target_model_type, self.target_features, self.target_final)
        return RunContract(
            target_layer_ids=self.layer_ids(), hidden_size=self.hidden_size,
            vocab_size=self.vocab_size, num_target_layers=self.num_target_layers,
            mask_token_id=self.mask_token_id, max_seq_len=max_seq_len,
            target_model_type=self.target_model_type, features=features,
            final_hidden=final_hidden, need_eval_split=need_eval_split,
        )

    def draft_config(self, target_config: Mapping[str, Any]) -> DSparkDraftConfig:
        """The full draft config: backbone sizes from the target's HF config, the rest from here."""
        from transformers import AutoConfig

        data = dict(target_config)
        hf = AutoConfig.for_model(data.pop("model_type"), **data)
        return from_target_config(
            hf, mask_token_id=self.mask_token_id, target_layer_ids=self.layer_ids(),
            num_hidden_layers=self.num_hidden_layers, block_size=self.block_size,
            num_anchors=self.num_anchors, markov_rank=self.markov_rank,
            markov_head_type=self.markov_head_type,
            enable_confidence_head=self.enable_confidence_head,
            confidence_head_with_markov=self.confidence_head_with_markov, **self.overrides,
        )


@dataclass(frozen=True, kw_only=True)
class LossSpec:
    """Weights of the three loss terms (dspark-algorithm.md section 8)."""

    ce_loss_alpha: float = 0.1
    """Weight of the cross-entropy to the data tokens."""
    l1_loss_alpha: float = 0.9
    """Weight of the full L1 distance to the teacher distribution."""
    confidence_head_alpha: float = 1.0
    """Must be > 0 exactly when the draft has a confidence head."""
    loss_decay_gamma: float | None = 4.0
    """Per-slot weight exp(-k/gamma); None disables the decay."""
    l1_chunk_rows: int = 128
    """Rows per chunk of the full-vocabulary L1 term (bounds its fp32 temporaries)."""

    def __post_init__(self) -> None:
        problems = [f"model.loss.{name}={value} must be >= 0" for name, value in (
            ("ce_loss_alpha", self.ce_loss_alpha), ("l1_loss_alpha", self.l1_loss_alpha),
            ("confidence_head_alpha", self.confidence_head_alpha)) if value < 0]
        if self.l1_chunk_rows < 1:
            problems.append(f"model.loss.l1_chunk_rows={self.l1_chunk_rows} must be >= 1")
        if problems:
            raise ValueError("invalid loss config:\n  " + "\n  ".join(problems))
