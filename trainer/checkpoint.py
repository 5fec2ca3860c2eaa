"""Opening a ``sparkforge train`` checkpoint safely, for ``export`` and ``train --ckpt_path``.

A checkpoint is a pickle, and a foreign one could run code on load: it is read weights-only (ours
hold only tensors and plain containers; the Lightning module saves its hyperparameters as
dicts), and anything else (random bytes, a code-running pickle, a special file) is refused in one
line naming the file.
"""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from sparkforge.shared.errors import SparkforgeError
from sparkforge.shared.storage import check_regular


class CheckpointError(SparkforgeError):
    """The file is not a checkpoint written by ``sparkforge train``."""


def load_checkpoint(path: str | Path, *, mmap: bool = False) -> dict[str, Any]:
    """The checkpoint's contents, loaded weights-only on the CPU (``mmap``: tensors stay on disk).

    Raises:
        FileNotFoundError: nothing at ``path``.
        CheckpointError: not a torch checkpoint, objects other than tensors and plain containers,
            or no ``draft_config``.
    """
    check_regular(path, path)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise
    except (pickle.UnpicklingError, zipfile.BadZipFile, RuntimeError, EOFError, OSError) as exc:
        raise CheckpointError(
            f"{path}: not a sparkforge train checkpoint: not a torch checkpoint, or it holds "
            f"objects other than tensors and plain containers ({type(exc).__name__}; nothing in "
            "it was run)") from exc
    if not isinstance(ckpt, dict) or "draft_config" not in ckpt:
        raise CheckpointError(f"{path} has no draft_config: not a sparkforge train checkpoint")
    return ckpt
