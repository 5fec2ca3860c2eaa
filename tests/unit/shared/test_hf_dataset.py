"""Hugging Face datasets as input: spellings, column mapping, save_to_disk and cached Hub data."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from sparkforge.shared.dataset import HF_DATASET_KEY, DatasetError, describe_sources, iter_rows
from sparkforge.shared.errors import SparkforgeError
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
    # A cached dataset at a revision the cache lacks: the revision is to blame, not the name.
    with pytest.raises(HfDatasetError, match="in the local Hugging Face cache, but not at "
                                             "revision 'nosuch'"):
        describe_sources("hf://org/chat@nosuch")


def _chats(n: int) -> dict[str, list[object]]:
    return {"messages": [[{"role": "user", "content": f"q{i}"},
                          {"role": "assistant", "content": f"a{i}"}] for i in range(n)]}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plain save_to_disk Dataset of 4 chats (copied by each case before it is damaged)."""
    folder = tmp_path_factory.mktemp("hf") / "plain"
    datasets.Dataset.from_dict(_chats(4)).save_to_disk(str(folder))
    return folder


ARROW = "data-00000-of-00001.arrow"


def _state(folder: Path, **fields: object) -> None:
    state = json.loads((folder / "state.json").read_text())
    (folder / "state.json").write_text(json.dumps({**state, **fields}))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:path.stat().st_size * 2 // 3])


# (case, damage to the copied folder, what the one-line error says)
DAMAGED = [
    ("garbage arrow", lambda d: (d / ARROW).write_bytes(b"\x00\xff" * 500),
     "not a readable save_to_disk folder"),
    ("empty arrow", lambda d: (d / ARROW).write_bytes(b""), "not a readable save_to_disk folder"),
    ("truncated arrow", lambda d: _truncate(d / ARROW),
     "not a readable save_to_disk folder"),
    ("bad dataset_info.json", lambda d: (d / "dataset_info.json").write_text("{not json"),
     "dataset_info.json: not valid JSON"),
    ("bad state.json", lambda d: (d / "state.json").write_text("[1, 2"),
     "state.json: not valid JSON"),
    ("state.json a list", lambda d: (d / "state.json").write_text("[1, 2]"),
     "expected a JSON object"),
    ("data file escapes", lambda d: _state(d, _data_files=[{"filename": "../../../etc/passwd"}]),
     "'../../../etc/passwd' lies outside the folder"),
    ("absolute data file", lambda d: _state(d, _data_files=[{"filename": "/etc/passwd"}]),
     "lies outside the folder"),
    ("no data files", lambda d: _state(d, _data_files=[]), "names no data files"),
    ("missing data file", lambda d: _state(d, _data_files=[{"filename": "gone.arrow"}]),
     "'gone.arrow', which is not there"),
    ("arrow a FIFO", lambda d: ((d / ARROW).unlink(), os.mkfifo(d / ARROW)),
     "a FIFO (named pipe), not a regular file"),
    ("symlink out", lambda d: ((d / ARROW).unlink(), (d / ARROW).symlink_to("/dev/zero")),
     "lies outside the folder"),
]


@pytest.mark.parametrize(("case", "damage", "message"), DAMAGED, ids=[c[0] for c in DAMAGED])
def test_a_damaged_save_to_disk_folder_is_one_error(saved: Path, tmp_path: Path, case: str,
                                                    damage: Any, message: str) -> None:
    """Each damaged folder is refused in one line naming it, before datasets opens what the
    folder's JSON names (a FIFO would block, ../../etc/passwd would be read)."""
    folder = tmp_path / "copy"
    shutil.copytree(saved, folder)
    damage(folder)
    with pytest.raises(SparkforgeError, match=re.escape(message)) as raised:
        describe_sources(str(folder))
    assert "\n" not in str(raised.value)
    assert str(folder) in str(raised.value), case


def test_a_dataset_dict_split_folder_may_not_escape(tmp_path: Path) -> None:
    """dataset_dict.json's split names are folders inside the dataset, too."""
    folder = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(_chats(2))}).save_to_disk(
        str(folder))
    (folder / "dataset_dict.json").write_text(json.dumps({"splits": ["../../elsewhere"]}))
    with pytest.raises(HfDatasetError, match="lies outside the folder"):
        describe_sources(str(folder))


@pytest.mark.parametrize("uri", ["hf:///x", "hf://org/na..me", "hf://../..", "hf://org/-x",
                                 "hf://a/b/c"])
def test_a_bad_hub_name_is_refused_before_the_hub_is_asked(uri: str) -> None:
    """Names the Hub's own rule refuses are one HfDatasetError (was HFValidationError)."""
    with pytest.raises(HfDatasetError, match=re.escape(f"{uri!r} is not hf://<org>/<name>")):
        parse_spec(uri)


def test_a_split_or_column_that_names_nothing_is_refused(saved: Path, tmp_path: Path) -> None:
    """``folder:nosuch`` on a plain Dataset (was ignored while the manifest recorded it) and
    ``--data_column nosuch`` (was ignored for the messages column) name what is there."""
    with pytest.raises(HfDatasetError, match="one Dataset without splits, so ':nosuch'"):
        describe_sources(f"{saved}:nosuch")
    with pytest.raises(HfDatasetError, match="no column 'nosuch'.*its columns: messages"):
        describe_sources(str(saved), column="nosuch")
    jsonl = tmp_path / "chat.jsonl"
    jsonl.write_text(json.dumps({"messages": _chats(1)["messages"][0]}) + "\n")
    with pytest.raises(DatasetError, match="read from Hugging Face datasets only"):
        describe_sources(str(jsonl), column="conversations")
    [plain] = describe_sources(str(saved))
    assert plain.num_rows == 4
