"""The run/cache contract: every mismatch is reported, each naming its field."""

from __future__ import annotations

import dataclasses

import pytest

from sparkforge.manifests.open import open_cache
from sparkforge.trainer.cache_check import CacheContractError, RunContract, check_contract

FITS = RunContract(target_layer_ids=(0, 2), hidden_size=128, vocab_size=1024, num_target_layers=4,
                   mask_token_id=3, max_seq_len=256, target_model_type="qwen3",
                   need_eval_split=True)


def test_matching_run_is_accepted(tiny_cache: str) -> None:
    """The tiny run fits the tiny cache: no error."""
    reader = open_cache(tiny_cache)
    check_contract(reader.manifest, FITS, split_counts={"train": 12, "eval": 4})


@pytest.mark.parametrize(("change", "fields"), [
    ({"target_layer_ids": (1, 2)}, ["model.target_layer_ids", "capture.layer_ids"]),
    ({"target_layer_ids": (0, 1, 2)}, ["storage.spec.num_aux_layers"]),
    ({"hidden_size": 64}, ["model.hidden_size", "target.hidden_size", "storage.spec.hidden_size"]),
    ({"vocab_size": 2048}, ["model.vocab_size", "target.vocab_size"]),
    ({"num_target_layers": 8}, ["model.num_target_layers", "target.num_hidden_layers"]),
    ({"mask_token_id": 5000}, ["model.mask_token_id"]),
    ({"max_seq_len": 32}, ["data.max_seq_len", "capture.max_seq_len"]),
    ({"target_model_type": "llama"}, ["model.target_model_type", "target.model_type"]),
])
def test_each_mismatch_names_its_fields(tiny_cache: str, change: dict, fields: list[str]) -> None:
    """A single wrong field is refused with a message naming the run and cache fields."""
    reader = open_cache(tiny_cache)
    with pytest.raises(CacheContractError) as err:
        check_contract(reader.manifest, dataclasses.replace(FITS, **change),
                       split_counts={"train": 12, "eval": 4})
    for name in fields:
        assert name in str(err.value)


def test_all_mismatches_are_listed_together(tiny_cache: str) -> None:
    """Several mismatches in one run are reported in one error, one line each."""
    bad = dataclasses.replace(FITS, hidden_size=64, vocab_size=2048, target_layer_ids=(1, 2))
    with pytest.raises(CacheContractError, match=r"\(5 problem") as err:
        check_contract(open_cache(tiny_cache).manifest, bad, split_counts={"train": 1})
    assert str(err.value).count("\n  ") == 5


def test_missing_eval_split_is_refused_when_validating(tiny_cache: str) -> None:
    """Validation on an empty eval split is a contract error, not a silent no-op."""
    with pytest.raises(CacheContractError, match="eval split is empty"):
        check_contract(open_cache(tiny_cache).manifest, FITS, split_counts={"train": 12})
