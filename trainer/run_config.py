"""The run's draft and loss settings, and how they become a draft config and a cache contract.

Torch-free: ``sparkforge validate --against`` builds the training contract with ``DraftSpec``
(read from the YAML by ``sparkforge.trainer.train_yaml``) without loading the trainer's heavy
dependencies, through the same code ``sparkforge train`` checks its cache with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from sparkforge.manifests.contract import RunContract
from sparkforge.shared.errors import SparkforgeError
from sparkforge.shared.layer_ids import default_feature_ids
from sparkforge.shared.target_config import TargetConfig
from sparkforge.shared.target_families import (
    FeatureSemantics,
    FinalSemantics,
    TargetScaling,
    family_of,
)
from sparkforge.trainer.architectures.config import (
    DraftConfig,
    LegacyArchitecture,
    fold_flat_options,
    from_target_config,
)
from sparkforge.trainer.architectures.config_rules import Architecture
from sparkforge.trainer.architectures.options import options_dict
from sparkforge.trainer.draft.block_layout import NO_HEADS, Layout
from sparkforge.trainer.draft.config import MarkovHeadType

RecipeName = Literal["dspark", "dflash", "dflash2"]
"""A recipe's name (``RECIPES``); each recipe's loss objective has the recipe's name
(``LossSpec.objective``)."""


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """A training recipe: the draft fields and the loss objective it stands for."""

    objective: RecipeName
    """The loss objective (``LossSpec.objective``)."""
    draft_defaults: Mapping[str, Any]
    """DraftSpec fields a run leaves unset (None) take these values."""
    fixed: frozenset[str] = frozenset()
    """Fields of ``draft_defaults`` the recipe needs: a run setting another value is refused."""


RECIPES: dict[RecipeName, Recipe] = {
    # The paper's DSpark draft: Markov head and confidence head (the draft config's defaults,
    # so the two cannot drift apart); any draft architecture.
    "dspark": Recipe(objective="dspark", draft_defaults={
        "architecture": DraftConfig.architecture, "layout": DraftConfig.layout,
        "markov_rank": DraftConfig.markov_rank,
        "enable_confidence_head": DraftConfig.enable_confidence_head,
        "confidence_head_with_markov": DraftConfig.confidence_head_with_markov}),
    # DFlash: the DFlash block layout, no Markov or confidence head, on the architecture the
    # run names (qwen3 by default: served as a DFlash draft).
    "dflash": Recipe(objective="dflash", draft_defaults={
        "architecture": DraftConfig.architecture, "layout": "dflash", **NO_HEADS},
        fixed=frozenset({"layout", *NO_HEADS})),
    # DFlash2: DFlash's block with the block convolutions and the candidate selector head.
    "dflash2": Recipe(objective="dflash2", draft_defaults={
        "architecture": DraftConfig.architecture, "layout": "dflash2", **NO_HEADS},
        fixed=frozenset({"layout", *NO_HEADS})),
}


@dataclass(frozen=True, kw_only=True)
class DraftSpec:
    """The draft to train. Target-facing fields are checked against the cache before training.

    Defaults are the draft config's own (the paper recipe), so the two cannot drift apart;
    fields left None take the run's recipe's values (``RECIPES``).
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
    num_hidden_layers: int = DraftConfig.num_hidden_layers
    """Draft depth."""
    block_size: int = DraftConfig.block_size
    """K: tokens drafted per pass."""
    num_anchors: int = DraftConfig.num_anchors
    """A: blocks sampled per sequence per step."""
    architecture: Architecture | LegacyArchitecture | None = None
    """The draft's backbone: ``qwen3`` (every engine loads it, any target), ``deepseek_v4`` (a
    DeepSeek-V4 target's attention; export refused for now), ``gemma4`` / ``kimi_k3`` (the
    drafts vLLM's Gemma4 / Kimi-K3 DSpark classes load); None: qwen3. The old ``dflash`` reads
    as qwen3 with layout dflash (deprecated, dropped in 0.3.0)."""
    layout: Layout | None = None
    """The block layout: ``dspark``, ``dflash`` or ``dflash2`` (``DraftConfig.layout``);
    None: the recipe's (the dflash and dflash2 recipes need their own)."""
    markov_rank: int | None = None
    """r: rank of the Markov bigram bias; 0 disables the head. None: the recipe's (dspark 256,
    dflash 0)."""
    markov_head_type: MarkovHeadType = DraftConfig.markov_head_type
    """vanilla (the only type serving engines build), gated or rnn."""
    enable_confidence_head: bool | None = None
    """Train the per-slot acceptance predictor (needs loss.confidence_head_alpha > 0). None:
    the recipe's (dspark true, dflash false)."""
    confidence_head_with_markov: bool | None = None
    """Confidence features [h ; W1[prev]] (needs markov_rank > 0); h alone when false. None:
    the recipe's."""
    target_model_type: str | None = None
    """Expected target model_type (checked against the cache when set)."""
    target_features: FeatureSemantics | None = None
    """What a feature is (``residual`` or ``hc_mean``); None: the target family's."""
    target_final: FinalSemantics | None = None
    """What the final state is (``post_norm`` or ``lm_head_input``); None: the target family's."""
    options: dict[str, Any] = field(default_factory=dict)
    """The architecture's own options (``DraftConfig.options``: the fields only it reads, its
    class in the architecture's ``config.py``), over the ones taken from the target; e.g.
    {"q_lora_rank": 1536} for a kimi_k3 draft of a Kimi-Linear target (no query bottleneck)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Other DraftConfig fields to change (e.g. {"intermediate_size": 2048}). An architecture
    option written here still reads, warning: its place is ``options``."""

    def for_recipe(self, recipe: RecipeName) -> DraftSpec:
        """This spec with the recipe's values in its unset fields.

        Raises:
            ValueError: naming every field set to a value the recipe cannot train.
        """
        rec = RECIPES[recipe]
        problems = [f"model.draft.{name}={getattr(self, name)!r}: the {recipe} recipe needs "
                    f"{value!r} (leave it unset)" for name, value in rec.draft_defaults.items()
                    if name in rec.fixed and getattr(self, name) not in (None, value)]
        if problems:
            raise SparkforgeError("; ".join(problems))
        return dataclasses.replace(self, **{name: value for name, value in
                                            rec.draft_defaults.items()
                                            if getattr(self, name) is None})

    def layer_ids(self) -> tuple[int, ...]:
        """The configured ids, or the default rule's."""
        if self.target_layer_ids is not None:
            return tuple(self.target_layer_ids)
        return default_feature_ids(self.num_target_layers, self.num_hidden_layers)

    def scaling(self, target_config: Mapping[str, Any]) -> TargetScaling:
        """The embedding scale and logit softcap the draft built from ``target_config`` applies:
        the target's (``from_target_config``), unless ``overrides`` sets them."""
        target = TargetConfig(raw=target_config, source="the cache's target/config.json")
        return TargetScaling(
            embedding_scale=self.overrides.get("embedding_scale", target.embedding_scale),
            final_logit_softcapping=self.overrides.get("final_logit_softcapping",
                                                       target.final_logit_softcapping))

    def contract(self, *, max_seq_len: int, need_eval_split: bool,
                 target_config: Mapping[str, Any] | None) -> RunContract:
        """What this draft needs from a cache.

        Args:
            max_seq_len: The run's ``data.max_seq_len``.
            need_eval_split: Whether the run validates (so the cache needs an eval split).
            target_config: The target ``config.json`` the draft is built from (the cache's);
                None leaves the embedding scale and softcap unchecked.
        """
        family = family_of(self.target_model_type)
        return RunContract(
            target_layer_ids=self.layer_ids(), hidden_size=self.hidden_size,
            vocab_size=self.vocab_size, num_target_layers=self.num_target_layers,
            mask_token_id=self.mask_token_id, max_seq_len=max_seq_len,
            target_model_type=self.target_model_type,
            features=self.target_features or family.features,
            final_hidden=self.target_final or family.final_state,
            scaling=None if target_config is None else self.scaling(target_config),
            need_eval_split=need_eval_split,
        )

    def draft_config(self, target_config: Mapping[str, Any]) -> DraftConfig:
        """The full draft config: backbone sizes from the target's HF config, the rest from here."""
        from transformers import AutoConfig

        data = dict(target_config)
        hf = AutoConfig.for_model(data.pop("model_type"), **data)
        spec = self.for_recipe("dspark")  # no-op when a recipe already filled the fields
        overrides = fold_flat_options(spec.overrides, warn_as=("model.draft.overrides",
                                                               "model.draft.options"))
        options = {**spec.options, **options_dict(overrides.pop("options", None))}
        return from_target_config(hf, **{
            "mask_token_id": spec.mask_token_id, "target_layer_ids": spec.layer_ids(),
            "num_hidden_layers": spec.num_hidden_layers, "block_size": spec.block_size,
            "num_anchors": spec.num_anchors, "markov_rank": spec.markov_rank,
            "markov_head_type": spec.markov_head_type, "architecture": spec.architecture,
            "layout": spec.layout,
            "enable_confidence_head": spec.enable_confidence_head,
            "confidence_head_with_markov": spec.confidence_head_with_markov,
            **({"options": options} if options else {}), **overrides})


OBJECTIVE_ALPHAS: dict[RecipeName, dict[str, float]] = {
    "dspark": {"ce_loss_alpha": 0.1, "l1_loss_alpha": 0.9, "confidence_head_alpha": 1.0,
               "selector_loss_alpha": 0.0},
    "dflash": {"ce_loss_alpha": 1.0, "l1_loss_alpha": 0.0, "confidence_head_alpha": 0.0,
               "selector_loss_alpha": 0.0},
    "dflash2": {"ce_loss_alpha": 1.0, "l1_loss_alpha": 0.0, "confidence_head_alpha": 0.0,
                "selector_loss_alpha": 1.0},
}
"""Each objective's term weights; DFlash is cross-entropy only (its draft has no heads), DFlash2
DFlash's cross-entropy plus the candidate selector's."""
CE_ONLY_TERMS = ("l1_loss_alpha", "confidence_head_alpha")
"""The terms the DFlash objectives leave out (their drafts have no confidence head)."""


@dataclass(frozen=True, kw_only=True)
class LossSpec:
    """Weights and settings of the loss terms, passed as one value to the loss.

    Every supervised draft position k (0-indexed) is weighted ``exp(-k/gamma)``. For DSpark k
    is also the block slot; a DFlash block's slot 0 is the anchor, which drafts nothing, so its
    position k is block slot k+1 and the weight is DFlash's decay ``exp(-(slot-1)/gamma)``.
    """

    objective: RecipeName | None = None
    """``dspark`` (0.1 CE + 0.9 L1 + 1.0 confidence BCE), ``dflash`` (CE only) or ``dflash2``
    (1.0 CE + 1.0 candidate selector CE); None: the run's recipe's (``model.recipe``), or
    dspark."""
    ce_loss_alpha: float | None = None
    """Weight of the cross-entropy to the data tokens (None: the objective's)."""
    l1_loss_alpha: float | None = None
    """Weight of the full L1 distance to the teacher distribution (None: the objective's)."""
    confidence_head_alpha: float | None = None
    """Must be > 0 exactly when the draft has a confidence head (None: the objective's)."""
    selector_loss_alpha: float | None = None
    """Weight of the candidate selector's k-way cross-entropy to the data token; > 0 exactly
    when the draft has the selector (dflash2; None: the objective's)."""
    loss_decay_gamma: float | None = 4.0
    """Per-position weight exp(-k/gamma); None disables the decay."""
    l1_chunk_rows: int = 128
    """Rows per chunk of the full-vocabulary L1 term (bounds its fp32 temporaries)."""

    def __post_init__(self) -> None:
        problems = [f"model.loss.{name}={getattr(self, name)} must be >= 0"
                    for name in OBJECTIVE_ALPHAS["dspark"]
                    if getattr(self, name) is not None and getattr(self, name) < 0]
        if self.l1_chunk_rows < 1:
            problems.append(f"model.loss.l1_chunk_rows={self.l1_chunk_rows} must be >= 1")
        if self.objective in ("dflash", "dflash2"):
            problems += [f"model.loss.{name}={getattr(self, name)}: the {self.objective} "
                         "objective has no such term (leave it unset or 0)"
                         for name in CE_ONLY_TERMS if getattr(self, name)]
        if self.objective not in (None, "dflash2") and self.selector_loss_alpha:
            problems.append(f"model.loss.selector_loss_alpha={self.selector_loss_alpha}: only "
                            "the dflash2 objective has a candidate selector term")
        if problems:
            raise SparkforgeError("invalid loss config:\n  " + "\n  ".join(problems))
        if self.objective is not None:  # the objective's weights in the unset fields
            for name, value in OBJECTIVE_ALPHAS[self.objective].items():
                if getattr(self, name) is None:
                    object.__setattr__(self, name, value)

    def with_objective(self, objective: RecipeName) -> LossSpec:
        """This spec under ``objective`` (a no-op when it already has it).

        Raises:
            ValueError: the spec names another objective.
        """
        if self.objective not in (None, objective):
            raise SparkforgeError(
                f"model.loss.objective={self.objective!r}: the run's recipe trains "
                f"with {objective!r} (leave it unset)")
        return dataclasses.replace(self, objective=objective)


DEFAULT_LIMIT_VAL_BATCHES = 1.0
"""Lightning's ``trainer.limit_val_batches`` default: validate on the whole eval split."""


def validation_on(limit_val_batches: float | None) -> bool:
    """Whether Lightning runs validation during ``fit``, so the cache needs an eval split.

    Only ``limit_val_batches=0`` turns it off: with ``val_check_interval`` and
    ``check_val_every_n_epoch`` both null Lightning still validates at the end of each epoch.
    ``None`` is Lightning's "use the default".
    """
    return bool(DEFAULT_LIMIT_VAL_BATCHES if limit_val_batches is None else limit_val_batches)
