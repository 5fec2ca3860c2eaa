"""``sparkforge parity`` on the HF backend: its batched capture against one-row forwards."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
from producer_helpers import chat_rows, producer_config, write_jsonl

from sparkforge.producer import hf_source
from sparkforge.producer.config import EngineOptions
from sparkforge.producer.parity import MAX_NOISE_TOL, NOISE_FACTOR, REL_TOL, LayerParity
from sparkforge.producer.parity_check import ParityFailed, parity
from sparkforge.producer.run import run
from sparkforge.shared.target_families import family_of


@pytest.fixture
def glm_config(tmp_path: Path, tiny_family: Callable[[str], Path]):
    """An HF-backend producer config over a tiny GLM-5 target and 6 chat rows."""
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(6))
    return producer_config(tiny_family("glm_moe_dsa"), data, str(tmp_path / "cache"),
                           parity_samples=6)


@pytest.fixture
def padded_glm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The HF backend as it was: GLM-5 rows right-padded into batches like every family."""
    def unsafe(model_type: str | None):
        return dataclasses.replace(family_of(model_type), padding_sensitive=False)

    monkeypatch.setattr(hf_source, "family_of", unsafe)


def test_hf_parity_passes_for_glm(glm_config) -> None:
    """GLM-5 rows captured by the HF backend equal one-row forwards: parity passes."""
    report = parity(glm_config)
    assert report.passed, report.table()
    assert max(layer.rel for layer in report.layers) < 1e-5


@pytest.mark.usefixtures("padded_glm")
def test_hf_parity_catches_padded_glm_rows(glm_config) -> None:
    """Padded GLM-5 batches fail parity; a produce run with parity_samples stops before writing."""
    report = parity(glm_config)
    assert not report.passed
    assert max(layer.rel for layer in report.layers) > 1e-2
    with pytest.raises(ParityFailed, match="hf capture disagrees"):
        run(glm_config)
    assert not (Path(glm_config.output) / "manifest.json").exists()


def test_bf16_capture_is_held_to_the_reference_own_bf16_noise(
    tmp_path: Path, tiny_family: Callable[[str], Path]
) -> None:
    """A bf16 Qwen3-Next capture is off fp32 by more than bf16's fixed limit, but within the
    reference's own bf16 noise (measured per layer): parity passes and reports that noise."""
    target = tiny_family("qwen3_next")
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(4))
    config = producer_config(target, data, str(tmp_path / "cache"), parity_samples=4,
                             engine=EngineOptions(model=str(target), max_model_len=128,
                                                  dtype="bfloat16"))
    report = parity(config)
    assert report.passed, report.table()
    assert report.dtype == "bfloat16"
    assert all(layer.dtype_noise is not None and layer.dtype_noise > 0
               for layer in report.layers)
    assert max(layer.rel for layer in report.layers) > REL_TOL["bfloat16"], report.table()
    assert "bfloat16 noise" in report.table()


@pytest.mark.parametrize(("noise", "expected"), [
    (None, REL_TOL["bfloat16"]),  # not measured: the dtype's fixed limit
    (1e-3, REL_TOL["bfloat16"]),  # quiet reference: never below the fixed limit
    (0.05, NOISE_FACTOR * 0.05),
    (0.5, MAX_NOISE_TOL),  # so noisy that order-one errors would hide: capped
])
def test_layer_limit_follows_the_measured_noise(noise: float | None, expected: float) -> None:
    """A layer's limit is max(fixed, NOISE_FACTOR x noise), never above MAX_NOISE_TOL."""
    layer = LayerParity(name="final", max_abs=1.0, rel=0.1, dtype_noise=noise)
    assert layer.tolerance("bfloat16") == pytest.approx(expected)
