"""The LightningCLI of ``sparkforge train``: ``--ckpt_path``, a ``checkpoint`` section, and the
run folder of a run without a logger or root folder.

It imports Lightning: ``trainer/cli.py`` (which the console script imports for every command)
imports it inside ``train_cli`` only.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI

from sparkforge.trainer.run_folder import run_folder, wants_run_folder


class TrainCLI(LightningCLI):
    """Adds ``--ckpt_path`` (resume) and a ``checkpoint`` section to the Lightning CLI."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_argument("--ckpt_path", type=str | None, default=None,
                            help="checkpoint to resume from (path, or 'last')")
        # Always checkpoint (``checkpoint.*`` options); save_last makes --ckpt_path last work.
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.save_last": True})

    run_folder: str | None = None
    """The folder chosen for a run without a logger or root folder (``run_folder``)."""

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        """The trainer, without the ``checkpoint`` callback when
        ``trainer.enable_checkpointing`` is false (Lightning refuses the two together), and
        rooted in a run folder when it has no logger and no ``default_root_dir``."""
        config = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        keys = self._parser(self.subcommand).callback_keys
        if config.get("enable_checkpointing") is False:
            logging.getLogger(__name__).warning(
                "trainer.enable_checkpointing is false: this run writes no checkpoint")
            keys = [key for key in keys if key != "checkpoint"]
        callbacks = [self._get(self.config_init, k) for k in keys]
        if wants_run_folder(config):
            config["default_root_dir"] = self._choose_run_folder(callbacks)
        return self._instantiate_trainer(config, callbacks)

    def _choose_run_folder(self, callbacks: list[Any]) -> str:
        """This config's run folder, printed on every rank; the checkpoint callback writes
        into its ``checkpoints/`` unless ``--checkpoint.dirpath`` is set."""
        dumped = self._parser(self.subcommand).dump(self.config, skip_none=False)
        folder = str(run_folder(dumped, self.config["seed_everything"]).resolve())
        for callback in callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath is None:
                callback.dirpath = str(Path(folder) / "checkpoints")
        print(f"run folder: {folder}", file=sys.stderr)  # noqa: T201 - the CLI's own output
        self.run_folder = folder
        return folder
