"""Run one producer worker: read its uncommitted units, capture them, commit them, finalize.

Each unit is all-or-nothing: its rows are tokenized and captured, and its samples stream, block of
rows by block as they are captured, to a writer thread that writes them into the unit's fresh
slots and commits the unit atomically once it is whole, while the engine captures the next unit.
A crash anywhere loses at most the units in flight (nothing of a unit is visible before its
commit); re-running the same command skips committed units, and samples are written in sample-id
order, so a resumed cache has the same bytes as an uninterrupted one.

The steps live apart: ``prepare`` (what the config resolves to), ``backend`` (the engine),
``parity_check`` (``--parity_samples``) and ``capture_loop`` (the units captured and written).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Mapping

from sparkforge.manifests.finalize import finalize_cache
from sparkforge.manifests.no_samples import NoSamplesWritten, require_samples
from sparkforge.manifests.schema import CacheIncompleteError, CacheManifest
from sparkforge.producer.backend import make_source
from sparkforge.producer.capture import CaptureAborted, NonFiniteActivations
from sparkforge.producer.capture_loop import capture_units, writer_threads
from sparkforge.producer.config import ProducerConfig
from sparkforge.producer.header import build_header
from sparkforge.producer.image_check import check_committed_images
from sparkforge.producer.image_rows import ImageChatEncoder
from sparkforge.producer.parity_check import ParityFailed, check_parity
from sparkforge.producer.prepare import Prepared, prepare
from sparkforge.producer.source import HiddenStateSource
from sparkforge.producer.stop import SignalStop, StopRequested
from sparkforge.producer.summary import RunSummary
from sparkforge.producer.target_files import target_files, target_identity
from sparkforge.producer.units import WorkerShare, owned_units, resolve_share
from sparkforge.producer.write_queue import writer_memory_bytes
from sparkforge.shared import storage
from sparkforge.shared.errors import Interrupted
from sparkforge.shared.io_errors import storage_errors
from sparkforge.shared.layout import TARGET_PREFIX
from sparkforge.shared.target_families import family_of_config
from sparkforge.shared.writer import CacheSpec, CacheWriter

logger = logging.getLogger(__name__)
# The errors ``run`` raises, importable from here with it.
__all__ = ["CaptureAborted", "NoSamplesWritten", "NonFiniteActivations", "ParityFailed", "run"]

STALE_PARTIAL_S = 900
"""Age after which a ``*.partial`` temp file in a local cache is a dead write, not a live one."""


def _open_writer(cfg: ProducerConfig, prep: Prepared) -> CacheWriter:
    header = build_header(cfg, target=target_identity(cfg.engine, prep.model_dir),
                          hf_layer_ids=prep.hf_layer_ids, encoder=prep.encoder,
                          inputs=prep.inputs, num_units=prep.num_units, eval_ids=prep.eval_ids,
                          scaling=family_of_config(prep.target_config).scaling(prep.target_config))
    spec = CacheSpec(hidden_size=prep.target_config["hidden_size"],
                     num_aux_layers=len(prep.hf_layer_ids), hidden_dtype=cfg.hidden_dtype,
                     max_seq_len=cfg.seq_len, aux_codec=cfg.aux_codec, topk=cfg.topk,
                     shard_rows=cfg.shard_rows, rows_per_unit=cfg.rows_per_unit)
    writer = CacheWriter.open(cfg.output, spec=spec, header=header,
                              storage_options=cfg.storage_options,
                              max_concurrency=cfg.writer_max_concurrency,
                              max_in_flight_bytes=cfg.writer_max_in_flight_bytes)
    threads = writer_threads(cfg)
    logger.info("writer: %d threads, %d writes in flight, at most %.1f MiB held (each thread's "
                "shard buffers and up to %.1f MiB of slot objects in flight)", threads,
                cfg.writer_max_concurrency,
                writer_memory_bytes(spec, threads=threads,
                                    in_flight_bytes=cfg.writer_max_in_flight_bytes) / 2**20,
                cfg.writer_max_in_flight_bytes / 2**20)
    # Written last, so its presence means every target file is there (the header already
    # guarantees it is this target's); other workers and re-runs skip the multi-GB upload.
    if not storage.exists(writer.loc, f"{TARGET_PREFIX}/weights.safetensors"):
        files = target_files(prep.model_dir, hidden_dtype=cfg.hidden_dtype)
        # The template actually used (an override included), so the trainer renders alike.
        files["chat_template.jinja"] = prep.encoder.template.encode()
        weights = files.pop("weights.safetensors")
        writer.write_target_files(files)
        writer.write_target_files({"weights.safetensors": weights})
    return writer


def try_finalize(
    output: str, *, expected_units: int, storage_options: Mapping[str, object]
) -> CacheManifest | None:
    """Finalize if every unit is committed; None (and a log line) while some are missing."""
    try:
        with storage_errors("output", output):
            return finalize_cache(output, expected_units=expected_units,
                                  storage_options=storage_options)
    except CacheIncompleteError as exc:
        logger.info("not finalizing yet (the last worker will, or `sparkforge finalize`): %s", exc)
        return None


def run(
    cfg: ProducerConfig,
    *,
    source: HiddenStateSource | None = None,
    env: Mapping[str, str] | None = None,
) -> RunSummary:
    """Produce this worker's share of the cache described by ``cfg``.

    Args:
        cfg: The validated producer config.
        source: A running capture backend to use instead of starting ``cfg.backend``.
        env: Environment for the worker share (default ``os.environ``).

    Raises:
        CacheMismatchError: The cache exists with a different config, target, data or template,
            or an image behind one of its committed image rows changed.
        CaptureAborted: Too many requests failed in a row.
        NonFiniteActivations: ``non_finite`` is ``fail`` and a row's activations hold NaN/inf.
        NoSamplesWritten: Rows were read (by this run, or into the finalized cache) but none was
            written.
        ParityFailed: ``parity_samples`` > 0 and the capture disagrees with transformers.
        StorageError: The data or the cache cannot be read or written (disk full, ...).
    """
    share = resolve_share(cfg.worker_index, cfg.num_workers, os.environ if env is None else env)
    with SignalStop() as stop:
        try:
            return _run(cfg, share, source, stop)
        except StopRequested as exc:
            raise _stopped(cfg, stop, exc.signum) from None


def _run(cfg: ProducerConfig, share: WorkerShare, source: HiddenStateSource | None,
         stop: SignalStop) -> RunSummary:
    prep = prepare(cfg)
    storage.set_codec_threads(writer_threads(cfg))  # before the first store opens
    with storage_errors("output", cfg.output):
        writer = _open_writer(cfg, prep)
        for path in storage.remove_stale_partials(writer.loc, older_than_s=STALE_PARTIAL_S):
            logger.info("removed %s, left by a write that was killed", path)
    mine = owned_units(prep.num_units, share)
    todo = sorted(set(mine) - writer.committed_units())
    stop.todo, stop.writer = todo, writer
    if isinstance(prep.encoder, ImageChatEncoder) and len(todo) < len(mine):
        with storage_errors("output", cfg.output):
            checked = check_committed_images(
                writer, sorted(set(mine) - set(todo)), prep.inputs,
                rows_per_unit=cfg.rows_per_unit, reader=prep.encoder.image_reader,
                storage_options=cfg.storage_options, batch_rows=cfg.read_batch_rows)
        logger.info("images of %d committed image rows unchanged", checked)
    summary = RunSummary(output=cfg.output, worker=share, units_owned=len(mine),
                         units_todo=len(todo), num_rows=prep.num_rows,
                         mix=prep.inputs.mix_infos())
    logger.info("worker %d/%d (%s): %d of its %d units to do (cache has %d units)",
                share.worker_index, share.num_workers, share.origin, len(todo), len(mine),
                prep.num_units)
    if todo:
        active = make_source(cfg, prep.model_dir, prep.hf_layer_ids) if source is None else source
        try:
            if cfg.parity_samples:
                check_parity(cfg, prep, active, writer)
            capture_units(cfg, prep, writer, active, todo, summary, stop)
        finally:
            if source is None:
                active.close()
    if cfg.finalize:
        manifest = try_finalize(cfg.output, expected_units=prep.num_units,
                                storage_options=cfg.storage_options)
        summary.finalized = manifest is not None
        if manifest is not None:
            require_samples(manifest.accounting, f"the cache {cfg.output}")
            return summary
    require_samples(summary.accounting(), f"this run's share of {cfg.output}")
    return summary


def _stopped(cfg: ProducerConfig, stop: SignalStop, signum: int) -> Interrupted:
    """What a stop by signal did: the units this run committed, the one it abandoned."""
    name = signal.Signals(signum).name
    if stop.writer is None:
        return Interrupted(f"stopped by {name} before capturing; nothing was written to "
                           f"{cfg.output}", signum=signum)
    with storage_errors("output", cfg.output):
        done = sorted(set(stop.todo) & stop.writer.committed_units())
    abandoned = (f"unit {stop.unit_in_flight} was being captured and is abandoned (nothing of it "
                 "is committed)" if stop.unit_in_flight is not None else "no unit was abandoned")
    return Interrupted(
        f"stopped by {name}: {len(done)} of this worker's {len(stop.todo)} units to do are "
        f"committed in {cfg.output}; {abandoned}; re-run the same command to capture the other "
        f"{len(stop.todo) - len(done)} (committed units are kept)", signum=signum)
