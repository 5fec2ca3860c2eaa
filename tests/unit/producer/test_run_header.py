"""The producer's run header is typed at construction and parses back unchanged."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sparkforge.producer.config import ProducerConfig
from sparkforge.producer.engine_options import EngineOptions
from sparkforge.producer.header import build_header
from sparkforge.producer.inputs import InputRows
from sparkforge.shared.dataset import DataSource
from sparkforge.shared.header import RunHeader, TargetInfo
from sparkforge.shared.layer_ids import HfIndices
from sparkforge.shared.target_families import TargetScaling

TARGET = TargetInfo(name_or_path="m", revision=None, content_hash="ab" * 32, model_type="qwen3",
                    architecture="Qwen3ForCausalLM", vocab_size=1024, hidden_size=32,
                    num_hidden_layers=4, dtype="float32", quantization=None)
ENCODER = SimpleNamespace(uses_generation_tags=False, tokenizer_hash="cd" * 32,
                          template_sha256="ef" * 32)


@pytest.mark.parametrize("eval_ids", [None, frozenset({5, 2})])
def test_built_header_parses_at_write_time(eval_ids: frozenset[int] | None) -> None:
    """build_header's JSON is what the parser reads back, with num_units typed."""
    cfg = ProducerConfig(data="d.jsonl", output="out", backend="hf", shard_rows=512,
                         engine=EngineOptions(model="m", max_model_len=256))
    sources = [DataSource(uri="d.jsonl", format="jsonl", num_rows=9, content_hash="01" * 32,
                          metadata={})]
    header = build_header(cfg, target=TARGET, hf_layer_ids=HfIndices((1, 2)), encoder=ENCODER,  # type: ignore[arg-type]
                          inputs=InputRows(sources=sources, num_rows=9), num_units=3,
                          eval_ids=eval_ids,
                          scaling=TargetScaling(embedding_scale=8.0, final_logit_softcapping=30.0))
    assert RunHeader.from_json(header.to_json()) == header
    assert header.capture.scaling == TargetScaling(embedding_scale=8.0,
                                                   final_logit_softcapping=30.0)
    assert header.num_units == 3
    assert header.to_json()["producer_config"]["resolved"]["dspark_feature_ids"] == [0, 1]
