"""LightningDataModule over a hidden-state cache at any fsspec URI (train fits, eval validates)."""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import lightning as L
import torch
from docstring_parser import parse_from_object
from safetensors.torch import load as load_safetensors
from torch.utils.data import DataLoader

from sparkforge.manifests.open import open_cache
from sparkforge.manifests.schema import CacheManifest
from sparkforge.shared import storage
from sparkforge.shared.layer_ids import feature_positions
from sparkforge.shared.layout import MANIFEST_KEY
from sparkforge.shared.reader import CacheReader
from sparkforge.shared.target_config import parse_target_config
from sparkforge.trainer.data import CacheStream, ResumableLoader, ignore_sigterm, load_split_index
from sparkforge.trainer.data_plan import SplitIndex
from sparkforge.trainer.loader_settings import Batching, LoaderSettings, StartMethod

logger = logging.getLogger(__name__)
_DEFAULTS = LoaderSettings()


class CacheDataModule(L.LightningDataModule):
    """Streams the cache's train split for fitting and its eval split for validation.

    The arguments are the ``data.*`` flags of ``sparkforge train``: ``uri`` and
    ``storage_options`` name the cache, the rest are :class:`LoaderSettings` fields (their
    defaults, and their descriptions appended below from its attribute docstrings), parsed once
    into ``self.settings``.

    Args:
        uri: Cache root: a local path or any fsspec URI (``s3://bucket/cache``, ``gs://...``).
        storage_options: fsspec options for the store (e.g. ``{"endpoint_url": ...}`` for S3;
            on S3 the client pools 128 connections unless
            ``{"config_kwargs": {"max_pool_connections": N}}`` says otherwise).
    """

    def __init__(
        self,
        uri: str,
        *,
        storage_options: dict[str, Any] | None = None,
        max_seq_len: int = _DEFAULTS.max_seq_len,
        batch_size: int = _DEFAULTS.batch_size,
        batching: Batching = _DEFAULTS.batching,
        shuffle_buffer: int = _DEFAULTS.shuffle_buffer,
        pool_batches: int = _DEFAULTS.pool_batches,
        num_workers: int = _DEFAULTS.num_workers,
        prefetch_factor: int = _DEFAULTS.prefetch_factor,
        read_ahead_units: int = _DEFAULTS.read_ahead_units,
        seed: int = _DEFAULTS.seed,
        min_loss_tokens: int = _DEFAULTS.min_loss_tokens,
        verify_checksums: bool = _DEFAULTS.verify_checksums,
        val_batch_size: int | None = _DEFAULTS.val_batch_size,
        start_method: StartMethod | None = _DEFAULTS.start_method,
    ) -> None:
        super().__init__()
        self.settings = LoaderSettings(
            max_seq_len=max_seq_len, batch_size=batch_size, batching=batching,
            shuffle_buffer=shuffle_buffer, pool_batches=pool_batches, num_workers=num_workers,
            prefetch_factor=prefetch_factor, read_ahead_units=read_ahead_units, seed=seed,
            min_loss_tokens=min_loss_tokens, verify_checksums=verify_checksums,
            val_batch_size=val_batch_size, start_method=start_method)
        # storage_options may hold credentials: kept out of the hparams that loggers publish.
        self.save_hyperparameters(ignore=["storage_options"])
        self.uri, self.storage_options = uri, storage_options
        self._reader: CacheReader[CacheManifest] | None = None
        self._indexes: dict[str, SplitIndex] = {}
        self.features: tuple[int, ...] | None = None
        """Feature ids the draft reads (``use_features``); None streams every captured layer."""

    # ---- cache access -----------------------------------------------------------------------
    def use_features(self, feature_ids: tuple[int, ...]) -> None:
        """Stream only these captured features (the draft's ``target_layer_ids``), in this order.

        Raises:
            LayerIdError: the cache did not capture one of them.
        """
        self.features = tuple(feature_ids)
        if self._reader is not None:
            captured = self._reader.manifest.capture.layer_ids
            self._reader = self._reader.with_layers(feature_positions(captured, self.features))

    @property
    def reader(self) -> CacheReader[CacheManifest]:
        """The rank's ``CacheReader``, opened on first use; its DataLoader workers share its
        columns and open only their own storage handles."""
        if self._reader is None:
            self._reader = open_cache(self.uri, storage_options=self.storage_options,
                                      verify=self.settings.verify_checksums,
                                      features=self.features)
        return self._reader

    def split_index(self, split: str) -> SplitIndex:
        """The usable samples of ``split`` (cached)."""
        if split not in self._indexes:
            self._indexes[split] = load_split_index(
                self.reader, split, min_loss_tokens=self.settings.min_loss_tokens)
        return self._indexes[split]

    def split_counts(self) -> dict[str, int]:
        """Samples per split in the cache's index (before any filtering)."""
        return self.reader.samples.split_counts()

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
    def _stream(self, split: str, *, shuffle: bool) -> CacheStream:
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer else (0, 1)
        return CacheStream(self.reader, self.split_index(split), self.settings, rank=rank,
                           world_size=world, shuffle=shuffle)

    def _pin(self) -> bool:
        trainer = self.trainer
        return trainer is not None and trainer.strategy.root_device.type == "cuda"

    def train_dataloader(self) -> ResumableLoader:
        """The resumable training stream of this rank."""
        stream = self._stream("train", shuffle=True)
        logger.info("train: %d samples, %d micro-batches per rank per epoch, %d shares%s",
                    len(stream.index), len(stream), stream.num_shares,
                    f", rows packed to {self.settings.max_seq_len} tokens"
                    if stream.packed else "")
        return ResumableLoader(stream, prefetch_factor=self.settings.prefetch_factor,
                               pin_memory=self._pin())

    def val_dataloader(self) -> DataLoader[dict[str, torch.Tensor]]:
        """The eval split in storage order, split across ranks."""
        stream = self._stream("eval", shuffle=False)
        stream.prepare()
        workers = self.settings.num_workers
        return DataLoader(stream, batch_size=None, num_workers=workers, pin_memory=self._pin(),
                          worker_init_fn=ignore_sigterm,
                          prefetch_factor=self.settings.prefetch_factor if workers else None)


# ``--help`` reads the class docstring: the loader flags' lines come from LoaderSettings.
CacheDataModule.__doc__ = (CacheDataModule.__doc__ or "").rstrip() + "\n" + "\n".join(
    f"        {p.arg_name}: {' '.join((p.description or '').split())}"
    for p in parse_from_object(LoaderSettings).params) + "\n"
