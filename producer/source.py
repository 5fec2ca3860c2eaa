"""The hidden-state source interface that every capture backend (vLLM, transformers) implements."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import torch

from sparkforge.shared.layer_ids import HfIndices


@dataclass(frozen=True, kw_only=True)
class CaptureRequest:
    """One teacher-forced sequence to run through the target."""

    sample_id: int
    input_ids: np.ndarray
    """[T] int32 token ids, sent as ids (never re-tokenized text)."""
    model_inputs: Mapping[str, Any] | None = None
    """An image row's extra forward inputs (``pixel_values``, ...); None for a text row."""


@dataclass(frozen=True, kw_only=True)
class CaptureResult:
    """What a backend returns for one request; ``error`` set means it failed after retries."""

    sample_id: int
    aux_hidden: torch.Tensor | None = None
    """[T, F, H] model dtype, on the capture device (host or GPU; the capturer converts it there
    and copies it to the host once): feature of each captured layer, ids ascending (the residual
    after it, or a hyper-connection target's mean over streams)."""
    final_hidden: torch.Tensor | None = None
    """[T, H] model dtype, device as ``aux_hidden``: the lm_head input (post-final-norm for
    Llama/Qwen-style targets; after ``hc_head`` and the norm for DeepSeek-V4)."""
    topk_ids: torch.Tensor | None = None
    """[T, k] int32: top-k of the distribution computed from row t (it predicts token t+1)."""
    topk_logprobs: torch.Tensor | None = None
    """[T, k] float32 log-probabilities matching ``topk_ids``."""
    row_start: int = 0
    """The sample's row at which ``aux_hidden`` and the rest begin: a source that forwards a long
    sample in chunks returns it as consecutive results, one per chunk, in row order."""
    last: bool = True
    """This result holds the sample's last rows (always true for a whole-sample result)."""
    error: str | None = None
    skipped: str | None = None
    """Set when the row's own input made the forward fail (an image row whose vision forward
    raised): the skip reason it is counted under, not a failed request."""


class HiddenStateSource(Protocol):
    """A running target that captures hidden states for batches of requests."""

    layer_ids: HfIndices
    """Captured layers as HF ``hidden_states`` indices (= vLLM aux ids), sorted and unique."""

    def capture(self, requests: Sequence[CaptureRequest]) -> Iterator[CaptureResult]:
        """Run ``requests``; yield one result per request (or its chunks, consecutive and in row
        order, the last one ``last``), requests in completion order."""
        ...

    def engine_info(self) -> dict[str, Any]:
        """Engine name, version and parallel sizes, for the manifest's capture section."""
        ...

    def close(self) -> None:
        """Release the engine and any scratch space."""
        ...


def whole_results(results: Iterable[CaptureResult]) -> Iterator[CaptureResult]:
    """The results of a capture with each sample's chunks joined into one whole-sample result."""
    parts: list[CaptureResult] = []
    for result in results:
        parts.append(result)
        if not result.last:
            continue
        yield parts[0] if len(parts) == 1 else _joined(parts)
        parts = []
    assert not parts, f"sample {parts[0].sample_id if parts else None}: its last chunk is missing"


def _joined(parts: list[CaptureResult]) -> CaptureResult:
    def cat(name: str) -> torch.Tensor | None:
        values = [getattr(p, name) for p in parts]
        return None if values[0] is None else torch.cat(values)

    return replace(parts[-1], row_start=0, aux_hidden=cat("aux_hidden"),
                   final_hidden=cat("final_hidden"), topk_ids=cat("topk_ids"),
                   topk_logprobs=cat("topk_logprobs"))
