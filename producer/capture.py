"""Capture one commit unit: tokenize its rows, run them through a source, build sample records.

Results are checked at the source boundary (shapes), converted to the cache's stored form where
they were captured (storage dtype, fp8 codes) and moved to the host once, checked for NaN/inf in
what will be stored (whatever the backend, and including an overflow of the dtype conversion) and
sorted by sample id, so a unit's records do not depend on the order requests finished in.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from sparkforge.producer.chat import ChatEncoder, Encoded, unreadable_reason
from sparkforge.producer.chat_rows import SkipReason
from sparkforge.producer.fp8 import quantize_e4m3
from sparkforge.producer.sample_order import InOrder, SampleSink
from sparkforge.producer.source import CaptureRequest, CaptureResult, HiddenStateSource
from sparkforge.producer.splits import SplitRule
from sparkforge.shared.dataset import RawRow, row_hash
from sparkforge.shared.dtypes import non_finite
from sparkforge.shared.errors import SparkforgeError
from sparkforge.shared.records import (
    SampleRecord,
    SampleRows,
    SampleStart,
    Split,
    UnitAccounting,
)

logger = logging.getLogger(__name__)


NonFinitePolicy = Literal["skip", "fail"]
_SCAN_ELEMENTS = 1 << 24
"""Hidden values checked per block (bounds the NaN/inf scan's temporaries to ~50 MB)."""


class CaptureAborted(SparkforgeError, RuntimeError):
    """Raised after ``max_consecutive_failures`` requests failed in a row."""


class NonFiniteActivations(SparkforgeError, RuntimeError):
    """Raised under ``non_finite: fail`` when the target produced NaN or inf for a row."""


@dataclass
class _Pending:
    raw: RawRow
    split: Split
    encoded: Encoded

    @property
    def input_ids(self) -> np.ndarray:
        return self.encoded.input_ids

    @property
    def loss_mask(self) -> np.ndarray:
        return self.encoded.loss_mask

    @property
    def start(self) -> SampleStart:
        """The sample as the writer takes it before its captured rows."""
        return SampleStart(sample_id=self.raw.index, source_row=self.raw.index,
                           source_hash=self.source_hash, split=self.split,
                           input_ids=self.input_ids, loss_mask=self.loss_mask)

    @property
    def source_hash(self) -> str:
        """The raw row's hash, or for an image row the hash of the row and its images."""
        return sample_source_hash(self.raw.content_hash, self.encoded.images_sha256)


def sample_source_hash(content_hash: str, images_sha256: str | None) -> str:
    """A sample's ``source_hash``: the raw row's hash, or for an image row the hash of the row's
    hash and its images' (so a changed image behind an unchanged path changes it)."""
    return (content_hash if images_sha256 is None else
            row_hash(f"{content_hash}:{images_sha256}".encode()))


@dataclass
class FailureRun:
    """Counts failed requests in a row and aborts the run at ``limit``."""

    limit: int
    count: int = 0
    last_errors: list[str] = field(default_factory=list)

    def failed(self, sample_id: int, error: str) -> None:
        """Record one failure; raise CaptureAborted when the run of failures reaches the limit."""
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
        """A success ends the run of failures."""
        self.count = 0


_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the host: itself when it is there already (a no-op ``contiguous``), else
    one device-to-host copy into pinned memory (torch's caching host allocator reuses it)."""
    if tensor.device.type == "cpu":
        return tensor.contiguous()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor)


def host_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a host tensor (bf16 as its uint16 bit pattern)."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


def to_storage(
    result: CaptureResult, hidden_dtype: str, aux_codec: str
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """A result's activations in the cache's stored form, moved to the host once.

    Conversion to the storage dtype and fp8 quantisation run in torch where the activations are
    (the GPU on inference nodes), so only stored bytes cross to the host.

    Returns:
        ``(aux_hidden, aux_scale, final_hidden)``; ``aux_scale`` is None unless ``aux_codec`` is
        fp8, when ``aux_hidden`` holds the e4m3 codes.
    """
    assert result.aux_hidden is not None
    assert result.final_hidden is not None
    dtype = _TORCH_DTYPES[hidden_dtype]
    aux = result.aux_hidden.to(dtype)
    final = host_numpy(to_host(result.final_hidden.to(dtype)))
    if aux_codec == "fp8":
        codes, scale = quantize_e4m3(aux)
        return to_host(codes).numpy(), to_host(scale).numpy(), final
    return host_numpy(to_host(aux)), None, final


def _check_piece(result: CaptureResult, pending: _Pending, done: int, num_layers: int,
                 topk: int) -> str | None:
    """Shape errors at the source boundary, as a failure message (None: fine). ``done``: the
    rows of the sample already received."""
    t = pending.input_ids.shape[0]
    aux, final = result.aux_hidden, result.final_hidden
    n = t - done if aux is None else aux.shape[0]
    if result.row_start != done or done + n > t or result.last != (done + n == t):
        return (f"a chunk of rows [{result.row_start}, {result.row_start + n}) (last: "
                f"{result.last}) after {done} of its {t} rows")
    if aux is None or final is None or aux.shape[:2] != (n, num_layers) or final.shape[0] != n:
        shapes = [None if x is None else tuple(x.shape) for x in (aux, final)]
        return f"expected aux [{n}, {num_layers}, H] and final [{n}, H], got {shapes}"
    if topk and (result.topk_ids is None or tuple(result.topk_ids.shape) != (n, topk)):
        return f"expected top-{topk} ids of shape [{n}, {topk}]"
    return None


def non_finite_problem(record: SampleRecord, hidden_dtype: str) -> str | None:
    """Where a record's hidden states hold NaN or inf, as a message (None: all finite)."""
    return _non_finite_rows(record.sample_id, record.rows(), hidden_dtype, row_start=0)


def _non_finite_rows(sample_id: int, rows: SampleRows, hidden_dtype: str, *,
                     row_start: int) -> str | None:
    """Where a block of a sample's rows (from ``row_start``) holds NaN or inf, as a message.

    Scanned in row blocks, so the temporaries stay small whatever the sequence length.
    """
    for name in ("aux_hidden", "final_hidden"):
        values = getattr(rows, name)
        step = max(1, _SCAN_ELEMENTS // values[0].size)
        count, tokens = 0, []
        for start in range(0, values.shape[0], step):
            bad = non_finite(values[start:start + step], hidden_dtype)
            if bad.any():
                count += int(bad.sum())
                tokens.append(start + np.flatnonzero(bad.reshape(bad.shape[0], -1).any(axis=1)))
        if count:
            bad_tokens = np.concatenate(tokens)
            span = (f"{values.shape[0]} tokens" if not row_start else
                    f"the {values.shape[0]} tokens from token {row_start}")
            return (f"sample {sample_id}: {name} holds {count} non-finite values in "
                    f"{bad_tokens.size} of {span}, first at token {row_start + bad_tokens[0]}")
    return None


def _stored_rows(result: CaptureResult, hidden_dtype: str, aux_codec: str,
                 topk: int) -> SampleRows:
    aux, aux_scale, final = to_storage(result, hidden_dtype, aux_codec)
    topk_ids = result.topk_ids if topk else None  # a source may return more than was asked
    topk_lp = result.topk_logprobs if topk else None
    return SampleRows(
        aux_hidden=aux,
        aux_scale=aux_scale,
        final_hidden=final,
        topk_ids=None if topk_ids is None else to_host(topk_ids.to(torch.int32)).numpy(),
        topk_logprobs=None if topk_lp is None else to_host(topk_lp.float()).numpy(),
    )


@dataclass
class UnitCapturer:
    """Streams one unit's rows through a source into a sink (``stream``), and accounts for them."""

    encoder: ChatEncoder
    split_rule: SplitRule
    num_layers: int
    hidden_dtype: str
    topk: int
    failures: FailureRun
    aux_codec: str = "lossless"
    non_finite: NonFinitePolicy = "skip"
    """Rows whose activations hold NaN or inf: count them as skipped, or stop the run."""

    def encode(self, rows: Sequence[RawRow]) -> tuple[list[_Pending], Counter[str]]:
        """Tokenize rows; bad ones are counted by reason."""
        skipped: Counter[str] = Counter()
        pending = []
        for raw in rows:
            encoded = (unreadable_reason(raw.error) if raw.row is None
                       else self.encoder.encode(raw.row, folder=raw.folder))
            if isinstance(encoded, SkipReason):
                skipped[encoded.value] += 1
                continue
            split = self.split_rule.split_of(index=raw.index, content_hash=raw.content_hash)
            pending.append(_Pending(raw, split, encoded))
        return pending, skipped

    def stream(
        self, source: HiddenStateSource, rows: Sequence[RawRow], sink: SampleSink
    ) -> UnitAccounting:
        """Capture a unit's rows into ``sink``: samples in sample-id order, whatever the
        completion order, each chunk handed over as soon as it is its turn (``InOrder``)."""
        pending, skipped = self.encode(rows)
        pending.sort(key=lambda p: p.raw.index)
        by_id = {p.raw.index: p for p in pending}
        image_ids = {p.raw.index for p in pending if p.encoded.model_inputs is not None}
        order = InOrder(sink, [p.start for p in pending])
        requests = [CaptureRequest(sample_id=p.raw.index, input_ids=p.input_ids,
                                   model_inputs=p.encoded.model_inputs) for p in pending]
        done: dict[int, int] = {}  # rows received of each sample still arriving
        ignored: set[int] = set()  # samples dropped before their last chunk
        failed = 0
        for result in source.capture(requests) if requests else ():
            sid = result.sample_id
            if sid in ignored:  # the rest of a sample already dropped
                if result.last:
                    ignored.discard(sid)
                continue
            item = by_id.get(sid)
            if item is None:
                raise RuntimeError(f"capture backend returned sample {sid}, which was not "
                                   "requested or was already returned")
            outcome = self._take(result, item, done.get(sid, 0), order)
            if outcome == "rows":
                done[sid] = done.get(sid, 0) + result.aux_hidden.shape[0]  # type: ignore[union-attr]
                if result.last:
                    del by_id[sid], done[sid]
                continue
            del by_id[sid]
            done.pop(sid, None)
            if not result.last:
                ignored.add(sid)
            if outcome == "failed":
                failed += 1
            else:
                skipped[outcome] += 1
        while order.head is not None:  # requests the backend never answered (whole)
            failed += 1
            self.failures.failed(order.head, "the capture backend returned no result")
            order.drop(order.head)
        return UnitAccounting(input_rows=len(rows), written=len(order.written),
                              skipped=dict(sorted(skipped.items())), failed=failed,
                              image_rows=sum(i in image_ids for i in order.written))

    def _take(self, result: CaptureResult, item: _Pending, done: int, order: InOrder) -> str:
        """Pass one result's rows on; ``"rows"`` if taken, else why the sample is dropped (a
        skip reason or ``"failed"``)."""
        sid = result.sample_id
        if result.skipped is not None:
            order.drop(sid)
            return result.skipped
        error = result.error or _check_piece(result, item, done, self.num_layers, self.topk)
        if error is not None:
            order.drop(sid)
            self.failures.failed(sid, error)
            return "failed"
        self.failures.succeeded()
        rows = _stored_rows(result, self.hidden_dtype, self.aux_codec, self.topk)
        problem = _non_finite_rows(sid, rows, self.hidden_dtype, row_start=done)
        if problem is None:
            order.add(sid, rows, last=result.last)
            return "rows"
        if self.non_finite == "fail":
            raise NonFiniteActivations(f"{problem}; nothing of this unit was committed "
                                       "(--non_finite fail; 'skip' counts such rows instead)")
        logger.warning("skipping %s", problem)
        order.drop(sid)
        return SkipReason.NON_FINITE_ACTIVATIONS.value
