"""One run per checkpoint folder: a second ``train`` writing into a folder another run owns is
refused, unless it resumes that run.

Two runs in one folder used to mix their checkpoints silently (Lightning only warns that the
folder is not empty; ``--ckpt_path last`` then resumed the other run's ``last-v1.ckpt``). Rank 0
holds an exclusive ``flock`` on a lock file in the folder for the whole fit, once Lightning has
resolved the folder (a fixed ``--checkpoint.dirpath``, the logger's version folder, or the run
folder of a run without a logger, which an identical rerun finds again: the refusal says so).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import lightning as L

from sparkforge.shared.errors import SparkforgeError

LOCK_NAME = ".sparkforge-train.lock"


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
