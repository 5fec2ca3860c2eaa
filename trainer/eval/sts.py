"""Sequential temperature scaling (STS) of per-slot acceptance logits, and the file engines read.

A confidence of slot ``k`` is conditional on every earlier slot being accepted; a serving engine
schedules on the prefix survival ``prod_{i<=k} sigmoid(logit_i / T_i)``. STS fits ``T_k`` slot by
slot, left to right, each by a grid search that minimises the ECE of the survival at ``k`` with
the earlier temperatures fixed (the DSpark paper's post-hoc calibration). A temperature keeps
each slot's ranking, so it fixes the magnitude of the survival, not the head's ordering of
blocks.

The file ``confidence_calibration.json`` holds one temperature per draft slot under both names
the engines read: ``sts_temperatures`` (TensorRT-LLM's DSpark loader,
``tensorrt_llm/_torch/speculative/dspark_sts.py``, which also accepts ``temperatures``) and
``temperatures`` (DeepSpec's ``eval.py --confidence-calibration-path``, which wants exactly
``block_size`` of them, and SGLang's ``--speculative-dspark-confidence-sts-path``, which wants
exactly its ``gamma``); each applies ``sigmoid(logit_k / T_k)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from sparkforge.trainer.eval.calibration import auroc, expected_calibration_error

CALIBRATION_FILE = "confidence_calibration.json"
GRID = np.unique(np.concatenate([np.logspace(np.log10(0.05), np.log10(20.0), 256), [1.0]]))
"""Temperatures searched per slot: 256 log-spaced in [0.05, 20], and 1 (no change)."""
_EPS = 1e-6


def logit(p: np.ndarray) -> np.ndarray:
    """The logit of probabilities, clipped away from 0 and 1."""
    q = np.clip(np.asarray(p, dtype=np.float64), _EPS, 1.0 - _EPS)
    return np.asarray(np.log(q) - np.log1p(-q))


def survival(logits_NK: np.ndarray, temperatures: Sequence[float]) -> np.ndarray:
    """``prod_{i<=k} sigmoid(logit_i / T_i)`` per block and slot."""
    scaled = np.asarray(logits_NK, dtype=np.float64) / np.asarray(temperatures)[None, :]
    return np.asarray(np.cumprod(1.0 / (1.0 + np.exp(-scaled)), axis=1))


def fit_sts(logits_NK: np.ndarray, survived_NK: np.ndarray, valid_NK: np.ndarray,
            grid: np.ndarray = GRID) -> list[float]:
    """One temperature per slot, left to right (1 for a slot without data).

    Args:
        logits_NK: Per block and slot, the acceptance logit.
        survived_NK: What survived up to each slot: a 0/1 prefix-acceptance event, or the
            expected survival (the product of teacher-forced acceptances).
        valid_NK: Slots that were verified (a prefix of each block).
    """
    logits_NK = np.asarray(logits_NK, dtype=np.float64)
    prefix = np.ones(logits_NK.shape[0])
    temperatures: list[float] = []
    for k in range(logits_NK.shape[1]):
        on = np.asarray(valid_NK[:, k], dtype=bool)
        if not on.any():
            temperatures.append(1.0)
            continue
        step = 1.0 / (1.0 + np.exp(-logits_NK[on, k][None, :] / grid[:, None]))
        eces = [expected_calibration_error(row, survived_NK[on, k])
                for row in prefix[on][None, :] * step]
        best = float(grid[int(np.argmin(eces))])
        temperatures.append(best)
        prefix[on] *= 1.0 / (1.0 + np.exp(-logits_NK[on, k] / best))
    return temperatures


def survival_metrics(logits_NK: np.ndarray, survived_NK: np.ndarray, valid_NK: np.ndarray,
                     temperatures: Sequence[float], *, events: bool) -> dict[str, Any]:
    """ECE of the survival over every verified slot and by slot; AUROC too for 0/1 events."""
    pred, on = survival(logits_NK, temperatures), np.asarray(valid_NK, dtype=bool)
    out: dict[str, Any] = {
        "slots": int(on.sum()),
        "ece": expected_calibration_error(pred[on], survived_NK[on]),
        "ece_by_position": [expected_calibration_error(pred[on[:, k], k], survived_NK[on[:, k], k])
                            for k in range(pred.shape[1])]}
    if events:
        out["auroc"] = auroc(pred[on], survived_NK[on] > 0.5)
    return out


def calibration_file(temperatures: Sequence[float], **metadata: Any) -> dict[str, Any]:
    """The ``confidence_calibration.json`` contents (both key spellings, then metadata the
    engines ignore)."""
    temps = [float(t) for t in temperatures]
    return {"sts_temperatures": temps, "temperatures": temps, "num_positions": len(temps),
            **metadata}
