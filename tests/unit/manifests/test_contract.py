"""validate --against: the training contract, one mismatch per field, and the YAML loader."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from cache_helpers import SMALL_SPEC, build_cache, make_header

from sparkforge.app.cli import main
from sparkforge.manifests.contract import (
    CacheContractError,
    RunContract,
    check_contract,
    contract_problems,
)
from sparkforge.manifests.open import open_cache
from sparkforge.manifests.validate import validate_cache
from sparkforge.shared.target_families import TargetScaling
from sparkforge.trainer.train_yaml import TrainConfigError, contract_from_train_config

# The trainer's tiny.yaml shape, fitted to the test cache (H=16, F=2 -> HF ids [1, 2], L=4).
FITS: dict[str, Any] = {
    "model": {"draft": {"mask_token_id": 3, "hidden_size": 16, "vocab_size": 1024,
                        "num_target_layers": 4, "target_layer_ids": [0, 1],
                        "num_hidden_layers": 1, "target_model_type": "qwen3"}},
    "data": {"uri": "./tiny-cache", "max_seq_len": 256},
    "trainer": {"accelerator": "cpu", "val_check_interval": None, "check_val_every_n_epoch": None},
}

MISMATCHES = [
    ("target_layer_ids", [1, 2], r"^model.target_layer_ids=\[1, 2\] must be a subset of the "
                                 r"cache's features, but feature ids \[2\] \(HF hidden_states "
                                 r"indices = id \+ 1: \[3\]\) are not in capture.layer_ids "
                                 r"\[1, 2\]$"),
    ("hidden_size", 32, r"^model.hidden_size=32 but the cache's target.hidden_size=16$"),
    ("vocab_size", 2048, r"^model.vocab_size=2048 but the cache's target.vocab_size=1024$"),
    ("num_target_layers", 8, r"^model.num_target_layers=8 but the cache's "
                             r"target.num_hidden_layers=4$"),
    ("mask_token_id", 1024, r"^model.mask_token_id=1024 is outside the cache's vocabulary "
                            r"\[0, target.vocab_size=1024\)$"),
    ("target_model_type", "llama", r"^model.target_model_type='llama' but the cache's "
                                   r"target.model_type='qwen3'$"),
    ("target_features", "hc_mean", r"^model.draft.target_features='hc_mean' but the cache's "
                                   r"capture.features='residual'$"),
    ("target_final", "lm_head_input", r"^model.draft.target_final='lm_head_input' but the "
                                      r"cache's capture.final_hidden='post_norm'$"),
]


def test_v4_draft_config_expects_v4_semantics(cache: Path, tmp_path: Path) -> None:
    """A draft for a DeepSeek-V4 target expects hc-mean features and the lm_head input."""
    config = copy.deepcopy(FITS)
    config["model"]["draft"]["target_model_type"] = "deepseek_v4"
    run = contract_from_train_config(_write(tmp_path, config))
    assert (run.features, run.final_hidden) == ("hc_mean", "lm_head_input")
    problems = validate_cache(str(cache), against=run).problems
    assert any("target_features='hc_mean'" in p for p in problems), problems
    assert any("target_final='lm_head_input'" in p for p in problems), problems


V4_FLASH_EXAMPLE = Path(__file__).resolve().parents[3] / "trainer/examples/deepseek_v4_flash.yaml"


@pytest.mark.parametrize(("held", "missing"), [([41, 42, 43], None), ([40, 41, 42], 42)])
def test_v4_flash_ids_need_the_last_layer_of_a_43_layer_cache(
    tmp_path: Path, held: list[int], missing: int | None
) -> None:
    """The V4-Flash example's ids [40, 41, 42] (42 = L-1) fit a 43-layer V4 cache holding HF
    [41, 42, 43]; one without index 43 (the last layer) is refused naming feature 42."""
    spec = dataclasses.replace(SMALL_SPEC, num_aux_layers=3)
    header = make_header(spec, num_hidden_layers=43, num_units=3)
    header["target"] |= {"model_type": "deepseek_v4", "architecture": "DeepseekV4ForCausalLM",
                         "vocab_size": 129_280}
    header["capture"] |= {"layer_ids": held, "features": "hc_mean",
                          "final_hidden": "lm_head_input"}
    cache = build_cache(tmp_path / "c", spec, header=header)
    example = contract_from_train_config(V4_FLASH_EXAMPLE)
    assert (example.target_layer_ids, example.num_target_layers) == ((40, 41, 42), 43)
    run = dataclasses.replace(example, hidden_size=spec.hidden_size)
    problems = validate_cache(str(cache), against=run).problems
    if missing is None:
        assert problems == []
    else:
        assert len(problems) == 1, problems
        assert f"feature ids [{missing}]" in problems[0]


def test_unknown_semantics_are_refused(tmp_path: Path) -> None:
    """A target_features value outside the known set is a config error naming it."""
    config = copy.deepcopy(FITS)
    config["model"]["draft"]["target_features"] = "hc_sum"
    with pytest.raises(TrainConfigError, match=r"model.draft.target_features='hc_sum' not in"):
        contract_from_train_config(_write(tmp_path, config))


def _write(tmp_path: Path, config: dict[str, Any]) -> Path:
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One valid cache shared by the read-only contract tests."""
    return build_cache(tmp_path_factory.mktemp("contract") / "c")


def test_matching_config_passes(cache: Path, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    """A train config that fits the cache adds no problem (exit 0) and reports its anchor
    budget with and without packing, in text and in JSON."""
    assert main(["validate", str(cache), "--against", str(_write(tmp_path, FITS))]) == 0
    out = capsys.readouterr().out
    assert "anchor budget over" in out
    assert re.search(r"^  pack +[01]\.\d\d", out, re.M)
    assert main(["validate", str(cache), "--against", str(_write(tmp_path, FITS)),
                 "--json"]) == 0
    budget = json.loads(capsys.readouterr().out)["anchor_budget"]
    assert budget["row_tokens"] == 256
    assert budget["pack"]["kept_anchor_ratio"] >= budget["bucket"]["kept_anchor_ratio"]


def test_plan_against_a_config_reports_its_anchor_budget(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """plan --against estimates the budget on chat-like lengths of --mean_seq_len."""
    config = copy.deepcopy(FITS)
    config["model"]["draft"]["num_anchors"] = 512
    config["data"] |= {"max_seq_len": 4096, "batch_size": 8}
    assert main(["plan", "--hidden_size", "16", "--num_aux_layers", "2", "--num_tokens", "1000",
                 "--mean_seq_len", "500", "--against", str(_write(tmp_path, config)),
                 "--json"]) == 0
    budget = json.loads(capsys.readouterr().out)["anchor_budget"]
    assert budget["bucket"]["kept_anchor_ratio"] < 0.6 < 0.95 < budget["pack"][
        "kept_anchor_ratio"]


@pytest.mark.parametrize(("name", "value", "message"), MISMATCHES, ids=[m[0] for m in MISMATCHES])
def test_each_draft_field_mismatch_is_reported(cache: Path, tmp_path: Path, name: str,
                                               value: object, message: str) -> None:
    """One wrong model.draft field gives its own problem line naming it (exit 1)."""
    config = copy.deepcopy(FITS)
    config["model"]["draft"][name] = value
    run = contract_from_train_config(_write(tmp_path, config))
    problems = validate_cache(str(cache), against=run).problems
    # H is checked against both target.hidden_size and storage.spec.hidden_size.
    assert len(problems) == (2 if name == "hidden_size" else 1), problems
    assert re.search(message, problems[0]), problems
    assert main(["validate", str(cache), "--against", str(tmp_path / "train.yaml")]) == 1


def test_sequence_length_mismatch(cache: Path, tmp_path: Path) -> None:
    """data.max_seq_len shorter than the captured max_seq_len is one problem naming both."""
    config = copy.deepcopy(FITS)
    config["data"]["max_seq_len"] = 8
    problems = validate_cache(str(cache), against=contract_from_train_config(
        _write(tmp_path, config))).problems
    assert problems == ["data.max_seq_len=8 is shorter than the cache's capture.max_seq_len=16"]


@pytest.mark.parametrize("ids", [(0,), (1,), (0, 1)])
def test_any_subset_of_the_captured_features_fits(cache: Path, ids: tuple[int, ...]) -> None:
    """A draft may use any subset of the cache's features (HF [1, 2] = feature ids [0, 1])."""
    m = open_cache(str(cache)).manifest
    run = RunContract(**{**contract_from_train_config(FITS).__dict__, "target_layer_ids": ids})
    assert contract_problems(m, run, split_counts={"train": 9, "eval": 3}) == []


def test_missing_ids_and_hidden_size_both_fields_named(cache: Path) -> None:
    """Ids beyond the capture are named (feature and HF); H names target and spec."""
    m = open_cache(str(cache)).manifest
    base = contract_from_train_config(FITS)
    problems = contract_problems(m, RunContract(**{**base.__dict__, "target_layer_ids": (-1, 0, 2),
                                                   "hidden_size": 8}),
                                 split_counts={"train": 9, "eval": 3})
    assert "feature ids [-1, 2] (HF hidden_states indices = id + 1: [0, 3]) are not in " \
        "capture.layer_ids [1, 2]" in problems[0]
    assert "model.hidden_size=8 but the cache's storage.spec.hidden_size=16" in problems
    assert len(problems) == 3


def test_scaling_differences_are_named(cache: Path) -> None:
    """A draft whose embedding scale or logit softcap differs from the capture's is refused with
    both values named; the cache's own values (1.0, no cap: a Qwen3 target) fit."""
    m = open_cache(str(cache)).manifest
    assert m.capture.scaling == TargetScaling()
    base = contract_from_train_config(FITS)
    fits = RunContract(**{**base.__dict__, "scaling": TargetScaling()})
    assert contract_problems(m, fits, split_counts={"train": 9, "eval": 3}) == []
    gemma = TargetScaling(embedding_scale=4.0, final_logit_softcapping=30.0)
    problems = contract_problems(m, RunContract(**{**base.__dict__, "scaling": gemma}),
                                 split_counts={"train": 9, "eval": 3})
    assert problems == [
        "model.draft embedding_scale=4.0 but the cache's capture.embedding_scale=1.0",
        "model.draft final_logit_softcapping=30.0 but the cache's "
        "capture.final_logit_softcapping=None"]


def test_eval_split_needed_when_validating(cache: Path) -> None:
    """With validation on (val_check_interval set) an empty eval split is a problem."""
    config = copy.deepcopy(FITS)
    config["trainer"]["val_check_interval"] = 100
    run = contract_from_train_config(config)
    assert run.need_eval_split
    m = open_cache(str(cache)).manifest
    assert contract_problems(m, run, split_counts={"train": 9, "eval": 3}) == []
    with pytest.raises(CacheContractError, match=r"(?s)\(2 problem.*train split is empty.*\n.*eval "
                                                 r"split is empty"):
        check_contract(m, run, split_counts={})


def test_loader_reads_the_trainer_yaml_shape(tmp_path: Path) -> None:
    """The loader maps model.draft.* and data.max_seq_len; missing ids use the DFlash rule."""
    run = contract_from_train_config(_write(tmp_path, FITS))
    # Lightning validates at each epoch's end even with both schedule options null, as train does.
    assert run == RunContract(target_layer_ids=(0, 1), hidden_size=16, vocab_size=1024,
                              num_target_layers=4, mask_token_id=3, max_seq_len=256,
                              target_model_type="qwen3", need_eval_split=True)
    off = copy.deepcopy(FITS)
    off["trainer"]["limit_val_batches"] = 0
    assert not contract_from_train_config(off).need_eval_split
    config = copy.deepcopy(FITS)
    del config["model"]["draft"]["target_layer_ids"]
    config["model"]["draft"].update(num_target_layers=36, num_hidden_layers=5)
    assert contract_from_train_config(config).target_layer_ids == (1, 9, 17, 25, 33)


@pytest.mark.parametrize(("edit", "match"), [
    (lambda c: c["model"]["draft"].pop("hidden_size"), r"model.draft.hidden_size must be an "
                                                       r"integer, got None"),
    (lambda c: c["model"]["draft"].__setitem__("target_layer_ids", "0,1"),
     "model.draft.target_layer_ids must be a list of integers"),
    (lambda c: c.__setitem__("model", [1]), "model must be a mapping"),
    (lambda c: c["data"].__setitem__("max_seq_len", True), "data.max_seq_len must be an integer"),
    # the draft section is the anchor budget's too (one reader): its fields are checked here
    (lambda c: c["model"]["draft"].__setitem__("num_anchors", 0),
     r"model.draft.num_anchors must be an integer >= 1, got 0"),
])
def test_bad_train_config_names_the_field(edit: Any, match: str) -> None:
    """A config missing or mistyping a contract field raises TrainConfigError naming it."""
    config = copy.deepcopy(FITS)
    edit(config)
    with pytest.raises(TrainConfigError, match=match):
        contract_from_train_config(config)


def test_bad_train_config_is_a_usage_error(cache: Path, tmp_path: Path) -> None:
    """An --against file that is not a usable YAML config exits 2, not 1."""
    path = tmp_path / "bad.yaml"
    path.write_text("model: [unclosed")
    assert main(["validate", str(cache), "--against", str(path)]) == 2
