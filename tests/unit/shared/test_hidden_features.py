"""Hidden states as vLLM's aux ids hold them: HF's, with the last layer's raw output at L."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from sparkforge.shared.hidden_features import served_hidden_states


def _target() -> Qwen3ForCausalLM:
    """A 3-layer Qwen3 with random weights."""
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    return Qwen3ForCausalLM(cfg).eval()


def test_entry_l_is_the_last_layer_before_the_final_norm() -> None:
    """Entries 0..L-1 are HF's own; entry L normed by the final norm is HF's post-norm entry L,
    from a full forward and from a cached one-token step alike."""
    target = _target()
    ids = torch.randint(0, 64, (1, 9))
    with torch.no_grad(), served_hidden_states(target) as served:
        out = target(ids, output_hidden_states=True, use_cache=True)
        states = served(out.hidden_states)
        step = target(ids[:, :1], past_key_values=out.past_key_values, use_cache=True,
                      output_hidden_states=True)
        step_states = served(step.hidden_states)
    for got, hf in ((states, out.hidden_states), (step_states, step.hidden_states)):
        assert len(got) == 4
        assert all(a is b for a, b in zip(got[:3], hf[:3], strict=True))
        torch.testing.assert_close(target.model.norm(got[3]), hf[3])
        assert (got[3] - hf[3]).abs().max() > 0.1
    assert step_states[3].shape == (1, 1, 32)


def test_hook_is_removed_after_the_block() -> None:
    """Leaving the block unhooks the last layer."""
    target = _target()
    with served_hidden_states(target):
        assert len(target.model.layers[-1]._forward_hooks) == 1
    assert len(target.model.layers[-1]._forward_hooks) == 0


def test_misuse_is_a_clear_error() -> None:
    """A model without decoder layers, or states read before a forward, raise naming why."""
    class NoLayers(torch.nn.Module):
        def get_decoder(self) -> torch.nn.Module:
            return self

    with pytest.raises(ValueError, match="NoLayers: no decoder layers"), \
            served_hidden_states(NoLayers()):
        pass
    with served_hidden_states(_target()) as served, \
            pytest.raises(ValueError, match="expected one per layer plus the embeddings"):
        served([torch.zeros(1)] * 4)
