"""vLLM general plugin: the extractor also stores the exact tensor the target's lm_head consumes.

vLLM's ``extract_hidden_states`` method stores the aux states the target returns next to its
output, and drops the output itself: the tensor whose rows ``compute_logits`` turns into logits
(after the final norm, and for DeepSeek-V4 after ``hc_head``; before any logit softcap). For
targets whose lm_head input is not ``RMSNorm(h_L) * w`` the producer needs that tensor.

The mechanism, in every vLLM process (the entry point ``sparkforge-lm-head-input`` of the
``vllm.general_plugins`` group, which vLLM loads in the front end, the engine core and every
worker): :func:`register` wraps the extractor's ``load_model(target_model)`` of both model runners
(V1: ``ExtractHiddenStatesProposer``; V2: ``ExtractHiddenStatesSpeculator``). When the extractor's
draft config carries ``LM_HEAD_INPUT_KEY`` (set by the producer, never by anyone else), the
target model's ``forward`` is wrapped to append its own output to the aux list it returns. The
producer asks for one more aux id than the target has layers (``num_hidden_layers + 1``), which
no decoder layer matches, so the cache-only layer has a slot for it and the appended tensor is
the last slot of every capture file, in ascending-id order. The target model itself never sees
that id: its ``set_aux_hidden_state_layers`` is wrapped to drop it, because vLLM's Transformers
modeling backend (the fallback for architectures vLLM does not implement, e.g. MiniMax-M3's text
model) maps every aux id to a decoder layer and raises ``KeyError`` on one past the last. Without
the key nothing changes.

vLLM's files are not edited; the wrapped methods are private to vLLM 0.32 and checked by the real
engine tests.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from sparkforge.shared.errors import SparkforgeError

logger = logging.getLogger(__name__)

LM_HEAD_INPUT_KEY = "sparkforge_lm_head_input_id"
"""Draft ``hf_config`` key (the extractor's config) holding the aux id of the lm_head input."""
_WRAPPED = "_sparkforge_lm_head_input"


class LmHeadInputError(SparkforgeError, RuntimeError):
    """Raised in the worker when the target's output cannot be stored as the lm_head input."""


def lm_head_input_id(num_hidden_layers: int) -> int:
    """The aux id that stands for the lm_head input: one past the last layer, matching none."""
    return num_hidden_layers + 1


def register() -> None:
    """Entry point: wrap the extractors' ``load_model`` in this process (idempotent).

    vLLM runs every general plugin in every process, for every user of the environment, so a
    vLLM layout this module does not know is logged, never raised: only a capture that asked
    for the lm_head input then fails (its extractor finds one aux state fewer than its slots).
    """
    try:
        from vllm.v1.spec_decode.extract_hidden_states import ExtractHiddenStatesProposer
        from vllm.v1.worker.gpu.spec_decode.extract_hidden_states import (
            ExtractHiddenStatesSpeculator,
        )

        _wrap_load_model(ExtractHiddenStatesProposer, lambda p: p.hf_config)
        _wrap_load_model(ExtractHiddenStatesSpeculator,
                         lambda s: s.draft_model_config.hf_config)
    except (ImportError, AttributeError) as exc:
        logger.warning("sparkforge lm_head-input capture unavailable in this vLLM: %s", exc)


def _wrap_load_model(cls: type, draft_config_of: Callable[[Any], Any]) -> None:
    original = cls.load_model  # type: ignore[attr-defined]
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def load_model(self: Any, target_model: nn.Module) -> None:
        original(self, target_model)
        sentinel = getattr(draft_config_of(self), LM_HEAD_INPUT_KEY, None)
        if sentinel is not None:
            append_output_to_aux(target_model)
            hide_aux_id(target_model, sentinel)
            logger.info("aux id %s holds the lm_head input (%s)", sentinel, type(target_model))

    setattr(load_model, _WRAPPED, True)
    cls.load_model = load_model  # type: ignore[attr-defined]


def append_output_to_aux(model: nn.Module) -> None:
    """Make ``model.forward`` return ``(out, aux + [out])`` wherever it returns ``(out, aux)``.

    ``out`` is what the model runner slices by ``logits_indices`` and passes to
    ``compute_logits``, i.e. the lm_head input. Idempotent.
    """
    forward = model.forward
    if getattr(forward, _WRAPPED, False):
        return

    @functools.wraps(forward)
    def forward_with_lm_head_input(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        if not isinstance(out, tuple):
            return out  # an intermediate pipeline stage or a run without aux states
        hidden, aux = out
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or not aux or (
                hidden.shape != aux[0].shape):
            raise LmHeadInputError(
                f"target output {_shape(hidden)} is not one [tokens, hidden] row per aux row "
                f"{_shape(aux[0]) if aux else '(no aux states)'}: cannot store it as the "
                "lm_head input")
        return hidden, [*aux, hidden]

    setattr(forward_with_lm_head_input, _WRAPPED, True)
    model.forward = forward_with_lm_head_input


def hide_aux_id(model: nn.Module, aux_id: int) -> None:
    """Make ``model.set_aux_hidden_state_layers`` drop ``aux_id`` (the lm_head input's, which
    matches no layer) before the model maps ids to its layers. Idempotent."""
    setter = getattr(model, "set_aux_hidden_state_layers", None)
    if setter is None or getattr(setter, _WRAPPED, False):
        return

    @functools.wraps(setter)
    def set_layers_but_lm_head_input(layers: tuple[int, ...]) -> None:
        setter(tuple(i for i in layers if i != aux_id))

    setattr(set_layers_but_lm_head_input, _WRAPPED, True)
    model.set_aux_hidden_state_layers = set_layers_but_lm_head_input  # type: ignore[assignment]


def _shape(x: object) -> str:
    return str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__
