"""Hugging Face ``datasets`` as chat input: a ``save_to_disk`` folder or a Hub dataset already in
the local cache (never downloaded), one split, rows mapped onto OpenAI ``messages``.

Spelling (``--data``): ``hf://<org>/<name>[@<revision>][:<split>]`` for a Hub dataset, or a
``save_to_disk`` folder, optionally ``<folder>:<split>``. The split defaults to ``train``.

Rows become ``{"messages": [...], **other columns}``: the conversation is read from the column
given (default: ``messages``, else ``conversations``); ShareGPT turns (``from``/``value``, with
``human``/``gpt`` roles) become ``role``/``content`` turns. A row the mapping cannot read keeps
its bad value, so the chat encoder counts it (``missing_messages``, ``unknown_role``, ...) like
any other bad row. ``datasets`` is imported only when such a source is used.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from sparkforge.shared.hf_disk import HfDatasetError as HfDatasetError
from sparkforge.shared.hf_disk import load_checked

HF_SCHEME: Final = "hf://"
DEFAULT_SPLIT: Final = "train"
CONVERSATION_COLUMNS: Final = ("messages", "conversations")
SHAREGPT_ROLES: Final = {"human": "user", "user": "user", "gpt": "assistant",
                         "assistant": "assistant", "system": "system", "tool": "tool",
                         "function_call": "assistant", "observation": "tool"}
_DISK_MARKERS: Final = ("dataset_dict.json", "state.json")
_BATCH_ROWS: Final = 1024


@dataclass(frozen=True, kw_only=True)
class HfDatasetSpec:
    """Which dataset, revision and split ``--data`` names."""

    name: str
    """Hub repo id, or the ``save_to_disk`` folder."""
    split: str
    revision: str | None = None
    """Hub only: a branch, tag or commit (None: the cached ``main``)."""
    on_disk: bool = False
    split_given: bool = False
    """``--data`` names the split (else it is the default, ``train``)."""


def is_hf_dataset(uri: str) -> bool:
    """Whether ``uri`` names a Hugging Face dataset (``hf://...`` or a ``save_to_disk`` folder)."""
    if uri.startswith(HF_SCHEME):
        return True
    folder = _split_folder(uri)[0]
    return folder is not None


def _split_folder(uri: str) -> tuple[Path | None, str | None]:
    """(folder, split) when ``uri`` is a local ``save_to_disk`` folder (``folder[:split]``)."""
    if "://" in uri:
        return None, None
    candidates: list[tuple[str, str | None]] = [(uri, None)]
    if ":" in uri:
        head, tail = uri.rsplit(":", 1)
        candidates.append((head, tail))
    for path, wanted in candidates:
        folder = Path(path)
        if folder.is_dir() and any((folder / m).is_file() for m in _DISK_MARKERS):
            return folder, wanted
    return None, None


def parse_spec(uri: str) -> HfDatasetSpec:
    """The dataset, revision and split of ``uri``.

    Raises:
        HfDatasetError: ``uri`` names no Hugging Face dataset.
    """
    if uri.startswith(HF_SCHEME):
        rest = uri.removeprefix(HF_SCHEME)
        name, _, split = rest.partition(":")
        name, _, revision = name.partition("@")
        _check_repo_id(name, uri)
        return HfDatasetSpec(name=name, split=split or DEFAULT_SPLIT, revision=revision or None,
                             split_given=bool(split))
    folder, folder_split = _split_folder(uri)
    if folder is None:
        raise HfDatasetError(f"data: {uri!r} is neither hf://... nor a save_to_disk folder")
    return HfDatasetSpec(name=str(folder), split=folder_split or DEFAULT_SPLIT, on_disk=True,
                         split_given=folder_split is not None)


def _check_repo_id(name: str, uri: str) -> None:
    """Refuse a name the Hub's own rule refuses (``hf:///x``, ``hf://org/na..me``)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id  # type: ignore[attr-defined]

    spelling = "hf://<org>/<name>[@<revision>][:<split>]"
    if not name or name.count("/") > 1:
        raise HfDatasetError(f"data: {uri!r} is not {spelling}")
    try:
        validate_repo_id(name)
    except HFValidationError as exc:
        raise HfDatasetError(f"data: {uri!r} is not {spelling}: {exc}") from exc


def open_dataset(spec: HfDatasetSpec) -> tuple[Any, dict[str, Any]]:
    """The split as a ``datasets.Dataset`` and its identity (name, revision, split, fingerprint).

    Raises:
        HfDatasetError: the dataset is not on disk / in the local cache, or lacks the split.
    """
    import datasets

    revision = spec.revision
    if spec.on_disk:
        loaded = load_checked(Path(spec.name))
    else:
        folder, revision = _cached_snapshot(spec)
        loaded = datasets.load_dataset(folder)
    if isinstance(loaded, datasets.DatasetDict):
        if spec.split not in loaded:
            raise HfDatasetError(f"data: {spec.name} has no split {spec.split!r} (splits: "
                                 f"{', '.join(sorted(loaded))})")
        loaded = loaded[spec.split]
    elif spec.split_given and spec.split != loaded.split:
        raise HfDatasetError(f"data: {spec.name} is one Dataset without splits, so "
                             f"':{spec.split}' names nothing; drop it")
    identity = {"name": spec.name, "revision": revision, "split": spec.split,
                "fingerprint": loaded._fingerprint}
    return loaded, identity


def _cached_snapshot(spec: HfDatasetSpec) -> tuple[str, str]:
    """The local snapshot folder of a Hub dataset and its commit (offline: never downloads)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    def cached(revision: str | None) -> str:
        folder: str = snapshot_download(spec.name, repo_type="dataset", revision=revision,
                                        local_files_only=True)
        return folder

    try:
        folder = cached(spec.revision)
    except LocalEntryNotFoundError as exc:
        fetch = f"hf download --repo-type dataset {spec.name}"
        if spec.revision is not None:
            try:
                cached(None)
            except LocalEntryNotFoundError:
                pass
            else:
                raise HfDatasetError(
                    f"data: hf://{spec.name} is in the local Hugging Face cache, but not at "
                    f"revision {spec.revision!r}; download that revision first ({fetch} "
                    f"--revision {spec.revision}) or name a cached one") from exc
        raise HfDatasetError(f"data: hf://{spec.name} is not in the local Hugging Face cache; "
                             f"download it first ({fetch})") from exc
    return folder, Path(folder).name


def content_hash(identity: Mapping[str, Any]) -> str:
    """sha256 of the dataset's identity (its fingerprint changes with its content)."""
    return hashlib.sha256(json.dumps(dict(identity), sort_keys=True).encode()).hexdigest()


def to_messages(row: Mapping[str, Any], column: str | None) -> dict[str, Any]:
    """``row`` with its conversation column as OpenAI ``messages`` (see the module docstring)."""
    names = (column,) if column else CONVERSATION_COLUMNS
    name = next((n for n in names if n in row), None)
    out = {k: v for k, v in row.items() if k != name}
    if name is None:
        return out
    turns = row[name]
    if isinstance(turns, list):
        turns = [_turn(t) for t in turns]
    out["messages"] = turns
    return out


def _turn(turn: object) -> object:
    if not isinstance(turn, dict) or "from" not in turn or "role" in turn:
        return turn
    out = {k: v for k, v in turn.items() if k not in ("from", "value")}
    role = turn["from"]
    out["role"] = SHAREGPT_ROLES.get(role, role) if isinstance(role, str) else role
    out["content"] = turn.get("value")
    return out


def iter_dataset(dataset: Any, wanted: Callable[[int], bool], column: str | None
                 ) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(index, mapped row)`` for each wanted row, read in slices (memory: one slice)."""
    for start in range(0, len(dataset), _BATCH_ROWS):
        stop = min(start + _BATCH_ROWS, len(dataset))
        if not any(wanted(i) for i in range(start, stop)):
            continue
        batch = dataset[start:stop]
        for offset in range(stop - start):
            if wanted(start + offset):
                yield start + offset, to_messages({k: v[offset] for k, v in batch.items()},
                                                  column)
