"""``sparkforge train``: check the cache against the run, then fit with Lightning and summarise."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException

from sparkforge.manifests.contract import RunContract, check_contract
from sparkforge.manifests.promises import check_promises
from sparkforge.shared.errors import ConfigError, SparkforgeError
from sparkforge.trainer.checkpoint import load_checkpoint
from sparkforge.trainer.datamodule import CacheDataModule
from sparkforge.trainer.interrupt import StopOnSigterm, stopped_by_lightning
from sparkforge.trainer.lit_module import DraftLitModule
from sparkforge.trainer.run_config import validation_on
from sparkforge.trainer.run_folder.checkpoints import CheckpointFolderLock

logger = logging.getLogger(__name__)
LIGHTNING_CKPT_NAMES = ("last", "best", "hpc", "registry")
"""``--ckpt_path`` values Lightning resolves to a file itself."""


def run_contract(model: DraftLitModule, data: CacheDataModule, trainer: L.Trainer,
                 target_config: Mapping[str, Any]) -> RunContract:
    """What this run needs from its cache, whose ``target_config`` the draft is built from."""
    return model.draft.contract(max_seq_len=data.settings.max_seq_len,
                                need_eval_split=validation_on(trainer.limit_val_batches),
                                target_config=target_config)


def check_cache(model: DraftLitModule, data: CacheDataModule, trainer: L.Trainer) -> None:
    """Refuse a cache that cannot feed this run, listing every mismatch, or that holds fewer units
    than its run header promised (before any training).

    A cache may hold more features than the draft uses; the data module then streams only the
    draft's, in its order.
    """
    contract = run_contract(model, data, trainer, data.target_config())
    counts = data.split_counts()
    check_contract(data.reader.manifest, contract, split_counts=counts, uri=data.uri)
    check_promises(data.uri, data.reader.manifest, data.storage_options)
    if not len(data.split_index("train")):
        raise SparkforgeError(
            f"{data.uri}: none of its {counts.get('train', 0)} train samples has "
            f"data.min_loss_tokens={data.settings.min_loss_tokens} supervised tokens: nothing to "
            "train on; lower data.min_loss_tokens")
    data.use_features(contract.target_layer_ids)
    logger.info("cache %s fits the run: %d train / %d eval samples", data.uri,
                len(data.split_index("train")), len(data.split_index("eval")))


def check_rows(model: DraftLitModule, data: CacheDataModule) -> None:
    """Refuse a draft that no training row can hold, before anything is allocated: each anchor
    is a position of a row of at most ``data.max_seq_len`` tokens (100,000 anchors of 4 tokens
    asked for a 320 GB attention mask)."""
    anchors, positions = model.draft.num_anchors, data.settings.max_seq_len
    if anchors > positions:
        raise ConfigError(
            f"--model.draft.num_anchors {anchors} is more than the {positions} positions "
            "of a training row (--data.max_seq_len): no row can hold that many anchors; lower "
            "num_anchors or raise data.max_seq_len")


def check_resume_target(trainer: L.Trainer, ckpt_path: str | None) -> None:
    """Refuse ``--ckpt_path last`` when no fixed ``--checkpoint.dirpath`` is set.

    Lightning looks for ``last`` in the new run's own version folder, finds nothing, warns and
    trains from scratch: a resubmitted job would silently restart. With a fixed folder a missing
    checkpoint still starts fresh, which is what auto-requeued jobs want on their first run.
    """
    callback = trainer.checkpoint_callback
    if ckpt_path == "last" and getattr(callback, "dirpath", None) is None:
        raise SparkforgeError(
            "--ckpt_path last needs a fixed --checkpoint.dirpath (each run otherwise writes to a "
            "new version folder, so 'last' never finds the previous run); set it, or pass the "
            "checkpoint file's path"
        )


def finish_wandb_runs(trainer: L.Trainer) -> None:
    """Finish the run of each W&B logger (rank 0): Lightning leaves it open, so its last records
    would wait for interpreter exit and a second ``train()`` in a notebook would log into it."""
    from lightning.pytorch.loggers import WandbLogger

    for lg in trainer.loggers:
        if isinstance(lg, WandbLogger) and trainer.is_global_zero:
            lg.experiment.finish()


def train(model: DraftLitModule, data: CacheDataModule, trainer: L.Trainer, *,
          ckpt_path: str | None = None, run_folder: str | None = None) -> dict[str, Any]:
    """Validate the cache, fit (resuming from ``ckpt_path`` when given) and return a summary.

    ``run_folder`` is the folder the CLI chose for a run without a logger or root folder
    (:mod:`sparkforge.trainer.run_folder`); the summary names it.

    Raises:
        CacheContractError: the cache does not match the run's draft and data settings.
        ValueError: ``ckpt_path="last"`` without a fixed checkpoint folder, where it can never
            find a checkpoint (each run logs into a new version folder).
        Interrupted: a SIGTERM stopped the fit (a resumable checkpoint saved where it could).
    """
    check_resume_target(trainer, ckpt_path)
    check_rows(model, data)
    if ckpt_path is not None and ckpt_path not in LIGHTNING_CKPT_NAMES:
        load_checkpoint(ckpt_path, mmap=True)  # one line for a foreign file, not a traceback
    check_cache(model, data, trainer)
    # Trainer builds its callback list at init (LightningCLI's); run-time ones are appended.
    trainer.callbacks.extend(  # type: ignore[attr-defined]
        [CheckpointFolderLock(ckpt_path, run_folder=run_folder), StopOnSigterm()])
    try:
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    except SIGTERMException:  # Lightning's own stop (exit code None): a stop, not a success
        raise stopped_by_lightning(trainer) from None
    finish_wandb_runs(trainer)
    callback = trainer.checkpoint_callback
    summary = {
        **({"run_folder": run_folder} if run_folder is not None else {}),
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "last_checkpoint": getattr(callback, "last_model_path", None) or None,
        "log_dir": trainer.log_dir,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
    }
    logger.info("training done: %d steps, checkpoint %s, logs %s", summary["global_step"],
                summary["last_checkpoint"], summary["log_dir"])
    return summary
