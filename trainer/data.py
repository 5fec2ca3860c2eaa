"""Stream a hidden-state cache into padded micro-batches: per-share plans, unit reads, resume.

Each (data-parallel rank x dataloader worker) executes its own ``EpochPlan`` (see ``data_plan``):
it reads the units holding its samples whole and in plan order, with a few units read ahead on a
thread, keeps only the samples the plan still needs, and yields collated batches. The loader
wrapper counts the batches the trainer took, so a checkpoint records the exact data position and a
resumed run recomputes the plan and skips those batches without reading them.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from sparkforge.shared.errors import SparkforgeError
from sparkforge.shared.reader import CachedSample
from sparkforge.trainer.data_plan import (
    Batching,
    EpochPlan,
    SplitIndex,
    batches_per_share,
    packed_batches_per_share,
    plan_epoch,
)

logger = logging.getLogger(__name__)

# Keys of a collated batch; the first four are the draft forward's argument names. A packed
# batch adds PACKED_KEYS (the forward's keyword arguments of the same names).
BATCH_KEYS = ("input_ids", "loss_mask", "target_hidden_states", "target_last_hidden_states",
              "attention_mask", "sample_ids")
PACKED_KEYS = ("position_ids", "document_ids")


class UnitReader(Protocol):
    """What the stream reads from a cache: its sample index and whole units (``CacheReader``)."""

    def sample_index(self) -> pa.Table:
        """index.parquet: one row per sample."""
        ...

    def read_unit(self, unit: int) -> list[CachedSample]:
        """All samples of a committed unit, in storage order."""
        ...


def load_split_index(reader: UnitReader, split: str, *, min_loss_tokens: int = 2) -> SplitIndex:
    """The split's samples from ``index.parquet``, minus those too short to hold one anchor."""
    table = reader.sample_index()
    col = {name: table.column(name).to_numpy(zero_copy_only=False)
           for name in ("sample_id", "unit", "length", "num_loss_tokens", "split")}
    in_split = col["split"] == split
    keep = in_split & (col["num_loss_tokens"] >= min_loss_tokens)
    if int(in_split.sum()) > int(keep.sum()):
        logger.info("%s split: skipping %d samples with < %d loss tokens (no valid anchor)",
                    split, int(in_split.sum() - keep.sum()), min_loss_tokens)
    return SplitIndex.from_columns(sample_id=col["sample_id"][keep], unit=col["unit"][keep],
                                   length=col["length"][keep],
                                   num_loss_tokens=col["num_loss_tokens"][keep])


def _hidden_tensor(values: np.ndarray, hidden_dtype: str) -> torch.Tensor:
    """A tensor sharing ``values``' memory (bf16 bits viewed as bfloat16)."""
    t = torch.from_numpy(values)
    return t.view(torch.bfloat16) if hidden_dtype == "bfloat16" else t


def collate(samples: Sequence[CachedSample], sample_ids: Sequence[int],
            rows: Sequence[int] | np.ndarray | None = None) -> dict[str, torch.Tensor]:
    """Right-pad rows (numpy, as read) to the longest one; tensors are made once, at the end.

    Each sample is its own row, or with ``rows`` (the row of each sample; one row's samples are
    contiguous) the samples of a row sit end to end and the batch also holds ``position_ids``
    (restarting at 0 in each sample) and ``document_ids`` (the index into ``sample_ids`` of each
    token's sample, -1 on padding). Each value is copied once, from the read sample into the
    batch array, and every batch array becomes a tensor without a copy. Padding has
    ``loss_mask = 0`` and ``attention_mask = 0``, so no anchor or label falls in it.
    """
    lengths = [int(s.input_ids.shape[0]) for s in samples]
    row_of = np.arange(len(samples)) if rows is None else np.asarray(rows)
    fill = np.bincount(row_of, weights=lengths).astype(np.int64)
    batch, seq = int(fill.size), int(fill.max())
    first = samples[0]
    num_feat = first.aux_hidden.shape[1] * first.aux_hidden.shape[2]
    ids = np.zeros((batch, seq), dtype=np.int64)
    mask = np.zeros((batch, seq), dtype=np.uint8)
    attn = np.zeros((batch, seq), dtype=np.uint8)
    pos = np.zeros((batch, seq), dtype=np.int64)
    doc = np.full((batch, seq), -1, dtype=np.int64)
    aux = np.zeros((batch, seq, num_feat), dtype=first.aux_hidden.dtype)
    fin = np.zeros((batch, seq, first.final_hidden.shape[1]), dtype=first.final_hidden.dtype)
    used = np.zeros(batch, dtype=np.int64)
    for i, (s, n, b) in enumerate(zip(samples, lengths, row_of.tolist(), strict=True)):
        at = slice(int(used[b]), int(used[b]) + n)
        used[b] += n
        ids[b, at] = s.input_ids
        mask[b, at] = s.loss_mask
        attn[b, at] = 1
        pos[b, at] = np.arange(n)
        doc[b, at] = i
        aux[b, at] = s.aux_hidden.reshape(n, num_feat)
        fin[b, at] = s.final_hidden
    out = {
        "input_ids": torch.from_numpy(ids), "loss_mask": torch.from_numpy(mask),
        "target_hidden_states": _hidden_tensor(aux, first.hidden_dtype),
        "target_last_hidden_states": _hidden_tensor(fin, first.hidden_dtype),
        "attention_mask": torch.from_numpy(attn),
        "sample_ids": torch.tensor(list(sample_ids), dtype=torch.long),
    }
    if rows is not None:
        out |= {"position_ids": torch.from_numpy(pos), "document_ids": torch.from_numpy(doc)}
    return out


class CacheStream(IterableDataset):  # type: ignore[type-arg]
    """One rank's stream of collated micro-batches; each dataloader worker runs its own share.

    Args:
        open_reader: Picklable zero-argument callable returning a ``CacheReader``; called once
            per process (readers hold open stores and are not shipped to workers).
        index: The split's samples.
        rank: Data-parallel rank.
        world_size: Data-parallel size.
        num_workers: DataLoader workers per rank (0 = read in the main process).
        batch_size: Samples per micro-batch.
        batching: "bucket" (length-sorted pools), "pad" (stream order) or "pack" (rows of
            whole samples up to ``row_tokens``; training streams only).
        shuffle: Shuffle units, samples and batches (training); False reads in storage order.
        shuffle_buffer: Samples held by the streaming shuffle buffer.
        pool_batches: Batches per length-sorting pool for "bucket".
        seed: Base seed; the plan depends only on (seed, epoch, share).
        read_ahead_units: Units read concurrently ahead of the one being consumed.
        row_tokens: Tokens per packed row (``pack``).
    """

    def __init__(self, open_reader: Callable[[], UnitReader], index: SplitIndex, *, rank: int,
                 world_size: int,
                 num_workers: int, batch_size: int, batching: Batching, shuffle: bool,
                 shuffle_buffer: int, pool_batches: int, seed: int, read_ahead_units: int,
                 row_tokens: int = 0) -> None:
        self.open_reader, self.index = open_reader, index
        self.rank, self.world_size, self.num_workers = rank, world_size, num_workers
        self.batch_size, self.batching, self.shuffle = batch_size, batching, shuffle
        self.shuffle_buffer, self.pool_batches, self.seed = shuffle_buffer, pool_batches, seed
        self.read_ahead_units, self.row_tokens = read_ahead_units, row_tokens
        self._packed_batches: int | None = None
        self.epoch = 0
        self.skip_batches = 0
        """Batches of this epoch the rank already consumed (set by the loader before iterating)."""
        self._reader: UnitReader | None = None

    @property
    def num_shares(self) -> int:
        """Disjoint shares per epoch: one per (rank, worker)."""
        return self.world_size * max(1, self.num_workers)

    @property
    def packed(self) -> bool:
        """Whether batches are packed rows (``pack`` on a shuffled, training stream)."""
        return self.batching == "pack" and self.shuffle

    def _per_share(self) -> int:
        if not self.packed:
            return batches_per_share(len(self.index), num_shares=self.num_shares,
                                     batch_size=self.batch_size)
        if self._packed_batches is None:
            self._packed_batches = packed_batches_per_share(
                self.index, seed=self.seed, num_shares=self.num_shares,
                batch_size=self.batch_size, shuffle_buffer=self.shuffle_buffer,
                row_tokens=self.row_tokens)
        return self._packed_batches

    def __len__(self) -> int:
        return self._per_share() * max(1, self.num_workers)

    def plan(self, share: int) -> EpochPlan:
        """This epoch's plan for one share."""
        return plan_epoch(
            self.index, seed=self.seed, epoch=self.epoch, num_shares=self.num_shares, share=share,
            batch_size=self.batch_size, batching=self.batching, shuffle=self.shuffle,
            shuffle_buffer=self.shuffle_buffer, pool_batches=self.pool_batches,
            row_tokens=self.row_tokens, num_batches=self._per_share() if self.packed else None,
        )

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        workers = max(1, self.num_workers)
        worker = 0 if info is None else info.id
        # Batches come out round-robin over workers; after n consumed batches the next one is
        # role n % W's, so worker w plays role (w + n) % W and skips that role's consumed batches.
        n = self.skip_batches
        role = (worker + n) % workers
        skip = max(0, -(-(n - role) // workers))
        if self._reader is None:
            self._reader = self.open_reader()
        plan = self.plan(self.rank * workers + role)
        if plan.num_dropped and self.rank == 0 and role == 0:
            logger.info("epoch %d: %d samples left out so every share is equal", self.epoch,
                        plan.num_dropped)
        return self._execute(plan, skip)

    def _execute(self, plan: EpochPlan, skip: int) -> Iterator[dict[str, torch.Tensor]]:
        remaining = plan.batches[skip:]
        if not remaining:
            return
        positions = np.concatenate(remaining)
        # A packed share short of batches repeats its first ones: keep a sample until its last use.
        needed = Counter(self.index.sample_id[positions].tolist())
        wanted = set(self.index.unit[positions].tolist())
        units = [u for u in plan.unit_order.tolist() if u in wanted]
        held: dict[int, CachedSample] = {}
        reads = self._read_ahead(units)
        rows = plan.rows[skip:] if plan.rows is not None else [None] * len(remaining)
        for batch, row_of in zip(remaining, rows, strict=True):
            ids = self.index.sample_id[batch].tolist()
            while any(i not in held for i in ids):
                for sample in next(reads):
                    if sample.sample_id in needed:
                        held[sample.sample_id] = sample
            yield collate([held[i] for i in ids], ids, row_of)
            for i in ids:
                needed[i] -= 1
                if not needed[i]:
                    del held[i]
        reads.close()

    def _read_ahead(self, units: list[int]) -> Generator[list[CachedSample], None, None]:
        """Yield whole units in order, keeping ``read_ahead_units`` reads in flight."""
        depth = max(1, self.read_ahead_units)
        reader = self._reader
        assert reader is not None, "opened in __iter__"
        with ThreadPoolExecutor(max_workers=depth, thread_name_prefix="cache-read") as pool:
            pending: list[Future[list[CachedSample]]] = []
            for unit in units:
                pending.append(pool.submit(reader.read_unit, unit))
                if len(pending) > depth:
                    yield pending.pop(0).result()
            while pending:
                yield pending.pop(0).result()


class ResumableLoader:
    """A DataLoader over a ``CacheStream`` that records how many batches the trainer consumed.

    Lightning saves ``state_dict()`` in the checkpoint (it treats any loader with
    ``state_dict``/``load_state_dict`` as resumable) and calls ``sampler.set_epoch`` at each epoch
    start. Because the loader has a length, Lightning does not prefetch ahead of the step, so the
    count equals the batches trained on.
    """

    def __init__(self, stream: CacheStream, *, prefetch_factor: int = 4,
                 pin_memory: bool = False) -> None:
        self.stream = stream
        self.prefetch_factor, self.pin_memory = prefetch_factor, pin_memory
        self.epoch = 0
        self.consumed = 0

    @property
    def sampler(self) -> ResumableLoader:
        """Lightning looks for ``loader.sampler.set_epoch``; the loader is its own sampler."""
        return self

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (a no-op when resuming inside it)."""
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0

    def __len__(self) -> int:
        return len(self.stream)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        self.stream.epoch, self.stream.skip_batches = self.epoch, self.consumed
        workers = self.stream.num_workers
        loader = DataLoader(
            self.stream, batch_size=None, num_workers=workers, pin_memory=self.pin_memory,
            prefetch_factor=self.prefetch_factor if workers else None,
        )
        for batch in loader:
            self.consumed += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        """The data position: epoch, consumed batches, and the layout that fixes the plan."""
        return {"epoch": self.epoch, "consumed": self.consumed,
                "world_size": self.stream.world_size, "num_workers": self.stream.num_workers,
                "batch_size": self.stream.batch_size, "seed": self.stream.seed,
                "packed_row_tokens": self._row_tokens()}

    def _row_tokens(self) -> int:
        """Tokens per packed row (0 when rows are single samples: the plan ignores it)."""
        return self.stream.row_tokens if self.stream.packed else 0

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Resume at a saved position; the data layout must be the one it was saved with."""
        problems = [
            f"data.{key}: checkpoint has {state[key]}, this run has {now}"
            for key, now in (("world_size", self.stream.world_size),
                             ("num_workers", self.stream.num_workers),
                             ("batch_size", self.stream.batch_size), ("seed", self.stream.seed))
            if state.get(key, now) != now
        ]
        rows = state.get("packed_row_tokens", self._row_tokens())
        if rows != self._row_tokens():
            def shown(n: int) -> str:
                return f"rows packed to data.max_seq_len={n}" if n else "one sample per row"
            problems.append(f"data.batching / data.max_seq_len: checkpoint has {shown(rows)}, "
                            f"this run has {shown(self._row_tokens())}")
        if problems:
            raise SparkforgeError(
                "cannot resume the data position exactly (the epoch plan depends on "
                "these):\n  " + "\n  ".join(problems))
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
        if self.consumed >= len(self):
            self.epoch, self.consumed = self.epoch + 1, 0
