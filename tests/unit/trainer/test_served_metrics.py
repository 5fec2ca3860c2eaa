"""Served acceptance: a server's per-request counts and /metrics totals, read as eval reads
the reference decoder's rounds (the numbers below are worked by hand)."""

from __future__ import annotations

import pytest

from sparkforge.shared.errors import SparkforgeError
from sparkforge.trainer.eval.served_metrics import (
    SpecCounters,
    counters_acceptance,
    parse_counters,
    request_rounds,
)

# Three verify steps of k=6 that accepted 2, 0 and 6 draft tokens.
DETAILED = {"num_spec_tokens": 6, "per_step_accepted": [2, 0, 6],
            "per_step_drafted": [6, 6, 6], "acceptance_histogram": [1, 0, 1, 0, 0, 0, 1]}
SUMMARY = {"num_spec_tokens": 6, "acceptance_histogram": [1, 0, 1, 0, 0, 0, 1]}


def test_detailed_steps_become_rounds_and_position_trials() -> None:
    """Each step yields accepted + 1 tokens; slot j is tried when every earlier one was
    accepted: step 1 tries slots 0-2 (accepts 0, 1), step 2 slot 0, step 3 all six."""
    res = request_rounds(DETAILED, [7, 8])
    assert res.tokens_per_round == [3, 1, 7]
    assert res.verified_per_round == [6, 6, 6]
    assert res.position_trials == [3, 2, 2, 1, 1, 1]
    assert res.position_accepted == [2, 2, 1, 1, 1, 1]
    assert res.tokens == [7, 8]


def test_a_summary_histogram_gives_the_same_totals() -> None:
    """Without per-step arrays the histogram still gives the rounds, tokens and trials."""
    detailed, summary = request_rounds(DETAILED, []), request_rounds(SUMMARY, [])
    assert sorted(summary.tokens_per_round) == sorted(detailed.tokens_per_round)
    assert summary.position_trials == detailed.position_trials
    assert summary.position_accepted == detailed.position_accepted


def test_a_short_final_draft_is_tried_only_where_it_drafted() -> None:
    """A step that drafted 2 slots (near max_tokens) and accepted both tries slots 0 and 1."""
    res = request_rounds({"num_spec_tokens": 6, "per_step_accepted": [2],
                          "per_step_drafted": [2]}, [])
    assert res.position_trials == [1, 1, 0, 0, 0, 0]
    assert res.tokens_per_round == [3]


def _vllm_page(drafts: float, accepted: float, per_pos: list[float]) -> str:
    """A vLLM /metrics page with two engines splitting every counter in halves."""
    lines = ["# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
             "# TYPE vllm:spec_decode_num_drafts_total counter"]
    for engine in ("0", "1"):
        lines += [f'vllm:spec_decode_num_drafts_total{{engine="{engine}"}} {drafts / 2}',
                  f'vllm:spec_decode_num_drafts_created{{engine="{engine}"}} 1.79e+09',
                  f'vllm:spec_decode_num_draft_tokens_total{{engine="{engine}"}} {drafts * 3}',
                  f'vllm:spec_decode_num_accepted_tokens_total{{engine="{engine}"}} '
                  f'{accepted / 2}']
        lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="{engine}",'
                  f'position="{p}"}} {v / 2}' for p, v in enumerate(per_pos)]
    return "\n".join(lines) + "\n"


def test_vllm_counter_change_gives_tau_and_conditional_acceptance() -> None:
    """Over 10 new drafts that accepted 8 tokens (6 at slot 0, 2 at slot 1, none at 2):
    tau = 1 + 8/10; slot 1 is tried by the 6 steps that accepted slot 0."""
    before = parse_counters(_vllm_page(4, 2, [2, 0, 0]))
    after = parse_counters(_vllm_page(14, 10, [8, 2, 0]))
    assert (after.drafts, after.accepted, after.accepted_per_position) == (
        14, 10, {0: 8, 1: 2, 2: 0})
    report = counters_acceptance(after.minus(before))
    assert report["tau"] == pytest.approx(1.8)
    assert report["rounds"] == 10
    assert report["position_trials"] == [10, 6, 2]
    assert report["acceptance_by_position"] == pytest.approx([0.6, 2 / 6, 0.0])
    assert report["tau_ci95"] is None


def test_sglang_mean_accept_length_over_the_run_is_weighted_by_requests() -> None:
    """SGLang keeps a running mean: 10 requests at 2.0, then 30 more with the mean at 2.5 give
    (2.5 * 40 - 2.0 * 10) / 30 over the new ones."""
    page = "sglang:spec_accept_length{{model_name=\"m\"}} {0}\n" \
           "sglang:num_requests_total{{model_name=\"m\"}} {1}\n"
    delta = parse_counters(page.format(2.5, 40)).minus(parse_counters(page.format(2.0, 10)))
    report = counters_acceptance(delta)
    assert report["tau"] == pytest.approx((2.5 * 40 - 2.0 * 10) / 30)
    assert "acceptance_by_position" not in report


def test_a_server_without_speculative_counters_is_refused() -> None:
    """No spec-decode change at all: the server is not serving a draft; one clear line."""
    with pytest.raises(SparkforgeError, match="no speculative decoding"):
        counters_acceptance(SpecCounters())
