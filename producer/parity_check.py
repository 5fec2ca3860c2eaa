"""The parity check: the run's capture against one-row transformers forwards, before a run
captures (``--parity_samples``) or alone (``sparkforge parity``)."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from sparkforge.producer.backend import hf_source, make_source
from sparkforge.producer.chat import unreadable_reason
from sparkforge.producer.chat_rows import SkipReason
from sparkforge.producer.config import ProducerConfig
from sparkforge.producer.image_rows import ImageChatEncoder
from sparkforge.producer.prepare import Prepared, prepare
from sparkforge.producer.source import CaptureRequest, HiddenStateSource
from sparkforge.shared.errors import SparkforgeError
from sparkforge.shared.layout import PARITY_FILE
from sparkforge.shared.writer import CacheWriter

if TYPE_CHECKING:
    from sparkforge.producer.parity import ParityReport

logger = logging.getLogger(__name__)

DEFAULT_PARITY_SAMPLES = 8
PARITY_SCAN_FACTOR = 16
"""Rows read at most per parity sample while looking for image rows."""


class ParityFailed(SparkforgeError, RuntimeError):
    """Raised when the capture disagrees with one-row transformers forwards."""


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
    reference = hf_source(cfg, prep.model_dir, prep.hf_layer_ids, dtype="float32", one_row=True)
    engine_dtype = str(source.engine_info()["dtype"])
    # The same reference in the engine's reduced dtype measures that dtype's own rounding noise.
    in_dtype = (None if engine_dtype == "float32" else
                hf_source(cfg, prep.model_dir, prep.hf_layer_ids, dtype=engine_dtype,
                           one_row=True))
    try:
        return run_parity(source, reference,  # type: ignore[arg-type]
                          _parity_requests(prep, num_samples, cfg),
                          dtype_reference=in_dtype)  # type: ignore[arg-type]
    finally:
        reference.close()
        if in_dtype is not None:
            in_dtype.close()


def check_parity(
    cfg: ProducerConfig, prep: Prepared, source: HiddenStateSource, writer: CacheWriter
) -> None:
    """Compare ``cfg.parity_samples`` rows, store the report as ``target/parity.json`` and stop
    the run before it captures when the check fails.

    Raises:
        ParityFailed: the capture disagrees with the one-row forwards.
    """
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
