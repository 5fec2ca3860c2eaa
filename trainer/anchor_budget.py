"""A run's expected anchor use from the sample index alone: one sample per row against packing.

Each row draws ``num_anchors`` anchors among its valid positions; a row with fewer valid
positions fills the rest with dummy blocks that cost compute and train nothing. From the
index's lengths and supervised-token counts this estimates, for the run's batch and row size,
the kept-anchor ratio (real anchors / anchor slots) and the padding of ``bucket`` batches and of
``pack`` rows, planning epoch 0 exactly as the run would (``data_plan``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from sparkforge.shared.errors import ConfigError
from sparkforge.trainer.architectures.config import DSparkDraftConfig, read_legacy
from sparkforge.trainer.data_plan import Batching, SplitIndex, plan_epoch
from sparkforge.trainer.draft.block_layout import BLOCK_LAYOUTS, LAYOUTS
from sparkforge.trainer.run_config import DEFAULT_MAX_SEQ_LEN, RECIPES


@dataclass(frozen=True, kw_only=True)
class AnchorSetting:
    """The run settings that fix anchor use (``model.draft.*`` and ``data.*``)."""

    num_anchors: int
    block_size: int
    full_block: bool
    """DFlash's rule: an anchor needs its whole block inside its sample."""
    batch_size: int
    row_tokens: int
    """``data.max_seq_len``: the tokens of a packed row."""
    shuffle_buffer: int = 256
    pool_batches: int = 16
    seed: int = 0


def valid_anchors(num_loss_tokens: np.ndarray, setting: AnchorSetting) -> np.ndarray:
    """Valid anchors per sample if its supervised tokens are one contiguous span.

    DSpark: every supervised token but the span's last; DFlash: those with K-1 tokens after them.
    A multi-turn sample has one span per turn, hence slightly fewer.
    """
    reach = setting.block_size - 1 if setting.full_block else 1
    out: np.ndarray = np.maximum(num_loss_tokens - reach, 0)
    return out


def batching_budget(index: SplitIndex, setting: AnchorSetting, batching: Batching
                    ) -> dict[str, float]:
    """Kept-anchor ratio, padding and real tokens per row of one epoch under ``batching``."""
    assert index.num_loss_tokens is not None, "the index needs num_loss_tokens"
    plan = plan_epoch(index, seed=setting.seed, epoch=0, num_shares=1, share=0,
                      batch_size=setting.batch_size, batching=batching,
                      shuffle_buffer=setting.shuffle_buffer, pool_batches=setting.pool_batches,
                      row_tokens=setting.row_tokens)
    valid = valid_anchors(index.num_loss_tokens, setting)
    kept = slots = real = computed = num_rows = 0.0
    for i, batch in enumerate(plan.batches):
        rows = np.arange(batch.size) if plan.rows is None else plan.rows[i]
        row_valid = np.bincount(rows, weights=valid[batch])
        row_len = np.bincount(rows, weights=index.length[batch])
        kept += float(np.minimum(row_valid, setting.num_anchors).sum())
        slots += row_valid.size * setting.num_anchors
        real += float(row_len.sum())
        computed += float(row_len.max()) * row_len.size
        num_rows += row_len.size
    return {"kept_anchor_ratio": kept / slots if slots else 0.0,
            "padding": 1.0 - real / computed if computed else 0.0,
            "tokens_per_row": real / num_rows if num_rows else 0.0,
            "kept_anchors_per_row": kept / num_rows if num_rows else 0.0,
            "rows": num_rows}


def anchor_budget(index: SplitIndex, setting: AnchorSetting) -> dict[str, Any]:
    """The budget of ``bucket`` and ``pack`` for ``setting`` (JSON-ready)."""
    return {"num_anchors": setting.num_anchors, "row_tokens": setting.row_tokens,
            "batch_size": setting.batch_size, "samples": len(index),
            "bucket": batching_budget(index, setting, "bucket"),
            "pack": batching_budget(index, setting, "pack")}


def budget_table(budget: dict[str, Any]) -> str:
    """Readable lines of ``anchor_budget``."""
    lines = [f"anchor budget over {budget['samples']:,} train samples, num_anchors "
             f"{budget['num_anchors']}, batch {budget['batch_size']}, packed rows of "
             f"{budget['row_tokens']} tokens:",
             f"  {'batching':<8} {'kept-anchor ratio':>18} {'padding':>8} {'tokens/row':>11}"]
    for name in ("bucket", "pack"):
        b = budget[name]
        lines.append(f"  {name:<8} {b['kept_anchor_ratio']:>18.2f} {b['padding']:>8.1%} "
                     f"{b['tokens_per_row']:>11,.0f}")
    return "\n".join(lines)


def setting_from_train_config(data: Mapping[str, Any]) -> AnchorSetting:
    """The anchor setting of a loaded ``sparkforge train`` config (unset fields: the defaults).

    Raises:
        ValueError: naming a field that is not an integer in range.
    """
    model = data.get("model") or {}
    draft, train = model.get("draft") or {}, data.get("data") or {}
    values = {}
    for section, where, name, default in (
            (draft, "model.draft", "num_anchors", DSparkDraftConfig.num_anchors),
            (draft, "model.draft", "block_size", DSparkDraftConfig.block_size),
            (train, "data", "batch_size", 1),
            (train, "data", "max_seq_len", DEFAULT_MAX_SEQ_LEN),
            (train, "data", "shuffle_buffer", 256), (train, "data", "pool_batches", 16),
            (train, "data", "seed", 0)):
        value, low = section.get(name, default), 0 if name == "seed" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"{where}.{name} must be an integer >= {low}, got {value!r}")
        values[name] = value
    recipe = RECIPES.get(model.get("recipe") or "dspark", RECIPES["dspark"])
    _, layout = read_legacy(draft.get("architecture"),
                            draft.get("layout") or recipe.draft_defaults["layout"])
    if layout is None or layout not in BLOCK_LAYOUTS:
        raise ConfigError(f"model.draft.layout={layout!r} not in {LAYOUTS}")
    return AnchorSetting(num_anchors=values["num_anchors"], block_size=values["block_size"],
                         full_block=BLOCK_LAYOUTS[layout].full_block,
                         batch_size=values["batch_size"], row_tokens=values["max_seq_len"],
                         shuffle_buffer=values["shuffle_buffer"],
                         pool_batches=values["pool_batches"], seed=values["seed"])


def chat_like_index(num_samples: int, *, mean_len: float, max_len: int,
                    loss_fraction: float = 0.5, sigma: float = 0.8, seed: int = 0) -> SplitIndex:
    """Log-normal sample lengths of mean ``mean_len`` (capped), a ``loss_fraction`` supervised.

    Real chat caches are close to this: a 4,000-chat code cache has mean 403 tokens and 53% of
    them supervised. 64 samples per unit, like ``sparkforge produce``.
    """
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(mean_len) - sigma**2 / 2, sigma, num_samples), 2,
                      max_len).astype(np.int64)
    return SplitIndex.from_columns(
        sample_id=np.arange(num_samples), unit=np.arange(num_samples) // 64, length=lengths,
        num_loss_tokens=np.maximum((lengths * loss_fraction).astype(np.int64), 1))
