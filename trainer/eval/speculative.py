"""Reference speculative decoding: a transformers target verifies DSpark drafts, losslessly.

Batch size 1, plain PyTorch; for measuring tau and per-position acceptance, not for serving.
Shape suffixes follow the legend in ``sparkforge.trainer.draft.model``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sparkforge.shared.hidden_features import layer_feature, served_hidden_states
from sparkforge.shared.layer_ids import feature_to_hf
from sparkforge.shared.target_families import STANDARD, TargetFamily, family_of
from sparkforge.trainer.draft.model import DraftModel
from sparkforge.trainer.draft.sampling import (
    logits_to_probs,
    residual_probs,
    sample_draft_tokens,
    sample_from_probs,
    sample_token,
)
from sparkforge.trainer.draft.selector import sample_with_selector
from sparkforge.trainer.eval.decode_result import SpecDecodeResult


def target_features(
    hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int],
    family: TargetFamily = STANDARD,
) -> torch.Tensor:
    """Concat the features of ``hidden_states[l+1]`` over the DSpark ids, in id order.

    ``hidden_states`` are the served ones (``_forward``): entry ``L`` is the last layer's raw
    output, as vLLM serves feature ``L - 1``.

    Returns:
        [B, T, X]; a hyper-connection target's streams are averaged first (see ``family``).
    """
    return torch.cat([layer_feature(hidden_states[k], family) for k in feature_to_hf(layer_ids)],
                     dim=-1)


def _forward(target: Any, ids: torch.Tensor, **kwargs: Any) -> tuple[Any, list[torch.Tensor]]:
    """One target forward: its output and its hidden states as vLLM's aux ids hold them."""
    with served_hidden_states(target) as served:
        out = target(ids, output_hidden_states=True, **kwargs)
        return out, served(out.hidden_states)


def verify_draft(
    draft_m: torch.Tensor, q_mV: torch.Tensor, p_m1V: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Standard speculative rejection sampling over one block.

    Accept ``d_j`` with probability ``min(1, p(d_j)/q(d_j))``; at the first rejection draw from
    ``normalize(max(p - q, 0))``; if all m are accepted draw the bonus token from ``p[m]``.

    Returns:
        (accepted count n, the token the target contributes).
    """
    for j in range(draft_m.shape[0]):
        tok = int(draft_m[j])
        ratio = p_m1V[j, tok] / q_mV[j, tok].clamp(min=1e-30)
        u = torch.rand((), generator=generator, device=ratio.device)
        if u >= ratio.clamp(max=1.0):
            return j, int(sample_from_probs(residual_probs(p_m1V[j], q_mV[j]), generator))
    m = draft_m.shape[0]
    return m, int(sample_from_probs(p_m1V[m], generator))


def _verify_length(conf_K: torch.Tensor | None, k: int, threshold: float | None) -> int:
    """m = K, or the number of leading slots whose confidence is >= threshold."""
    if threshold is None or conf_K is None:
        return k
    below = (conf_K < threshold).nonzero()
    return int(below[0]) if below.numel() else k


def _has_sliding_layers(target: Any) -> bool:
    """Whether a transformers target has sliding-window attention layers."""
    text = target.config.get_text_config()
    return "sliding_attention" in (getattr(text, "layer_types", None) or ())


@dataclass
class _Proposal:
    """One round's draft: its tokens, their logits, and the confidence head's view of them."""

    drafts_1K: torch.Tensor
    q_logits_1KV: torch.Tensor
    conf_logits_1K: torch.Tensor | None
    conf_K: torch.Tensor | None
    """Sigmoid of ``conf_logits_1K`` (None without a confidence head)."""


@dataclass
class _Decoding:
    """What one generation carries from round to round: both caches and the context so far."""

    target: Any
    draft: DraftModel
    temperature: float
    generator: torch.Generator | None
    target_inputs: Mapping[str, torch.Tensor] | None
    banned: list[int]
    """Placeholder ids neither model may emit (an image prompt's; see ``placeholder_ids``)."""
    rewindable: bool
    """Whether the target's cache can drop rejected tokens; if not, it re-runs the sequence."""
    context_1T: torch.Tensor
    cache_t: Any = None
    cache_d: Any = None

    def features(self, states: Sequence[torch.Tensor]) -> torch.Tensor:
        """The draft's input features of the target's served hidden states."""
        family = family_of(getattr(self.target.config, "model_type", None))
        return target_features(states, self.draft.config.target_layer_ids, family)


def _start(target: Any, draft: DraftModel, ids_1T: torch.Tensor, *, temperature: float,
           generator: torch.Generator | None,
           target_inputs: Mapping[str, torch.Tensor] | None) -> tuple[_Decoding, int]:
    """Prefill the prompt into both models; returns the decoding state and the first token."""
    # A target whose cache cannot be rewound (DeepSeek-V4's compressor state, the sliding-window
    # layers of Gemma, which drop past states once the window is full) re-runs the whole
    # sequence each round instead of cropping the rejected tokens' K/V.
    rewindable = not getattr(target, "_is_stateful", False) and not _has_sliding_layers(target)
    dec = _Decoding(target=target, draft=draft, temperature=temperature, generator=generator,
                    target_inputs=target_inputs, rewindable=rewindable, context_1T=ids_1T,
                    banned=placeholder_ids(target.config) if target_inputs else [])
    out, states = _forward(target, ids_1T, use_cache=rewindable,
                           **_with_images(target_inputs, ids_1T.shape[1]))
    dec.cache_t = out.past_key_values
    dec.cache_d = draft.extend_context(draft.empty_cache(), dec.features(states))
    return dec, int(sample_token(_banning(out.logits[0, -1], dec.banned), temperature, generator))


def _propose(dec: _Decoding, anchor_1: torch.Tensor) -> _Proposal:
    """Draft a block after ``anchor_1`` (DFlash2 through its selector's walk) and score it."""
    draft = dec.draft
    hidden, base = draft.draft_block(anchor_1, dec.cache_d)
    base = _banning(base, dec.banned)
    if draft.candidate_selector is not None:
        drafts, q_logits = sample_with_selector(draft.candidate_selector, base, anchor_1, hidden,
                                                dec.temperature, dec.generator)
    else:
        drafts, q_logits = sample_draft_tokens(base, anchor_1, hidden, draft.markov_head,
                                               dec.temperature, dec.generator)
    prev = torch.cat([anchor_1[:, None], drafts[:, :-1]], dim=1)
    conf_logits = draft.confidence(hidden, prev)
    conf_K = None if conf_logits is None else torch.sigmoid(conf_logits[0].float())
    return _Proposal(drafts_1K=drafts, q_logits_1KV=q_logits, conf_logits_1K=conf_logits,
                     conf_K=conf_K)


def _score_block(dec: _Decoding, block_1M: torch.Tensor) -> tuple[Any, torch.Tensor,
                                                                   list[torch.Tensor]]:
    """The target over ``[anchor, m drafts]``: its output, logits and served hidden states."""
    if dec.rewindable:
        ver, states = _forward(dec.target, block_1M, past_key_values=dec.cache_t, use_cache=True)
        return ver, ver.logits, states
    full = torch.cat([dec.context_1T, block_1M], dim=1)
    ver, states = _forward(dec.target, full, use_cache=False,
                           **_with_images(dec.target_inputs, full.shape[1]))
    width = block_1M.shape[1]
    return ver, ver.logits[:, -width:], [h[:, -width:] for h in states]


def _verify_round(dec: _Decoding, anchor_1: torch.Tensor, prop: _Proposal,
                  m: int) -> tuple[int, int]:
    """Verify the first ``m`` drafts and advance both caches past the accepted ones.

    Returns:
        (accepted count n, the token the target contributes).
    """
    block = torch.cat([anchor_1[:, None], prop.drafts_1K[:, :m]], dim=1)
    ver, logits, states = _score_block(dec, block)
    p = logits_to_probs(_banning(logits[0], dec.banned), dec.temperature)
    q = logits_to_probs(prop.q_logits_1KV[0, :m], dec.temperature)
    n, nxt = verify_draft(prop.drafts_1K[0, :m], q, p, dec.generator)
    if dec.rewindable:
        dec.cache_t = ver.past_key_values
        if m > n:  # drop the target K/V of the rejected draft tokens
            dec.cache_t.crop(n - m)
    dec.context_1T = torch.cat([dec.context_1T, block[:, : n + 1]], dim=1)
    dec.cache_d = dec.draft.extend_context(dec.cache_d, dec.features(states)[:, : n + 1])
    return n, nxt


def _record_round(res: SpecDecodeResult, prop: _Proposal, *, m: int, n: int, nxt: int) -> None:
    """Count one round in ``res``: trials, max q, confidences, and the tokens it yields."""
    res.count_round(verified=m, accepted=n)
    res.round_max_q.append(torch.softmax(prop.q_logits_1KV[0, :m].float(), -1).amax(-1).tolist())
    if prop.conf_logits_1K is not None and prop.conf_K is not None:
        res.trial_confidence += prop.conf_K[: min(m, n + 1)].tolist()
        res.round_confidence_logits.append(prop.conf_logits_1K[0, :m].float().tolist())
    res.tokens += [int(t) for t in prop.drafts_1K[0, :n]] + [nxt]


@torch.no_grad()
def speculative_generate(
    target: Any,
    draft: DraftModel,
    prompt_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    confidence_threshold: float | None = None,
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
    target_inputs: Mapping[str, torch.Tensor] | None = None,
) -> SpecDecodeResult:
    """Prefill, then draft / verify / accept rounds until ``max_new_tokens`` (or eos).

    Args:
        target: A transformers causal LM (returns ``logits``, ``hidden_states`` and a croppable
            ``past_key_values``; one that is ``_is_stateful`` or has sliding-window layers is
            re-run over the whole sequence).
        draft: The DSpark draft; its ``target_layer_ids`` select the features.
        prompt_ids: [T] or [1, T] prompt.
        max_new_tokens: Tokens to generate.
        temperature: 0 = greedy (output equals the target's greedy decoding).
        confidence_threshold: Verify only the slots before the first confidence < threshold.
        eos_token_id: Stop after this token.
        generator: RNG for draft sampling and acceptance tests.
        target_inputs: An image prompt's extra target inputs (``pixel_values``, ...; see
            ``sparkforge.shared.image_inputs``), given with the prefill and, on a target that
            re-runs the whole sequence, at every verification step; ``mm_token_type_ids`` is
            extended with text (0) over the generated tokens. With them, neither the draft nor
            the target may emit an image, video or audio placeholder id: transformers reads any
            such id in ``input_ids`` as a slot for the prompt's features (a re-run over a
            generated one fails: more slots than features), where vLLM keeps generated ids text.
    """
    t0 = time.perf_counter()
    k = draft.num_draft_tokens
    res = SpecDecodeResult(tokens=[], position_accepted=[0] * k, position_trials=[0] * k)
    dec, x0 = _start(target, draft, prompt_ids.view(1, -1), temperature=temperature,
                     generator=generator, target_inputs=target_inputs)
    res.tokens.append(x0)
    while len(res.tokens) < max_new_tokens and eos_token_id not in res.tokens:
        res.round_context.append(int(dec.context_1T.shape[1]))  # the anchor x0 follows it
        anchor = torch.tensor([x0], device=prompt_ids.device)
        prop = _propose(dec, anchor)
        m = _verify_length(prop.conf_K, k, confidence_threshold)
        n, x0 = _verify_round(dec, anchor, prop, m)
        _record_round(res, prop, m=m, n=n, nxt=x0)
    res.tokens = _cut(res.tokens, max_new_tokens, eos_token_id)
    res.wall_time_s = time.perf_counter() - t0
    return res


PLACEHOLDER_KEYS = ("image_token_id", "image_token_index", "video_token_id", "audio_token_id")
"""Config keys of the multimodal placeholder ids transformers' VL models look for."""


def placeholder_ids(config: Any) -> list[int]:
    """The multimodal placeholder token ids a transformers config names within its vocabulary
    (a config may name defaults of modalities the checkpoint does not have, past the vocab)."""
    vocab = config.get_text_config().vocab_size
    ids = {getattr(config, key, None) for key in PLACEHOLDER_KEYS}
    return sorted(i for i in ids if isinstance(i, int) and 0 <= i < vocab)


def _banning(logits: torch.Tensor, banned: Sequence[int]) -> torch.Tensor:
    """``logits`` with the ``banned`` ids (last dim) at -inf: probability 0 at any T."""
    if not banned:
        return logits
    out = logits.clone()
    out[..., list(banned)] = float("-inf")
    return out


def _with_images(inputs: Mapping[str, torch.Tensor] | None, length: int) -> dict[str, Any]:
    """Extra target kwargs of an image prompt for a forward over ``length`` tokens from the
    prompt's start: the token types padded with text (0) past the prompt."""
    if not inputs:
        return {}
    out = dict(inputs)
    types = out.get("mm_token_type_ids")
    if types is not None and types.shape[-1] < length:
        out["mm_token_type_ids"] = torch.nn.functional.pad(types, (0, length - types.shape[-1]))
    return out


def _cut(tokens: list[int], max_new_tokens: int, eos_token_id: int | None) -> list[int]:
    tokens = tokens[:max_new_tokens]
    if eos_token_id is not None and eos_token_id in tokens:
        tokens = tokens[: tokens.index(eos_token_id) + 1]
    return tokens
