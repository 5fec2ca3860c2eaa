"""One folder per run: the folder a run without one writes into, and the lock that keeps a
second run out of a folder another run owns, unless it resumes that run.

Lightning's default root is the current directory, so ``--trainer.logger false`` used to leave
``checkpoints/`` and ``config.yaml`` there. Such a run writes under
``runs/dspark/config-<hash>-seed<seed>/`` instead, next to the CSV logger's version folders. The
hash is over the parsed config without ``--ckpt_path`` and the run's length (``RUN_LENGTH_KEYS``;
``--config`` file names are not part of a dumped config), so every DDP rank, parsing the same
command line, names the same folder without communicating, and a rerun of the same config finds
its folder again: ``--ckpt_path last`` resumes (or extends) it. A changed setting or seed gets a
new folder.

Two runs in one checkpoint folder used to mix their checkpoints silently (Lightning only warns
that the folder is not empty; ``--ckpt_path last`` then resumed the other run's
``last-v1.ckpt``). Rank 0 holds an exclusive ``flock`` on a lock file in the folder for the whole
fit, once Lightning has resolved the folder (a fixed ``--checkpoint.dirpath``, the logger's
version folder, or the run folder above, which an identical rerun finds again: the refusal says
so).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import yaml

from sparkforge.shared.errors import SparkforgeError

RUNS_DIR = "runs"
RUN_NAME = "dspark"
"""The CSV logger's ``save_dir`` and ``name``: logged runs write ``runs/dspark/version_N/``."""
HASH_CHARS = 12
RUN_LENGTH_KEYS = ("ckpt_path", "trainer.max_steps", "trainer.max_epochs", "trainer.max_time")
"""Config keys left out of the hash: resuming a run, or training it longer, is the same run."""
LOCK_NAME = ".sparkforge-train.lock"


def wants_run_folder(trainer_config: Mapping[str, Any]) -> bool:
    """True for a run whose outputs would land in the current directory: no logger and no
    ``default_root_dir``."""
    logger = trainer_config.get("logger")
    return trainer_config.get("default_root_dir") is None and (logger is False or logger == [])


def run_folder(config_yaml: str, seed: Any) -> Path:
    """``runs/dspark/config-<hash>-seed<seed>`` for this dumped config, hashed without
    ``RUN_LENGTH_KEYS``."""
    config = yaml.safe_load(config_yaml)
    for key in RUN_LENGTH_KEYS:
        *parents, leaf = key.split(".")
        section = config
        for name in parents:
            section = section.get(name) or {}
        section.pop(leaf, None)
    text = json.dumps(config, sort_keys=True, default=str)
    digest = hashlib.sha256(text.encode()).hexdigest()[:HASH_CHARS]
    return Path(RUNS_DIR) / RUN_NAME / f"config-{digest}-seed{seed}"


class CheckpointFolderError(SparkforgeError):
    """The checkpoint folder belongs to another run."""


class CheckpointFolderLock(L.Callback):
    """Refuses a folder that another live run holds, or that holds checkpoints of a run this one
    does not resume (``ckpt_path`` is ``last`` or a file in it)."""

    def __init__(self, ckpt_path: str | None, run_folder: str | None = None) -> None:
        self.ckpt_path = ckpt_path
        self.run_folder = run_folder
        self._fd: int | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        dirpath = getattr(trainer.checkpoint_callback, "dirpath", None)
        if not trainer.is_global_zero or dirpath is None or "://" in str(dirpath):
            return  # other ranks write no checkpoint; object stores have no flock
        folder = Path(dirpath)
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise CheckpointFolderError(
                f"checkpoint folder {folder}: another sparkforge train run is writing there (it "
                f"holds {LOCK_NAME}); wait for it to end, or give this run its own "
                "--checkpoint.dirpath") from None
        self._fd = fd
        existing = sorted(p.name for p in folder.glob("*.ckpt"))
        if existing and not self._resumes(folder):
            self._release()
            same = (f" (an earlier run of this same config: {self.run_folder} is its run folder)"
                    if self.run_folder is not None else "")
            fresh = ("another --seed_everything or --trainer.default_root_dir"
                     if self.run_folder is not None else "an empty --checkpoint.dirpath")
            raise CheckpointFolderError(
                f"checkpoint folder {folder} holds another run's checkpoints "
                f"({', '.join(existing[:3])}{', ...' if len(existing) > 3 else ''}){same}; "
                f"resume that run with --ckpt_path last, or give this run {fresh}")

    def _resumes(self, folder: Path) -> bool:
        if self.ckpt_path is None:
            return False
        return self.ckpt_path == "last" or Path(self.ckpt_path).resolve().parent == folder.resolve()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._release()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule,
                     exception: BaseException) -> None:
        self._release()

    def _release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None
