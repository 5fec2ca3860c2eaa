"""The Python API in-process on the tiny cache: train, evaluate, export with a model card; the
card parses with huggingface_hub and the CLI's export writes the same card."""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from sparkforge import api
from sparkforge.app.cli import main
from sparkforge.manifests.open import open_cache

ROOT = Path(__file__).resolve().parents[2]


def _train_config(cache: str, out: Path) -> dict[str, Any]:
    """trainer/examples/tiny.yaml with the draft as a DraftSpec and 4 steps."""
    cfg = yaml.safe_load((ROOT / "trainer" / "examples" / "tiny.yaml").read_text())
    cfg["model"]["draft"] = api.DraftSpec(**cfg["model"]["draft"])
    cfg["model"]["scheduler"]["total_steps"] = 60
    cfg["data"]["uri"] = cache
    cfg["trainer"] |= {"max_steps": 4, "log_every_n_steps": 1, "logger": {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": str(out), "name": "api"}}}
    return cfg


@pytest.fixture(scope="module")
def exported(tiny_cache: str, tiny_target: Path,
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Train 4 steps, export, evaluate the export, export again with the report."""
    out = tmp_path_factory.mktemp("api")
    summary = api.train(_train_config(tiny_cache, out))
    draft = api.export(api.ExportConfig(ckpt=summary["last_checkpoint"],
                                        out_dir=str(out / "draft")))
    report = api.evaluate(api.EvalConfig(draft=str(draft), target=str(tiny_target),
                                         cache=tiny_cache, out_dir=str(out / "eval"),
                                         num_prompts=3, max_new_tokens=8, max_eval_batches=2))
    carded = api.export(api.ExportConfig(ckpt=summary["last_checkpoint"],
                                         out_dir=str(out / "carded"),
                                         eval_report=str(out / "eval" / "eval_report.json")))
    return {"out": out, "summary": summary, "draft": draft, "report": report, "carded": carded}


@pytest.mark.slow
def test_train_returns_the_run_and_its_checkpoint(exported: dict[str, Any]) -> None:
    """Four optimizer steps, a checkpoint on disk, finite train metrics."""
    summary = exported["summary"]
    assert summary["global_step"] == 4
    assert Path(summary["last_checkpoint"]).is_file()
    with (Path(summary["log_dir"]) / "metrics.csv").open() as f:
        taus = [float(r["train/tau"]) for r in csv.DictReader(f) if r.get("train/tau")]
    assert len(taus) == 4
    assert all(t >= 1.0 for t in taus)


@pytest.mark.slow
def test_model_card_fields(exported: dict[str, Any], tiny_cache: str) -> None:
    """The card's YAML header and body: target, draft sizes, cache identity, eval table, and
    the serving command for this folder."""
    from huggingface_hub import ModelCard

    card = ModelCard.load(Path(exported["carded"]) / "README.md")
    target = open_cache(tiny_cache).manifest.target.name_or_path
    assert card.data.base_model == target
    assert card.data.library_name == "vllm"
    assert card.data.pipeline_tag == "text-generation"
    assert {"speculative-decoding", "dspark"} <= set(card.data.tags)
    spec = {"method": "dspark", "model": str(exported["carded"]), "num_speculative_tokens": 4}
    assert f"vllm serve {target} --speculative-config '{json.dumps(spec)}'" in card.text
    sha = hashlib.sha256((Path(tiny_cache) / "manifest.json").read_bytes()).hexdigest()
    assert sha in card.text
    from safetensors.torch import load_file

    tensors = load_file(str(Path(exported["carded"]) / "model.safetensors"))
    own = sum(v.numel() for k, v in tensors.items() if not k.startswith(("embed", "lm_head")))
    # table cells are markdown-escaped (a crafted field could not inject markup)
    assert f"| draft\\_parameters | {own:,} |" in card.text
    assert "| num\\_hidden\\_layers | 1 |" in card.text
    assert "| block\\_size | 4 |" in card.text
    spec_report = exported["report"]["speculative"]
    assert f"**{spec_report['tau']:.3f}" in card.text
    for k, rate in enumerate(spec_report["acceptance_by_position"]):
        assert f"| {k} | {rate:.3f} |" in card.text
    assert "lr: 0.003" in card.text  # the training config (optimizer settings)
    # Without a report there is no eval table.
    assert "## Evaluation" not in (Path(exported["draft"]) / "README.md").read_text()


@pytest.mark.slow
def test_cli_export_writes_the_same_card(exported: dict[str, Any]) -> None:
    """``sparkforge export`` is the API's export: the same card, but for its own folder."""
    out = exported["out"] / "cli"
    assert main(["export", exported["summary"]["last_checkpoint"], str(out),
                 "--eval_report", str(exported["out"] / "eval" / "eval_report.json")]) == 0
    api_card = (Path(exported["carded"]) / "README.md").read_text()
    cli_card = (out / "README.md").read_text()
    assert cli_card == api_card.replace(str(exported["carded"]), str(out))


def test_load_config_reads_the_cli_yaml(tmp_path: Path) -> None:
    """The producer example parses into the config the CLI builds, overrides applied."""
    cfg = api.load_config(api.ProducerConfig, ROOT / "producer" / "examples" / "tiny.yaml",
                          "--rows_per_unit", "8")
    assert isinstance(cfg.engine, api.EngineOptions)
    assert cfg.rows_per_unit == 8
    assert cfg.layer_ids == [0, 2]
    example = api.load_config(api.ProducerConfig, ROOT / "producer" / "examples" / "tiny.yaml",
                              "--config", str(ROOT / "producer" / "examples" / "mix.yaml"),
                              "--data", "null")
    assert example.data is None
    assert example.mix_rows == 192
    assert [(m.name, m.weight, m.column) for m in example.mix or []] == [
        ("chat", 2.0, None), ("sharegpt", 1.0, "conversations")]
    mix = tmp_path / "mix.yaml"
    mix.write_text(yaml.safe_dump({"mix": [{"data": "a.jsonl", "weight": 2}],
                                   "output": "c", "engine": {"model": "m"}}))
    assert api.load_config(api.ProducerConfig, mix).mix == [api.MixSource(data="a.jsonl",
                                                                          weight=2.0)]
    with pytest.raises(ValueError, match="exactly one of --data and --mix"):
        api.load_config(api.ProducerConfig, mix, "--data", "b.jsonl")


def _api_refusals(tmp: Path, cache: str) -> list[tuple[Any, type[Exception], str]]:
    """(call, error class, what its message must say): a wrong type, a path that names
    nothing, a value the command line refuses (each used to be another exception, or a message
    without the reason)."""
    nothing = str(tmp / "nothing")
    engine = api.EngineOptions(model=nothing)
    return [
        (lambda: api.validate(cache, deep="yes"), api.ConfigError, "deep must be bool, got str"),
        (lambda: api.inspect(cache, storage_options=[1]), api.ConfigError,
         "storage_options must be Mapping"),
        (lambda: api.inspect(__file__), api.SparkforgeError, "(NotADirectoryError)"),
        (lambda: api.produce({"data": "x"}), api.ConfigError, "cfg must be ProducerConfig"),
        (lambda: api.ProducerConfig(data="d.jsonl", output=nothing, engine=engine, window="8"),
         api.ConfigError, "--window: expected int, got '8'"),
        (lambda: api.produce(api.ProducerConfig(data="d.jsonl", output=nothing, engine=engine)),
         api.ConfigError, "neither a checkpoint folder nor a Hugging Face model id"),
        (lambda: api.train(_train_config(cache, tmp), "--model.draft.num_anchors", "many"),
         api.ConfigError, 'Parser key "model.draft.num_anchors": Expected a'),
        (lambda: api.train(nothing), api.ConfigError, "File does not exist"),
        (lambda: api.export(api.ExportConfig(ckpt=nothing, out_dir=nothing)), api.ConfigError,
         "(FileNotFoundError)"),
        (lambda: api.ExportConfig(ckpt=3, out_dir=nothing), api.ConfigError,
         "export.ckpt: expected str, got 3"),
        (lambda: api.load_config(api.ProducerConfig, nothing), api.ConfigError,
         "File does not exist"),
    ]


def test_every_api_refusal_is_the_error_root_with_its_reason(tiny_cache: str,
                                                             tmp_path: Path) -> None:
    """Each call refuses as the command does: a SparkforgeError (ConfigError for usage) whose
    message holds the reason, never NotADirectoryError, ArgumentError, FileNotFoundError,
    HFValidationError or a bare "rejected the config"."""
    for call, kind, message in _api_refusals(tmp_path, tiny_cache):
        with pytest.raises(kind) as caught:
            call()
        assert message in str(caught.value), str(caught.value)
