"""Offline equals online: training from the cache matches training on live target hidden states
(a Qwen3 target with the Qwen3-shaped draft and with the DFlash2 recipe's, a DeepSeek-V4 target
with the deepseek_v4 draft)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from cache_helpers import write_tiny_cache
from safetensors.torch import load as load_safetensors
from torch.utils.data import DataLoader

from sparkforge.manifests.open import open_cache
from sparkforge.shared.hidden_features import layer_feature
from sparkforge.shared.reader import CachedSample
from sparkforge.shared.target_families import family_of
from sparkforge.trainer.data import collate
from sparkforge.trainer.datamodule import CacheDataModule
from sparkforge.trainer.lit_module import DraftLitModule
from sparkforge.trainer.run_config import DraftSpec, RecipeName
from sparkforge.trainer.schedule import OptimizerConfig, SchedulerConfig

SPEC = DraftSpec(mask_token_id=3, hidden_size=128, vocab_size=1024, num_target_layers=4,
                 target_layer_ids=(0, 2), num_hidden_layers=1, block_size=4, num_anchors=8,
                 markov_rank=16)
V4_SPEC = DraftSpec(mask_token_id=3, hidden_size=64, vocab_size=1024, num_target_layers=4,
                    target_layer_ids=(0, 1, 2, 3), num_hidden_layers=1, block_size=4,
                    num_anchors=8, markov_rank=16, architecture="deepseek_v4",
                    target_model_type="deepseek_v4")


class _Record(L.Callback):
    """Loss, sample ids and (packed batches) the row of each sample, of every training step."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.batches: list[list[int]] = []
        self.rows: list[list[int] | None] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))
        self.batches.append(batch["sample_ids"].tolist())
        doc = batch.get("document_ids")
        self.rows.append(None if doc is None else [
            int((doc == d).any(1).nonzero()[0]) for d in range(len(self.batches[-1]))])


class _OnlineData(L.LightningDataModule):
    """Batches of the same samples whose hidden states a transformers target computes live."""

    def __init__(self, target_dir: Path, reader: Any, batches: list[list[int]],
                 rows: list[list[int] | None], spec: DraftSpec) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.target = AutoModelForCausalLM.from_pretrained(str(target_dir),
                                                           dtype=torch.float32).eval()
        self.family = family_of(self.target.config.model_type)
        self.reader, self.batches, self.rows, self.spec = reader, batches, rows, spec
        # Feature id L-1 is the last layer's raw output (as vLLM serves it), not HF's post-norm
        # hidden_states[L]: read it from the layer itself.
        self.last: list[torch.Tensor] = []
        self.target.model.layers[-1].register_forward_hook(
            lambda module, args, output: self.last.append(output))

    def target_config(self) -> dict[str, Any]:
        return self.target.config.to_dict()

    def target_weights(self) -> dict[str, torch.Tensor]:
        return {"embed_tokens.weight": self.target.get_input_embeddings().weight.detach(),
                "lm_head.weight": self.target.get_output_embeddings().weight.detach()}

    def _sample(self, sample_id: int) -> CachedSample:
        cached = self.reader.read_sample(sample_id)   # tokens only; hidden states are recomputed
        ids = torch.from_numpy(cached.input_ids).long()
        with torch.no_grad():
            hs = self.target(ids[None], output_hidden_states=True, use_cache=False).hidden_states
        raw = [*hs[:-1], self.last.pop()]
        feats = [layer_feature(raw[i + 1], self.family)[0] for i in self.spec.layer_ids()]
        return dataclasses.replace(
            cached, hidden_dtype="float32", aux_hidden=torch.stack(feats, dim=1).numpy(),
            final_hidden=hs[-1][0].numpy())

    def train_dataloader(self) -> DataLoader[dict[str, torch.Tensor]]:
        batches = [collate([self._sample(i) for i in ids], ids, rows)
                   for ids, rows in zip(self.batches, self.rows, strict=True)]
        return DataLoader(batches, batch_size=None)  # type: ignore[arg-type]


def _fit(data: Any, steps: int, spec: DraftSpec, recipe: RecipeName) -> _Record:
    L.seed_everything(0)
    record = _Record()
    module = DraftLitModule(draft=spec, recipe=recipe, optimizer=OptimizerConfig(lr=3e-3),
                             scheduler=SchedulerConfig(warmup_steps=0), attn_implementation="sdpa")
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, callbacks=[record],
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, gradient_clip_val=1.0)
    trainer.fit(module, datamodule=data)
    return record


def _offline_equals_online(uri: str, target: Path, spec: DraftSpec,
                           recipe: RecipeName = "dspark", **data: Any) -> _Record:
    offline_data = CacheDataModule(uri, **{"batch_size": 2, "num_workers": 0} | data)
    offline = _fit(offline_data, 4, spec, recipe)
    weights = load_safetensors(offline_data.reader.target_file("weights.safetensors"))
    online_data = _OnlineData(target, offline_data.reader, offline.batches, offline.rows, spec)
    assert torch.equal(online_data.target_weights()["lm_head.weight"], weights["lm_head.weight"])
    online = _fit(online_data, 4, spec, recipe)
    assert online.batches == offline.batches
    assert len(offline.losses) == 4
    assert online.losses == pytest.approx(offline.losses, rel=1e-5, abs=1e-6)
    assert offline.losses[0] != offline.losses[-1]   # the steps really trained
    return offline


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["dspark", "dflash2"])
def test_cache_training_equals_live_target_training(tiny_target: Path, tmp_path: Path,
                                                    recipe: RecipeName) -> None:
    """Same samples, anchors and init: cache-fed and live-fed losses agree to fp32 tolerance
    (the dspark cache with 32-row shards, so its samples span up to three slots)."""
    uri = write_tiny_cache(str(tmp_path / "cache"), tiny_target, hidden_dtype="float32",
                           shard_rows=32 if recipe == "dspark" else None)
    if recipe == "dspark":
        index = open_cache(uri).samples
        assert int(((index.row_offset + index.length - 1) // 32 - index.slot).max()) >= 2
    spec = SPEC if recipe == "dspark" else dataclasses.replace(SPEC, markov_rank=None)
    _offline_equals_online(uri, tiny_target, spec, recipe)


@pytest.mark.slow
def test_packed_cache_training_equals_live_target_training(tiny_target: Path,
                                                           tmp_path: Path) -> None:
    """Packed rows of 192 tokens (twice the capture length, longer than any sample) train from
    the cache as from live hidden states packed the same way (one row per step, so the 4 steps
    are one epoch, as the live side replays them)."""
    uri = write_tiny_cache(str(tmp_path / "cache"), tiny_target, hidden_dtype="float32")
    offline = _offline_equals_online(uri, tiny_target, SPEC, batching="pack", max_seq_len=192,
                                     batch_size=1)
    assert all(rows is not None for rows in offline.rows)
    assert all(len(rows or []) > 1 for rows in offline.rows)  # each row holds several samples


@pytest.mark.slow
def test_v4_drafter_cache_training_equals_live_v4_training(tiny_v4_target: Path,
                                                           tiny_v4_cache: Path) -> None:
    """The deepseek_v4 draft fed from a V4 cache trains as when fed by a live HF V4 forward,
    the last layer's feature (id L-1, raw stream mean) included."""
    _offline_equals_online(str(tiny_v4_cache), tiny_v4_target, V4_SPEC)
