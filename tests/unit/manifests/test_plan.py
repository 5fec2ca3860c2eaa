"""sparkforge plan: the arithmetic of the estimate and its command line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from sparkforge.app.cli import main
from sparkforge.manifests.plan import human_bytes, plan_cache, target_shape_from_config
from sparkforge.shared.layout import CacheSpec


def test_lossless_bytes_per_token_by_hand() -> None:
    """bf16 lossless: (F+1) * 2H / 1.45 for the hidden arrays plus ids/3.4 and mask/100."""
    spec = CacheSpec(hidden_size=4096, num_aux_layers=5, hidden_dtype="bfloat16",
                     max_seq_len=4096)
    plan = plan_cache(spec, num_tokens=10**9, mean_seq_len=1024)
    expected = 6 * 2 * 4096 / 1.45 + 4 / 3.4 + 1 / 100
    assert plan["bytes_per_token"] == pytest.approx(expected)
    assert plan["total_bytes"] == int(expected * 10**9)
    assert plan["num_samples"] == 976_563
    assert plan["num_units"] == 3815  # ceil(976563 / 256)


def test_fp8_aux_is_smaller_and_keeps_final_lossless() -> None:
    """fp8 shrinks only aux_hidden (codes / 1.18 + a float32 scale per layer)."""
    spec = CacheSpec(hidden_size=2048, num_aux_layers=3, hidden_dtype="bfloat16",
                     max_seq_len=2048, aux_codec="fp8")
    arrays = plan_cache(spec, num_tokens=1000, mean_seq_len=100)["arrays"]
    assert arrays["aux_hidden"]["bytes_per_token"] == pytest.approx(3 * 2048 / 1.18)
    assert arrays["aux_scale"]["raw_bytes_per_token"] == 12
    assert arrays["final_hidden"]["bytes_per_token"] == pytest.approx(2 * 2048 / 1.45)


def test_shards_follow_unit_packing() -> None:
    """Each unit packs into its own slots: 256 samples of 1024 tokens need 33 slots of 8192."""
    spec = CacheSpec(hidden_size=64, num_aux_layers=1, hidden_dtype="bfloat16", max_seq_len=4096)
    plan = plan_cache(spec, num_tokens=256 * 1024 * 2, mean_seq_len=1024)
    assert plan["num_units"] == 2
    assert plan["num_shards"] == 2 * 35  # ceil(262144 / (8192 - 512))
    # slot objects, a commit record and an attempt claim per unit, a zarr.json per array, and
    # the group's zarr.json, header, index, manifest, units.parquet and slots.parquet
    assert plan["objects"] == 70 * 4 + 2 * 2 + 4 + 6
    long = dataclasses.replace(spec, max_seq_len=32768, shard_rows=4096)
    plan = plan_cache(long, num_tokens=256 * 20_000 * 2, mean_seq_len=20_000)
    assert plan["num_shards"] == 2 * 256 * 5  # each sample starts a slot and spans 5 of 4096


def test_target_config_and_text_config(tmp_path: Path) -> None:
    """config.json sizes are read directly or from text_config; bad sizes are named."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"text_config": {"hidden_size": 5120, "num_hidden_layers": 40,
                                                "torch_dtype": "bfloat16"}}))
    assert target_shape_from_config(path).hidden_size == 5120
    path.write_text(json.dumps({"hidden_size": "big", "num_hidden_layers": 4}))
    with pytest.raises(ValueError, match="hidden_size must be a positive integer, got 'big'"):
        target_shape_from_config(path)


def test_plan_cli_table_and_usage_errors(tiny_config: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI prints a table; out-of-range layer ids and bad sizes exit 2 naming the flag."""
    assert main(["plan", "--target_config", str(tiny_config), "--layer_ids", "1,2,3",
                 "--num_tokens", "1000000"]) == 0
    out = capsys.readouterr().out
    assert "aux_hidden" in out
    assert "bytes/token     707" in out  # 4 * 256 / 1.45 + 4 / 3.4 + 1 / 100 = 707.4
    assert main(["plan", "--target_config", str(tiny_config), "--layer_ids", "1,9",
                 "--num_tokens", "10"]) == 2
    assert "--layer_ids [1, 9]" in capsys.readouterr().err
    assert main(["plan", "--target_config", str(tiny_config), "--layer_ids", "1",
                 "--num_tokens", "-1"]) == 2
    assert "--num_tokens must be >= 0, got -1" in capsys.readouterr().err
    assert main(["plan", "--target_config", str(tiny_config.parent / "none.json"),
                 "--num_aux_layers", "2", "--num_tokens", "10"]) == 2


def test_plan_cli_defaults_to_the_producers_unit_size(tiny_config: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Without --rows_per_unit, plan packs units of 64 rows, the default of sparkforge produce."""
    from sparkforge.producer.config import ProducerConfig

    assert main(["plan", "--target_config", str(tiny_config), "--num_aux_layers", "2",
                 "--num_tokens", str(640 * 1024), "--mean_seq_len", "1024", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert ProducerConfig.__dataclass_fields__["rows_per_unit"].default == 64
    assert out["num_units"] == 640 // 64


def test_plan_sizes_a_strided_superset_capture(tiny_config: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """--layer_stride sizes the producer's stride capture, as the same ids given by hand."""
    assert main(["plan", "--target_config", str(tiny_config), "--layer_stride", "1",
                 "--layer_start", "0", "--num_tokens", "1000", "--json"]) == 0
    strided = json.loads(capsys.readouterr().out)
    assert main(["plan", "--target_config", str(tiny_config), "--layer_ids", "0,1,2",
                 "--num_tokens", "1000", "--json"]) == 0
    assert strided == json.loads(capsys.readouterr().out)
    assert strided["layer_ids"] == [1, 2, 3]
    assert strided["num_aux_layers"] == 3
    assert main(["plan", "--target_config", str(tiny_config), "--layer_stride", "2",
                 "--num_tokens", "1000"]) == 0
    assert "layers          hidden_states [2]" in capsys.readouterr().out
    assert main(["plan", "--hidden_size", "128", "--layer_stride", "2",
                 "--num_tokens", "10"]) == 2
    assert "--layer_stride needs --target_config" in capsys.readouterr().err
    assert main(["plan", "--target_config", str(tiny_config), "--layer_stride", "0",
                 "--num_tokens", "10"]) == 2
    assert "layer_stride must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize(("ids", "accepted"), [
    ("0,1,2", True), ("1,3", True), ("3", True),  # feature ids of a 4-layer target: [0, 3]
    ("2,4", False), ("0,0", False), ("2,1", False), ("-1,1", False)])
def test_plan_layer_ids_are_feature_ids_as_produce_takes_them(
        tiny_config: Path, ids: str, accepted: bool, capsys: pytest.CaptureFixture[str]) -> None:
    """plan --layer_ids takes feature ids, as produce and the drafts: it sizes the HF indices
    id + 1 and refuses what produce refuses (HF index 4, valid before, is feature id 3)."""
    features = [int(i) for i in ids.split(",")]
    code = main(["plan", "--target_config", str(tiny_config), f"--layer_ids={ids}",
                 "--num_tokens", "1000", "--json"])
    out = capsys.readouterr()
    assert code == (0 if accepted else 2)
    if accepted:
        plan = json.loads(out.out)
        assert plan["feature_ids"] == features
        assert plan["layer_ids"] == [i + 1 for i in features]
        assert plan["num_aux_layers"] == len(features)
    else:
        assert f"--layer_ids {features} for a 4-layer target" in out.err
        assert "HF hidden_states index = id + 1" in out.err
    no_config = main(["plan", "--hidden_size", "128", f"--layer_ids={ids}", "--num_tokens", "10"])
    assert no_config == (0 if accepted or ids == "2,4" else 2)  # no L: only order and sign


@pytest.fixture
def tiny_config(tmp_path: Path) -> Path:
    """A Qwen3-shaped config.json with H=128 and 4 layers."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "qwen3", "hidden_size": 128,
                                "num_hidden_layers": 4, "torch_dtype": "bfloat16"}))
    return path


@pytest.mark.parametrize(("n", "text"), [(999, "999 B"), (1000, "1.0 KB"), (1_450_000, "1.4 MB"),
                                         (2.5e9, "2.5 GB"), (3e15, "3000.0 TB")])
def test_human_bytes_uses_decimal_units_up_to_tb(n: float, text: str) -> None:
    """Whole bytes below 1 KB, one decimal in KB..TB, and TB is the largest unit."""
    assert human_bytes(n) == text


def test_writer_cores_follow_hidden_bytes_per_second() -> None:
    """Cores = ceil((F+1) x 2H bytes x tokens/s / per-core MB/s); fp8 aux halves the aux part."""
    from sparkforge.manifests.plan import WRITER_MB_S_PER_CORE

    spec = CacheSpec(hidden_size=4096, num_aux_layers=5, hidden_dtype="bfloat16",
                     max_seq_len=4096)
    writer = plan_cache(spec, num_tokens=1, mean_seq_len=1, tokens_per_s=50_000)["writer"]
    mb_per_s = 6 * 2 * 4096 * 50_000 / 1e6
    assert writer["hidden_mb_per_s"] == pytest.approx(mb_per_s)
    assert writer["cores"] == -(-mb_per_s // WRITER_MB_S_PER_CORE)
    fp8 = CacheSpec(hidden_size=4096, num_aux_layers=5, hidden_dtype="bfloat16",
                    max_seq_len=4096, aux_codec="fp8")
    fp8_mb = plan_cache(fp8, num_tokens=1, mean_seq_len=1, tokens_per_s=50_000)["writer"]
    assert fp8_mb["hidden_mb_per_s"] == pytest.approx((5 * 4096 + 2 * 4096) * 50_000 / 1e6)


def test_plan_prints_writer_cores_and_refuses_bad_speed(capsys: pytest.CaptureFixture[str]) -> None:
    """--tokens_per_s adds a writer-cores line; a non-positive speed is a usage error (2)."""
    args = ["plan", "--hidden_size", "4096", "--num_aux_layers", "5", "--num_tokens", "1000"]
    assert main([*args, "--tokens_per_s", "50000"]) == 0
    assert "writer cores" in capsys.readouterr().out
    assert main([*args, "--tokens_per_s", "0"]) == 2
    assert "--tokens_per_s must be > 0" in capsys.readouterr().err
