"""Tau and acceptance by context length: each block counted in the bucket of its anchor position.

A block's context length is the number of tokens before its anchor: its position in the sample
(teacher-forced) or the length of the prompt and the tokens accepted so far (speculative
decoding), the context a served draft reads when it drafts that block. Buckets are cut at
``edges`` (``sparkforge eval --context_buckets``, by default 1K, 4K and 16K tokens:
``<1K, 1K-4K, 4K-16K, >=16K``). Each bucket's tau has a
95% bootstrap interval over its prompts (eval samples), as the overall tau
(``sparkforge.trainer.eval.bootstrap``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from sparkforge.trainer.eval.bootstrap import ratio_ci


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 and n else str(n)


def bucket_labels(edges: Sequence[int]) -> list[str]:
    """``(1024, 4096) -> ['<1K', '1K-4K', '>=4K']``."""
    if not edges:
        return ["all"]
    inner = [f"{_tokens(a)}-{_tokens(b)}" for a, b in zip(edges[:-1], edges[1:], strict=True)]
    return [f"<{_tokens(edges[0])}", *inner, f">={_tokens(edges[-1])}"]


def bucket_index(context_len: np.ndarray | Sequence[int], edges: Sequence[int]) -> np.ndarray:
    """The bucket of each context length (0 = below ``edges[0]``)."""
    return np.searchsorted(np.asarray(edges), np.asarray(context_len), side="right")


def _interval(num: np.ndarray, den: np.ndarray, seed: int) -> list[float] | None:
    used = den > 0
    return list(ratio_ci(num[used], den[used], seed=seed)) if used.sum() >= 2 else None


def _bucket_entry(label: str, num: np.ndarray, den: np.ndarray, accepted: np.ndarray,
                  trials: np.ndarray, seed: int, unit: str) -> dict[str, Any]:
    total = float(den.sum())
    return {"bucket": label, "tau": float(num.sum() / total) if total else 0.0,
            "tau_ci95": _interval(num, den, seed), "blocks": int(total),
            unit: int((den > 0).sum()),
            "acceptance_by_position": [float(a / t) if t else 0.0
                                       for a, t in zip(accepted, trials, strict=True)],
            "position_trials": [float(t) for t in trials]}


def forced_buckets(rows: Sequence[tuple[np.ndarray, ...]], edges: Sequence[int], *,
                   seed: int = 0) -> list[dict[str, Any]]:
    """Teacher-forced tau and acceptance per bucket from per-batch block rows.

    Args:
        rows: Per batch, ``(anchor_pos_BA, length_BA, on_BA, accept_BAK, eval_mask_BAK)``: each
            block's anchor position, expected length (``1 + sum of surviving acceptances``),
            whether it counts (kept, with a supervised slot), the analytic acceptance and the
            supervised slots. Each row of a batch is one eval sample.
        edges: Bucket edges.
        seed: Bootstrap seed.
    """
    labels = bucket_labels(edges)
    out = []
    anchor, length, on, accept, mask = (np.concatenate(parts) for parts in zip(*rows, strict=True))
    which = bucket_index(anchor, edges)
    for b, label in enumerate(labels):
        sel = on & (which == b)
        ev = mask * sel[..., None]
        out.append(_bucket_entry(label, (length * sel).sum(-1), sel.sum(-1).astype(np.float64),
                                 (accept * ev).sum((0, 1)), ev.sum((0, 1)), seed, "samples"))
    return out


def speculative_buckets(runs: Sequence[Any], num_drafts: int, edges: Sequence[int], *,
                        seed: int = 0) -> list[dict[str, Any]]:
    """Measured tau and acceptance per bucket from speculative generations.

    A round verifying ``m`` slots and accepting ``n`` tried slot ``j`` iff ``j < min(m, n+1)``
    and accepted it iff ``j < n`` (``SpecDecodeResult``'s counting).

    Args:
        runs: ``SpecDecodeResult``s (one per prompt) with ``round_context``.
        num_drafts: K, the draft tokens per block.
        edges: Bucket edges.
        seed: Bootstrap seed.
    """
    labels = bucket_labels(edges)
    num = np.zeros((len(runs), len(labels)))
    den = np.zeros_like(num)
    accepted = np.zeros((len(labels), num_drafts))
    trials = np.zeros_like(accepted)
    j = np.arange(num_drafts)
    for p, run in enumerate(runs):
        which = bucket_index(run.round_context, edges)
        for b, tokens, m in zip(which, run.tokens_per_round, run.verified_per_round, strict=True):
            num[p, b] += tokens
            den[p, b] += 1
            trials[b] += j < min(m, tokens)
            accepted[b] += j < tokens - 1
    return [_bucket_entry(label, num[:, b], den[:, b], accepted[b], trials[b], seed, "prompts")
            for b, label in enumerate(labels)]
