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


def test_regeneration_sampling_of_the_sources_is_typed_into_the_data_section() -> None:
    """Distinct sampling settings of regenerated parts land in data.regeneration once each; a
    part written before top_k was recorded reads as vLLM's default (-1); plain sources add none."""
    cfg = ProducerConfig(data="parts/", output="out", backend="hf", shard_rows=512,
                         engine=EngineOptions(model="m", max_model_len=256))
    new = {"temperature": 0.6, "top_p": 1.0, "top_k": 20, "seed": 3, "max_tokens": 64,
           "model": "m"}
    old = {"temperature": 1.0, "top_p": 0.9, "seed": 0, "max_tokens": 32}
    sources = [DataSource(uri=f"parts/{i}.parquet", format="parquet", num_rows=4,
                          content_hash=f"{i:02d}" * 32,
                          metadata={} if params is None else {"sparkforge.regenerate": params})
               for i, params in enumerate([new, new, old, None])]
    header = build_header(cfg, target=TARGET, hf_layer_ids=HfIndices((1, 2)), encoder=ENCODER,  # type: ignore[arg-type]
                          inputs=InputRows(sources=sources, num_rows=16), num_units=1,
                          eval_ids=None, scaling=TargetScaling())
    assert RunHeader.from_json(header.to_json()) == header
    got = {(s.temperature, s.top_p, s.top_k, s.seed, s.max_tokens)
           for s in header.data.regeneration}
    assert got == {(0.6, 1.0, 20, 3, 64), (1.0, 0.9, -1, 0, 32)}
    assert len(header.data.regeneration) == 2
