"""`validate --against` and `train` derive the same training contract from every shipped config,
and both refuse a draft whose embedding scale or logit softcap is not the capture's."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from cache_helpers import SMALL_SPEC, build_cache, make_header

from sparkforge.app.cli import main
from sparkforge.app.demo import train_config
from sparkforge.app.tiny_target import tiny_gemma4_config
from sparkforge.manifests.contract import CacheContractError
from sparkforge.shared.target_families import TargetScaling
from sparkforge.trainer.cli import train_cli
from sparkforge.trainer.run import check_cache, run_contract
from sparkforge.trainer.run_config import DraftSpec
from sparkforge.trainer.train_yaml import contract_from_train_config

ROOT = Path(__file__).resolve().parents[3]
ALL_EXAMPLES = sorted((ROOT / "trainer" / "examples").glob("*.yaml"))
# Overlays (the logger examples) hold no model: they are added after a run's own config.
OVERLAYS = [p for p in ALL_EXAMPLES if "model" not in yaml.safe_load(p.read_text())]
EXAMPLES = [p for p in ALL_EXAMPLES if p not in OVERLAYS]
# Hardware settings only: they let a GPU config build its Trainer on CPU and never reach the
# contract, which reads the draft, data.max_seq_len and the validation schedule.
ON_CPU = ["--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.num_nodes", "1",
          "--trainer.strategy", "auto", "--trainer.precision", "32-true"]


def _config(source: Path | str, tmp_path: Path) -> Path:
    """An example's path, or a config written for the demo / the unset-schedule variant."""
    if isinstance(source, Path):
        return source
    if source == "demo":
        config = train_config(tmp_path / "demo", steps=10)
    else:  # Lightning still validates each epoch when both schedule options are null
        config = yaml.safe_load(EXAMPLES[-1].read_text())
        config["trainer"].update(val_check_interval=None, check_val_every_n_epoch=None)
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


SOURCES = [*EXAMPLES, "demo", "no-schedule"]


@pytest.mark.parametrize("source", SOURCES, ids=[str(getattr(s, "name", s)) for s in SOURCES])
def test_validate_and_train_build_the_same_contract(source: Path | str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The contract `validate --against` reads from a train YAML equals the one `train` checks."""
    monkeypatch.chdir(tmp_path)  # loggers and checkpoint folders land here, never in the repo
    path = _config(source, tmp_path)
    cli = train_cli(["--config", str(path), *ON_CPU])
    for target in (QWEN3_CONFIG, GEMMA4_CONFIG):
        from_train = run_contract(cli.model, cli.datamodule, cli.trainer, target)
        assert contract_from_train_config(path, target_config=target) == from_train
        assert from_train.scaling is not None


@pytest.mark.parametrize("overlay", OVERLAYS, ids=[p.name for p in OVERLAYS])
def test_overlays_add_their_logger_to_a_full_config(overlay: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A logger overlay after a full config sets its logger and leaves the contract unchanged."""
    monkeypatch.chdir(tmp_path)
    base = EXAMPLES[-1]
    cli = train_cli(["--config", str(base), "--config", str(overlay), *ON_CPU])
    wanted = yaml.safe_load(overlay.read_text())["trainer"]["logger"]["class_path"]
    assert type(cli.trainer.logger).__name__ == wanted.rsplit(".", 1)[-1]
    plain = train_cli(["--config", str(base), *ON_CPU])
    assert (run_contract(cli.model, cli.datamodule, cli.trainer, QWEN3_CONFIG)
            == run_contract(plain.model, plain.datamodule, plain.trainer, QWEN3_CONFIG))


def test_building_the_contract_imports_no_torch() -> None:
    """Building a contract (what `validate --against` does) loads neither torch nor Lightning."""
    code = ("import sys; from sparkforge.trainer.train_yaml import contract_from_train_config; "
            f"contract_from_train_config({str(EXAMPLES[-1])!r}); "
            "print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]", out.stderr


H = SMALL_SPEC.hidden_size
QWEN3_CONFIG: dict[str, Any] = {"model_type": "qwen3", "hidden_size": H, "vocab_size": 1024,
                                "num_hidden_layers": 4, "num_attention_heads": 2,
                                "num_key_value_heads": 2, "head_dim": 8,
                                "intermediate_size": 32}
GEMMA4_CONFIG: dict[str, Any] = tiny_gemma4_config(hidden_size=H, num_hidden_layers=4).to_dict()
GEMMA4_SCALING = TargetScaling(embedding_scale=math.sqrt(H), final_logit_softcapping=30.0)
"""What a Gemma4 capture records for the tiny H=16 target: sqrt(H) and its 30.0 cap."""


def _cache(path: Path, config: dict[str, Any], scaling: TargetScaling) -> Path:
    """A cache whose manifest records ``scaling`` and whose target/config.json is ``config``."""
    header = make_header(SMALL_SPEC, num_units=3)
    header["target"]["model_type"] = config["model_type"]
    header["capture"].update(embedding_scale=scaling.embedding_scale,
                             final_logit_softcapping=scaling.final_logit_softcapping,
                             final_hidden=("lm_head_input" if config["model_type"] != "qwen3"
                                           else "post_norm"))
    return build_cache(path, header=header,
                       target_files={"config.json": json.dumps(config).encode()})


@pytest.fixture(scope="module")
def gemma4_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache captured from a Gemma4 text target (sqrt(H) embedding scale, softcap 30)."""
    return _cache(tmp_path_factory.mktemp("gemma4") / "c", GEMMA4_CONFIG, GEMMA4_SCALING)


@pytest.fixture(scope="module")
def qwen3_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache captured from a Qwen3 target (no scale, no cap)."""
    return _cache(tmp_path_factory.mktemp("qwen3") / "c", QWEN3_CONFIG, TargetScaling())


def _train_yaml(tmp_path: Path, cache: Path, model_type: str,
                overrides: dict[str, Any] | None = None) -> Path:
    """trainer/examples/tiny.yaml fitted to the test caches (H=16, feature ids [0, 1])."""
    config = yaml.safe_load((ROOT / "trainer" / "examples" / "tiny.yaml").read_text())
    config["model"]["draft"].update(hidden_size=H, target_layer_ids=[0, 1],
                                    target_model_type=model_type, overrides=overrides or {})
    config["data"]["uri"] = str(cache)
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


# (cache, draft target_model_type, draft overrides, problems both paths must name)
SCALING_CASES = [
    ("gemma4", "gemma4_text", {}, []),
    ("qwen3", "qwen3", {}, []),
    ("gemma4", "gemma4_text", {"final_logit_softcapping": 50.0},
     ["model.draft final_logit_softcapping=50.0 but the cache's "
      "capture.final_logit_softcapping=30.0"]),
    ("gemma4", "gemma4_text", {"embedding_scale": 1.0, "final_logit_softcapping": None},
     ["model.draft embedding_scale=1.0 but the cache's capture.embedding_scale=4.0",
      "model.draft final_logit_softcapping=None but the cache's "
      "capture.final_logit_softcapping=30.0"]),
    ("qwen3", "qwen3", {"embedding_scale": 4.0, "final_logit_softcapping": 30.0},
     ["model.draft embedding_scale=4.0 but the cache's capture.embedding_scale=1.0",
      "model.draft final_logit_softcapping=30.0 but the cache's "
      "capture.final_logit_softcapping=None"]),
]


@pytest.mark.parametrize(("cache_name", "model_type", "overrides", "problems"), SCALING_CASES,
                         ids=["gemma4-fits", "qwen3-fits", "gemma4-wrong-cap",
                              "gemma4-draft-unscaled", "qwen3-draft-scaled"])
def test_both_paths_check_the_drafts_scaling(cache_name: str, model_type: str,
                                             overrides: dict[str, Any], problems: list[str],
                                             request: pytest.FixtureRequest, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`validate --against` and `train` both refuse a draft whose embedding scale or softcap is
    not the capture's, naming the field and both values, and both accept the matching draft."""
    monkeypatch.chdir(tmp_path)
    cache: Path = request.getfixturevalue(f"{cache_name}_cache")
    path = _train_yaml(tmp_path, cache, model_type, overrides)
    assert main(["validate", str(cache), "--against", str(path)]) == (1 if problems else 0)
    printed = capsys.readouterr().out.splitlines()
    assert [line for line in printed if "model.draft" in line] == problems
    cli = train_cli(["--config", str(path), *ON_CPU])
    if not problems:
        check_cache(cli.model, cli.datamodule, cli.trainer)
        return
    with pytest.raises(CacheContractError) as refused:
        check_cache(cli.model, cli.datamodule, cli.trainer)
    assert [line.strip() for line in str(refused.value).splitlines()[1:]] == problems


def test_contract_scaling_is_the_built_drafts() -> None:
    """The scaling in the contract is what the draft built from the same target config applies
    (target's by default, an override wins), for Gemma4 text, its multimodal top level and Qwen3."""
    gemma_mm = tiny_gemma4_config(hidden_size=H, multimodal=True).to_dict()
    spec = DraftSpec(mask_token_id=3, hidden_size=H, vocab_size=1024, num_target_layers=4,
                     num_hidden_layers=1)
    capped = dataclasses.replace(spec, overrides={"final_logit_softcapping": 50.0})
    for draft, target, want in [(spec, GEMMA4_CONFIG, GEMMA4_SCALING),
                                (spec, gemma_mm, GEMMA4_SCALING),
                                (spec, QWEN3_CONFIG, TargetScaling()),
                                (capped, GEMMA4_CONFIG, TargetScaling(
                                    embedding_scale=math.sqrt(H), final_logit_softcapping=50.0))]:
        built = draft.draft_config(target)
        assert draft.scaling(target) == want
        assert (built.embedding_scale, built.final_logit_softcapping) == (
            want.embedding_scale, want.final_logit_softcapping)
