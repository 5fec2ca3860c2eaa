"""The training loader over a real cache, its workers started by spawn (kept apart from
test_worker_memory.py, whose spawned children import that module: this one imports Lightning)."""

from __future__ import annotations

from pathlib import Path

import torch
from cache_helpers import build_cache

from sparkforge.trainer.datamodule import CacheDataModule
from sparkforge.trainer.loader_settings import StartMethod


def test_a_real_cache_loads_the_same_through_spawned_workers(tmp_path: Path) -> None:
    """The training loader over a real cache yields, through spawned workers, the tensors that
    forked workers yield: everything a worker unpickles (the reader, its location and its
    commit check) survives pickling."""
    cache = str(build_cache(tmp_path / "c"))

    def batches(method: StartMethod) -> list[dict[str, torch.Tensor]]:
        data = CacheDataModule(cache, batch_size=2, num_workers=2, max_seq_len=64,
                               start_method=method)
        return list(data.train_dataloader())

    forked, spawned = batches("fork"), batches("spawn")
    assert len(forked) == len(spawned) > 1
    for a, b in zip(forked, spawned, strict=True):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), a["sample_ids"]
