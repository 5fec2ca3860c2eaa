"""Serving checks of the DSpark parts every DSpark format shares: feature ids, mask id, heads.

Each architecture's ``export.py`` adds its own backbone's checks on top of these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sparkforge.shared.layer_ids import every_engine_feature_range
from sparkforge.trainer.architectures.config import DraftConfig

if TYPE_CHECKING:
    from sparkforge.trainer.architectures import Engine


def dspark_problems(cfg: DraftConfig, engine: Engine) -> list[str]:
    """Serving problems of the DSpark parts every DSpark format shares (ids, mask, heads)."""
    return id_problems(cfg, engine) + head_problems(cfg, engine)


def id_problems(cfg: DraftConfig, engine: Engine) -> list[str]:
    """Feature ids and mask id ``engine`` can serve as trained."""
    problems = []
    lo, hi = every_engine_feature_range(cfg.num_target_layers)
    if any(i < lo for i in cfg.target_layer_ids):
        problems.append("target_layer_ids holds -1 (the embeddings): no cache holds it, and "
                        "SGLang cannot capture it")
    if engine in ("sglang", "any") and any(i > hi for i in cfg.target_layer_ids):
        problems.append(f"target_layer_ids holds {hi + 1}, the last layer: SGLang cannot capture "
                        "it (vLLM serves it as the layer's raw output, which the cache holds)")
    if not 0 <= cfg.mask_token_id < cfg.vocab_size:
        problems.append(f"mask_token_id={cfg.mask_token_id} must be below "
                        f"vocab_size={cfg.vocab_size}")
    return problems


def head_problems(cfg: DraftConfig, engine: Engine) -> list[str]:
    """Markov and confidence heads an engine would build differently from the trained ones."""
    problems = []
    if engine in ("vllm", "any"):
        if cfg.markov_rank == 0:
            problems.append("markov_rank=0: vLLM's DSpark draft has no rank-0 path (markov_rank "
                            "must be > 0)")
        elif cfg.markov_head_type != "vanilla":
            problems.append(f"markov_head_type={cfg.markov_head_type!r}: vLLM builds only the "
                            "vanilla Markov head and fails to load gated/rnn weights")
    if engine in ("sglang", "any") and not cfg.enable_confidence_head:
        problems.append("enable_confidence_head=False: SGLang builds the confidence head anyway "
                        "and refuses a draft without its weights")
    return problems
