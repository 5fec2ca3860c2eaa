"""The HF backend captures, for every target family, what a one-row transformers forward gives."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_families import COMPOSITES, MODEL_TYPES

from sparkforge.producer.hf_source import HfSource
from sparkforge.producer.source import CaptureRequest

LAYER_IDS = (1, 2, 3)


def _requests() -> list[CaptureRequest]:
    """Lengths on both sides of GLM's index_topk (8) and MiniMax's block size (4)."""
    rng = np.random.default_rng(0)
    return [CaptureRequest(sample_id=i, input_ids=rng.integers(4, 1000, n).astype(np.int32))
            for i, n in enumerate((40, 7, 23, 33, 12))]


def _one_row_reference(target: Path, model_type: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(aux [T, F, H], final [T, H]) per request from a plain forward of that row alone."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if model_type in COMPOSITES else AutoModelForCausalLM
    model = auto.from_pretrained(str(target), dtype=torch.float32).eval()
    out = []
    for request in _requests():
        with torch.no_grad():
            states = model(input_ids=torch.from_numpy(request.input_ids.astype(np.int64))[None],
                           output_hidden_states=True).hidden_states
        # A DeepSeek-V4 layer output is [1, T, hc_mult, H]; its feature is the stream mean.
        aux = [states[k][0] if states[k].dim() == 3 else states[k][0].mean(1) for k in LAYER_IDS]
        out.append((torch.stack(aux, dim=1), states[-1][0]))
    return out


def _max_rel_error(source: HfSource, reference: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    worst = 0.0
    for got, (aux, final) in zip(source.capture(_requests()), reference, strict=True):
        for a, b in ((got.aux_hidden, aux), (got.final_hidden, final)):
            worst = max(worst, float((a - b).norm() / b.norm()))
    return worst


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_batched_capture_equals_one_row_forward(
    model_type: str, tiny_family: Callable[[str], Path]
) -> None:
    """Each family's default HF capture of mixed-length rows equals each row's own forward."""
    target = tiny_family(model_type)
    source = HfSource(str(target), layer_ids=LAYER_IDS, max_batch_tokens=4096)
    assert _max_rel_error(source, _one_row_reference(target, model_type)) < 1e-5


def test_padded_batches_change_glm_rows(tiny_family: Callable[[str], Path]) -> None:
    """GLM-5 rows padded into a batch differ from the row alone (so the family runs rows alone)."""
    target = tiny_family("glm_moe_dsa")
    source = HfSource(str(target), layer_ids=LAYER_IDS, max_batch_tokens=4096)
    assert source.one_row
    source.one_row = False  # the padded batching every other family uses
    assert _max_rel_error(source, _one_row_reference(target, "glm_moe_dsa")) > 1e-2
