"""Run one producer worker: read its uncommitted units, capture them, commit them, finalize.

Each unit is all-or-nothing: its rows are tokenized, captured and handed to the cache writer in one
``write_unit`` call, which commits atomically; the write runs on a background thread while the
engine captures the next unit. A crash anywhere loses at most the units in flight;
re-running the same command skips committed units, and samples are written in sample-id order, so a
resumed cache has the same bytes as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from sparkforge.manifests.finalize import finalize_cache
from sparkforge.manifests.no_samples import NoSamplesWritten, require_samples
from sparkforge.manifests.schema import CacheIncompleteError, CacheManifest
from sparkforge.producer.capture import (
    CaptureAborted,
    FailureRun,
    NonFiniteActivations,
    UnitCapturer,
)
from sparkforge.producer.chat import ChatEncoder, SkipReason, unreadable_reason
from sparkforge.producer.config import ProducerConfig
from sparkforge.producer.header import build_header
from sparkforge.producer.image_check import check_committed_images
from sparkforge.producer.image_rows import ImageChatEncoder
from sparkforge.producer.inputs import InputRows, open_inputs
from sparkforge.producer.source import CaptureRequest, HiddenStateSource
from sparkforge.producer.splits import SplitRule, load_eval_ids
from sparkforge.producer.stop import SignalStop, StopRequested
from sparkforge.producer.summary import RunSummary
from sparkforge.producer.target_files import resolve_model_dir, target_files, target_identity
from sparkforge.producer.units import (
    WorkerShare,
    num_units,
    owned_units,
    resolve_share,
    rows_by_unit,
)
from sparkforge.producer.write_queue import CapturedUnit, UnitWriteQueue, default_writer_threads
from sparkforge.shared import storage
from sparkforge.shared.errors import ConfigError, Interrupted, SparkforgeError
from sparkforge.shared.image_inputs import target_images
from sparkforge.shared.image_sources import ImageReader
from sparkforge.shared.io_errors import storage_errors
from sparkforge.shared.layer_ids import (
    HfIndices,
    LayerIdError,
    check_feature_ids,
    default_feature_ids,
    feature_to_hf,
    strided_feature_ids,
)
from sparkforge.shared.layout import PARITY_FILE, TARGET_PREFIX
from sparkforge.shared.target_config import read_target_config
from sparkforge.shared.target_families import family_of_config
from sparkforge.shared.writer import CacheSpec, CacheWriter

if TYPE_CHECKING:
    from sparkforge.producer.parity import ParityReport

logger = logging.getLogger(__name__)
__all__ = ["CaptureAborted", "NoSamplesWritten", "NonFiniteActivations", "ParityFailed",
           "make_source", "parity", "run"]
DEFAULT_PARITY_SAMPLES = 8
PARITY_SCAN_FACTOR = 16
"""Rows read at most per parity sample while looking for image rows."""
STALE_PARTIAL_S = 900
"""Age after which a ``*.partial`` temp file in a local cache is a dead write, not a live one."""
class ParityFailed(SparkforgeError, RuntimeError):
    """Raised when the capture disagrees with one-row transformers forwards."""


@dataclass(frozen=True)
class Prepared:
    """Everything a run derives from its config before touching the cache or an engine."""

    model_dir: Path
    target_config: dict[str, Any]
    hf_layer_ids: HfIndices
    encoder: ChatEncoder
    inputs: InputRows
    num_rows: int
    num_units: int
    eval_ids: frozenset[int] | None


def prepare(cfg: ProducerConfig) -> Prepared:
    """Resolve the target, layer ids, tokenizer/template and data sources of ``cfg``."""
    from transformers import AutoTokenizer

    model_dir = resolve_model_dir(cfg.engine)
    target_config = read_target_config(model_dir).text
    num_layers = target_config["num_hidden_layers"]
    try:
        feature_ids = (
            strided_feature_ids(num_layers, cfg.layer_stride, start=cfg.layer_start)
            if cfg.layer_stride is not None else check_feature_ids(
                cfg.layer_ids or default_feature_ids(num_layers, cfg.num_feature_layers),
                num_layers))
    except LayerIdError as exc:
        raise ConfigError(f"--layer_ids / --layer_stride / --num_feature_layers for a "
                          f"{num_layers}-layer target: {exc}") from exc
    encoder = chat_encoder(cfg, model_dir, AutoTokenizer.from_pretrained(str(model_dir)))
    inputs = open_inputs(cfg)
    return Prepared(
        model_dir=model_dir, target_config=target_config,
        hf_layer_ids=feature_to_hf(feature_ids), encoder=encoder, inputs=inputs,
        num_rows=inputs.num_rows, num_units=num_units(inputs.num_rows, cfg.rows_per_unit),
        eval_ids=load_eval_ids(cfg.eval_ids, cfg.storage_options) if cfg.eval_ids else None,
    )


def chat_encoder(cfg: ProducerConfig, model_dir: Path, tokenizer: Any) -> ChatEncoder:
    """The run's row encoder: with images for a VL target on the HF backend (whose processor
    runs here), else text only (image parts skip as ``image_content``)."""
    kwargs: dict[str, Any] = {"chat_template": cfg.chat_template, "reasoning": cfg.reasoning,
                              "max_seq_len": cfg.longest_sample, "overlong": cfg.overlong,
                              "template_row_seconds": cfg.template_row_seconds,
                              "chat_template_kwargs": cfg.chat_template_kwargs}
    images = (target_images(model_dir, read_target_config(model_dir).raw)
              if cfg.backend == "hf" else None)
    if images is None:
        return ChatEncoder(tokenizer, **kwargs)
    return ImageChatEncoder(tokenizer, images=images, max_image_pixels=cfg.max_image_pixels,
                            image_reader=image_reader(cfg), **kwargs)


def image_reader(cfg: ProducerConfig) -> ImageReader:
    """How the run reads image sources: its allow-list, storage options and limits."""
    return ImageReader.from_options(cfg.image_sources, storage_options=cfg.storage_options,
                                    max_bytes=cfg.max_image_bytes,
                                    timeout_s=cfg.image_read_timeout_s)


def make_source(
    cfg: ProducerConfig, model_dir: Path, hf_layer_ids: Sequence[int], *, backend: str | None = None
) -> HiddenStateSource:
    """Start a capture backend (``cfg.backend`` unless ``backend`` is given)."""
    source: HiddenStateSource
    if (backend or cfg.backend) == "vllm":
        from sparkforge.producer.vllm_source import VllmSource

        Path(cfg.scratch_dir).mkdir(parents=True, exist_ok=True)
        source = VllmSource(dataclasses.replace(cfg.engine, model=str(model_dir)),
                            layer_ids=tuple(hf_layer_ids), topk=cfg.topk,
                            scratch_dir=cfg.scratch_dir, window=cfg.window,
                            max_retries=cfg.max_retries)
        return source
    return _hf_source(cfg, model_dir, hf_layer_ids, dtype=None)


def _hf_source(
    cfg: ProducerConfig, model_dir: Path, hf_layer_ids: Sequence[int], *, dtype: str | None,
    one_row: bool = False,
) -> HiddenStateSource:
    from sparkforge.producer.hf_source import HfSource

    device = cfg.hf_device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype is None:
        config = read_target_config(model_dir).text
        auto = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
        dtype = cfg.engine.dtype if cfg.engine.dtype != "auto" else str(auto)
    source: HiddenStateSource = HfSource(str(model_dir), layer_ids=tuple(hf_layer_ids),
                                         dtype=dtype, topk=cfg.topk, device=device,
                                         one_row=one_row)
    return source


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
                              storage_options=cfg.storage_options)
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
                _check_parity(cfg, prep, active, writer)
            _capture_units(cfg, prep, writer, active, todo, summary, stop)
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


def _capture_units(
    cfg: ProducerConfig, prep: Prepared, writer: CacheWriter, source: HiddenStateSource,
    todo: list[int], summary: RunSummary, stop: SignalStop,
) -> None:
    """Capture the units in ``todo``; ``writer_threads`` threads write and commit them, one unit
    each, while the engine captures the next ones (``writer_queue_units`` bounds the units
    waiting)."""
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
                    summary.add_unit(item.records, item.accounting)
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
            records, accounting = capturer.capture(source, unit_rows)
            with stop.deferred(), storage_errors("output", cfg.output):
                count(writes.submit(CapturedUnit(unit, records, accounting)))
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


def _parity_requests(prep: Prepared, num_samples: int, cfg: ProducerConfig) -> list[CaptureRequest]:
    """The first ``num_samples`` usable rows; with images, half of them image rows where the
    first ``PARITY_SCAN_FACTOR * num_samples`` rows hold that many."""
    text: list[CaptureRequest] = []
    image: list[CaptureRequest] = []
    want_images = isinstance(prep.encoder, ImageChatEncoder)
    for n, raw in enumerate(prep.inputs.rows(batch_rows=cfg.read_batch_rows,
                                             storage_options=cfg.storage_options)):
        encoded = (unreadable_reason(raw.error) if raw.row is None
                   else prep.encoder.encode(raw.row, folder=raw.folder))
        if not isinstance(encoded, SkipReason):
            (text if encoded.model_inputs is None else image).append(CaptureRequest(
                sample_id=raw.index, input_ids=encoded.input_ids,
                model_inputs=encoded.model_inputs))
        found = len(text) + len(image)
        enough_images = not want_images or len(image) >= num_samples // 2
        if found >= num_samples and (enough_images or n + 1 >= PARITY_SCAN_FACTOR * num_samples):
            break
    num_image = min(len(image), max(num_samples // 2, num_samples - len(text)))
    return sorted([*image[:num_image], *text[:num_samples - num_image]],
                  key=lambda r: r.sample_id)


def _parity_report(
    cfg: ProducerConfig, prep: Prepared, source: HiddenStateSource, num_samples: int
) -> ParityReport:
    from sparkforge.producer.parity import run_parity

    # One row per forward: the reference is what each row alone gives, so an HF backend that
    # batches a padding-sensitive family wrongly fails here too.
    reference = _hf_source(cfg, prep.model_dir, prep.hf_layer_ids, dtype="float32", one_row=True)
    engine_dtype = str(source.engine_info()["dtype"])
    # The same reference in the engine's reduced dtype measures that dtype's own rounding noise.
    in_dtype = (None if engine_dtype == "float32" else
                _hf_source(cfg, prep.model_dir, prep.hf_layer_ids, dtype=engine_dtype,
                           one_row=True))
    try:
        return run_parity(source, reference,  # type: ignore[arg-type]
                          _parity_requests(prep, num_samples, cfg),
                          dtype_reference=in_dtype)  # type: ignore[arg-type]
    finally:
        reference.close()
        if in_dtype is not None:
            in_dtype.close()


def _check_parity(
    cfg: ProducerConfig, prep: Prepared, source: HiddenStateSource, writer: CacheWriter
) -> None:
    report = _parity_report(cfg, prep, source, cfg.parity_samples)
    logger.info("parity check:\n%s", report.table())
    writer.write_target_files({PARITY_FILE: json.dumps(report.to_dict(), indent=1).encode()})
    if not report.passed:
        raise ParityFailed(f"the {cfg.backend} capture disagrees with one-row transformers "
                           f"forwards; nothing was captured:\n{report.table()}")


def parity(cfg: ProducerConfig, *, source: HiddenStateSource | None = None) -> ParityReport:
    """``sparkforge parity``: compare the ``cfg.backend`` capture with one-row fp32 transformers
    forwards on ``parity_samples`` rows (8 if 0)."""
    prep = prepare(cfg)
    active = make_source(cfg, prep.model_dir, prep.hf_layer_ids) if source is None else source
    try:
        return _parity_report(cfg, prep, active, cfg.parity_samples or DEFAULT_PARITY_SAMPLES)
    finally:
        if source is None:
            active.close()
