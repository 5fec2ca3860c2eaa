"""The training contract: does a cache's manifest fit a training run? Every mismatch named.

This is the single check shared by ``sparkforge validate --against`` and the trainer's pre-flight
check; the trainer alone builds the contract (``DraftSpec.contract`` in
``sparkforge.trainer.run_config``), in both cases from the train config and the cache's target
``config.json``. Each problem is
one line naming the run field and the manifest field with both values, so one failed launch shows
everything to fix.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from sparkforge.manifests.schema import CacheManifest
from sparkforge.shared.errors import SparkforgeError
from sparkforge.shared.layer_ids import feature_to_hf, missing_features
from sparkforge.shared.target_families import FeatureSemantics, FinalSemantics, TargetScaling

logger = logging.getLogger(__name__)

HIDDEN_DTYPES = ("bfloat16", "float16", "float32")
EMPTY_TRAIN_SPLIT = "the cache's train split is empty"


class CacheContractError(SparkforgeError):
    """Raised when a cache cannot feed a training run; the message lists every mismatch."""


@dataclass(frozen=True, kw_only=True)
class RunContract:
    """What a training run expects of the cache (the draft's target-facing fields)."""

    target_layer_ids: tuple[int, ...]
    """DSpark feature ids (0-based: id l = HF hidden_states[l+1]); any subset of the cache's."""
    hidden_size: int
    vocab_size: int
    num_target_layers: int
    mask_token_id: int
    max_seq_len: int
    """Longest sample the run is sized for (the cache's capture.max_seq_len must not exceed it)."""
    target_model_type: str | None = None
    """Expected target ``model_type``; None accepts any."""
    features: FeatureSemantics = "residual"
    """What the draft expects a feature to be (``hc_mean`` for hyper-connection targets)."""
    final_hidden: FinalSemantics = "post_norm"
    """What the draft expects the final state to be (``lm_head_input`` for DeepSeek-V4)."""
    scaling: TargetScaling | None = None
    """The embedding scale and logit softcap the draft applies (they must be the ones the
    capture recorded); None: not checked (no target config to build the draft from)."""
    need_eval_split: bool = False



def contract_problems(manifest: CacheManifest, run: RunContract, *,
                      split_counts: Mapping[str, int]) -> list[str]:
    """Every way ``manifest`` fails to serve ``run``; empty when it fits.

    Args:
        manifest: The parsed manifest.
        run: The run's expectations.
        split_counts: Samples per split in the cache's index.
    """
    target, capture, spec = manifest.target, manifest.capture, manifest.storage.spec
    problems: list[str] = []

    def differ(run_field: str, want: object, cache_field: str, have: object) -> None:
        if want != have:
            problems.append(f"{run_field}={want!r} but the cache's {cache_field}={have!r}")

    if not manifest.complete:
        problems.append("cache is not complete (manifest complete=false): finalize it first")
    missing = missing_features(capture.layer_ids, run.target_layer_ids)
    if missing:
        problems.append(
            f"model.target_layer_ids={list(run.target_layer_ids)} must be a subset of the "
            f"cache's features, but feature ids {list(missing)} (HF hidden_states indices = id + "
            f"1: {list(feature_to_hf(missing))}) are not in capture.layer_ids "
            f"{list(capture.layer_ids)}")
    differ("capture.layer_id_convention", "hf_hidden_states_index",
           "capture.layer_id_convention", capture.layer_id_convention)
    differ("model.draft.target_features", run.features, "capture.features", capture.features)
    differ("model.draft.target_final", run.final_hidden, "capture.final_hidden",
           capture.final_hidden)
    if run.scaling is not None:
        differ("model.draft embedding_scale", run.scaling.embedding_scale,
               "capture.embedding_scale", capture.embedding_scale)
        differ("model.draft final_logit_softcapping", run.scaling.final_logit_softcapping,
               "capture.final_logit_softcapping", capture.final_logit_softcapping)
    differ("model.hidden_size", run.hidden_size, "target.hidden_size", target.hidden_size)
    differ("model.hidden_size", run.hidden_size, "storage.spec.hidden_size", spec.hidden_size)
    differ("model.vocab_size", run.vocab_size, "target.vocab_size", target.vocab_size)
    differ("model.num_target_layers", run.num_target_layers, "target.num_hidden_layers",
           target.num_hidden_layers)
    if run.target_model_type is not None:
        differ("model.target_model_type", run.target_model_type, "target.model_type",
               target.model_type)
    if not 0 <= run.mask_token_id < target.vocab_size:
        problems.append(f"model.mask_token_id={run.mask_token_id} is outside the cache's "
                        f"vocabulary [0, target.vocab_size={target.vocab_size})")
    if capture.max_seq_len > run.max_seq_len:
        problems.append(f"data.max_seq_len={run.max_seq_len} is shorter than the cache's "
                        f"capture.max_seq_len={capture.max_seq_len}")
    if spec.hidden_dtype not in HIDDEN_DTYPES:
        problems.append(f"storage.spec.hidden_dtype={spec.hidden_dtype!r} not in {HIDDEN_DTYPES}")
    if spec.aux_codec != "lossless":
        logger.warning("cache stores features with the lossy %r codec", spec.aux_codec)
    return problems + _split_problems(split_counts, need_eval=run.need_eval_split)


def _split_problems(split_counts: Mapping[str, int], *, need_eval: bool) -> list[str]:
    problems = []
    if split_counts.get("train", 0) == 0:
        problems.append(EMPTY_TRAIN_SPLIT)
    if need_eval and split_counts.get("eval", 0) == 0:
        problems.append("validation is on (trainer.limit_val_batches > 0) but the cache's eval "
                        "split is empty")
    return problems


def check_contract(manifest: CacheManifest, run: RunContract, *,
                   split_counts: Mapping[str, int], uri: str = "cache") -> None:
    """Raise ``CacheContractError`` listing every mismatch between ``manifest`` and ``run``."""
    problems = contract_problems(manifest, run, split_counts=split_counts)
    if problems:
        raise CacheContractError(
            f"{uri} cannot feed this run ({len(problems)} problem(s)):\n  "
            + "\n  ".join(problems))


