"""The LightningModule: holds the DSpark draft and its objective, logs ratio-of-sums metrics."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Mapping
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig

from sparkforge.shared.errors import SparkforgeError
from sparkforge.shared.renamed import renamed_attribute
from sparkforge.trainer.architectures import build_draft
from sparkforge.trainer.architectures.config import DraftConfig
from sparkforge.trainer.draft.block_layout import BLOCK_LAYOUTS
from sparkforge.trainer.draft.draft_batch import DraftBatch, FixedAnchors
from sparkforge.trainer.draft.model import DraftModel, DraftOutput
from sparkforge.trainer.loss import LossOutput, compute_dspark_loss
from sparkforge.trainer.metrics import (
    MetricSums,
    accumulate,
    all_reduce_sums,
    metric_ratios,
    metric_sums,
)
from sparkforge.trainer.run_config import RECIPES, DraftSpec, LossSpec, RecipeName
from sparkforge.trainer.schedule import (
    OptimizerConfig,
    SchedulerConfig,
    build_optimizer,
    build_scheduler,
)

logger = logging.getLogger(__name__)

LOSS_TERMS = ("loss", "ce_loss", "l1_loss", "confidence_loss", "selector_loss")
RESUME_FIELDS = ("mask_token_id", "block_size", "target_layer_ids")


class NonFiniteLossError(SparkforgeError):
    """Raised when a training loss is NaN or infinite; names the samples of the batch."""


def nonfinite_message(batch: dict[str, torch.Tensor], loss: torch.Tensor, *, step: int,
                      rank: int) -> str:
    """Which samples the non-finite batch held and which of them carry non-finite inputs."""
    if bool(torch.isfinite(loss.detach()).item()):
        return (f"non-finite training loss on another rank at step {step} (that rank names the "
                "samples); stopped before the optimizer step, no checkpoint holds it")
    ids = batch["sample_ids"].tolist()
    bad_BS = ~torch.isfinite(batch["target_hidden_states"].float()).all(dim=-1)
    bad_BS |= ~torch.isfinite(batch["target_last_hidden_states"].float()).all(dim=-1)
    # Each token's sample: its row, or in a packed row its document.
    doc_BS = batch.get("document_ids")
    if doc_BS is None:
        doc_BS = torch.arange(len(ids), device=bad_BS.device)[:, None].expand_as(bad_BS)
    bad_docs = set(doc_BS[bad_BS & (doc_BS >= 0)].tolist())
    culprits = [i for d, i in enumerate(ids) if d in bad_docs]
    cause = (f"samples {culprits} hold non-finite hidden states (check the cache with "
             "`sparkforge validate --deep`)" if culprits else
             "the inputs are finite, so the model diverged (lower the learning rate, or resume "
             "from an earlier checkpoint)")
    return (f"non-finite training loss {float(loss)} at step {step} (rank {rank}), batch samples "
            f"{ids}: {cause}; stopped before the optimizer step, no checkpoint holds it")


def _same_tensors(mine: Mapping[str, torch.Tensor], saved: Mapping[str, Any]) -> bool:
    """Whether a checkpoint's state_dict has exactly these tensor names and shapes."""
    return mine.keys() == saved.keys() and all(
        tuple(getattr(saved[k], "shape", ())) == tuple(v.shape) for k, v in mine.items())


class DraftLitModule(L.LightningModule):
    """Trains a draft of any table architecture on batches from ``CacheDataModule``.

    The draft is built in ``setup`` from the target config and frozen weights stored in the cache,
    so the target model is never loaded.

    Args:
        draft: The draft architecture and its target-facing contract.
        loss: Loss term weights.
        recipe: ``dspark`` (Markov and confidence heads, 0.1 CE + 0.9 L1 + 1.0 BCE),
            ``dflash`` (``layout: dflash`` on the draft's architecture: no heads, CE with the
            DFlash decay; qwen3 exports in the DFlash serving format) or ``dflash2``
            (``layout: dflash2``: DFlash with block convolutions and the candidate selector,
            CE + selector CE; qwen3 exports in the DFlash2 format); fills the draft and loss
            fields left unset.
        optimizer: Optimizer class and settings.
        scheduler: Warmup + cosine schedule.
        attn_implementation: "sdpa" (dense mask), "flex" (GPU) or "auto" (flex on CUDA).
        seed: Seed of anchor sampling; each batch draws from (seed, rank, epoch, batch index), so
            a resumed run samples the same anchors without saved RNG state.
    """

    def __init__(
        self,
        *,
        draft: DraftSpec,
        loss: LossSpec = LossSpec(),  # noqa: B008 - frozen dataclass, safe as a default
        recipe: RecipeName = "dspark",
        optimizer: OptimizerConfig = OptimizerConfig(),  # noqa: B008
        scheduler: SchedulerConfig = SchedulerConfig(),  # noqa: B008
        attn_implementation: Literal["auto", "sdpa", "flex"] = "auto",
        seed: int = 0,
    ) -> None:
        super().__init__()
        draft = draft.for_recipe(recipe)
        loss = loss.with_objective(RECIPES[recipe].objective)
        assert loss.confidence_head_alpha is not None
        if draft.enable_confidence_head != (loss.confidence_head_alpha > 0):
            raise SparkforgeError(
                f"model.draft.enable_confidence_head={draft.enable_confidence_head} needs "
                "model.loss.confidence_head_alpha "
                f"{'> 0' if draft.enable_confidence_head else '= 0'}"
                f", got {loss.confidence_head_alpha}")
        assert loss.selector_loss_alpha is not None
        assert draft.layout is not None
        with_selector = BLOCK_LAYOUTS[draft.layout].candidate_selector
        if with_selector != (loss.selector_loss_alpha > 0):
            raise SparkforgeError(
                f"model.draft.layout={draft.layout!r} "
                f"{'has' if with_selector else 'has no'} candidate selector, so "
                f"model.loss.selector_loss_alpha must be {'> 0' if with_selector else '0'}, got "
                f"{loss.selector_loss_alpha}")
        # Plain dicts keep checkpoints loadable with torch.load(weights_only=True).
        self.save_hyperparameters({"recipe": recipe, "draft": dataclasses.asdict(draft),
                                   "loss": dataclasses.asdict(loss),
                                   "optimizer": dataclasses.asdict(optimizer),
                                   "scheduler": dataclasses.asdict(scheduler),
                                   "attn_implementation": attn_implementation, "seed": seed})
        self.draft, self.loss_spec, self.seed = draft, loss, seed
        self.optimizer_cfg, self.scheduler_cfg = optimizer, scheduler
        self.attn_implementation = attn_implementation
        self.model: DraftModel | None = None
        self._window: MetricSums | None = None
        self._window_start = time.perf_counter()
        self._batch_end = time.perf_counter()
        self._val: MetricSums | None = None
        self._provenance: dict[str, Any] = {}

    # ---- model ---------------------------------------------------------------------------------
    def build(self, cfg: DraftConfig, weights: dict[str, torch.Tensor] | None = None) -> None:
        """Create the draft (frozen target pieces copied from ``weights`` when given)."""
        impl = self.attn_implementation
        if impl == "auto":
            impl = "flex" if torch.cuda.is_available() else "sdpa"
        weights = weights or {}
        self.model = build_draft(cfg, embed_weight=weights.get("embed_tokens.weight"),
                                      lm_head_weight=weights.get("lm_head.weight"),
                                      attn_implementation=impl)

    def setup(self, stage: str) -> None:
        """Build the draft from the target pieces in the datamodule's cache."""
        if self.model is not None:
            return
        dm: Any = self.trainer.datamodule  # type: ignore[attr-defined]
        self.build(self.draft.draft_config(dm.target_config()), dm.target_weights())
        self._provenance = dm.provenance() if hasattr(dm, "provenance") else {}

    def on_fit_start(self) -> None:
        """Log the run's config (this module's and the data module's hyperparameters) with the
        cache's provenance (manifest sha256, target, data identity) as hyperparameters.

        Lightning has logged the config alone by now; this call repeats it whole because
        TensorBoard keeps only the last hparams record. Loggers write on rank 0 only.
        """
        dm = getattr(self.trainer, "datamodule", None)
        params = {**(dict(dm.hparams_initial) if dm is not None else {}),
                  **dict(self.hparams_initial), "cache": self._provenance}
        for lg in self.loggers:
            lg.log_hyperparams(params)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Store the resolved draft config so export and eval need no cache."""
        assert self.model is not None
        checkpoint["draft_config"] = self.model.config.to_dict()
        checkpoint["sparkforge_provenance"] = self._provenance

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse to resume a checkpoint whose mask id, K or feature ids differ from this run's.

        These change what the weights mean without changing any shape, so ``load_state_dict``
        alone would resume silently.
        """
        assert self.model is not None
        saved, now = checkpoint.get("draft_config", {}), self.model.config.to_dict()
        problems = [f"model.draft.{name}: checkpoint has {saved[name]!r}, this run {now[name]!r}"
                    for name in RESUME_FIELDS if name in saved and saved[name] != now[name]]
        weights = checkpoint.get("state_dict")
        if not problems and weights is not None and not _same_tensors(self.state_dict(), weights):
            # A shape-changing field (num_hidden_layers, intermediate_size, ...): name every
            # field that differs rather than let load_state_dict list the missing tensors.
            problems = [f"model.draft.{name}: checkpoint has {saved[name]!r}, this run "
                        f"{value!r}" for name, value in now.items()
                        if name in saved and saved[name] != value]
            problems = problems or ["its weights have other names or shapes than this draft's"]
        if problems:
            raise SparkforgeError("cannot resume: " + "; ".join(problems))

    def _anchor_generator(self, stage: int, batch_idx: int) -> torch.Generator:
        return anchor_generator(self.seed, self.global_rank, stage, self.current_epoch, batch_idx,
                                device=self.device)

    def forward(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None,
                anchors: FixedAnchors | None = None) -> tuple[DraftOutput, LossOutput]:
        """Draft forward + loss on one collated batch."""
        assert self.model is not None
        out = self.model(DraftBatch.of(batch), anchors, generator)
        return out, compute_dspark_loss(out, self.loss_spec)

    # ---- training --------------------------------------------------------------------------------
    def _sums(self, batch: dict[str, torch.Tensor], out: DraftOutput,
              res: LossOutput) -> MetricSums:
        sums = metric_sums(out, res.accept_rate, res.weights, res.selector)
        one = torch.ones((), dtype=torch.float64, device=self.device)
        values = (res.logged_loss, res.ce_loss, res.l1_loss, res.confidence_loss,
                  res.selector_loss)
        sums |= {name: v.detach().double() for name, v in zip(LOSS_TERMS, values, strict=True)}
        sums["micro_batches"] = one
        sums["tokens"] = batch["attention_mask"].sum().double()
        sums["row_tokens"] = torch.tensor(float(batch["attention_mask"].numel()),
                                          dtype=torch.float64, device=self.device)
        return sums

    def on_train_epoch_start(self) -> None:
        """Start the data-wait clock (setup and validation time is not data wait)."""
        self._batch_end = time.perf_counter()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Time spent waiting for this batch since the previous step ended."""
        self._wait = time.perf_counter() - self._batch_end

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """One micro-batch: globally normalised loss; window sums for logging."""
        out, res = self(batch, self._anchor_generator(0, batch_idx))
        self._stop_if_not_finite(batch, res.loss)
        sums = self._sums(batch, out, res)
        sums["data_wait_s"] = torch.tensor(self._wait, dtype=torch.float64, device=self.device)
        self._window = accumulate(self._window, sums)
        self.log("loss", res.logged_loss, prog_bar=True, logger=False)
        # Lightning divides every micro-batch loss by accumulate_grad_batches, also in a shorter
        # last window of the epoch; rescale that one so its step is not shrunk (spec section 8).
        scale = trailing_window_scale(batch_idx, self.trainer.num_training_batches,
                                      self.trainer.accumulate_grad_batches)
        loss: torch.Tensor = res.loss * scale
        return loss

    def _stop_if_not_finite(self, batch: dict[str, torch.Tensor], loss: torch.Tensor) -> None:
        """Raise before backward when any rank's loss is NaN or infinite.

        Nothing non-finite reaches the weights, so no checkpoint ever holds them; every rank
        decides together, so none is left waiting in a collective.
        """
        finite = bool(torch.isfinite(loss.detach()).item())
        if self.trainer.world_size > 1:
            finite = self.trainer.strategy.reduce_boolean_decision(finite, all=True)
        if not finite:
            raise NonFiniteLossError(nonfinite_message(batch, loss, step=self.global_step,
                                                       rank=self.global_rank))

    def configure_callbacks(self) -> list[L.Callback]:
        """The window logger (see :class:`WindowLogger`)."""
        return [WindowLogger()]

    def end_train_batch(self, batch_idx: int) -> None:
        """Every ``log_every_n_steps`` optimizer steps: reduce the window over ranks and log it.

        Only a micro-batch that ends an accumulation window has stepped, so each logged row has
        its own ``global_step`` and the window holds every micro-batch of its steps.
        """
        trainer = self.trainer
        last = trainer.is_last_batch
        stepped = (batch_idx + 1) % trainer.accumulate_grad_batches == 0 or last
        every = trainer.log_every_n_steps  # type: ignore[attr-defined]
        if stepped and (self.global_step % every == 0 or last):
            self._log_window()
        self._batch_end = time.perf_counter()

    def _log_window(self) -> None:
        assert self._window is not None
        sums = all_reduce_sums(self._window)
        elapsed = time.perf_counter() - self._window_start
        metrics = window_metrics(sums, elapsed_s=elapsed, world_size=self.trainer.world_size)
        metrics["lr"] = self.trainer.optimizers[0].param_groups[0]["lr"]
        if self.trainer.is_global_zero:
            for lg in self.loggers:
                lg.log_metrics({f"train/{k}": v for k, v in metrics.items()}, step=self.global_step)
                # Lightning flushes only every flush_logs_every_n_steps steps and at the end; a
                # killed run would lose every window since. One small write per window.
                lg.save()
        self._window, self._window_start = None, time.perf_counter()

    # ---- validation ------------------------------------------------------------------------
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        """Accumulate the eval split's sums (ratios are formed once at the end)."""
        out, res = self(batch, self._anchor_generator(1, batch_idx))
        self._val = accumulate(self._val, self._sums(batch, out, res))

    def on_validation_epoch_end(self) -> None:
        """Log ``val_loss`` and every validation ratio, reduced over ranks."""
        self._batch_end = time.perf_counter()  # validation time is not data wait
        if self._val is None:
            return
        metrics = window_metrics(all_reduce_sums(self._val), elapsed_s=0.0, world_size=1)
        self._val = None
        # The values are already reduced over ranks, hence identical: sync_dist's mean keeps them
        # (and keeps Lightning from warning about unsynced epoch-level logs).
        self.log("val_loss", metrics.pop("loss"), prog_bar=True, sync_dist=True)
        self.log_dict({f"val/{k}": v for k, v in metrics.items() if k != "tokens_per_s"},
                      sync_dist=True)

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        """Optimizer over the trainable parameters and the per-step warmup + cosine schedule."""
        params = [p for p in self.parameters() if p.requires_grad]
        opt = build_optimizer(params, self.optimizer_cfg)
        total = int(self.trainer.estimated_stepping_batches)
        sched = build_scheduler(opt, self.scheduler_cfg, total_steps=total)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def anchor_generator(seed: int, rank: int, stage: int, epoch: int, batch_idx: int, *,
                     device: torch.device | str = "cpu") -> torch.Generator:
    """The anchor-sampling RNG of one micro-batch: a pure function of its position in the run."""
    gen = torch.Generator(device=device)
    # hash() of a tuple of ints is stable across processes (PYTHONHASHSEED affects only str/bytes).
    gen.manual_seed(hash((seed, rank, stage, epoch, batch_idx)) & 0x7FFF_FFFF_FFFF_FFFF)
    return gen


def trailing_window_scale(batch_idx: int, num_batches: float, accumulate: int) -> float:
    """``accumulate / p`` in the epoch's last window of ``p < accumulate`` micro-batches, else 1.

    Args:
        batch_idx: The micro-batch's index in the epoch.
        num_batches: Micro-batches in the epoch (``inf`` when unknown: no rescaling).
        accumulate: Micro-batches per optimizer step.
    """
    if accumulate <= 1 or not math.isfinite(num_batches):
        return 1.0
    tail = int(num_batches) % accumulate
    if tail == 0 or batch_idx < int(num_batches) - tail:
        return 1.0
    return accumulate / tail


def window_metrics(sums: MetricSums, *, elapsed_s: float, world_size: int) -> dict[str, float]:
    """Ratios of a (rank-reduced) window: loss terms are means over micro-batches of all ranks."""
    metrics = metric_ratios(sums)
    count = float(sums["micro_batches"])
    metrics |= {name: float(sums[name]) / count for name in LOSS_TERMS}
    if float(sums.get("row_tokens", 0.0)) > 0:
        metrics["fill_ratio"] = float(sums["tokens"]) / float(sums["row_tokens"])
    if elapsed_s > 0:
        metrics["tokens_per_s"] = float(sums["tokens"]) / elapsed_s
    if "data_wait_s" in sums and elapsed_s > 0:
        metrics["data_wait_frac"] = float(sums["data_wait_s"]) / (elapsed_s * world_size)
    return metrics


class WindowLogger(L.Callback):
    """Logs (and flushes) the training window at each batch end, before any checkpoint is saved.

    Lightning runs callbacks' batch-end hooks before the module's, and checkpoint callbacks after
    every other callback; logged from here, a step's metrics are on disk before a checkpoint of
    that step exists, so a run killed after a checkpoint keeps the metrics of every step in it.
    """

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        """Hand the batch end to the module."""
        assert isinstance(pl_module, DraftLitModule)
        pl_module.end_train_batch(batch_idx)


RENAMED = {"DSparkLitModule": "DraftLitModule"}
"""Old names this module still serves, each as its new name (``renamed_attribute``)."""


def __getattr__(name: str) -> Any:
    """An old name of ``RENAMED``, with a FutureWarning naming its replacement."""
    return renamed_attribute(__name__, name, RENAMED)
