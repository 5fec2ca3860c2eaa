"""Checks and converts what the vLLM capture path returns: connector files and prompt logprobs.

Kept free of vLLM imports so the boundary checks can be tested on crafted files directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from sparkforge.shared.errors import SparkforgeError


class PayloadError(SparkforgeError):
    """Raised when a captured hidden-state file does not match the request it answers."""


@dataclass(frozen=True)
class SplitPayload:
    """A checked connector file split into the captured layers and the final slot."""

    aux_TFH: torch.Tensor
    final_TH: torch.Tensor
    """The slot of ``final_id``: the pre-norm final residual (aux id L) or the lm_head input."""


def check_payload(
    data: dict[str, torch.Tensor],
    *,
    sample_id: int,
    sent_ids: np.ndarray,
    aux_ids: Sequence[int],
    hidden_size: int,
    row_start: int = 0,
) -> None:
    """Check one connector file against its rows of the request: keys, token ids, shape.

    NaN and inf are not a failure of the request (a retry gives them again): the capturer
    judges them on the stored values, as for every backend (``--non_finite``).

    Args:
        data: The loaded safetensors dict (``hidden_states`` [T, n_ids, H], ``token_ids`` [T]).
        sample_id: For error messages.
        sent_ids: The token ids that were sent for the file's rows.
        aux_ids: The vLLM aux ids requested, ascending (one slot each).
        hidden_size: The target's H.
        row_start: The request's row at which the file's rows begin (a chunk file's).

    Raises:
        PayloadError: Naming the sample and the expected and actual values.
    """
    where = f"sample {sample_id}" + (f" (rows from {row_start})" if row_start else "")
    missing = {"hidden_states", "token_ids"} - data.keys()
    if missing:
        raise PayloadError(f"{where}: capture file lacks {sorted(missing)}, has {sorted(data)}")
    got_ids = data["token_ids"].numpy()
    if got_ids.shape != sent_ids.shape or not np.array_equal(got_ids, sent_ids):
        first = _first_difference(got_ids, sent_ids)
        raise PayloadError(
            f"{where}: engine token ids differ from the request ({got_ids.shape[0]} vs "
            f"{sent_ids.shape[0]} tokens, first difference at position {row_start + first})"
        )
    hidden = data["hidden_states"]
    expected = (sent_ids.shape[0], len(aux_ids), hidden_size)
    if tuple(hidden.shape) != expected:
        raise PayloadError(
            f"{where}: hidden_states shape {tuple(hidden.shape)} != expected {expected} "
            f"[tokens, aux ids {list(aux_ids)}, hidden_size]"
        )


def _first_difference(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.shape[0], b.shape[0])
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def split_payload(
    hidden_TNH: torch.Tensor, *, aux_ids: Sequence[int], layer_ids: Sequence[int], final_id: int
) -> SplitPayload:
    """Map file slots (ascending aux ids) to the captured layers and the final slot."""
    slot = {aux: i for i, aux in enumerate(aux_ids)}
    aux = hidden_TNH[:, [slot[k] for k in layer_ids]]
    return SplitPayload(aux_TFH=aux, final_TH=hidden_TNH[:, slot[final_id]])


class FlatLogprobsLike(Protocol):
    """The fields of vLLM's ``FlatLogprobs`` that the conversion reads."""

    start_indices: list[int]
    end_indices: list[int]
    token_ids: list[int]
    logprobs: list[float]


def topk_rows(
    prompt: FlatLogprobsLike, sampled: FlatLogprobsLike, *, num_tokens: int, k: int,
    rows: slice | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k per row, aligned so row t holds the distribution computed from row t.

    vLLM's prompt entry t (t >= 1) scores token t from the state at t - 1, and entry 0 is empty;
    the distribution after the last prompt token comes from the sampled step. Each entry lists the
    scored token first, then the top-k in rank order (vllm/logprobs.py), so the top-k are entries
    ``[1, k]``.

    Args:
        rows: Only these rows (a chunk of the sample); None: all ``num_tokens``.

    Returns:
        ``(ids [T, k] int32, logprobs [T, k] float32)`` (T: the rows asked for).
    """
    entries = ([(prompt, t) for t in range(1, num_tokens)] + [(sampled, 0)])[rows or slice(None)]
    ids = np.empty((len(entries), k), dtype=np.int32)
    lps = np.empty((len(entries), k), dtype=np.float32)
    for row, (flat, position) in enumerate(entries):
        start = flat.start_indices[position] + 1
        assert flat.end_indices[position] - start == k, "vLLM returned a different top-k width"
        ids[row] = flat.token_ids[start : start + k]
        lps[row] = flat.logprobs[start : start + k]
    return torch.from_numpy(ids), torch.from_numpy(lps)


def scored_token_logprobs(prompt: FlatLogprobsLike, num_tokens: int) -> torch.Tensor:
    """vLLM's log-probability of each actual next token: [T - 1], row t scores token t + 1."""
    values = [prompt.logprobs[prompt.start_indices[t]] for t in range(1, num_tokens)]
    return torch.tensor(values, dtype=torch.float32)
