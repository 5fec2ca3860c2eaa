"""Tau and acceptance by context bucket and by kind of turn, counted by hand."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from sparkforge.trainer.eval.context_buckets import (
    bucket_index,
    bucket_labels,
    forced_buckets,
    speculative_buckets,
)
from sparkforge.trainer.eval.turn_kinds import TurnTags, by_kind


def test_labels_and_edges() -> None:
    """Edges cut half-open buckets; labels name them in K when they are multiples of 1024."""
    assert bucket_labels((1024, 4096, 16384)) == ["<1K", "1K-4K", "4K-16K", ">=16K"]
    assert bucket_labels((100,)) == ["<100", ">=100"]
    assert bucket_labels(()) == ["all"]
    assert bucket_index([0, 1023, 1024, 4095, 4096, 20000], (1024, 4096)).tolist() == \
        [0, 0, 1, 1, 2, 2]


def test_speculative_rounds_by_the_context_of_their_anchor() -> None:
    """Rounds land in the bucket of the tokens before their anchor; a round verifying m slots
    and accepting n tries slots j < min(m, n+1) and accepts j < n."""
    runs = [SimpleNamespace(round_context=[5, 9, 12], tokens_per_round=[4, 3, 1],
                            verified_per_round=[3, 3, 0]),
            SimpleNamespace(round_context=[11], tokens_per_round=[2], verified_per_round=[3])]
    low, high = speculative_buckets(runs, 3, (10,), seed=0)
    assert (low["bucket"], low["blocks"], low["prompts"]) == ("<10", 2, 1)
    assert low["tau"] == pytest.approx(3.5)
    # rounds (m=3, n=3) and (m=3, n=2): trials 3+3 ... slot 2 tried twice, accepted once
    assert low["position_trials"] == [2, 2, 2]
    assert low["acceptance_by_position"] == pytest.approx([1.0, 1.0, 0.5])
    assert (high["blocks"], high["prompts"], high["tau"]) == (2, 2, pytest.approx(1.5))
    # rounds (m=0, n=0): nothing tried; (m=3, n=1): slots 0, 1 tried, slot 0 accepted
    assert high["position_trials"] == [1, 1, 0]
    assert high["acceptance_by_position"] == pytest.approx([1.0, 0.0, 0.0])
    assert low["tau_ci95"] is None   # one prompt: no interval
    assert high["tau_ci95"] is not None
    assert high["tau_ci95"][0] <= high["tau"] <= high["tau_ci95"][1]


def test_forced_blocks_by_their_anchor_position() -> None:
    """Each counted block adds its length to its anchor's bucket and its supervised slots'
    acceptances to that bucket's positions; blocks that do not count are left out."""
    anchor = np.array([[2, 30], [40, 3]])
    length = np.array([[2.0, 1.5], [3.0, 9.0]])
    on = np.array([[True, True], [True, False]])
    accept = np.array([[[0.5, 0.2], [0.5, 0.0]], [[1.0, 1.0], [0.9, 0.9]]])
    mask = np.array([[[1.0, 1.0], [1.0, 0.0]], [[1.0, 1.0], [1.0, 1.0]]])
    low, high = forced_buckets([(anchor, length, on, accept, mask)], (10,), seed=0)
    assert (low["blocks"], low["samples"], low["tau"]) == (1, 1, 2.0)
    assert low["acceptance_by_position"] == pytest.approx([0.5, 0.2])
    assert (high["blocks"], high["samples"], high["tau"]) == (2, 2, pytest.approx(2.25))
    assert high["position_trials"] == [2.0, 1.0]
    assert high["acceptance_by_position"] == pytest.approx([0.75, 1.0])


def test_turn_kinds_by_their_tags() -> None:
    """A turn thinks when it holds either thinking tag and calls a tool when it holds the
    tool-call tag (multi-token tags matched as runs); each kind's tau sums its own samples."""
    tags = TurnTags(thinking=((7, 8), (9,)), tool_call=((5,),))
    assert tags.kinds([1, 7, 8, 2]) == (True, False)
    assert tags.kinds([1, 8, 7, 2]) == (False, False)   # the tag's tokens out of order
    assert tags.kinds([3, 9, 5]) == (True, True)
    num, den = np.array([6.0, 2.0, 9.0, 0.0]), np.array([2.0, 1.0, 3.0, 0.0])
    kinds = [(True, False), (False, False), (True, True), (True, True)]
    got = by_kind(num, den, kinds, unit="samples")
    assert (got["thinking"]["tau"], got["thinking"]["samples"]) == (pytest.approx(3.0), 2)
    assert (got["no_thinking"]["tau"], got["no_thinking"]["samples"]) == (2.0, 1)
    assert (got["tool_call"]["tau"], got["tool_call"]["blocks"]) == (3.0, 3)
    assert got["no_tool_call"]["tau"] == pytest.approx(8.0 / 3.0)
    assert got["no_thinking"]["tau_ci95"] is None   # one sample


def test_tags_come_from_the_tokenizer(tiny_target: Path) -> None:
    """Tag text is encoded by the target's tokenizer; a sample holding it is that kind."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target)
    tags = TurnTags.from_tokenizer(tok, ("<think>", "</think>"), "<tool_call>")
    reply = tok.encode("so </think> the call <tool_call> f", add_special_tokens=False)
    assert tags.kinds(reply) == (True, True)
    assert tags.kinds(tok.encode("plain text", add_special_tokens=False)) == (False, False)
