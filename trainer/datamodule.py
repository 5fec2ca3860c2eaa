"""LightningDataModule over a hidden-state cache at any fsspec URI (train fits, eval validates)."""

from __future__ import annotations

import functools
import hashlib
import logging
from collections import Counter
from typing import Any

import lightning as L
import torch
from safetensors.torch import load as load_safetensors
from torch.utils.data import DataLoader

from sparkforge.manifests.open import open_cache
from sparkforge.manifests.schema import CacheManifest
from sparkforge.shared import storage
from sparkforge.shared.errors import SparkforgeError
from sparkforge.shared.layout import MANIFEST_KEY
from sparkforge.shared.reader import CacheReader
from sparkforge.shared.target_config import parse_target_config
from sparkforge.trainer.data import CacheStream, ResumableLoader, load_split_index
from sparkforge.trainer.data_plan import Batching, SplitIndex
from sparkforge.trainer.run_config import DEFAULT_MAX_SEQ_LEN

logger = logging.getLogger(__name__)


class CacheDataModule(L.LightningDataModule):
    """Streams the cache's train split for fitting and its eval split for validation.

    Args:
        uri: Cache root: a local path or any fsspec URI (``s3://bucket/cache``, ``gs://...``).
        storage_options: fsspec options for the store (e.g. ``{"endpoint_url": ...}`` for S3).
        max_seq_len: Longest sample the run is sized for; a cache captured with a longer
            ``max_seq_len`` is refused before training. With ``pack`` also the tokens of one
            packed row (it may exceed the cache's ``capture.max_seq_len``).
        batch_size: Samples per micro-batch (per rank).
        batching: ``bucket`` groups samples of similar length (least padding of one sample per
            row; see benchmarks/bench_trainer_data.py); ``pad`` keeps the shuffled order;
            ``pack`` fills each training row with whole samples up to ``max_seq_len`` tokens,
            each keeping its own positions and attention (see trainer/README.md, Packing).
            Validation always runs one sample per row.
        shuffle_buffer: Samples held by the streaming shuffle buffer (bounds memory).
        pool_batches: Batches per length-sorting pool with ``bucket``.
        num_workers: DataLoader worker processes per rank; each reads its own disjoint share.
        prefetch_factor: Batches each worker prepares ahead of the step.
        read_ahead_units: Cache units each worker reads concurrently ahead of consumption.
        seed: Seed of the data order; the order is a function of (seed, epoch, rank, worker).
        min_loss_tokens: Samples with fewer supervised tokens hold no anchor and are skipped.
        verify_checksums: Check each slot's crc32c while reading (on by default; it costs
            little next to decoding, see benchmarks/bench_trainer_data.py). Whether each slot's
            objects exist is always checked.
        val_batch_size: Micro-batch size for validation (default: ``batch_size``).
    """

    def __init__(
        self,
        uri: str,
        *,
        storage_options: dict[str, Any] | None = None,
        max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
        batch_size: int = 1,
        batching: Batching = "bucket",
        shuffle_buffer: int = 256,
        pool_batches: int = 16,
        num_workers: int = 2,
        prefetch_factor: int = 4,
        read_ahead_units: int = 2,
        seed: int = 0,
        min_loss_tokens: int = 2,
        verify_checksums: bool = True,
        val_batch_size: int | None = None,
    ) -> None:
        super().__init__()
        problems = [f"data.{name}={value} must be >= {low}" for name, value, low in (
            ("max_seq_len", max_seq_len, 2), ("batch_size", batch_size, 1),
            ("shuffle_buffer", shuffle_buffer, 1), ("pool_batches", pool_batches, 1),
            ("num_workers", num_workers, 0), ("prefetch_factor", prefetch_factor, 1),
            ("read_ahead_units", read_ahead_units, 1), ("min_loss_tokens", min_loss_tokens, 0),
            ("val_batch_size", val_batch_size or 1, 1)) if value < low]
        if batching not in ("pad", "bucket", "pack"):
            problems.append(f"data.batching={batching!r} must be 'pad', 'bucket' or 'pack'")
        if problems:
            raise SparkforgeError("invalid data config:\n  " + "\n  ".join(problems))
        # storage_options may hold credentials: kept out of the hparams that loggers publish.
        self.save_hyperparameters(ignore=["storage_options"])
        self.uri, self.storage_options = uri, storage_options
        self.max_seq_len, self.batch_size, self.batching = max_seq_len, batch_size, batching
        self.shuffle_buffer, self.pool_batches, self.seed = shuffle_buffer, pool_batches, seed
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self.read_ahead_units, self.min_loss_tokens = read_ahead_units, min_loss_tokens
        self.verify_checksums = verify_checksums
        self.val_batch_size = val_batch_size or batch_size
        self._reader: CacheReader[CacheManifest] | None = None
        self._indexes: dict[str, SplitIndex] = {}
        self.features: tuple[int, ...] | None = None
        """Feature ids the draft reads (``use_features``); None streams every captured layer."""

    # ---- cache access -----------------------------------------------------------------------
    def use_features(self, feature_ids: tuple[int, ...]) -> None:
        """Stream only these captured features (the draft's ``target_layer_ids``), in this order."""
        self.features = tuple(feature_ids)

    @property
    def open_reader(self) -> functools.partial[CacheReader[CacheManifest]]:
        """A picklable callable opening the cache (each worker process opens its own reader)."""
        return functools.partial(open_cache, self.uri, storage_options=self.storage_options,
                                 verify=self.verify_checksums, features=self.features)

    @property
    def reader(self) -> CacheReader[CacheManifest]:
        """This process's ``CacheReader`` (opened on first use)."""
        if self._reader is None:
            self._reader = self.open_reader()
        return self._reader

    def split_index(self, split: str) -> SplitIndex:
        """The usable samples of ``split`` (cached)."""
        if split not in self._indexes:
            self._indexes[split] = load_split_index(self.reader, split,
                                                    min_loss_tokens=self.min_loss_tokens)
        return self._indexes[split]

    def split_counts(self) -> dict[str, int]:
        """Samples per split in the cache's index (before any filtering)."""
        return dict(Counter(self.reader.sample_index().column("split").to_pylist()))

    def target_config(self) -> dict[str, Any]:
        """The target's HF ``config.json`` stored in the cache."""
        source = f"{self.uri}/target/config.json"
        return dict(parse_target_config(self.reader.target_file("config.json"), source).raw)

    def target_weights(self) -> dict[str, torch.Tensor]:
        """The target's ``embed_tokens.weight``, ``lm_head.weight`` and ``norm.weight``."""
        return load_safetensors(self.reader.target_file("weights.safetensors"))

    def provenance(self) -> dict[str, Any]:
        """Where the training data came from, for checkpoints, exports and experiment loggers:
        the cache (its manifest's sha256 included), its target and its data's identity."""
        m = self.reader.manifest
        manifest = storage.read_bytes(self.reader.loc, MANIFEST_KEY)
        return {"cache_uri": self.uri, "cache_created_at": m.created_at,
                "cache_manifest_sha256": hashlib.sha256(manifest).hexdigest(),
                "data": m.data.identity(),
                "cache_sparkforge_version": m.sparkforge_version, "cache_git_sha": m.git_sha,
                "target_name_or_path": m.target.name_or_path,
                "target_content_hash": m.target.content_hash,
                "capture_layer_ids": list(m.capture.layer_ids), "capture_engine": m.capture.engine}

    # ---- Lightning hooks ----------------------------------------------------------------------
    def _stream(self, split: str, *, shuffle: bool, batch_size: int) -> CacheStream:
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer else (0, 1)
        return CacheStream(
            self.open_reader, self.split_index(split), rank=rank, world_size=world,
            num_workers=self.num_workers, batch_size=batch_size, batching=self.batching,
            shuffle=shuffle, shuffle_buffer=self.shuffle_buffer, pool_batches=self.pool_batches,
            seed=self.seed, read_ahead_units=self.read_ahead_units, row_tokens=self.max_seq_len,
        )

    def _pin(self) -> bool:
        trainer = self.trainer
        return trainer is not None and trainer.strategy.root_device.type == "cuda"

    def train_dataloader(self) -> ResumableLoader:
        """The resumable training stream of this rank."""
        stream = self._stream("train", shuffle=True, batch_size=self.batch_size)
        logger.info("train: %d samples, %d micro-batches per rank per epoch, %d shares%s",
                    len(stream.index), len(stream), stream.num_shares,
                    f", rows packed to {self.max_seq_len} tokens" if stream.packed else "")
        return ResumableLoader(stream, prefetch_factor=self.prefetch_factor, pin_memory=self._pin())

    def val_dataloader(self) -> DataLoader[dict[str, torch.Tensor]]:
        """The eval split in storage order, split across ranks."""
        stream = self._stream("eval", shuffle=False, batch_size=self.val_batch_size)
        return DataLoader(stream, batch_size=None, num_workers=self.num_workers,
                          pin_memory=self._pin(),
                          prefetch_factor=self.prefetch_factor if self.num_workers else None)
