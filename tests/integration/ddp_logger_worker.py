"""One rank of a 2-process CPU DDP run with TensorBoard and offline W&B loggers (test_ddp.py).

Trains through ``sparkforge.trainer.run.train`` (cache check, fit, W&B finish), as
``sparkforge train`` does.
"""

from __future__ import annotations

import sys

import lightning as L
from ddp_worker import OPTIMIZER, SCHEDULER, SPEC, STEPS
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

from sparkforge.trainer.datamodule import CacheDataModule
from sparkforge.trainer.lit_module import DraftLitModule
from sparkforge.trainer.run import train


def main(cache: str, out: str) -> None:
    L.seed_everything(0)
    module = DraftLitModule(draft=SPEC, optimizer=OPTIMIZER, scheduler=SCHEDULER,
                             attn_implementation="sdpa")
    loggers = [TensorBoardLogger(save_dir=out, name="tb"),
               WandbLogger(save_dir=out, offline=True, project="ddp")]
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS,
                        logger=loggers, log_every_n_steps=1, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    train(module, CacheDataModule(cache, batch_size=2, num_workers=0), trainer)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
