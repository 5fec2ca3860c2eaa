"""A stop by SIGTERM: save a resumable checkpoint at the next optimizer step, then end the run.

Lightning's own handling records a SIGTERM and raises a ``SystemExit`` whose code is None after
the batch it arrives in, mid gradient-accumulation window or not, without a checkpoint: the
process exits 0, so a scheduler that requeues failed jobs sees a finished one.
:class:`StopOnSigterm` takes SIGTERM over once the training loop starts: it ends the fit at the
first optimizer-step boundary after the signal (after a validation pass in progress; ranks agree
through one boolean reduce per step), writes ``last.ckpt`` into the checkpoint folder there (the
exact-resume state a periodic checkpoint holds: ``--ckpt_path last`` continues with the losses of
an uninterrupted run) and raises :class:`~sparkforge.shared.errors.Interrupted`, which the CLI
turns into exit 143.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L

from sparkforge.shared.errors import Interrupted

logger = logging.getLogger(__name__)
LAST_NAME = "last.ckpt"


class StopOnSigterm(L.Callback):
    """Ends the fit at the first optimizer step after a SIGTERM, with a checkpoint."""

    def __init__(self) -> None:
        self.signalled = False
        self._step: int | None = None
        self._previous: Any = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._step = trainer.global_step  # a resumed run starts at its checkpoint's step
        # Lightning registers its own handler just before the training loop starts.
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._note)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        del signum, frame
        if not self.signalled:
            logger.warning("SIGTERM: stopping at the next optimizer step, with a checkpoint")
        self.signalled = True

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        stepped, self._step = trainer.global_step != self._step, trainer.global_step
        if not stepped:  # inside a gradient-accumulation window: its gradients are not saved
            return
        if not trainer.strategy.reduce_boolean_decision(self.signalled, all=False):
            return
        dirpath = getattr(trainer.checkpoint_callback, "dirpath", None)
        if dirpath is None:
            saved = "no checkpoint was saved (trainer.enable_checkpointing is false)"
        else:
            path = str(Path(dirpath) / LAST_NAME)
            trainer.save_checkpoint(path)
            saved = (f"saved the resumable checkpoint {path}; resume with --ckpt_path last "
                     "(and the same --checkpoint.dirpath)")
        raise Interrupted(f"stopped by SIGTERM after step {trainer.global_step}: {saved}",
                          signum=signal.SIGTERM)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def stopped_by_lightning(trainer: L.Trainer) -> Interrupted:
    """The error for a SIGTERM Lightning acted on itself (one that came while the fit was being
    set up): the last checkpoint the run saved resumes it."""
    last = getattr(trainer.checkpoint_callback, "last_model_path", None) or None
    where = (f"the last checkpoint it saved is {last}" if last else "it saved no checkpoint")
    return Interrupted(f"stopped by SIGTERM at step {trainer.global_step}, before its first "
                       f"step ended; {where}", signum=signal.SIGTERM)
