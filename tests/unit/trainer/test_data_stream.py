"""The cache stream: every rank/worker share disjoint, exact resume, only needed units read."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from process_helpers import mapping_of
from torch.utils.data import get_worker_info

from sparkforge.shared.cache_tables import SampleColumns
from sparkforge.shared.dtypes import float_to_storage
from sparkforge.shared.errors import ConfigError
from sparkforge.shared.reader import CachedSample
from sparkforge.trainer import worker_memory
from sparkforge.trainer.data import CacheStream, ResumableLoader, collate, load_split_index
from sparkforge.trainer.loader_settings import Batching, LoaderSettings, StartMethod

F, H = 2, 4


def _sample(sample_id: int, length: int) -> CachedSample:
    """A sample as the reader returns it: numpy arrays, bf16 as uint16 bits."""
    return CachedSample(
        sample_id=sample_id, split="train",
        input_ids=np.full(length, sample_id, dtype=np.int32),
        loss_mask=np.ones(length, dtype=np.uint8),
        aux_hidden=float_to_storage(np.full((length, F, H), sample_id, np.float32), "bfloat16"),
        final_hidden=float_to_storage(np.full((length, H), -sample_id, np.float32), "bfloat16"),
        topk_ids=None, topk_logprobs=None)


class _Reader:
    """In-memory stand-in for CacheReader's index and unit reads (the stream's only inputs)."""

    def __init__(self, num_units: int = 6, per_unit: int = 7) -> None:
        rng = np.random.default_rng(0)
        self.units = {u: [_sample(u * 100 + i, int(rng.integers(3, 20))) for i in range(per_unit)]
                      for u in range(num_units)}
        self.reads: list[int] = []
        rows = [(s, u) for u, ss in self.units.items() for s in ss]
        lengths = [len(s.input_ids) for s, _ in rows]
        self.samples = SampleColumns.from_columns({
            "sample_id": np.array([s.sample_id for s, _ in rows]),
            "unit": np.array([u for _, u in rows]), "slot": np.array([u for _, u in rows]),
            "row_offset": np.cumsum([0, *lengths[:-1]]), "length": np.array(lengths),
            "num_loss_tokens": np.array(lengths),
            "split": np.array([s.sample_id % 10 == 9 for s, _ in rows], dtype=np.uint8)})

    def read_unit(self, unit: int) -> list[CachedSample]:
        self.reads.append(unit)
        return list(self.units[unit])


class _SharedColumnsReader(_Reader):
    """A reader that fails in a loader worker unless its index columns are mapped from shared
    memory (a worker that unpickled a private copy holds them on its heap)."""

    def read_unit(self, unit: int) -> list[CachedSample]:
        if get_worker_info() is not None:
            where = mapping_of(self.samples.sample_id)
            assert where.startswith("/dev/shm/"), f"a worker's own copy of the index: {where}"
        return super().read_unit(unit)


def _stream(reader: _Reader, *, rank: int = 0, world: int = 1, workers: int = 0,
            split: str = "train", batching: Batching = "bucket",
            start_method: StartMethod | None = None) -> CacheStream:
    index = load_split_index(reader, split)
    settings = LoaderSettings(num_workers=workers, batch_size=3 if batching != "pack" else 2,
                              batching=batching, shuffle_buffer=8, pool_batches=2, seed=3,
                              read_ahead_units=2, max_seq_len=40, start_method=start_method)
    return CacheStream(reader, index, settings, rank=rank, world_size=world,
                       shuffle=split == "train")


def _ids(batches: list[dict[str, torch.Tensor]]) -> list[list[int]]:
    return [b["sample_ids"].tolist() for b in batches]


def test_collate_pads_right_with_masked_padding() -> None:
    """Padding rows carry loss_mask 0 and attention_mask 0; features keep their values."""
    batch = collate([_sample(5, 3), _sample(7, 1)], [5, 7])
    assert batch["input_ids"].tolist() == [[5, 5, 5], [7, 0, 0]]
    assert batch["loss_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["target_hidden_states"].shape == (2, 3, F * H)
    assert batch["target_hidden_states"][1, 0].float().eq(7).all()
    assert batch["target_hidden_states"][1, 1:].float().eq(0).all()
    assert batch["target_last_hidden_states"][0, 2].float().eq(-5).all()


def test_collate_packs_rows_with_per_document_positions() -> None:
    """Packed rows: samples end to end, positions restart, document ids index sample_ids."""
    batch = collate([_sample(5, 3), _sample(7, 2), _sample(8, 4)], [5, 7, 8], rows=[0, 0, 1])
    assert batch["input_ids"].tolist() == [[5, 5, 5, 7, 7], [8, 8, 8, 8, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]
    assert batch["document_ids"].tolist() == [[0, 0, 0, 1, 1], [2, 2, 2, 2, -1]]
    assert batch["attention_mask"].tolist() == [[1] * 5, [1, 1, 1, 1, 0]]
    assert batch["sample_ids"].tolist() == [5, 7, 8]
    assert batch["target_hidden_states"][0, 3].float().eq(7).all()
    assert batch["target_last_hidden_states"][1, 3].float().eq(-8).all()


@pytest.mark.parametrize("batching", ["bucket", "pack"])
@pytest.mark.parametrize(("world", "workers"), [(1, 0), (2, 0), (2, 2), (1, 3)])
def test_ranks_and_workers_see_disjoint_equal_shares(world: int, workers: int,
                                                     batching: Batching) -> None:
    """Across all (rank, worker) shares each train sample appears at most once; counts equal.

    ``pack``: every rank yields the same batch count; a share short of rows may repeat its
    first batches, so samples are distinct within a share's first pass, and rows fit.
    """
    reader = _Reader()
    per_rank, counts = [], []
    for rank in range(world):
        loader = ResumableLoader(_stream(reader, rank=rank, world=world, workers=workers,
                                         batching=batching))
        batches = list(loader)
        assert len(batches) == len(loader)
        counts.append(len(batches))
        per_rank.append([i for b in _ids(batches) for i in b])
        if batching == "pack":
            assert all(int(b["attention_mask"].sum(1).max()) <= 40 for b in batches)
    assert len(set(counts)) == 1
    flat = [i for ids in per_rank for i in ids]
    train = [s.sample_id for ss in reader.units.values() for s in ss if s.sample_id % 10 != 9]
    assert set(flat) <= set(train)
    if batching == "pack":
        assert len(set(flat)) > 0.8 * len(train)
        return
    assert len(flat) == len(set(flat))
    assert len({len(ids) for ids in per_rank}) == 1
    assert len(train) - len(flat) < world * max(1, workers)


@pytest.mark.parametrize("batching", ["bucket", "pack"])
@pytest.mark.parametrize(("workers", "stop"), [(0, 0), (0, 4), (2, 3), (2, 4), (3, 5)])
def test_resume_continues_at_the_exact_batch(workers: int, stop: int, batching: Batching) -> None:
    """A loader restored from state_dict yields exactly the uninterrupted remaining batches."""
    full = _ids(list(ResumableLoader(_stream(_Reader(), workers=workers, batching=batching))))
    first = ResumableLoader(_stream(_Reader(), workers=workers, batching=batching))
    batches = iter(first)
    seen = [next(batches)["sample_ids"].tolist() for _ in range(stop)]
    state = first.state_dict()
    assert state["consumed"] == stop
    resumed = ResumableLoader(_stream(_Reader(), workers=workers, batching=batching))
    resumed.load_state_dict(state)
    assert seen + _ids(list(resumed)) == full


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_workers_not_forked_read_shared_columns_and_yield_the_forked_batches(
        method: StartMethod, monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers started by spawn or forkserver yield the batches forked workers yield, reading
    the rank's columns from shared memory (every array shared, so this small index is too)."""
    monkeypatch.setattr(worker_memory, "MIN_SHARED_BYTES", 0)
    forked = _ids(list(ResumableLoader(_stream(_Reader(), workers=2, batching="pack",
                                               start_method="fork"))))
    started = ResumableLoader(_stream(_SharedColumnsReader(), workers=2, batching="pack",
                                      start_method=method))
    assert _ids(list(started)) == forked


def test_resume_skips_units_whose_samples_were_all_consumed() -> None:
    """Fast-forwarding reads no unit whose samples all lie in already consumed batches."""
    reader = _Reader(num_units=8, per_unit=4)
    loader = ResumableLoader(_stream(reader))
    total = len(loader)
    resumed_reader = _Reader(num_units=8, per_unit=4)
    resumed = ResumableLoader(_stream(resumed_reader))
    resumed.load_state_dict({**loader.state_dict(), "consumed": total - 1})
    assert len(list(resumed)) == 1
    assert len(resumed_reader.reads) < 8


def test_epochs_differ_and_end_of_epoch_state_moves_to_the_next() -> None:
    """set_epoch reshuffles; a state saved after the last batch resumes at the next epoch."""
    loader = ResumableLoader(_stream(_Reader()))
    epoch0 = _ids(list(loader))
    state = loader.state_dict()
    loader.set_epoch(1)
    epoch1 = _ids(list(loader))
    assert sorted(map(sorted, epoch0)) != sorted(map(sorted, epoch1)) or epoch0 != epoch1
    resumed = ResumableLoader(_stream(_Reader()))
    resumed.load_state_dict(state)
    assert _ids(list(resumed)) == epoch1


def test_resume_with_another_layout_is_refused() -> None:
    """Restoring into a different world size names the field instead of silently reordering."""
    state = ResumableLoader(_stream(_Reader())).state_dict()
    other = ResumableLoader(_stream(_Reader(), world=2))
    with pytest.raises(ValueError, match="data.world_size"):
        other.load_state_dict(state)
    packed = ResumableLoader(_stream(_Reader(), batching="pack"))
    with pytest.raises(ValueError, match="checkpoint has one sample per row, this run has rows "
                                         "packed to data.max_seq_len=40"):
        packed.load_state_dict(state)


def test_eval_stream_reads_the_eval_split_in_order() -> None:
    """Validation sees exactly the eval split, in storage order."""
    reader = _Reader()
    ids = [i for b in _ids(list(_stream(reader, split="eval"))) for i in b]
    assert ids == sorted(s.sample_id for ss in reader.units.values() for s in ss
                         if s.sample_id % 10 == 9)


def test_samples_held_stay_bounded_whatever_the_cache_size() -> None:
    """Read-but-unyielded samples never exceed buffer + pool + the units in flight."""
    reader = _Reader(num_units=40, per_unit=7)
    stream = _stream(reader)
    train = {s.sample_id for ss in reader.units.values() for s in ss if s.sample_id % 10 != 9}
    yielded, peak = 0, 0
    for batch in ResumableLoader(stream):
        read = sum(1 for u in reader.reads for s in reader.units[u] if s.sample_id in train)
        yielded += batch["sample_ids"].numel()
        peak = max(peak, read - yielded)
    s = stream.settings
    bound = s.shuffle_buffer + s.batch_size * s.pool_batches + 7 * (s.read_ahead_units + 1)
    assert yielded == len(train)
    assert peak <= bound < len(train) / 4


class _LazyReader:
    """Index columns of ``num_units`` units of ``per_unit`` samples; units made when read."""

    def __init__(self, num_units: int, per_unit: int = 64) -> None:
        ids = np.arange(num_units * per_unit)
        self.per_unit = per_unit
        self.samples = SampleColumns.from_columns({
            "sample_id": ids, "unit": ids // per_unit, "slot": ids // per_unit,
            "row_offset": ids * 8, "length": 3 + ids % 5, "num_loss_tokens": 3 + ids % 5,
            "split": np.zeros(ids.size, dtype=np.uint8)})

    def read_unit(self, unit: int) -> list[CachedSample]:
        first = unit * self.per_unit
        return [_sample(i, 3 + i % 5) for i in range(first, first + self.per_unit)]


def _worker_bytes(num_units: int) -> int:
    """Bytes a worker's iteration still holds after 3 batches, the rank's shares prepared
    (allocated under the stream's own code: the samples read are the read-ahead's)."""
    import tracemalloc

    stream = _stream(_LazyReader(num_units), workers=2, batching="pack")  # type: ignore[arg-type]
    stream.prepare()
    tracemalloc.start(6)
    batches = iter(stream)
    for _ in range(3):
        next(batches)
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(True, f"*/trainer/{name}", all_frames=True)
         for name in ("data.py", "data_plan.py")])
    tracemalloc.stop()
    return sum(stat.size for stat in snapshot.statistics("filename"))


def test_a_worker_builds_nothing_per_sample_of_the_index() -> None:
    """A DataLoader worker executes the plan its rank prepared before forking (shared
    copy-on-write, never written): what its iteration allocates does not grow with the index
    (planning its own share, it held 5.4 bytes per sample more at 20k samples than at 2.6k)."""
    _worker_bytes(40)  # one-time costs (first imports, caches) out of the comparison
    small, big = _worker_bytes(40), _worker_bytes(320)
    assert (big - small) / ((320 - 40) * 64) < 0.5, (small, big)


def test_an_unknown_start_method_is_refused_naming_the_choices() -> None:
    """``data.start_method`` accepts fork, spawn, forkserver or null, by constructor and YAML."""
    def read(value: object) -> LoaderSettings:
        return LoaderSettings.from_train_config({"data": {"start_method": value}})

    assert read("spawn").start_method == "spawn"
    assert read(None).start_method is None
    with pytest.raises(ConfigError, match=r"data.start_method='threads' must be one of "
                                          r"\['fork', 'spawn', 'forkserver'\]"):
        LoaderSettings(start_method="threads")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"data.start_method must be one of \['fork', "):
        read(3)
