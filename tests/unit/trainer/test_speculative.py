"""Reference speculative decoding is lossless: greedy-identical at T=0, target law at T=1."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from sparkforge.trainer.architectures.config import from_target_config
from sparkforge.trainer.architectures.qwen3.model import Qwen3DraftModel
from sparkforge.trainer.eval.speculative import speculative_generate, target_features


def _draft_for(target: Any, *, seed: int = 0, **overrides: Any) -> Qwen3DraftModel:
    cfg = from_target_config(target.config, mask_token_id=3, target_layer_ids=(0, 1),
                             num_hidden_layers=1, num_anchors=8, markov_rank=8)
    cfg = dataclasses.replace(cfg, **{"block_size": 4, **overrides})
    torch.manual_seed(seed)
    return Qwen3DraftModel(cfg, embed_weight=target.model.embed_tokens.weight,
                            lm_head_weight=target.lm_head.weight).eval()


def _greedy_reference(target: Any, prompt: torch.Tensor, n: int) -> list[int]:
    """Plain greedy decoding with full forwards (no cache), independent of the loop."""
    ids = prompt.view(1, -1)
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, target(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids[0, prompt.numel():].tolist()


def _small_target(vocab: int = 8, seed: int = 0) -> Qwen3ForCausalLM:
    """A 3-layer Qwen3 over a tiny vocabulary with peaked next-token laws."""
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=16, initializer_range=0.4, tie_word_embeddings=False,
                      bos_token_id=None, eos_token_id=None, pad_token_id=0)
    return Qwen3ForCausalLM(cfg).eval()


@pytest.mark.parametrize("threshold", [None, 0.5, 1.01])
def test_greedy_speculative_equals_target_greedy(tiny_target: Path,
                                                 threshold: float | None) -> None:
    """T=0 output is identical to the tiny target's greedy decoding (any verify length)."""
    target = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    draft = _draft_for(target)
    prompt = torch.tensor([5, 17, 99, 4, 250, 31, 7])
    res = speculative_generate(target, draft, prompt, max_new_tokens=24,
                               confidence_threshold=threshold)
    assert res.tokens == _greedy_reference(target, prompt, 24)
    assert sum(res.tokens_per_round) + 1 >= 24
    assert all(t >= 1 for t in res.tokens_per_round)
    # each round's anchor follows the prompt, its first token and the tokens of earlier rounds
    starts = [len(prompt) + sum(res.tokens_per_round[:i]) for i in range(len(res.tokens_per_round))]
    assert res.round_context == starts
    if threshold == 1.01:  # nothing passes: every round verifies 0 drafts, emits 1 token
        assert set(res.verified_per_round) == {0}
        assert set(res.tokens_per_round) == {1}
    assert res.wall_time_s > 0


def test_greedy_speculative_on_a_v4_target_equals_its_greedy(tiny_v4_target: Path) -> None:
    """A DeepSeek-V4 target (stream-mean features, cache not rewindable) stays greedy-exact."""
    target = AutoModelForCausalLM.from_pretrained(tiny_v4_target).eval()
    draft = _draft_for(target)
    prompt = torch.tensor([5, 17, 99, 4, 250, 31, 7])
    res = speculative_generate(target, draft, prompt, max_new_tokens=12)
    assert res.tokens == _greedy_reference(target, prompt, 12)
    assert max(res.verified_per_round) > 0


def test_greedy_speculative_on_a_sliding_window_gemma4_target_equals_its_greedy() -> None:
    """A Gemma4 target whose sequence outgrows its sliding window (cache not croppable) and a
    Gemma4 draft stay greedy-exact."""
    from sparkforge.app.tiny_target import tiny_gemma4_config
    from sparkforge.trainer.architectures import build_draft

    config = tiny_gemma4_config()
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(config).eval()
    cfg = from_target_config(target.config, mask_token_id=3, target_layer_ids=(0, 1),
                             num_hidden_layers=1, num_anchors=8, markov_rank=8, block_size=4,
                             architecture="gemma4")
    draft = build_draft(cfg, embed_weight=target.model.embed_tokens.weight,
                        lm_head_weight=target.lm_head.weight).eval()
    prompt = torch.tensor([5, 17, 99, 4, 250, 31, 7])
    res = speculative_generate(target, draft, prompt, max_new_tokens=20)
    assert prompt.numel() + 20 > config.sliding_window
    assert res.tokens == _greedy_reference(target, prompt, 20)


def test_greedy_lossless_with_accepted_drafts() -> None:
    """On a tiny vocabulary drafts do get accepted, and the output is still greedy-identical."""
    target = _small_target()
    draft = _draft_for(target, seed=1, mask_token_id=3)
    prompt = torch.tensor([1, 2, 5, 7, 0, 3])
    res = speculative_generate(target, draft, prompt, max_new_tokens=40)
    assert res.tokens == _greedy_reference(target, prompt, 40)
    assert res.tau > 1.0
    assert res.position_accepted[0] > 0
    assert all(a <= t for a, t in zip(res.position_accepted, res.position_trials, strict=True))


def test_greedy_lossless_through_the_dflash2_candidate_walk() -> None:
    """A DFlash2 draft drafts through its candidate selector (top 3 of 8 tokens): its drafts
    get accepted and the output stays greedy-identical."""
    from sparkforge.trainer.architectures import build_draft

    target = _small_target()
    cfg = from_target_config(target.config, mask_token_id=3, target_layer_ids=(0, 1),
                             num_hidden_layers=1, num_anchors=8, block_size=4, layout="dflash2",
                             markov_rank=0, enable_confidence_head=False,
                             confidence_head_with_markov=False, selector_top_k=3,
                             selector_rank=8, conv_group_size=8)
    torch.manual_seed(1)
    draft = build_draft(cfg, embed_weight=target.model.embed_tokens.weight,
                        lm_head_weight=target.lm_head.weight).eval()
    prompt = torch.tensor([1, 2, 5, 7, 0, 3])
    res = speculative_generate(target, draft, prompt, max_new_tokens=40)
    assert res.tokens == _greedy_reference(target, prompt, 40)
    assert len(res.position_trials) == 3
    assert res.position_accepted[0] > 0


def _exact_laws(target: Any, prompt: torch.Tensor, v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact joint law of (t1, t2) [V, V] and marginal of t3 [V] by enumeration."""
    with torch.no_grad():
        p1 = torch.softmax(target(prompt[None]).logits[0, -1], -1)
        x1 = torch.arange(v)[:, None]
        p2 = torch.softmax(target(torch.cat([prompt.expand(v, -1), x1], 1)).logits[:, -1], -1)
        pairs = torch.cartesian_prod(torch.arange(v), torch.arange(v))
        seq = torch.cat([prompt.expand(v * v, -1), pairs], 1)
        p3 = torch.softmax(target(seq).logits[:, -1], -1).view(v, v, v)
    joint12 = p1[:, None] * p2
    return joint12, (joint12[..., None] * p3).sum((0, 1))


def _draft_first_slot_law(target: Any, draft: Qwen3DraftModel, prompt: torch.Tensor,
                          p1: torch.Tensor) -> torch.Tensor:
    """Law of the draft's first token d_1 (t2 if emitted unverified), averaged over t1."""
    with torch.no_grad():
        out = target(prompt[None], output_hidden_states=True)
        cache = draft.extend_context(draft.empty_cache(),
                                     target_features(out.hidden_states, (0, 1)))
        law = torch.zeros_like(p1)
        for x1 in range(p1.numel()):
            hid, base = draft.draft_block(torch.tensor([x1]), cache)
            bias, _ = draft.markov_head.step(torch.tensor([x1]), hid[:, 0])
            law += p1[x1] * torch.softmax(base[0, 0] + bias[0], -1)
    return law


@pytest.mark.slow
def test_temperature_one_output_follows_the_target_law() -> None:
    """At T=1 the empirical law of (t1, t2) and of t3 matches the exact target law."""
    v, trials = 6, 1500
    target = _small_target(vocab=v, seed=3)
    draft = _draft_for(target, seed=2, block_size=3)
    prompt = torch.tensor([1, 4, 2, 5])
    joint12, marg3 = _exact_laws(target, prompt, v)
    g = torch.Generator().manual_seed(0)
    c12, c3 = torch.zeros(v, v), torch.zeros(v)
    accepted = 0
    for _ in range(trials):
        res = speculative_generate(target, draft, prompt, max_new_tokens=3, temperature=1.0,
                                   generator=g)
        c12[res.tokens[0], res.tokens[1]] += 1
        c3[res.tokens[2]] += 1
        accepted += res.position_accepted[0]
    # Expected TV of an n-sample empirical law is <= 0.5 * sum sqrt(p(1-p)/n); allow 2.5x.
    def bound(p: torch.Tensor) -> float:
        return 2.5 * 0.5 * float((p * (1 - p) / trials).sqrt().sum())

    tv12 = 0.5 * float((c12 / trials - joint12).abs().sum())
    tv3 = 0.5 * float((c3 / trials - marg3).abs().sum())
    assert tv12 < bound(joint12.flatten())
    assert tv3 < bound(marg3)
    # Power: emitting the draft's tokens unverified would be far outside the bound, and the
    # accept branch was exercised.
    q2 = _draft_first_slot_law(target, draft, prompt, joint12.sum(1))
    assert 0.5 * float((q2 - joint12.sum(0)).abs().sum()) > 3 * bound(joint12.sum(0))
    assert 0.1 * trials < accepted < trials


def test_image_prompt_decodes_with_a_draft_that_proposes_image_slots(tmp_path: Path) -> None:
    """A Gemma4 target re-runs the whole sequence with the prompt's pixels each round, and
    transformers reads every image id in it as a slot for the pixels' features: a draft that
    proposes the image id made the re-run fail (more slots than features). Neither side may emit
    a placeholder id: the draft's proposals and the output skip it, and at T=0 the output is the
    target's greedy decoding over the other ids."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from sparkforge.app.tiny_target import main as tiny_target_main
    from sparkforge.shared.image_inputs import target_images
    from sparkforge.shared.image_sources import ImageReader
    from sparkforge.shared.target_config import read_target_config
    from sparkforge.trainer.eval.chat_prompts import chat_prompts
    from sparkforge.trainer.eval.speculative import placeholder_ids

    assert tiny_target_main([str(tmp_path), "--model_type", "gemma4", "--rows", "2"]) == 0
    target = AutoModelForImageTextToText.from_pretrained(tmp_path, dtype=torch.float32).eval()
    images = target_images(tmp_path, read_target_config(tmp_path).raw)
    prompts = chat_prompts(str(tmp_path / "chat.jsonl"), AutoTokenizer.from_pretrained(tmp_path),
                           2, images=images, image_reader=ImageReader.from_options([str(tmp_path)]))
    prompt = next(p for p in prompts if p.model_inputs is not None)
    image_id = images.image_token_id
    assert image_id in placeholder_ids(target.config)
    draft = Qwen3DraftModel(
        dataclasses.replace(from_target_config(target.config, mask_token_id=3,
                                               target_layer_ids=(0, 1), num_hidden_layers=1,
                                               num_anchors=8, markov_rank=8), block_size=4),
        embed_weight=target.get_input_embeddings().weight,
        lm_head_weight=target.get_output_embeddings().weight).eval()
    block = draft.draft_block

    def proposing_image_slots(*args: Any) -> Any:
        hidden, base = block(*args)
        return hidden, base.index_fill(-1, torch.tensor([image_id]), 1e4)

    draft.draft_block = proposing_image_slots  # type: ignore[method-assign]
    ids = torch.from_numpy(prompt.input_ids)
    res = speculative_generate(target, draft, ids, max_new_tokens=6,
                               target_inputs=prompt.model_inputs)
    assert image_id not in res.tokens
    assert len(res.tokens) == 6
    assert sum(res.verified_per_round) > 0   # the draft's blocks were verified
    # the reference: full forwards with the pixels, the placeholder ids never chosen
    seq, banned = ids.view(1, -1), placeholder_ids(target.config)
    inputs = dict(prompt.model_inputs)
    prompt_types = inputs["mm_token_type_ids"]
    with torch.no_grad():
        for _ in range(6):
            types = torch.nn.functional.pad(prompt_types, (0, seq.shape[1] - prompt_types.shape[1]))
            logits = target(seq, **{**inputs, "mm_token_type_ids": types}).logits[0, -1]
            logits[banned] = float("-inf")
            seq = torch.cat([seq, logits.argmax().view(1, 1)], dim=1)
    assert res.tokens == seq[0, ids.numel():].tolist()
