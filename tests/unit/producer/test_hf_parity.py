"""``sparkforge parity`` on the HF backend: its batched capture against one-row forwards."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
from producer_helpers import chat_rows, producer_config, write_jsonl

from sparkforge.producer import hf_source
from sparkforge.producer.run import ParityFailed, parity, run
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
