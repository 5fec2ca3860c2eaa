"""Run one producer worker: read its uncommitted units, capture them, commit them, finalize.

Each unit is all-or-nothing: its rows are tokenized, captured and handed to the cache writer in one
``write_unit`` call, which commits atomically. A crash anywhere loses at most the units in flight;
re-running the same command skips committed units, and samples are written in sample-id order, so a
resumed cache has the same bytes as an uninterrupted one.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from sparkforge.manifests.finalize import finalize_cache, read_run_header
from sparkforge.manifests.schema import CacheIncompleteError, CacheManifest
from sparkforge.producer.chat import ChatEncoder, SkipReason
from sparkforge.producer.config import ProducerConfig
from sparkforge.producer.dataset import DataSource, RawRow, describe_sources, iter_rows
from sparkforge.producer.header import build_header
from sparkforge.producer.layer_ids import default_feature_ids, feature_to_hf, validate_feature_ids
from sparkforge.producer.source import CaptureRequest, CaptureResult, HiddenStateSource
from sparkforge.producer.splits import SplitRule, load_eval_ids
from sparkforge.producer.summary import RunSummary
from sparkforge.producer.target_files import (
    read_config,
    resolve_model_dir,
    target_files,
    target_identity,
)
from sparkforge.producer.units import num_units, owned_units, resolve_share, rows_by_unit
from sparkforge.shared import storage
from sparkforge.shared.records import SampleRecord, Split, UnitAccounting
from sparkforge.shared.writer import CacheSpec, CacheWriter

logger = logging.getLogger(__name__)


class CaptureAborted(RuntimeError):
    """Raised after ``max_consecutive_failures`` requests failed in a row."""


@dataclass
class _Pending:
    raw: RawRow
    split: Split
    input_ids: np.ndarray
    loss_mask: np.ndarray


@dataclass
class _FailureRun:
    limit: int
    count: int = 0
    last_errors: list[str] = field(default_factory=list)

    def failed(self, sample_id: int, error: str) -> None:
        self.count += 1
        self.last_errors = [*self.last_errors[-2:], f"sample {sample_id}: {error}"]
        logger.warning("capture failed for sample %d: %s", sample_id, error)
        if self.count >= self.limit:
            raise CaptureAborted(
                f"{self.count} consecutive capture requests failed (--max_consecutive_failures="
                f"{self.limit}); the engine is likely broken, so the run stops instead of writing "
                "an empty cache. Committed units are kept; re-run to resume. Last errors:\n  "
                + "\n  ".join(self.last_errors)
            )

    def succeeded(self) -> None:
        self.count = 0


def to_storage(tensor: torch.Tensor, hidden_dtype: str) -> np.ndarray:
    """A CPU tensor in the cache's storage dtype (bf16 as its uint16 bit pattern)."""
    if hidden_dtype == "bfloat16":
        bits = tensor.to(torch.bfloat16).contiguous().view(torch.int16).numpy()
        return bits.view(np.uint16)
    return tensor.to(getattr(torch, hidden_dtype)).contiguous().numpy()


def _check_result(
    result: CaptureResult, pending: _Pending, num_layers: int, topk: int
) -> str | None:
    """Shape errors at the source boundary, as a failure message (None: fine)."""
    t = pending.input_ids.shape[0]
    aux, final = result.aux_hidden, result.final_hidden
    if aux is None or final is None or aux.shape[:2] != (t, num_layers) or final.shape[0] != t:
        shapes = [None if x is None else tuple(x.shape) for x in (aux, final)]
        return f"expected aux [{t}, {num_layers}, H] and final [{t}, H], got {shapes}"
    if topk and (result.topk_ids is None or tuple(result.topk_ids.shape) != (t, topk)):
        return f"expected top-{topk} ids of shape [{t}, {topk}]"
    return None


def _record(result: CaptureResult, pending: _Pending, hidden_dtype: str, topk: int) -> SampleRecord:
    assert result.aux_hidden is not None
    assert result.final_hidden is not None
    topk_ids = result.topk_ids if topk else None  # a source may return more than was asked
    topk_lp = result.topk_logprobs if topk else None
    return SampleRecord(
        sample_id=pending.raw.index,
        source_row=pending.raw.index,
        source_hash=pending.raw.content_hash,
        split=pending.split,
        input_ids=pending.input_ids,
        loss_mask=pending.loss_mask,
        aux_hidden=to_storage(result.aux_hidden, hidden_dtype),
        final_hidden=to_storage(result.final_hidden, hidden_dtype),
        topk_ids=None if topk_ids is None else topk_ids.to(torch.int32).numpy(),
        topk_logprobs=None if topk_lp is None else topk_lp.float().numpy(),
    )


@dataclass
class _Worker:
    """The per-run state of one worker: encoder, split rule, source and counters."""

    cfg: ProducerConfig
    encoder: ChatEncoder
    split_rule: SplitRule
    num_layers: int
    failures: _FailureRun
    summary: RunSummary

    def encode_unit(self, rows: Sequence[RawRow]) -> tuple[list[_Pending], Counter[str]]:
        skipped: Counter[str] = Counter()
        pending = []
        for raw in rows:
            encoded = SkipReason.MALFORMED_JSON if raw.row is None else self.encoder.encode(raw.row)
            if isinstance(encoded, SkipReason):
                skipped[encoded.value] += 1
                continue
            split = self.split_rule.split_of(index=raw.index, content_hash=raw.content_hash)
            pending.append(_Pending(raw, split, encoded.input_ids, encoded.loss_mask))
        return pending, skipped

    def capture_unit(
        self, source: HiddenStateSource, rows: Sequence[RawRow]
    ) -> tuple[list[SampleRecord], UnitAccounting]:
        pending, skipped = self.encode_unit(rows)
        by_id = {p.raw.index: p for p in pending}
        requests = [CaptureRequest(sample_id=p.raw.index, input_ids=p.input_ids) for p in pending]
        records, failed = [], 0
        for result in source.capture(requests) if requests else ():
            item = by_id.pop(result.sample_id, None)
            if item is None:
                raise RuntimeError(f"capture backend returned sample {result.sample_id}, which "
                                   "was not requested or was already returned")
            error = result.error or _check_result(result, item, self.num_layers, self.cfg.topk)
            if error is not None:
                failed += 1
                self.failures.failed(result.sample_id, error)
                continue
            self.failures.succeeded()
            records.append(_record(result, item, self.cfg.hidden_dtype, self.cfg.topk))
        for sample_id in by_id:  # requests the backend never answered
            failed += 1
            self.failures.failed(sample_id, "the capture backend returned no result")
        records.sort(key=lambda r: r.sample_id)
        accounting = UnitAccounting(input_rows=len(rows), written=len(records),
                                    skipped=dict(sorted(skipped.items())), failed=failed)
        return records, accounting


def make_source(
    cfg: ProducerConfig, model_dir: Path, hf_layer_ids: Sequence[int]
) -> HiddenStateSource:
    """Start the configured capture backend."""
    source: HiddenStateSource
    if cfg.backend == "vllm":
        from sparkforge.producer.vllm_source import VllmSource

        source = VllmSource(cfg.engine, layer_ids=tuple(hf_layer_ids), topk=cfg.topk,
                            scratch_dir=cfg.scratch_dir, window=cfg.window,
                            max_retries=cfg.max_retries)
        return source
    from sparkforge.producer.hf_source import HfSource

    device = cfg.hf_device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    source = HfSource(str(model_dir), layer_ids=tuple(hf_layer_ids), dtype=cfg.engine.dtype,
                      topk=cfg.topk, device=device)
    return source


def try_finalize(
    output: str, *, expected_units: int, storage_options: Mapping[str, object]
) -> bool:
    """Finalize if every unit is committed; False (and a log line) while some are missing."""
    try:
        finalize_cache(output, expected_units=expected_units, storage_options=storage_options)
    except CacheIncompleteError as exc:
        logger.info("not finalizing yet (the last worker will, or `sparkforge finalize`): %s", exc)
        return False
    return True


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
        CacheMismatchError: The cache exists with a different config, target, data or template.
        CaptureAborted: Too many requests failed in a row.
    """
    share = resolve_share(cfg.worker_index, cfg.num_workers, os.environ if env is None else env)
    model_dir = resolve_model_dir(cfg.engine)
    target_config = read_config(model_dir)
    num_hidden_layers = target_config["num_hidden_layers"]
    feature_ids = (validate_feature_ids(cfg.layer_ids, num_hidden_layers) if cfg.layer_ids
                   else default_feature_ids(num_hidden_layers, cfg.num_feature_layers))
    hf_ids = feature_to_hf(feature_ids)
    from transformers import AutoTokenizer

    encoder = ChatEncoder(AutoTokenizer.from_pretrained(str(model_dir)),
                          chat_template=cfg.chat_template, reasoning=cfg.reasoning,
                          max_seq_len=cfg.seq_len, overlong=cfg.overlong)
    sources = describe_sources(cfg.data, data_format=cfg.data_format,
                               storage_options=cfg.storage_options)
    num_rows = sum(s.num_rows for s in sources)
    total_units = num_units(num_rows, cfg.rows_per_unit)
    eval_ids = load_eval_ids(cfg.eval_ids, cfg.storage_options) if cfg.eval_ids else None
    header = build_header(cfg, target=target_identity(cfg.engine, model_dir), hf_layer_ids=hf_ids,
                          encoder=encoder, sources=sources, num_units=total_units,
                          eval_ids=eval_ids)
    spec = CacheSpec(hidden_size=target_config["hidden_size"], num_aux_layers=len(hf_ids),
                     hidden_dtype=cfg.hidden_dtype, max_seq_len=cfg.seq_len,
                     aux_codec=cfg.aux_codec, topk=cfg.topk, shard_rows=cfg.shard_rows,
                     rows_per_unit=cfg.rows_per_unit)
    writer = CacheWriter.open(cfg.output, spec=spec, header=header,
                              storage_options=cfg.storage_options)
    files = target_files(model_dir, hidden_dtype=cfg.hidden_dtype)
    # The template actually used (an override included), so the trainer renders alike.
    files["chat_template.jinja"] = encoder.template.encode()
    writer.write_target_files(files)
    mine = owned_units(total_units, share)
    todo = sorted(set(mine) - writer.committed_units())
    summary = RunSummary(output=cfg.output, worker=share, units_owned=len(mine),
                         units_todo=len(todo), num_rows=num_rows)
    logger.info("worker %d/%d (%s): %d of its %d units to do (cache has %d units)",
                share.worker_index, share.num_workers, share.origin, len(todo), len(mine),
                total_units)
    if todo:
        worker = _Worker(cfg, encoder, SplitRule(cfg.eval_fraction, eval_ids, cfg.split_seed),
                         len(hf_ids), _FailureRun(cfg.max_consecutive_failures), summary)
        _capture_units(cfg, worker, writer, sources, todo, source, model_dir, hf_ids)
    if cfg.finalize:
        summary.finalized = try_finalize(cfg.output, expected_units=total_units,
                                         storage_options=cfg.storage_options)
    return summary


def _capture_units(
    cfg: ProducerConfig,
    worker: _Worker,
    writer: CacheWriter,
    sources: list[DataSource],
    todo: list[int],
    source: HiddenStateSource | None,
    model_dir: Path,
    hf_ids: Sequence[int],
) -> None:
    todo_set = set(todo)
    rows = iter_rows(sources, wanted=lambda i: i // cfg.rows_per_unit in todo_set,
                     batch_rows=cfg.read_batch_rows, storage_options=cfg.storage_options)
    owned_source = source is None
    active = make_source(cfg, model_dir, hf_ids) if source is None else source
    start = time.monotonic()
    try:
        with tqdm(total=len(todo), unit="unit", disable=not cfg.progress) as bar:
            for unit, unit_rows in rows_by_unit(rows, cfg.rows_per_unit):
                records, accounting = worker.capture_unit(active, unit_rows)
                writer.write_unit(unit, records, accounting)
                worker.summary.add_unit(records, accounting)
                bar.update(1)
                elapsed = time.monotonic() - start
                bar.set_postfix_str(worker.summary.progress(elapsed), refresh=False)
    finally:
        worker.summary.seconds = time.monotonic() - start
        if owned_source:
            active.close()


def finalize(output: str, *, storage_options: Mapping[str, object] | None = None) -> CacheManifest:
    """``sparkforge finalize``: build the manifest from the commit records (unit count from the
    header), or raise CacheIncompleteError listing the missing units."""
    _, header = read_run_header(storage.open_location(output, storage_options))
    expected = header["producer_config"]["resolved"]["num_units"]
    return finalize_cache(output, expected_units=expected, storage_options=storage_options)
