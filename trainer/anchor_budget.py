"""A run's expected anchor use from the sample index alone: one sample per row against packing.

Each row draws ``num_anchors`` anchors among its valid positions; a row with fewer valid
positions fills the rest with dummy blocks that cost compute and train nothing. From the
index's lengths and supervised-token counts this estimates, for the run's batch and row size,
the kept-anchor ratio (real anchors / anchor slots) and the padding of ``bucket`` batches and of
``pack`` rows, planning epoch 0 exactly as the run would (``data_plan``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from sparkforge.shared.errors import ConfigError
from sparkforge.trainer.architectures.config import read_legacy
from sparkforge.trainer.data_plan import SplitIndex, plan_epoch
from sparkforge.trainer.draft.block_layout import BLOCK_LAYOUTS, LAYOUTS
from sparkforge.trainer.loader_settings import Batching, LoaderSettings
from sparkforge.trainer.run_config import RECIPES
from sparkforge.trainer.train_yaml import TrainConfigError, read_draft_section


@dataclass(frozen=True, kw_only=True)
class AnchorSetting:
    """The run settings that fix anchor use (``model.draft.*`` and ``data.*``)."""

    num_anchors: int
    block_size: int
    full_block: bool
    """DFlash's rule: an anchor needs its whole block inside its sample."""
    loader: LoaderSettings = LoaderSettings()
    """``data.*``: batch size, ``max_seq_len`` (the tokens of a packed row), buffer, seed."""


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
    plan = plan_epoch(index, dataclasses.replace(setting.loader, batching=batching), epoch=0,
                      num_shares=1, share=0)
    if not plan.positions.size:
        return {"kept_anchor_ratio": 0.0, "padding": 0.0, "tokens_per_row": 0.0,
                "kept_anchors_per_row": 0.0, "rows": 0.0}
    batch_of = plan.batch_of()
    if plan.row_of is None:  # one sample per row
        row_in_batch = np.arange(batch_of.size) - plan.batch_starts[batch_of]
    else:
        row_in_batch = plan.row_of
    rows_per_batch = np.zeros(len(plan), dtype=np.int64)
    np.maximum.at(rows_per_batch, batch_of, row_in_batch + 1)
    row_base = np.r_[0, np.cumsum(rows_per_batch)[:-1]]
    row = row_base[batch_of] + row_in_batch
    valid = valid_anchors(index.num_loss_tokens[plan.positions], setting)
    row_valid = np.bincount(row, weights=valid)
    row_len = np.bincount(row, weights=index.length[plan.positions])
    used = rows_per_batch > 0
    longest = np.maximum.reduceat(row_len, row_base[used])
    kept = float(np.minimum(row_valid, setting.num_anchors).sum())
    slots = row_valid.size * setting.num_anchors
    real, computed = float(row_len.sum()), float((longest * rows_per_batch[used]).sum())
    return {"kept_anchor_ratio": kept / slots, "padding": 1.0 - real / computed,
            "tokens_per_row": real / row_len.size, "kept_anchors_per_row": kept / row_len.size,
            "rows": float(row_len.size)}


def anchor_budget(index: SplitIndex, setting: AnchorSetting) -> dict[str, Any]:
    """The budget of ``bucket`` and ``pack`` for ``setting`` (JSON-ready)."""
    return {"num_anchors": setting.num_anchors, "row_tokens": setting.loader.max_seq_len,
            "batch_size": setting.loader.batch_size, "samples": len(index),
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
        ValueError: naming every mistyped draft field, or a ``data`` field.
    """
    problems: list[str] = []
    draft = read_draft_section(data, problems)
    if problems:
        raise TrainConfigError("train config: " + "; ".join(problems))
    _, layout = read_legacy(draft.architecture,
                            draft.layout or RECIPES[draft.recipe].draft_defaults["layout"])
    if layout is None or layout not in BLOCK_LAYOUTS:
        raise ConfigError(f"model.draft.layout={layout!r} not in {LAYOUTS}")
    return AnchorSetting(num_anchors=draft.num_anchors, block_size=draft.block_size,
                         full_block=BLOCK_LAYOUTS[layout].full_block,
                         loader=LoaderSettings.from_train_config(data))


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
