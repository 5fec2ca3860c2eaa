"""Stream a hidden-state cache into padded micro-batches: per-share plans, unit reads, resume.

Each (data-parallel rank x dataloader worker) executes its own ``EpochPlan`` (see ``data_plan``):
it reads the units holding its samples whole and in plan order, with a few units read ahead on a
thread, keeps only the samples the plan still needs, and yields collated batches. The loader
wrapper counts the batches the trainer took, so a checkpoint records the exact data position and a
resumed run recomputes the plan and skips those batches without reading them.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
from collections.abc import Generator, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from sparkforge.shared.cache_tables import SampleColumns
from sparkforge.shared.errors import SparkforgeError
from sparkforge.shared.reader import CachedSample
from sparkforge.trainer.data_plan import (
    EpochPlan,
    SplitIndex,
    batches_per_share,
    packed_batches_per_share,
    plan_epoch,
)
from sparkforge.trainer.loader_settings import LoaderSettings
from sparkforge.trainer.worker_memory import arrays_in_shared_memory

logger = logging.getLogger(__name__)


class UnitReader(Protocol):
    """What the stream reads from a cache: its sample columns and whole units (``CacheReader``,
    which reopens its storage in each worker process and shares its columns)."""

    samples: SampleColumns

    def read_unit(self, unit: int) -> list[CachedSample]:
        """All samples of a committed unit, in storage order."""
        ...


def load_split_index(reader: UnitReader, split: str, *, min_loss_tokens: int = 2,
                     loss_tokens: bool = False) -> SplitIndex:
    """The split's samples from the index columns, minus those too short to hold one anchor;
    with ``loss_tokens`` they keep their supervised-token counts (the anchor budget)."""
    col = reader.samples
    in_split = col.in_split(split)
    keep = in_split & (col.num_loss_tokens >= min_loss_tokens)
    if int(in_split.sum()) > int(keep.sum()):
        logger.info("%s split: skipping %d samples with < %d loss tokens (no valid anchor)",
                    split, int(in_split.sum() - keep.sum()), min_loss_tokens)
    order = col.in_storage_order(keep)
    return SplitIndex.from_columns(
        sample_id=col.sample_id[order], unit=col.unit[order], length=col.length[order],
        num_loss_tokens=col.num_loss_tokens[order] if loss_tokens else None)


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


@dataclass(frozen=True)
class ShareWork:
    """One share's work from batch ``skip`` on: its plan, the index positions those batches
    still hold (sorted, once each) and the units holding them, in reading order."""

    plan: EpochPlan
    skip: int
    needed: np.ndarray
    units: np.ndarray

    @classmethod
    def of(cls, index: SplitIndex, plan: EpochPlan, skip: int) -> ShareWork:
        """The work of ``plan`` resumed at batch ``skip``."""
        rest = plan.positions[int(plan.batch_starts[min(skip, len(plan))]):]
        # Inside a period each position appears once: a sort is enough (unique keeps 2 more
        # arrays as long as the positions while it runs).
        needed = np.sort(rest) if plan.period is None else np.unique(rest)
        units = plan.unit_order[np.isin(plan.unit_order, index.unit[needed])]
        return cls(plan=plan, skip=skip, needed=needed, units=units)

    def needs(self, positions: np.ndarray) -> np.ndarray:
        """Mask of ``positions`` (-1: none) that a batch still to come holds."""
        if not self.needed.size:
            return np.zeros(positions.shape, dtype=bool)
        at = np.minimum(np.searchsorted(self.needed, positions), self.needed.size - 1)
        mask: np.ndarray = (positions >= 0) & (self.needed[at] == positions)
        return mask


class CacheStream(IterableDataset):  # type: ignore[type-arg]
    """One rank's stream of collated micro-batches; each dataloader worker runs its own share.

    Args:
        reader: The cache reader, opened once per rank before the workers start; each worker
            shares its columns and opens its own storage handles.
        index: The split's samples.
        settings: The run's loader settings (batching, batch sizes, buffer, seed, read-ahead).
        rank: Data-parallel rank.
        world_size: Data-parallel size.
        shuffle: Training order (shuffled units, samples and batches, ``settings.batching``);
            False reads in storage order, one sample per row (validation).
    """

    def __init__(self, reader: UnitReader, index: SplitIndex, settings: LoaderSettings, *,
                 rank: int, world_size: int, shuffle: bool) -> None:
        self.reader, self.index, self.settings = reader, index, settings
        self.rank, self.world_size, self.shuffle = rank, world_size, shuffle
        self._packed_batches: int | None = None
        self._prepared: tuple[int, int, list[ShareWork]] | None = None
        self.epoch = 0
        self.skip_batches = 0
        """Batches of this epoch the rank already consumed (set by the loader before iterating)."""

    @property
    def num_workers(self) -> int:
        """DataLoader workers per rank (0 = read in the main process)."""
        return self.settings.num_workers

    @property
    def num_shares(self) -> int:
        """Disjoint shares per epoch: one per (rank, worker)."""
        return self.world_size * max(1, self.num_workers)

    @property
    def packed(self) -> bool:
        """Whether batches are packed rows (``pack`` on a shuffled, training stream)."""
        return self.settings.batching == "pack" and self.shuffle

    def _per_share(self) -> int:
        if not self.packed:
            size = self.settings.batch_size if self.shuffle else self.settings.eval_batch_size
            return batches_per_share(len(self.index), num_shares=self.num_shares,
                                     batch_size=size)
        if self._packed_batches is None:
            self._packed_batches = packed_batches_per_share(self.index, self.settings,
                                                            num_shares=self.num_shares)
        return self._packed_batches

    def __len__(self) -> int:
        return self._per_share() * max(1, self.num_workers)

    def plan(self, share: int) -> EpochPlan:
        """This epoch's plan for one share."""
        return plan_epoch(self.index, self.settings, epoch=self.epoch, num_shares=self.num_shares,
                          share=share, shuffle=self.shuffle,
                          num_batches=self._per_share() if self.packed else None)

    def _role(self, worker: int) -> int:
        # Batches come out round-robin over workers; after n consumed batches the next one is
        # role n % W's, so worker w plays role (w + n) % W and skips that role's consumed batches.
        return (worker + self.skip_batches) % max(1, self.num_workers)

    def share_work(self, role: int) -> ShareWork:
        """What the worker playing ``role`` executes at the current epoch and position."""
        workers = max(1, self.num_workers)
        skip = max(0, -(-(self.skip_batches - role) // workers))
        return ShareWork.of(self.index, self.plan(self.rank * workers + role), skip)

    def prepare(self) -> None:
        """Plan every worker share of this rank now, before the loader forks its workers:
        each then executes a plan it shares with this process (copy-on-write, never written)
        instead of building its own, so a worker adds no memory per sample."""
        roles = range(max(1, self.num_workers))
        self._prepared = (self.epoch, self.skip_batches, [self.share_work(r) for r in roles])

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        role = self._role(0 if info is None else info.id)
        prepared = self._prepared
        work = (prepared[2][role] if prepared and prepared[:2] == (self.epoch, self.skip_batches)
                else self.share_work(role))
        if work.plan.num_dropped and self.rank == 0 and role == 0:
            logger.info("epoch %d: %d samples left out so every share is equal", self.epoch,
                        work.plan.num_dropped)
        return self._execute(work)

    def _execute(self, work: ShareWork) -> Iterator[dict[str, torch.Tensor]]:
        plan = work.plan
        held: dict[int, CachedSample] = {}
        """Read samples the plan still needs, by position in the index."""
        reads = self._read_ahead(work.units)
        for b in range(work.skip, len(plan)):
            batch = plan.batch(b).tolist()
            while any(p not in held for p in batch):
                unit, samples = next(reads)
                ids = np.fromiter((s.sample_id for s in samples), np.int64, len(samples))
                at = self.index.positions_in_unit(unit, ids)
                keep = work.needs(at)
                held.update((int(p), samples[i]) for i, p in zip(
                    np.flatnonzero(keep).tolist(), at[keep].tolist(), strict=True))
            yield collate([held[p] for p in batch], self.index.sample_id[batch].tolist(),
                          plan.rows(b))
            if plan.last_use(b):
                for p in batch:
                    del held[p]
        reads.close()

    def _read_ahead(self, units: np.ndarray
                    ) -> Generator[tuple[int, list[CachedSample]], None, None]:
        """Yield whole units in order, keeping ``read_ahead_units`` reads in flight (the units
        stay a shared array: a list of them would cost a worker ~36 bytes per unit)."""
        depth = self.settings.read_ahead_units
        with ThreadPoolExecutor(max_workers=depth, thread_name_prefix="cache-read") as pool:
            pending: list[tuple[int, Future[list[CachedSample]]]] = []
            for k in range(units.size):
                unit = int(units[k])
                pending.append((unit, pool.submit(self.reader.read_unit, unit)))
                if len(pending) > depth:
                    done, future = pending.pop(0)
                    yield done, future.result()
            while pending:
                done, future = pending.pop(0)
                yield done, future.result()


def ignore_sigterm(worker_id: int) -> None:
    """A loader worker leaves a SIGTERM to the training process (a scheduler signals every
    process of the job), which stops at the next step with a checkpoint and then ends the
    workers; a worker killed first would fail the step instead."""
    del worker_id
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


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
        self.stream.prepare()
        workers = self.stream.num_workers
        context = multiprocessing.get_context(self.stream.settings.start_method)
        loader = DataLoader(
            self.stream, batch_size=None, num_workers=workers, pin_memory=self.pin_memory,
            prefetch_factor=self.prefetch_factor if workers else None,
            worker_init_fn=ignore_sigterm, multiprocessing_context=context if workers else None,
        )
        forked = context.get_start_method() == "fork"
        with nullcontext() if forked or not workers else arrays_in_shared_memory():
            batches = iter(loader)  # starts the workers
        for batch in batches:
            self.consumed += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        """The data position: epoch, consumed batches, and the layout that fixes the plan."""
        return {"epoch": self.epoch, "consumed": self.consumed,
                "world_size": self.stream.world_size, "num_workers": self.stream.num_workers,
                "batch_size": self.stream.settings.batch_size, "seed": self.stream.settings.seed,
                "packed_row_tokens": self._row_tokens()}

    def _row_tokens(self) -> int:
        """Tokens per packed row (0 when rows are single samples: the plan ignores it)."""
        return self.stream.settings.max_seq_len if self.stream.packed else 0

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Resume at a saved position; the data layout must be the one it was saved with."""
        problems = [
            f"data.{key}: checkpoint has {state[key]}, this run has {now}"
            for key, now in (("world_size", self.stream.world_size),
                             ("num_workers", self.stream.num_workers),
                             ("batch_size", self.stream.settings.batch_size),
                             ("seed", self.stream.settings.seed))
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
