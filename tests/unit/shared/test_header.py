"""The run header: its JSON and its parser are inverses, and the writer refuses a bad one."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from cache_helpers import SMALL_SPEC, make_header, make_run_header

from sparkforge.shared.fields import ManifestError
from sparkforge.shared.header import RunHeader
from sparkforge.shared.layout import CacheSpec
from sparkforge.shared.writer import CacheWriter

SPEC = CacheSpec(hidden_size=32, num_aux_layers=2, hidden_dtype="float32", max_seq_len=16,
                 shard_rows=64, rows_per_unit=4)


@pytest.mark.parametrize("split", [{"eval_fraction": 0.25}, {"eval_ids": [3, 7]}, {}])
def test_header_json_round_trips(split: dict) -> None:
    """to_json(from_json(x)) == x, with an unset split rule left out as the producer writes it."""
    raw = make_header(SPEC)
    del raw["data"]["eval_fraction"]
    raw["data"].update(split)
    assert RunHeader.from_json(raw).to_json() == raw


def test_num_units_is_read_typed() -> None:
    """num_units comes from producer_config.resolved and names the field when it is absent."""
    raw = make_header(SPEC)
    raw["producer_config"]["resolved"] = {"num_units": 12}
    assert RunHeader.from_json(raw).num_units == 12
    with pytest.raises(ManifestError, match=r"producer_config\.resolved"):
        _ = make_run_header(SPEC).num_units


def test_writer_refuses_a_bad_header_before_creating_the_store(tmp_path: Path) -> None:
    """A header that would not parse back fails at open, naming the field; nothing is written."""
    header = make_run_header(SPEC)
    bad = dataclasses.replace(header, capture=dataclasses.replace(header.capture, layer_ids=()))
    with pytest.raises(ManifestError, match=r"capture\.layer_ids"):
        CacheWriter.open(str(tmp_path / "c"), spec=SPEC, header=bad)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(("model_type", "scale"), [("qwen3", 1.0), ("gemma4_text", 4.0),
                                                   ("gemma4", 4.0), ("kimi_linear", 1.0)])
def test_header_without_scaling_fields_reads_the_family_default(model_type: str,
                                                                scale: float) -> None:
    """A header written before the scaling fields reads its family's embedding scale (sqrt(H)
    for Gemma, 1.0 otherwise; H=16 here) and no softcap."""
    data = make_header(SMALL_SPEC)
    data["target"]["model_type"] = model_type
    for key in ("embedding_scale", "final_logit_softcapping"):
        del data["capture"][key]
    capture = RunHeader.from_json(data).capture
    assert (capture.embedding_scale, capture.final_logit_softcapping) == (scale, None)


@pytest.mark.parametrize(("change", "message"), [
    ({"first_sample": 1}, r"data.mix\[0\].first_sample"),
    ({"num_sources": 2}, r"data.mix\[0\].num_sources"),
    ({"weight": "x"}, r"data.mix\[0\].weight"),
])
def test_bad_mix_names_its_field(change: dict, message: str) -> None:
    """A mix entry whose samples leave a gap, or that names missing files, is refused."""
    header = make_run_header(SMALL_SPEC).to_json()
    header["data"]["mix"] = [{"name": "a", "data": "a.jsonl", "weight": 1.0, "source_rows": 3,
                              "rows": 3, "first_sample": 0, "first_source": 0,
                              "num_sources": 1, **change}]
    with pytest.raises(ManifestError, match=message):
        RunHeader.from_json(header)
