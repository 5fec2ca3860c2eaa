"""The capture loop of a run: a worker's units captured in order while writer threads commit
the ones captured before."""

from __future__ import annotations

import logging
import os
import time

from tqdm import tqdm

from sparkforge.producer.capture import FailureRun, UnitCapturer
from sparkforge.producer.config import ProducerConfig
from sparkforge.producer.prepare import Prepared
from sparkforge.producer.source import HiddenStateSource
from sparkforge.producer.splits import SplitRule
from sparkforge.producer.stop import SignalStop
from sparkforge.producer.summary import RunSummary
from sparkforge.producer.units import rows_by_unit
from sparkforge.producer.write_queue import CapturedUnit, UnitWriteQueue, default_writer_threads
from sparkforge.shared.io_errors import storage_errors
from sparkforge.shared.writer import CacheWriter

logger = logging.getLogger(__name__)


def capture_units(
    cfg: ProducerConfig, prep: Prepared, writer: CacheWriter, source: HiddenStateSource,
    todo: list[int], summary: RunSummary, stop: SignalStop,
) -> None:
    """Capture the units in ``todo``; ``writer_threads`` threads write and commit them, one unit
    each, a unit's samples streaming to its thread as they are captured (``writer_queue_units``
    bounds the units waiting for a thread, ``FEED_BLOCKS`` the blocks of rows each holds)."""
    capturer = UnitCapturer(prep.encoder, SplitRule(cfg.eval_fraction, prep.eval_ids,
                                                    cfg.split_seed),
                            len(prep.hf_layer_ids), cfg.hidden_dtype, cfg.topk,
                            FailureRun(cfg.max_consecutive_failures), aux_codec=cfg.aux_codec,
                            non_finite=cfg.non_finite)
    todo_set = set(todo)
    rows = prep.inputs.rows(wanted=lambda i: i // cfg.rows_per_unit in todo_set,
                            batch_rows=cfg.read_batch_rows, storage_options=cfg.storage_options)
    start = time.monotonic()
    with tqdm(total=len(todo), unit="unit", disable=not cfg.progress) as bar, \
            UnitWriteQueue(writer, queue_units=cfg.writer_queue_units,
                           num_threads=writer_threads(cfg)) as writes:

        def count(done: list[CapturedUnit]) -> None:
            for item in done:
                if item.taken_over:
                    _taken_over(summary, item.unit)
                else:
                    assert item.tally is not None, "a committed unit is tallied"
                    summary.add_unit(item.tally, item.accounting)
                bar.update(1)
            summary.seconds = time.monotonic() - start
            bar.set_postfix_str(summary.progress(summary.seconds), refresh=False)

        # A duplicate or restarted worker may commit one of these units first: such a unit is
        # skipped (before capture, or when its commit loses the race) and the run carries on.
        for unit, unit_rows in rows_by_unit(rows, cfg.rows_per_unit):
            with storage_errors("output", cfg.output):
                committed = writer.is_committed(unit)
            if committed:
                _taken_over(summary, unit)
                bar.update(1)
                continue
            stop.unit_in_flight = unit
            with storage_errors("output", cfg.output):
                feed = writes.open(unit)
            try:  # the unit's samples stream to a writer thread as they are captured
                # (whose write errors surface here, on the feed's calls)
                with storage_errors("output", cfg.output):
                    accounting = capturer.stream(source, unit_rows, feed)
            except BaseException:
                feed.cancel()  # nothing of this unit is committed
                raise
            with stop.deferred(), storage_errors("output", cfg.output):
                feed.commit(accounting)
                count(writes.committed())
                stop.unit_in_flight = None
        with stop.deferred(), storage_errors("output", cfg.output):
            count(writes.close())


def _taken_over(summary: RunSummary, unit: int) -> None:
    logger.warning("unit %d was committed by another process meanwhile; skipping it", unit)
    summary.units_taken_over += 1


def writer_threads(cfg: ProducerConfig) -> int:
    """``cfg.writer_threads``, or the CPUs this process may use minus the engine's."""
    if cfg.writer_threads:
        return cfg.writer_threads
    engine = cfg.engine
    processes = (engine.tensor_parallel_size * engine.data_parallel_size + 1
                 if cfg.backend == "vllm" else 0)
    return default_writer_threads(cpus=len(os.sched_getaffinity(0)), engine_processes=processes)
