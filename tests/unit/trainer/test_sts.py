"""STS of the confidence head: it recovers known per-slot temperatures, and its file carries the
keys TensorRT-LLM, SGLang and DeepSpec read."""

from __future__ import annotations

import numpy as np
import pytest

from sparkforge.trainer.eval.decode_result import SpecDecodeResult
from sparkforge.trainer.eval.head_calibration import SlotRows, calibration_study, speculative_rows
from sparkforge.trainer.eval.sts import calibration_file, fit_sts, survival, survival_metrics

TRUE_T = [2.0, 0.5, 1.0]


def _blocks(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Logits whose true conditional acceptance is sigmoid(logit / TRUE_T[k]); the label is
    the exact expected survival; every slot verified."""
    logits = np.random.default_rng(seed).normal(0.5, 2.0, size=(n, 3))
    return logits, survival(logits, TRUE_T), np.ones((n, 3), dtype=bool)


def test_sts_recovers_the_temperatures_that_calibrate_the_survival() -> None:
    """Fitted slot by slot, the temperatures land on the true ones (grid step ~2.4%) and the
    survival's ECE drops from the raw head's to about zero."""
    logits, survived, valid = _blocks(4000, 0)
    fitted = fit_sts(logits, survived, valid)
    assert fitted == pytest.approx(TRUE_T, rel=0.05)
    before = survival_metrics(logits, survived, valid, [1.0] * 3, events=False)
    after = survival_metrics(logits, survived, valid, fitted, events=False)
    assert before["ece"] > 0.03
    assert after["ece"] < 0.01
    assert len(after["ece_by_position"]) == 3


def test_a_slot_without_data_keeps_temperature_one() -> None:
    """Slots never verified (blocks cut before them) get T=1, not an arbitrary grid value."""
    logits, survived, valid = _blocks(500, 1)
    valid[:, 2] = False
    assert fit_sts(logits, survived, valid)[2] == 1.0


def test_the_file_names_the_temperatures_both_ways() -> None:
    """sts_temperatures (TensorRT-LLM) and temperatures (SGLang, DeepSpec) hold the same list,
    one per slot; metadata rides along."""
    contents = calibration_file([1.5, 0.8], fit_blocks=10)
    assert contents["sts_temperatures"] == contents["temperatures"] == [1.5, 0.8]
    assert contents["num_positions"] == 2
    assert contents["fit_blocks"] == 10


def test_speculative_rounds_become_prefix_survival_events() -> None:
    """A round that verified 3 slots and accepted 1 survived slot 0 only; a round that verified
    2 and accepted both survived both; unverified slots are not counted."""
    res = SpecDecodeResult(tokens=[], position_accepted=[0] * 3, position_trials=[0] * 3)
    res.count_round(verified=3, accepted=1)
    res.count_round(verified=2, accepted=2)
    res.round_confidence_logits = [[0.1, 0.2, 0.3], [1.0, 2.0]]
    res.round_max_q = [[0.5, 0.6, 0.7], [0.8, 0.9]]
    rows = speculative_rows([res], 3)
    assert rows.valid_NK.tolist() == [[True, True, True], [True, True, False]]
    assert rows.survived_NK.tolist() == [[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
    assert rows.head_NK[1].tolist() == [1.0, 2.0, 0.0]


def test_the_study_compares_the_head_and_max_q_before_and_after() -> None:
    """Four estimators (raw and STS, head and max q) on the held-out blocks; a head with wrong
    temperatures improves after STS."""
    logits, survived, valid = _blocks(2000, 2)
    max_q = np.full_like(logits, 0.5)   # an estimator that knows nothing
    fit = SlotRows(logits, max_q, survived, valid)
    test_logits, test_survived, _ = _blocks(2000, 3)
    test = SlotRows(test_logits, max_q, test_survived, valid)
    section = calibration_study(fit, test, None)
    rows = section["estimators"]
    assert set(rows) == {"head", "head + STS", "max_q", "max_q + STS"}
    assert rows["head + STS"]["teacher_forced"]["ece"] < rows["head"]["teacher_forced"]["ece"]
    assert section["temperatures"]["head"] == pytest.approx(TRUE_T, rel=0.05)
