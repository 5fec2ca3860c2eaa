"""One rank of a 2-process CPU DDP run (gloo), launched by test_ddp.py with torchrun-style env vars.

Writes ``rank{R}.json`` (sample ids and loss per step) and, on rank 0, the draft's initial and
final state dicts, so the test can replay the same global batches in a single process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch

from sparkforge.trainer.datamodule import CacheDataModule
from sparkforge.trainer.lit_module import DraftLitModule
from sparkforge.trainer.run_config import DraftSpec
from sparkforge.trainer.schedule import OptimizerConfig, SchedulerConfig

SPEC = DraftSpec(mask_token_id=3, hidden_size=128, vocab_size=1024, num_target_layers=4,
                 target_layer_ids=(0, 2), num_hidden_layers=1, block_size=4, num_anchors=8,
                 markov_rank=16)
OPTIMIZER = OptimizerConfig(lr=3e-3)
SCHEDULER = SchedulerConfig(warmup_steps=1, total_steps=10)
STEPS = 3


class _Record(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out, self.steps = out, []  # type: ignore[var-annotated]

    def on_train_start(self, trainer: L.Trainer, module: Any) -> None:
        if trainer.global_rank == 0:
            torch.save(module.model.state_dict(), self.out / "initial.pt")

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.steps.append({"batch_idx": batch_idx, "sample_ids": batch["sample_ids"].tolist(),
                           "loss": float(outputs["loss"])})

    def on_train_end(self, trainer: L.Trainer, module: Any) -> None:
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.steps))
        if trainer.global_rank == 0:
            torch.save(module.model.state_dict(), self.out / "final.pt")


def main(cache: str, out: str) -> None:
    L.seed_everything(0)
    module = DraftLitModule(draft=SPEC, optimizer=OPTIMIZER, scheduler=SCHEDULER,
                             attn_implementation="sdpa")
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, gradient_clip_val=1.0,
                        callbacks=[_Record(Path(out))])
    trainer.fit(module, datamodule=CacheDataModule(cache, batch_size=2, num_workers=0))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
