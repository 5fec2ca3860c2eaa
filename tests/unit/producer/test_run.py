"""The producer run over a plain transformers forward: values, accounting, resume, workers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from producer_helpers import (
    ForwardSource,
    assert_same_samples,
    cache_samples,
    chat_rows,
    producer_config,
    write_jsonl,
)
from safetensors.torch import load as load_safetensors
from transformers import AutoModelForCausalLM, AutoTokenizer

from sparkforge.app.cli import main
from sparkforge.manifests.open import open_cache
from sparkforge.producer.run import CaptureAborted, run
from sparkforge.shared.io_errors import StorageError
from sparkforge.shared.records import SampleRows
from sparkforge.shared.writer import CacheMismatchError, CacheWriter, UnitStream

HF_IDS = (1, 2, 3)  # DSpark ids 0, 1, 2 of the 4-layer tiny target


@pytest.fixture(scope="module")
def source(tiny_target: Path) -> ForwardSource:
    return ForwardSource(tiny_target, layer_ids=HF_IDS, topk=3)


def test_cache_holds_the_forward_of_each_chat(tiny_target: Path, source, tmp_path: Path) -> None:
    """Ids, mask and hidden states in the cache equal an independent tokenize + forward, with
    16-row shards: each chat spans two to four slots (--shard_rows below --max_seq_len)."""
    rows = chat_rows(6)
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = producer_config(tiny_target, data, str(tmp_path / "cache"), topk=3, shard_rows=16)
    summary = run(cfg, source=source)
    assert summary.finalized
    index = open_cache(cfg.output).samples
    spans = (index.row_offset + index.length - 1) // 16 - index.slot + 1
    assert int(spans.min()) >= 2, spans
    assert int(spans.max()) >= 3, spans
    _assert_forward_of_each_chat(cfg.output, rows, tiny_target)


def _assert_forward_of_each_chat(uri: str, rows: list[dict], tiny_target: Path) -> None:
    """Every sample of the cache at ``uri`` equals a plain tokenize + whole forward of its row."""
    samples = cache_samples(uri)
    tok = AutoTokenizer.from_pretrained(tiny_target)
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    for i, row in enumerate(rows):
        enc = tok.apply_chat_template(row["messages"], tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        np.testing.assert_array_equal(samples[i]["input_ids"], enc["input_ids"])
        np.testing.assert_array_equal(samples[i]["loss_mask"], enc["assistant_masks"])
        with torch.no_grad():
            out = model(torch.tensor([enc["input_ids"]]), output_hidden_states=True)
        hs = out.hidden_states
        for slot, k in enumerate(HF_IDS):
            torch.testing.assert_close(torch.from_numpy(samples[i]["aux_hidden"][:, slot]),
                                       hs[k][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.from_numpy(samples[i]["final_hidden"]), hs[-1][0],
                                   rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(samples[i]["topk_ids"],
                                      out.logits[0].topk(3, dim=-1).indices.numpy())


def test_hf_backend_streams_chunks_and_a_crash_inside_a_sample_commits_nothing(
        tiny_target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With --hf_batch_tokens 16 the real HF backend forwards every chat (26-60 tokens) in
    chunks of 16 tokens, a KV cache carried between them, and each chunk reaches the writer as
    it is computed, so 16-row slots are written while their sample still arrives. The writer
    dies inside a sample: the unit is not committed although slots of it were written; the
    same command then completes a cache equal to one plain whole forward per chat."""
    rows = chat_rows(6)
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = producer_config(tiny_target, data, str(tmp_path / "cache"), topk=3, shard_rows=16,
                          hf_batch_tokens=16)
    real_add, blocks = UnitStream.add, []

    def dying_add(self: UnitStream, rows_: SampleRows) -> None:
        if len(blocks) == 6:
            raise OSError("disk gone")
        assert self._open is not None
        blocks.append((self._open.start.sample_id, rows_.num_rows))
        real_add(self, rows_)

    monkeypatch.setattr(UnitStream, "add", dying_add)
    with pytest.raises(StorageError, match="disk gone"):
        run(cfg)
    monkeypatch.undo()
    assert not list((tmp_path / "cache" / "_commits").glob("*.json"))
    assert list((tmp_path / "cache").glob("aux_hidden*/c/**/*")), "slots were written"
    per_sample = {i: [n for j, n in blocks if j == i] for i, _ in blocks}
    assert max(len(b) for b in per_sample.values()) >= 3, per_sample
    assert all(n <= 16 for b in per_sample.values() for n in b)
    assert run(cfg).finalized
    _assert_forward_of_each_chat(cfg.output, rows, tiny_target)


def test_target_files_and_header(tiny_target: Path, source, tmp_path: Path) -> None:
    """The cache carries config, tokenizer and embed/lm_head/norm weights, and both id lists."""
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(2))
    cfg = producer_config(tiny_target, data, str(tmp_path / "cache"), topk=3)
    run(cfg, source=source)
    reader = open_cache(cfg.output)
    weights = load_safetensors(reader.target_file("weights.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    torch.testing.assert_close(weights["lm_head.weight"], model.lm_head.weight, rtol=0, atol=0)
    torch.testing.assert_close(weights["norm.weight"], model.model.norm.weight, rtol=0, atol=0)
    torch.testing.assert_close(weights["embed_tokens.weight"], model.model.embed_tokens.weight,
                               rtol=0, atol=0)
    assert json.loads(reader.target_file("config.json"))["hidden_size"] == 128
    assert reader.target_file("tokenizer.json")
    header = json.loads((Path(cfg.output) / "_meta" / "header.json").read_text())["header"]
    assert header["capture"]["layer_ids"] == [1, 2, 3]
    assert header["producer_config"]["resolved"]["dspark_feature_ids"] == [0, 1, 2]
    assert "worker_index" not in header["producer_config"]


BAD_ROWS = {
    "malformed_json": ["{broken json", "[1, 2]", "[" * 200_000 + "]" * 200_000,
                       '{"input_ids": [' + "7" * 5000 + '], "loss_mask": [1]}'],
    "missing_messages": [{"text": "x"}],
    "unknown_role": [{"messages": [{"role": "robot", "content": "x"},
                                   {"role": "assistant", "content": "y"}]},
                     {"messages": [{"role": ["user"], "content": "x"},
                                   {"role": "assistant", "content": "y"}]},
                     {"messages": [{"role": {"name": "user"}, "content": "x"},
                                   {"role": "assistant", "content": "y"}]}],
    "bad_tool_calls": [{"messages": [{"role": "user", "content": "x"},
                                     {"role": "assistant", "content": "y", "tool_calls": 3}]}],
    "non_string_content": [{"messages": [{"role": "user", "content": 3},
                                         {"role": "assistant", "content": "y"}]}],
    "missing_assistant": [{"messages": [{"role": "user", "content": "only a question"}]}],
    "empty_assistant": [{"messages": [{"role": "user", "content": "q"},
                                      {"role": "assistant", "content": ""}]}],
    "too_long": [{"messages": [{"role": "user", "content": "word " * 200},
                               {"role": "assistant", "content": "y"}]},
                 # max_model_len (128) tokens: vLLM refuses such a prompt, so both backends skip it
                 {"input_ids": [5] * 128, "loss_mask": [1] * 128}],
    "no_loss_tokens": [{"input_ids": [5, 6, 7], "loss_mask": [0, 0, 0]}],
    "bad_pretokenized": [{"input_ids": [5, 6], "loss_mask": [1]},
                         {"input_ids": [5, 10**30], "loss_mask": [0, 1]},
                         '{"input_ids": [5, Infinity], "loss_mask": [0, 1]}',
                         {"input_ids": [5, 5.7], "loss_mask": [0, 1]},
                         {"input_ids": [5, "6"], "loss_mask": [0, 1]},
                         {"input_ids": [5, True], "loss_mask": [0, 1]},
                         {"input_ids": [5, 6], "loss_mask": [0, 0.5]}],
}


def test_bad_rows_are_counted_by_reason(tiny_target_plain_template: Path, tmp_path: Path) -> None:
    """Every bad row is skipped with its reason (none stops the run), failures are counted, and
    the sums add up."""
    good = chat_rows(5)
    lines: list = []
    for reason_rows in BAD_ROWS.values():
        for bad in reason_rows:
            lines += [good[len(lines) % 5], bad]
    data = write_jsonl(tmp_path / "d.jsonl", lines)
    good_ids = [i for i in range(len(lines)) if i % 2 == 0]
    fail_ids = frozenset(good_ids[:2])
    source = ForwardSource(tiny_target_plain_template, layer_ids=HF_IDS, fail_ids=fail_ids)
    cfg = producer_config(tiny_target_plain_template, data, str(tmp_path / "cache"))
    summary = run(cfg, source=source)
    manifest = open_cache(cfg.output).manifest
    acc = manifest.accounting
    assert acc.skipped == {reason: len(rows) for reason, rows in BAD_ROWS.items()}
    assert acc.failed == 2
    assert acc.written == len(good_ids) - 2
    assert acc.written + sum(acc.skipped.values()) + acc.failed == acc.input_rows == len(lines)
    assert summary.skipped == acc.skipped
    assert sorted(cache_samples(cfg.output)) == sorted(set(good_ids) - fail_ids)


def test_consecutive_failures_abort_and_keep_committed_units(tiny_target: Path,
                                                             tmp_path: Path) -> None:
    """N failures in a row stop the run with a clear error; earlier units stay committed."""
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(12))
    source = ForwardSource(tiny_target, layer_ids=HF_IDS, fail_ids=frozenset(range(4, 12)))
    cfg = producer_config(tiny_target, data, str(tmp_path / "cache"), max_consecutive_failures=3)
    with pytest.raises(CaptureAborted, match="3 consecutive"):
        run(cfg, source=source)
    assert source.calls == 7  # unit 0 (4 rows) and 3 failures in unit 1
    commits = sorted(p.name for p in (Path(cfg.output) / "_commits" / "0").iterdir())
    assert commits == ["unit_00000000.json"]


def test_resume_with_other_settings_is_refused(tiny_target: Path, source, tmp_path: Path) -> None:
    """Re-running into a cache made with other settings names the differing fields."""
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(3))
    cfg = producer_config(tiny_target, data, str(tmp_path / "cache"))
    run(cfg, source=source)
    changed = producer_config(tiny_target, data, cfg.output, layer_ids=[0, 2], overlong="truncate")
    with pytest.raises(CacheMismatchError) as info:
        run(changed, source=source)
    for name in ("producer_config.layer_ids", "producer_config.overlong", "capture.layer_ids"):
        assert name in str(info.value)
    # Settings that do not change the bytes may differ: this resumes (nothing left to do).
    again = producer_config(tiny_target, data, cfg.output, window=3, max_retries=0)
    assert run(again, source=source).units_done == 0


def test_writer_flags_reach_the_writer_and_its_memory_is_logged(
        tiny_target: Path, source, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """--writer_max_concurrency sizes the writer's pool and each stream's writes in flight,
    --writer_max_in_flight_bytes each stream's byte bound, and the writer memory logged at start
    counts that bound per thread beside the shard buffers (256 rows of 3 fp32 aux layers and the
    final hidden state at H=128, int32 ids, uint8 mask)."""
    opened: list[CacheWriter] = []
    real_open = CacheWriter.open

    def recording_open(*args: object, **kwargs: object) -> CacheWriter:
        opened.append(real_open(*args, **kwargs))  # type: ignore[arg-type]
        return opened[-1]

    monkeypatch.setattr(CacheWriter, "open", recording_open)
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(3))
    cfg = producer_config(tiny_target, data, str(tmp_path / "cache"), writer_threads=2,
                          writer_max_concurrency=3, writer_max_in_flight_bytes=1 << 20)
    with caplog.at_level("INFO", logger="sparkforge.producer.run"):
        assert run(cfg, source=source).finalized
    (writer,) = opened
    assert writer._pool._max_workers == 3
    assert (writer._target.max_in_flight, writer._target.max_bytes) == (3, 1 << 20)
    held = 2 * (256 * ((3 + 1) * 128 * 4 + 4 + 1) + (1 << 20))
    assert f"3 writes in flight, at most {held / 2**20:.1f} MiB held" in caplog.text


def test_two_workers_equal_one(tiny_target: Path, source, tmp_path: Path) -> None:
    """Two workers (sequential) + finalize give the same samples and bytes as one worker."""
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(10))
    single = producer_config(tiny_target, data, str(tmp_path / "single"), eval_fraction=0.3)
    run(single, source=source)
    shared = str(tmp_path / "shared")
    first = run(producer_config(tiny_target, data, shared, eval_fraction=0.3, worker_index=0,
                                num_workers=2), source=source)
    assert (first.units_done, first.finalized) == (2, False)
    assert main(["finalize", "--output", shared]) == 1  # unit 1 missing
    second = run(producer_config(tiny_target, data, shared, eval_fraction=0.3),
                 source=source, env={"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2"})
    assert (second.units_done, second.finalized) == (1, True)
    assert main(["finalize", "--output", shared]) == 0  # idempotent
    a, b = cache_samples(single.output), cache_samples(shared)
    assert_same_samples(a, b)
    assert {s["split"] for s in a.values()} == {"train", "eval"}


def test_eval_ids_mark_the_listed_rows(tiny_target: Path, source, tmp_path: Path) -> None:
    """Rows listed in --eval_ids land in the same cache marked eval, the others train."""
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(6))
    ids = tmp_path / "eval.txt"
    ids.write_text("1\n4\n")
    cfg = producer_config(tiny_target, data, str(tmp_path / "cache"), eval_ids=str(ids))
    run(cfg, source=source)
    splits = {i: s["split"] for i, s in cache_samples(cfg.output).items()}
    assert [i for i, s in sorted(splits.items()) if s == "eval"] == [1, 4]


def test_layer_ids_outside_the_target_name_the_flag(tiny_target: Path, tmp_path: Path) -> None:
    """Feature ids beyond [0, L-1] of the actual target are refused naming --layer_ids."""
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(1))
    cfg = producer_config(tiny_target, data, str(tmp_path / "cache"), layer_ids=[0, 4])
    with pytest.raises(ValueError, match="--layer_ids"):
        run(cfg, source=None)
    assert not (tmp_path / "cache").exists()


def test_layer_stride_captures_a_superset(tiny_target: Path, source, tmp_path: Path) -> None:
    """--layer_stride 1 --layer_start 0 captures every portable feature (HF ids 1..L-1)."""
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(2))
    cfg = producer_config(tiny_target, data, str(tmp_path / "cache"), layer_ids=None,
                          layer_stride=1, layer_start=0)
    assert run(cfg, source=source).finalized
    assert open_cache(cfg.output).manifest.capture.layer_ids == HF_IDS
    with pytest.raises(ValueError, match="both --layer_ids and --layer_stride"):
        producer_config(tiny_target, data, cfg.output, layer_stride=2)
