"""The offline final norm and the logprob check, against a plain transformers forward."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from sparkforge.producer.target_head import FinalStateMismatch, TargetHead, load_target_head
from sparkforge.shared.target_families import family_of


@pytest.fixture(scope="module")
def forward(tiny_target):
    """HF forward of one sequence: hidden states, the last layer's pre-norm output, logprobs."""
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    ids = np.random.default_rng(1).integers(4, 1000, 40)
    seen = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda _m, _i, out: seen.setdefault("pre_norm", out[0] if isinstance(out, tuple) else out)
    )
    with torch.no_grad():
        out = model(torch.from_numpy(ids)[None], output_hidden_states=True)
    hook.remove()
    return ids, out.hidden_states, seen["pre_norm"][0], torch.log_softmax(out.logits[0], -1)


def test_final_norm_of_pre_norm_residual_is_hf_post_norm(tiny_target, forward) -> None:
    """RMSNorm(last layer output) with the checkpoint's weight and eps = HF hidden_states[L]."""
    _, hidden, pre_norm, _ = forward
    head = load_target_head(tiny_target, with_lm_head=False)
    assert not torch.allclose(pre_norm, hidden[4], atol=1e-2)
    torch.testing.assert_close(
        head.final_norm(pre_norm, torch.float32), hidden[4][0], atol=1e-5, rtol=1e-5
    )


def test_logprob_check_accepts_the_right_state_and_stops_a_wrong_one(tiny_target, forward) -> None:
    """The lm_head check passes for the post-norm state and raises for a pre-norm one."""
    ids, hidden, pre_norm, logprobs = forward
    head = load_target_head(tiny_target, with_lm_head=True)
    actual = logprobs[:-1].gather(1, torch.from_numpy(ids[1:])[:, None]).squeeze(1)
    assert head.check_against_engine(ids, hidden[4][0], actual) < 1e-4
    with pytest.raises(FinalStateMismatch, match="differ from the engine's"):
        head.check_against_engine(ids, pre_norm, actual)


def test_final_norm_of_an_lm_head_input_family_is_refused(tmp_path) -> None:
    """A family whose lm_head input is not RMSNorm(h_L) * w gets no offline norm."""
    (tmp_path / "config.json").write_text('{"model_type": "gemma3", "num_hidden_layers": 2}')
    with pytest.raises(ValueError, match="gemma family.*capture the lm_head input instead"):
        load_target_head(tmp_path, with_lm_head=False)


def test_softcap_bends_the_recomputed_logprobs(tiny_target, forward) -> None:
    """With a logit softcap the recomputed logprobs are log_softmax(cap * tanh(logits / cap))."""
    _, hidden, _, logprobs = forward
    head = load_target_head(tiny_target, with_lm_head=True, with_norm=False)
    assert head.norm_weight is None
    capped = dataclasses.replace(head, final_logit_softcapping=0.5)
    logits = hidden[4][0] @ head.lm_head_weight.T
    torch.testing.assert_close(capped.log_probs(hidden[4][0]),
                               torch.log_softmax(0.5 * torch.tanh(logits / 0.5), -1))
    assert not torch.allclose(capped.log_probs(hidden[4][0]), logprobs, atol=1e-2)



@pytest.mark.parametrize(("model_type", "plain_norm"), [
    ("qwen3", True), ("qwen3_moe", True), ("glm_moe_dsa", True), ("kimi_linear", True),
    ("qwen3_next", False), ("qwen3_5_text", False), ("minimax_m3_vl_text", False)])
def test_only_families_ending_in_plain_rmsnorm_are_finished_offline(
    model_type: str, plain_norm: bool, tiny_family
) -> None:
    """A target whose final norm is not RMSNorm(x) * w (Qwen3-Next/3.5 and MiniMax-M3 scale by
    1 + w) is never finished offline from its last residual: its family captures the lm_head
    input. (Kimi-K3 captures it too, for its residual fold after the last layer.)"""
    model = AutoModelForCausalLM.from_pretrained(tiny_family(model_type),
                                                 dtype=torch.float32).eval()
    norm = model.get_decoder().norm
    torch.manual_seed(0)
    with torch.no_grad():  # random weights, so a 1 + w norm cannot pass for w
        norm.weight.copy_(torch.rand_like(norm.weight) + 0.5)
    seen = {}
    hook = norm.register_forward_hook(lambda _m, args, out: seen.update(io=(args[0][0], out[0])))
    with torch.no_grad():
        model(torch.from_numpy(np.random.default_rng(1).integers(4, 1000, 24))[None])
    hook.remove()
    norm_in, norm_out = seen["io"]
    eps = float(model.config.get_text_config().rms_norm_eps)
    plain = TargetHead(norm_weight=norm.weight.detach(), eps=eps).final_norm(norm_in, torch.float32)
    assert torch.allclose(plain, norm_out, atol=1e-5, rtol=1e-5) == plain_norm
    if not plain_norm:
        assert not family_of(model_type).final_from_residual
