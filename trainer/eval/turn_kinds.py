"""Tau by kind of turn: with or without thinking, calling a tool or not.

A turn is the supervised tokens of an eval sample (teacher-forced) or the tokens a prompt's
speculative decoding generated. It thinks when it holds the target's thinking open or close tag
(a template that opens the think block in the generation prompt leaves only the close tag to
the reply; one with thinking off renders an empty block in the prompt, which is never
supervised), and it calls a tool when it holds the tool-call tag. The tags are the target
tokenizer's encodings of ``sparkforge eval --thinking_tags`` and ``--tool_call_tag`` (Qwen3's
``<think>``, ``</think>`` and ``<tool_call>`` by default). Each kind's tau has a 95% bootstrap
interval over its samples (prompts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sparkforge.trainer.eval.bootstrap import ratio_ci

KINDS = ("thinking", "no_thinking", "tool_call", "no_tool_call")


@dataclass(frozen=True)
class TurnTags:
    """Token sequences that mark a thinking turn (either one) and a tool call."""

    thinking: tuple[tuple[int, ...], ...]
    tool_call: tuple[tuple[int, ...], ...]

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, thinking: Sequence[str],
                       tool_call: str) -> TurnTags:
        """The tags' token ids (a tag the tokenizer encodes to nothing marks nothing)."""
        def ids(text: str) -> tuple[int, ...]:
            return tuple(int(i) for i in tokenizer.encode(text, add_special_tokens=False))
        return cls(thinking=tuple(t for t in map(ids, thinking) if t),
                   tool_call=tuple(t for t in (ids(tool_call),) if t))

    def kinds(self, tokens: Sequence[int] | np.ndarray) -> tuple[bool, bool]:
        """(thinks, calls a tool) for a turn's tokens."""
        seq = [int(t) for t in tokens]
        return (any(_holds(seq, tag) for tag in self.thinking),
                any(_holds(seq, tag) for tag in self.tool_call))


def _holds(seq: list[int], tag: tuple[int, ...]) -> bool:
    n = len(tag)
    return any(tuple(seq[i:i + n]) == tag for i in range(len(seq) - n + 1))


def by_kind(num: np.ndarray, den: np.ndarray, kinds: Sequence[tuple[bool, bool]], *, unit: str,
            seed: int = 0) -> dict[str, dict[str, Any]]:
    """Tau of each kind from per-sample (prompt) sums of tokens ``num`` over rounds ``den``.

    Returns:
        ``{kind: {"tau", "tau_ci95", unit, "blocks"}}`` for the four ``KINDS``; an interval
        needs two samples with rounds.
    """
    flags = np.asarray(kinds, dtype=bool).reshape(-1, 2)
    masks = {"thinking": flags[:, 0], "no_thinking": ~flags[:, 0],
             "tool_call": flags[:, 1], "no_tool_call": ~flags[:, 1]}
    out = {}
    for kind in KINDS:
        sel = masks[kind] & (den > 0)
        total = float(den[sel].sum())
        out[kind] = {"tau": float(num[sel].sum() / total) if total else 0.0,
                     "tau_ci95": list(ratio_ci(num[sel], den[sel], seed=seed))
                     if sel.sum() >= 2 else None,
                     unit: int(sel.sum()), "blocks": int(total)}
    return out
