"""A ``save_to_disk`` folder checked before ``datasets`` opens it.

``datasets.load_from_disk`` trusts the folder's JSON: ``state.json`` names the Arrow files it
memory-maps (``../../etc/passwd`` included) and ``dataset_dict.json`` the split folders, and it
opens a FIFO named like a data file, which blocks forever. So every JSON file it reads is parsed
here first (bounded in size), every data file and split folder named must stay inside the folder
and be a regular file or folder, and whatever ``datasets`` or Arrow still raises on the files
(garbage, empty or truncated ``.arrow``) becomes one :class:`HfDatasetError` naming the folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

from sparkforge.shared.errors import SparkforgeError
from sparkforge.shared.storage import check_regular

MAX_JSON_BYTES: Final = 16 << 20
"""Largest ``state.json`` / ``dataset_info.json`` / ``dataset_dict.json`` read (``datasets``
writes a few KiB)."""
DICT_FILE: Final = "dataset_dict.json"
STATE_FILE: Final = "state.json"
INFO_FILE: Final = "dataset_info.json"
REWRITE: Final = "re-create it with Dataset.save_to_disk (or DatasetDict.save_to_disk)"


class HfDatasetError(SparkforgeError):
    """Raised when a Hugging Face dataset cannot be found, opened or split as asked."""


def check_disk_folder(folder: Path) -> None:
    """Refuse a ``save_to_disk`` folder whose JSON is broken or names anything outside it.

    Raises:
        HfDatasetError: naming the folder and the file at fault.
    """
    if (folder / DICT_FILE).is_file():
        splits = _json(folder / DICT_FILE, folder).get("splits")
        if not isinstance(splits, list) or not splits:
            raise HfDatasetError(f"data {folder}: {DICT_FILE} lists no splits; {REWRITE}")
        for split in splits:
            _check_split(_inside(folder, split, f"{DICT_FILE} split"), folder)
    else:
        _check_split(folder, folder)


def load_checked(folder: Path) -> Any:
    """``datasets.load_from_disk`` of a checked folder; its failures name the folder."""
    import datasets
    import pyarrow

    check_disk_folder(folder)
    try:
        return datasets.load_from_disk(str(folder))
    except (OSError, ValueError, KeyError, TypeError, pyarrow.ArrowException) as exc:
        raise HfDatasetError(f"data {folder}: not a readable save_to_disk folder "
                             f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]}); "
                             f"{REWRITE}") from exc


def _check_split(split: Path, root: Path) -> None:
    state = _json(split / STATE_FILE, root)
    _json(split / INFO_FILE, root)
    files = state.get("_data_files")
    if not isinstance(files, list) or not files or not all(
            isinstance(f, dict) and isinstance(f.get("filename"), str) for f in files):
        raise HfDatasetError(f"data {split}: {STATE_FILE} names no data files "
                             f"(_data_files); {REWRITE}")
    for entry in files:
        path = _inside(split, entry["filename"], f"{STATE_FILE} data file")
        check_regular(path, f"data {path}")
        if not path.is_file():
            raise HfDatasetError(f"data {split}: {STATE_FILE} names {entry['filename']!r}, "
                                 f"which is not there; {REWRITE}")


def _inside(folder: Path, name: str, what: str) -> Path:
    """``folder / name``, refused unless it stays inside ``folder`` (links followed)."""
    if not isinstance(name, str) or not name:
        raise HfDatasetError(f"data {folder}: {what} {name!r} is not a name; {REWRITE}")
    path = folder / name
    if not path.resolve().is_relative_to(folder.resolve()):
        raise HfDatasetError(f"data {folder}: {what} {name!r} lies outside the folder; "
                             "refusing to open it")
    return path


def _json(path: Path, root: Path) -> dict[str, Any]:
    """A JSON object file of the folder (regular, at most MAX_JSON_BYTES)."""
    _inside(root, str(path.relative_to(root)), "file")
    check_regular(path, f"data {path}")
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_JSON_BYTES + 1)
    except FileNotFoundError as exc:
        raise HfDatasetError(f"data {path.parent}: no {path.name}; {REWRITE}") from exc
    if len(raw) > MAX_JSON_BYTES:
        raise HfDatasetError(f"data {path}: over {MAX_JSON_BYTES >> 20} MiB; {REWRITE}")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise HfDatasetError(f"data {path}: not valid JSON ({str(exc)[:120]}); {REWRITE}") from exc
    if not isinstance(data, dict):
        raise HfDatasetError(f"data {path}: expected a JSON object, got "
                             f"{type(data).__name__}; {REWRITE}")
    return data
