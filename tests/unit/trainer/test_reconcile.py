"""Reconciliation: served against the reference decoder (exact at T=0, intervals at T>0) and
against teacher-forced tau (only where the matched check compares them)."""

from __future__ import annotations

from typing import Any

import pytest

from sparkforge.trainer.eval.decode_result import SpecDecodeResult
from sparkforge.trainer.eval.reconcile import exact_agreement, reconcile
from sparkforge.trainer.eval.served_summary import reconciliation_lines


def _run(accepted: list[int], tokens: list[int], k: int = 4) -> SpecDecodeResult:
    res = SpecDecodeResult(tokens=tokens, position_accepted=[0] * k, position_trials=[0] * k)
    for a in accepted:
        res.count_round(verified=k, accepted=a)
    return res


REFERENCE = [_run([1, 0, 2], [5, 6, 7, 8, 9, 1]), _run([0, 0], [3, 4])]


def test_identical_greedy_runs_agree_exactly() -> None:
    """Same rounds, accepted tokens and outputs: 5 rounds, 3 accepted, both outputs equal."""
    check = exact_agreement([_run([1, 0, 2], [5, 6, 7, 8, 9, 1]), _run([0, 0], [3, 4])],
                            REFERENCE)
    assert check["agree"] is True
    assert check["rounds"] == [5, 5]
    assert check["accepted_tokens"] == [3, 3]
    assert check["outputs_equal"] == 2


def test_equal_totals_from_different_prompts_still_disagree() -> None:
    """Totals can hide a difference: one prompt accepts a token more and the other one less."""
    check = exact_agreement([_run([0, 0, 2], [5, 6, 7, 8, 9, 1]), _run([1, 0], [3, 4, 2])],
                            REFERENCE)
    assert (check["rounds"], check["accepted_tokens"]) == ([5, 5], [3, 3])
    assert check["agree"] is False
    assert check["prompts_differing"] == 2
    lines = reconciliation_lines({"temperature": 0.0, "num_speculative_tokens": 4,
                                  "concurrency": 1, "prompts": 2, "taus": {},
                                  "served_vs_reference": check,
                                  "served_vs_teacher_forced": {"note": "no cache"}})
    assert "DISAGREE at T=0" in lines[1]


SERVED = {"prompts": 2, "runs": [
    {"num_speculative_tokens": 4, "concurrency": 8, "tau": 9.0, "tau_ci95": [8.0, 10.0],
     "source": "per_request", "rounds": 5},
    {"num_speculative_tokens": 4, "concurrency": 1, "tau": 2.0, "tau_ci95": [1.8, 2.2],
     "source": "per_request", "rounds": 5},
    {"num_speculative_tokens": 2, "concurrency": 1, "tau": 7.0, "tau_ci95": [6.0, 8.0],
     "source": "per_request", "rounds": 5}]}
FORCED = {"full_blocks": {"tau": 2.05, "tau_ci95": [1.95, 2.15], "blocks": 40}}
MATCHED = {"matched": True}


def _reconcile(temperature: float, reference: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return reconcile(SERVED, {}, reference=reference, reference_runs=REFERENCE,
                     forced=kw.get("forced", FORCED), matched=kw.get("matched", MATCHED),
                     k=kw.get("k", 4), temperature=temperature)


def test_sampled_runs_are_compared_at_the_draft_length_and_lowest_concurrency() -> None:
    """k=4 at 1 in flight (tau 2.0) is compared, not the k=2 or 8-in-flight runs; it agrees
    with a reference of 2.1 [1.9, 2.3] and with the matched teacher-forced 2.05."""
    rec = _reconcile(1.0, {"tau": 2.1, "tau_ci95": [1.9, 2.3], "rounds": 5})
    assert rec["concurrency"] == 1
    assert rec["taus"]["served"]["tau"] == 2.0
    assert rec["served_vs_reference"]["difference"] == pytest.approx(-0.1)
    assert rec["served_vs_reference"]["agree"] is True
    assert rec["served_vs_teacher_forced"]["agree"] is True
    far = _reconcile(1.0, {"tau": 3.0, "tau_ci95": [2.9, 3.1], "rounds": 5})
    assert far["served_vs_reference"]["agree"] is False
    assert "DISAGREE" in "\n".join(reconciliation_lines(far))


def test_teacher_forced_is_compared_only_on_the_matched_split_at_t1() -> None:
    """At T=0, or on a split that was not regenerated, served and teacher-forced tau measure
    different things: a note, no verdict."""
    reference = {"tau": 2.0, "tau_ci95": [1.9, 2.1], "rounds": 5}
    assert "note" in _reconcile(0.0, reference)["served_vs_teacher_forced"]
    unmatched = _reconcile(1.0, reference, matched={"matched": None, "note": "not regenerated"})
    assert unmatched["served_vs_teacher_forced"] == {"note": "not regenerated"}


def test_no_served_run_at_the_draft_length_is_said() -> None:
    """A sweep that skips the draft's own length has nothing the reference decoder measured."""
    rec = _reconcile(1.0, {"tau": 2.0, "tau_ci95": [1.9, 2.1], "rounds": 5}, k=6)
    assert "k=6" in rec["note"]
