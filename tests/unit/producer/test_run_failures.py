"""How a producer run meets bad activations, empty or wrong input, storage failures and a
duplicate worker: a counted skip or one clear line, never a traceback or an empty "valid" cache."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from producer_helpers import (
    ForwardSource,
    assert_same_samples,
    cache_samples,
    chat_rows,
    poison_rows,
    poisoned_target,
    producer_config,
    write_jsonl,
)

from sparkforge.app.cli import main
from sparkforge.manifests.open import open_cache
from sparkforge.manifests.validate import validate_cache
from sparkforge.producer.run import (
    STALE_PARTIAL_S,
    NonFiniteActivations,
    NoSamplesWritten,
    run,
)
from sparkforge.shared.dataset import DatasetError

HF_IDS = (1, 2, 3)
POISON_TOKEN = 77


@pytest.fixture(scope="module")
def source(tiny_target: Path) -> ForwardSource:
    return ForwardSource(tiny_target, layer_ids=HF_IDS)


def test_non_finite_rows_are_skipped_and_counted(tiny_target: Path, tmp_path: Path) -> None:
    """A row whose activations hold NaN is counted as non_finite_activations, never written."""
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(6))
    nan_source = ForwardSource(tiny_target, layer_ids=HF_IDS, nan_ids=frozenset({1, 4}))
    cfg = producer_config(tiny_target, data, str(tmp_path / "cache"))
    run(cfg, source=nan_source)
    acc = open_cache(cfg.output).manifest.accounting
    assert acc.skipped == {"non_finite_activations": 2}
    assert sorted(cache_samples(cfg.output)) == [0, 2, 3, 5]


def test_non_finite_fail_policy_stops_before_the_unit_commits(tiny_target: Path,
                                                              tmp_path: Path) -> None:
    """non_finite=fail stops the run naming the sample; its unit is not committed, earlier are."""
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(8))
    nan_source = ForwardSource(tiny_target, layer_ids=HF_IDS, nan_ids=frozenset({5}))
    cfg = producer_config(tiny_target, data, str(tmp_path / "cache"), non_finite="fail")
    with pytest.raises(NonFiniteActivations, match="sample 5: aux_hidden holds 1 non-finite"):
        run(cfg, source=nan_source)
    commits = tmp_path / "cache" / "_commits" / "0"
    assert [p.name for p in commits.iterdir()] == ["unit_00000000.json"]


def test_empty_input_is_refused_before_anything_is_written(tiny_target: Path,
                                                           tmp_path: Path) -> None:
    """A data file with no rows fails naming --data; no cache is created."""
    data = write_jsonl(tmp_path / "d.jsonl", [])
    cfg = producer_config(tiny_target, data, str(tmp_path / "cache"))
    with pytest.raises(DatasetError, match="holds no rows"):
        run(cfg, source=None)
    assert not (tmp_path / "cache").exists()


def test_wrong_schema_fails_with_the_reason_every_time(tiny_target: Path, source,
                                                      tmp_path: Path) -> None:
    """Parquet without a messages column fails naming missing_messages, and so do the resume and
    `finalize`, instead of finishing an empty cache with exit status 0."""
    data = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"text": f"row {i}"} for i in range(6)]), data)
    cfg = producer_config(tiny_target, data, str(tmp_path / "cache"))
    for _ in range(2):  # the first run and its resume
        with pytest.raises(NoSamplesWritten,
                           match="every one of its 6 input rows was skipped as missing_messages"):
            run(cfg, source=source)
    assert main(["finalize", "--output", cfg.output]) == 1


def test_duplicate_worker_skips_what_the_other_committed(tiny_target: Path, tmp_path: Path):
    """A second worker on the same share that commits units first makes the first one skip
    them and finish normally, not stop at its first collision."""
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(12))
    cfg = producer_config(tiny_target, data, str(tmp_path / "cache"))

    class RacedSource(ForwardSource):
        """Runs a whole duplicate worker when asked for its first unit."""

        def capture(self, requests):
            if self.calls == 0:
                run(cfg, source=ForwardSource(tiny_target, layer_ids=HF_IDS))
            yield from super().capture(requests)

    summary = run(cfg, source=RacedSource(tiny_target, layer_ids=HF_IDS))
    assert (summary.units_done, summary.units_taken_over) == (0, 3)
    reference = producer_config(tiny_target, data, str(tmp_path / "reference"))
    run(reference, source=ForwardSource(tiny_target, layer_ids=HF_IDS))
    assert_same_samples(cache_samples(cfg.output), cache_samples(reference.output))


def test_stale_partial_files_are_removed_on_the_next_run(tiny_target: Path, source,
                                                         tmp_path: Path) -> None:
    """Temp files a killed write left behind go on the next run; a fresh one (a live writer's)
    stays."""
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(4))
    cfg = producer_config(tiny_target, data, str(tmp_path / "cache"))
    run(cfg, source=source)
    cache = Path(cfg.output)
    stale = [cache / "_commits" / f".unit_00000007.json.{'a' * 32}.partial",
             cache / "aux_hidden.0" / "c" / "9" / f"0.{'b' * 32}.partial"]
    fresh = cache / "_commits" / f".unit_00000008.json.{'c' * 32}.partial"
    old = time.time() - STALE_PARTIAL_S - 60
    for path in [*stale, fresh]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"half a write")
    for path in stale:
        os.utime(path, (old, old))
    run(cfg, source=source)
    assert [p.exists() for p in stale] == [False, False]
    assert fresh.exists()


def test_an_all_zero_slot_is_stored_and_valid(tiny_target: Path, source, tmp_path: Path) -> None:
    """Rows whose token ids are all 0 give an all-zero input_ids slot that is still stored, so
    validate finds every committed object."""
    rows = [{"input_ids": [0] * 6, "loss_mask": [0, 0, 1, 1, 1, 1]} for _ in range(3)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = producer_config(tiny_target, data, str(tmp_path / "cache"))
    run(cfg, source=source)
    assert [s["input_ids"].any() for s in cache_samples(cfg.output).values()] == [False] * 3
    report = validate_cache(cfg.output, deep=True)
    assert report.problems == []


def _config_file(tmp_path: Path, model: Path, data: Path, output: str, **extra) -> Path:
    cfg = {"data": str(data), "output": output, "backend": "hf", "layer_ids": [0, 1, 2],
           "hidden_dtype": "bfloat16", "rows_per_unit": 64, "shard_rows": 4096,
           "progress": False, "hf_device": "cpu",
           "engine": {"model": str(model), "max_model_len": 128, "dtype": "float32"}, **extra}
    path = tmp_path / f"{Path(output).name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


BIG_SLOTS = {"rows_per_unit": 256, "shard_rows": 8192}
"""One unit of 256 rows (~12k tokens) whose first 8192-row slot holds a shard of one aux layer
over 768 KiB."""


def _limit_file_size() -> None:
    # A file-size limit makes the kernel refuse writes past 768 KiB (EFBIG), as a full disk does
    # (ENOSPC): the target weights (513 KiB) fit, the first shard of an aux layer does not
    # (~8192 rows x H=128 bf16, about 1 MB compressed; see BIG_SLOTS).
    # Python ignores SIGXFSZ, so the write fails instead of killing the process.
    resource.setrlimit(resource.RLIMIT_FSIZE, (768 << 10, 768 << 10))


def test_refused_writes_end_in_one_line_and_resume_cleanly(tiny_target: Path,
                                                          tmp_path: Path) -> None:
    """When the file system refuses a shard, produce exits 1 with one line naming the output,
    leaves no temp file and no commit, and the same command then completes the same cache."""
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(256))
    config = _config_file(tmp_path, tiny_target, data, str(tmp_path / "cache"), **BIG_SLOTS)
    command = [sys.executable, "-P", "-m", "sparkforge.app.cli", "produce", "--config",
               str(config)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    limited = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600,
                             preexec_fn=_limit_file_size, check=False)
    assert limited.returncode == 1, limited.stderr[-3000:]
    assert "Traceback" not in limited.stderr
    (line,) = [x for x in limited.stderr.splitlines() if "error:" in x]
    assert line.startswith(f"sparkforge produce: error: output {tmp_path / 'cache'}: ")
    assert "File too large" in line
    cache = tmp_path / "cache"
    assert not list(cache.rglob("*.partial"))
    assert not list(cache.glob("_commits/*"))
    assert main(["produce", "--config", str(config)]) == 0
    reference = _config_file(tmp_path, tiny_target, data, str(tmp_path / "reference"),
                             **BIG_SLOTS)
    assert main(["produce", "--config", str(reference)]) == 0
    assert_same_samples(cache_samples(str(cache)), cache_samples(str(tmp_path / "reference")))
    assert validate_cache(str(cache), deep=True).problems == []


@pytest.mark.parametrize("failure", ["missing bucket", "endpoint gone"])
def test_object_store_failures_end_in_one_line(tiny_target: Path, moto_server: dict,
                                               tmp_path: Path, capsys, failure: str) -> None:
    """An output bucket that does not exist, or an S3 endpoint that is gone, exits 1 with one
    line naming the output URI and what to check."""
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(2))
    options = moto_server["storage_options"]
    output = f"s3://{moto_server['bucket']}/cache"
    if failure == "missing bucket":
        output = "s3://no-such-bucket/cache"
    else:
        options = {**options, "endpoint_url": "http://127.0.0.1:9",
                   "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}}}
    config = _config_file(tmp_path, tiny_target, data, output, storage_options=options)
    assert main(["produce", "--config", str(config)]) == 1
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if "error:" in x]
    assert line.startswith(f"sparkforge produce: error: output {output}: "), line
    assert "Traceback" not in err


def test_hf_backend_skips_rows_the_target_makes_non_finite(tiny_target: Path,
                                                           tmp_path: Path) -> None:
    """With the real transformers backend, rows that drive the target to inf/NaN are counted as
    non_finite_activations; the other rows are written."""
    model = poisoned_target(tiny_target, tmp_path / "poisoned", POISON_TOKEN)
    data = write_jsonl(tmp_path / "d.jsonl", poison_rows(6, POISON_TOKEN, frozenset({2, 3})))
    cfg = producer_config(model, data, str(tmp_path / "cache"), hf_device="cpu")
    run(cfg, source=None)
    acc = open_cache(cfg.output).manifest.accounting
    assert (acc.written, acc.skipped) == (4, {"non_finite_activations": 2})
    assert sorted(cache_samples(cfg.output)) == [0, 1, 4, 5]


@pytest.mark.parametrize("hidden_dtype", ["bfloat16", "float16", "float32"])
def test_non_finite_scan_finds_every_bad_token_across_blocks(monkeypatch, hidden_dtype) -> None:
    """The block-wise scan counts NaN and inf in any block, in every storage dtype, and names
    the first bad token; finite values (the largest included) pass."""
    import numpy as np

    from sparkforge.producer import capture
    from sparkforge.shared.dtypes import float_to_storage
    from sparkforge.shared.records import SampleRecord

    monkeypatch.setattr(capture, "_SCAN_ELEMENTS", 2 * 3 * 4)  # two tokens per block
    big = float(np.finfo(np.float16 if hidden_dtype == "float16" else np.float32).max)
    aux = np.full((7, 3, 4), big, dtype=np.float32)
    final = np.ones((7, 4), dtype=np.float32)

    def record(aux: np.ndarray) -> SampleRecord:
        return SampleRecord(
            sample_id=9, source_row=9, source_hash="ab", split="train",
            input_ids=np.zeros(7, np.int32), loss_mask=np.ones(7, np.uint8),
            aux_hidden=float_to_storage(aux, hidden_dtype),
            final_hidden=float_to_storage(final, hidden_dtype))

    if hidden_dtype != "bfloat16":  # bf16 rounds float32's max up to inf
        assert capture.non_finite_problem(record(aux), hidden_dtype) is None
    aux[:] = 1.0
    aux[3, 1, 2], aux[6, 0, 0], aux[6, 2, 3] = np.nan, np.inf, -np.inf
    assert capture.non_finite_problem(record(aux), hidden_dtype) == (
        "sample 9: aux_hidden holds 3 non-finite values in 2 of 7 tokens, first at token 3")


def test_rows_a_template_loops_on_are_skipped_as_template_timeout(tiny_target: Path,
                                                                  tmp_path: Path) -> None:
    """A template that passes the start-up check but loops for ever on rows holding a marker:
    produce (real transformers backend) stops each such row at --template_row_seconds, counts
    it as template_timeout and writes the other rows."""
    from transformers import AutoTokenizer

    own = AutoTokenizer.from_pretrained(tiny_target).chat_template
    template = ("{% for m in messages %}{% if 'LOOP' in m['content'] %}"
                "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
                "{% endif %}{% endfor %}" + own)
    rows = chat_rows(6)
    for i in (1, 4):
        rows[i]["messages"][0]["content"] += " LOOP"
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = producer_config(tiny_target, data, str(tmp_path / "cache"), hf_device="cpu",
                          chat_template=template, template_row_seconds=0.5)
    run(cfg, source=None)
    acc = open_cache(cfg.output).manifest.accounting
    assert (acc.written, acc.skipped) == (4, {"template_timeout": 2})
    assert sorted(cache_samples(cfg.output)) == [0, 2, 3, 5]
