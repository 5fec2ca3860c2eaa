"""Hugging Face datasets as input: spellings, column mapping, save_to_disk and cached Hub data."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkforge.shared.dataset import HF_DATASET_KEY, describe_sources, iter_rows
from sparkforge.shared.hf_dataset import HfDatasetError, is_hf_dataset, parse_spec, to_messages

datasets = pytest.importorskip("datasets")

SHAREGPT = [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi?"},
            {"from": "gpt", "value": "Hello."}]


def test_hub_spelling_parses_name_revision_and_split() -> None:
    spec = parse_spec("hf://org/chat@v1.0:validation")
    assert (spec.name, spec.revision, spec.split, spec.on_disk) == ("org/chat", "v1.0",
                                                                    "validation", False)
    assert parse_spec("hf://org/chat").split == "train"
    with pytest.raises(HfDatasetError, match="hf://<org>/<name>"):
        parse_spec("hf://a/b/c")


def test_sharegpt_turns_become_openai_messages() -> None:
    """from/value with human/gpt roles map to role/content; other columns stay."""
    row = to_messages({"conversations": SHAREGPT, "id": 3}, None)
    assert row == {"id": 3, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "Hello."}]}
    assert to_messages({"chat": SHAREGPT}, "chat")["messages"][1] == {"role": "user",
                                                                       "content": "Hi?"}
    # Nothing to map: the row keeps no messages, so the encoder counts it missing_messages.
    assert "messages" not in to_messages({"text": "x"}, None)
    # An unknown ShareGPT role passes through for the encoder to count as unknown_role.
    assert to_messages({"conversations": [{"from": "bot", "value": "x"}]},
                       None)["messages"] == [{"role": "bot", "content": "x"}]


def test_save_to_disk_folder_with_split_is_one_source(tmp_path: Path) -> None:
    """A DatasetDict folder: ``folder:split`` picks the split; identity and rows come back."""
    rows = {"conversations": [SHAREGPT, SHAREGPT[1:]], "n": [0, 1]}
    folder = tmp_path / "ds"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows),
                          "test": datasets.Dataset.from_dict({**rows, "n": [5, 6]})}
                         ).save_to_disk(str(folder))
    assert is_hf_dataset(str(folder))
    assert is_hf_dataset(f"{folder}:test")
    assert not is_hf_dataset(str(tmp_path))
    [source] = describe_sources(f"{folder}:test")
    identity = source.metadata[HF_DATASET_KEY]
    assert (source.format, source.num_rows, identity["split"], identity["revision"]) == (
        "hf", 2, "test", None)
    assert identity["fingerprint"] == datasets.load_from_disk(str(folder))["test"]._fingerprint
    got = [r.row for r in iter_rows([source], wanted=lambda i: i == 1)]
    assert got == [{"n": 6, "messages": [{"role": "user", "content": "Hi?"},
                                         {"role": "assistant", "content": "Hello."}]}]
    with pytest.raises(HfDatasetError, match="no split 'dev'"):
        describe_sources(f"{folder}:dev")


def test_cached_hub_dataset_is_read_offline(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A Hub dataset laid out in the local hub cache (refs/main -> snapshot) loads without
    network, and its revision is the snapshot's commit; an uncached one says how to get it."""
    import huggingface_hub.constants as hub_constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "datasets--org--chat"
    snapshot = repo / "snapshots" / commit / "data"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    datasets.Dataset.from_dict({"messages": [[{"role": "user", "content": "a"},
                                              {"role": "assistant", "content": "b"}]]}
                               ).to_parquet(str(snapshot / "train-00000-of-00001.parquet"))
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    [source] = describe_sources("hf://org/chat:train")
    assert source.metadata[HF_DATASET_KEY]["revision"] == commit
    assert source.num_rows == 1
    assert next(iter_rows([source])).row == {"messages": [{"role": "user", "content": "a"},
                                                          {"role": "assistant", "content": "b"}]}
    with pytest.raises(HfDatasetError, match="not in the local Hugging Face cache"):
        describe_sources("hf://org/missing")
