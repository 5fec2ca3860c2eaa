"""Matched evaluation: the eval split's sampling decides whether the two taus must agree."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sparkforge.shared.header import SamplingInfo
from sparkforge.trainer.eval.matched import matched_report, split_sampling

SPEC = {"tau": 3.0, "tau_ci95": [2.8, 3.2], "rounds": 40}
FORCED = {"metrics": {"tau": 3.1}, "tau_ci95": [3.0, 3.2],
          "full_blocks": {"tau": 3.1, "tau_ci95": [3.0, 3.2], "blocks": 90, "cut_blocks": 10}}


def _manifest(typed: tuple[SamplingInfo, ...], resolved: list[dict]) -> SimpleNamespace:
    return SimpleNamespace(data=SimpleNamespace(regeneration=typed),
                           producer_config={"resolved": {"regeneration": resolved}})


def test_sampling_comes_from_the_manifest_field_else_the_resolved_record() -> None:
    """The typed data.regeneration wins; an older cache's resolved record (no top_k) is read
    with vLLM's default top_k; a cache of hand-written replies has none."""
    typed = (SamplingInfo(temperature=0.6, top_p=1.0, top_k=-1, seed=0, max_tokens=8),)
    assert split_sampling(_manifest(typed, [])) == [{"temperature": 0.6, "top_p": 1.0,
                                                     "top_k": -1}]
    old = [{"temperature": 0.0, "top_p": 0.9, "seed": 0, "max_tokens": 8}]
    assert split_sampling(_manifest((), old)) == [{"temperature": 0.0, "top_p": 0.9,
                                                   "top_k": -1}]
    assert split_sampling(_manifest((), [])) == []


@pytest.mark.parametrize(("sampling", "temperature", "matched", "compared"), [
    ([{"temperature": 1.0, "top_p": 1.0, "top_k": -1}], 1.0, True, True),
    ([{"temperature": 0.0, "top_p": 1.0, "top_k": -1}], 1.0, False, False),
    ([{"temperature": 1.0, "top_p": 0.9, "top_k": -1}], 1.0, False, False),
    ([{"temperature": 1.0, "top_p": 1.0, "top_k": 20}], 1.0, False, False),
    ([{"temperature": 0.0, "top_p": 1.0, "top_k": -1}], 0.0, True, False),
    ([], 1.0, None, False),
])
def test_the_taus_are_compared_only_on_the_same_distribution(
        sampling: list, temperature: float, matched: bool | None, compared: bool) -> None:
    """Only an eval split sampled from the target's untruncated T=1 distribution, measured at
    T=1 (the teacher-forced acceptance's temperature), gets a verdict; otherwise a note."""
    report = matched_report(sampling, temperature, SPEC, FORCED)
    assert report["matched"] is matched
    assert ("agreement" in report) is compared
    assert ("note" in report) is not compared
    if compared:
        assert report["agreement"]["agree"] is True


def test_default_eval_measures_at_the_default_regeneration_temperature() -> None:
    """Out of the box, eval samples at the temperature regenerate samples at: matched."""
    from sparkforge.producer.config import RegenerateConfig
    from sparkforge.producer.engine_options import EngineOptions
    from sparkforge.trainer.job_config import EvalConfig

    regen = RegenerateConfig(data="d", output="o", engine=EngineOptions(model="m"))
    sampling = [{"temperature": regen.temperature, "top_p": regen.top_p, "top_k": regen.top_k}]
    evaluation = EvalConfig(draft="d", target="t", out_dir="o", cache="c")
    assert matched_report(sampling, evaluation.temperature, SPEC, FORCED)["matched"] is True


def test_the_taus_are_compared_on_full_blocks() -> None:
    """The verdict uses the teacher-forced tau of full blocks (a cut block stops as if rejected,
    a speculative round never does), not the headline tau over every block."""
    matched = [{"temperature": 1.0, "top_p": 1.0, "top_k": -1}]
    cut_low = {**FORCED, "metrics": {"tau": 2.5}, "tau_ci95": [2.4, 2.6]}
    report = matched_report(matched, 1.0, SPEC, cut_low)
    assert report["agreement"]["difference"] == pytest.approx(3.0 - 3.1)
    assert report["agreement"]["agree"] is True
    far = {**FORCED, "full_blocks": {**FORCED["full_blocks"], "tau": 2.5,
                                     "tau_ci95": [2.4, 2.6]}}
    assert matched_report(matched, 1.0, SPEC, far)["agreement"]["agree"] is False
