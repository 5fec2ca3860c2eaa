"""sparkforge plan: the estimate is within a stated tolerance of a cache of real activations."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from cache_helpers import make_header

from sparkforge.app.cli import main
from sparkforge.manifests.finalize import finalize_cache
from sparkforge.manifests.plan import plan_cache
from sparkforge.manifests.summary import summarize_cache
from sparkforge.shared.dtypes import float_to_storage
from sparkforge.shared.header import RunHeader
from sparkforge.shared.layout import CacheSpec, array_layouts
from sparkforge.shared.records import SampleRecord, UnitAccounting
from sparkforge.shared.writer import CacheWriter

LAYER_IDS = (1, 2, 3)
NUM_SAMPLES, ROWS_PER_UNIT = 40, 8
TOLERANCE = 0.10
"""Estimated bytes within 10% of the bytes the writer stored."""


@pytest.fixture(scope="module")
def activations(tiny_target: Path) -> list[dict[str, np.ndarray]]:
    """Hidden states of the tiny Qwen3 target (HF forward) over random-length token sequences."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    out = []
    with torch.no_grad():
        for _ in range(NUM_SAMPLES):
            ids = torch.from_numpy(rng.integers(4, 1024, int(rng.integers(64, 513))))
            res = model(ids[None], output_hidden_states=True)
            out.append({"ids": ids.numpy().astype(np.int32),
                        "aux": torch.stack([res.hidden_states[k][0] for k in LAYER_IDS], 1).numpy(),
                        "final": res.hidden_states[-1][0].numpy()})
    return out


def _write(path: Path, spec: CacheSpec, acts: list[dict[str, np.ndarray]]) -> None:
    header = make_header(spec)
    header["capture"]["layer_ids"] = list(LAYER_IDS)
    w = CacheWriter.open(str(path), spec=spec, header=RunHeader.from_json(header))
    for unit in range(NUM_SAMPLES // ROWS_PER_UNIT):
        samples = []
        for row in range(unit * ROWS_PER_UNIT, (unit + 1) * ROWS_PER_UNIT):
            a, t = acts[row], len(acts[row]["ids"])
            samples.append(SampleRecord(
                sample_id=row, source_row=row, split="train",
                source_hash=hashlib.sha256(str(row).encode()).hexdigest(),
                input_ids=a["ids"], loss_mask=(np.arange(t) > t // 3).astype(np.uint8),
                aux_hidden=float_to_storage(a["aux"], spec.hidden_dtype),
                final_hidden=float_to_storage(a["final"], spec.hidden_dtype)))
        w.write_unit(unit, samples, UnitAccounting(input_rows=ROWS_PER_UNIT,
                                                   written=ROWS_PER_UNIT))
    finalize_cache(str(path), expected_units=NUM_SAMPLES // ROWS_PER_UNIT)


@pytest.mark.slow
@pytest.mark.parametrize("aux_codec", ["lossless", "fp8"])
def test_plan_matches_a_written_cache(tmp_path: Path, activations: list[dict[str, np.ndarray]],
                                      aux_codec: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Bytes within 10%, shards within one per unit, objects exact, for real tiny-target data."""
    spec = CacheSpec(hidden_size=128, num_aux_layers=3, hidden_dtype="bfloat16", max_seq_len=512,
                     shard_rows=2048, rows_per_unit=ROWS_PER_UNIT, aux_codec=aux_codec)  # type: ignore[arg-type]
    _write(tmp_path / "c", spec, activations)
    actual = summarize_cache(str(tmp_path / "c"))
    tokens = actual["tokens"]
    plan = plan_cache(spec, num_tokens=tokens, mean_seq_len=tokens / NUM_SAMPLES)
    assert plan["total_bytes"] == pytest.approx(actual["data_bytes"], rel=TOLERANCE)
    assert plan["num_units"] == actual["units"]
    assert abs(plan["num_shards"] - actual["shards"]) <= actual["units"]
    assert plan["objects"] - plan["num_shards"] * len(array_layouts(spec)) == \
        actual["objects"] - actual["shards"] * len(actual["arrays"])

    argv = ["plan", "--hidden_size", "128", "--num_aux_layers", "3", "--num_tokens", str(tokens),
            "--mean_seq_len", str(tokens / NUM_SAMPLES), "--aux_codec", aux_codec,
            "--shard_rows", "2048", "--rows_per_unit", str(ROWS_PER_UNIT), "--json"]
    capsys.readouterr()
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["total_bytes"] == plan["total_bytes"]
    print(f"{aux_codec}: plan {plan['total_bytes']:,} B ({plan['bytes_per_token']:.1f} B/tok), "
          f"stored {actual['data_bytes']:,} B ({actual['data_bytes'] / tokens:.1f} B/tok)")
