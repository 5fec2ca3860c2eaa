"""The lm_head-input plugin: the entry point vLLM finds, the forward wrap, the class wrap."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
import torch
from torch import nn

from sparkforge.producer.lm_head_capture import (
    LmHeadInputError,
    append_output_to_aux,
    hide_aux_id,
    lm_head_input_id,
    register,
)


class _Target(nn.Module):
    """Returns (out, aux) like a vLLM target with aux layers set, or ``out`` alone."""

    def __init__(self, *, with_aux: bool = True, out_dims: int = 2) -> None:
        super().__init__()
        self.with_aux, self.out_dims = with_aux, out_dims

    def forward(self, x: torch.Tensor):
        out = x * 2 if self.out_dims == 2 else torch.stack([x, x], dim=1)
        return (out, [x + 1]) if self.with_aux else out


def test_vllm_finds_the_entry_point() -> None:
    """The installed package declares register() in vLLM's vllm.general_plugins group."""
    found = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert found.get("sparkforge-lm-head-input") == "sparkforge.producer.lm_head_capture:register"


def test_wrapped_forward_appends_its_own_output_once() -> None:
    """(out, aux) becomes (out, aux + [out]); wrapping twice appends once."""
    model = _Target()
    append_output_to_aux(model)
    append_output_to_aux(model)
    x = torch.randn(5, 8)
    out, aux = model(x)
    assert len(aux) == 2
    assert aux[1] is out
    torch.testing.assert_close(aux[0], x + 1)


def test_output_without_aux_passes_through() -> None:
    """A run without aux states (a plain tensor) is returned untouched."""
    model = _Target(with_aux=False)
    append_output_to_aux(model)
    x = torch.randn(3, 4)
    torch.testing.assert_close(model(x), x * 2)


def test_output_that_is_not_one_row_per_token_is_refused() -> None:
    """An output of another shape than the aux rows (e.g. hyper-connection streams) raises."""
    model = _Target(out_dims=3)
    append_output_to_aux(model)
    with pytest.raises(LmHeadInputError, match=r"\(5, 2, 8\).*\(5, 8\)"):
        model(torch.randn(5, 8))


def test_register_wraps_the_extractor_once() -> None:
    """register() wraps the V1 extractor's load_model, and a second call changes nothing."""
    from vllm.v1.spec_decode.extract_hidden_states import ExtractHiddenStatesProposer

    register()
    wrapped = ExtractHiddenStatesProposer.load_model
    register()
    assert ExtractHiddenStatesProposer.load_model is wrapped
    assert wrapped.__wrapped__ is not wrapped  # functools.wraps keeps vLLM's own method


def test_lm_head_input_id_matches_no_layer() -> None:
    """The extra aux id is one past L, above every real layer id (0..L)."""
    assert lm_head_input_id(36) == 37


class _LayerMapped(nn.Module):
    """Maps each aux id to a decoder layer and raises on others, as vLLM's Transformers
    modeling backend does."""

    def __init__(self, num_layers: int) -> None:
        super().__init__()
        self.layer_names = {i: f"layers.{i}" for i in range(num_layers)}
        self.recorded: list[str] = []

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        self.recorded = [self.layer_names[i - 1] for i in layers]


def test_the_model_never_sees_the_lm_head_input_id() -> None:
    """The lm_head input's id (L + 1) is dropped before the model maps ids to layers; the real
    ids pass in order, and wrapping twice changes nothing."""
    model = _LayerMapped(4)
    with pytest.raises(KeyError):
        model.set_aux_hidden_state_layers((1, 3, lm_head_input_id(4)))
    hide_aux_id(model, lm_head_input_id(4))
    hide_aux_id(model, lm_head_input_id(4))
    model.set_aux_hidden_state_layers((1, 3, lm_head_input_id(4)))
    assert model.recorded == ["layers.0", "layers.2"]
