"""Draft-side sampling: temperature handling, serial Markov block sampling, the residual law.

Shape suffixes follow the legend in ``sparkforge.trainer.draft.model``.
"""

from __future__ import annotations

import torch

from sparkforge.trainer.draft.heads import MarkovHead

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are greedy: argmax, one-hot probabilities."""


def logits_to_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 ``softmax(logits / T)``, or the one-hot argmax when T is ~0."""
    if temperature < GREEDY_TEMPERATURE:
        idx = logits.argmax(dim=-1, keepdim=True)
        return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, idx, 1.0)
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample_from_probs(
    probs: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """One draw per row of ``probs [..., V]`` -> [...] int64."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def sample_token(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Argmax at T ~ 0, else a multinomial draw from ``softmax(logits / T)``."""
    if temperature < GREEDY_TEMPERATURE:
        return logits.argmax(dim=-1)
    return sample_from_probs(logits_to_probs(logits, temperature), generator)


def residual_probs(p_target: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """``normalize(max(p - q, 0))``; falls back to ``p`` where the residual mass is ~0."""
    res = (p_target - q_draft).clamp(min=0.0)
    mass = res.sum(-1, keepdim=True)
    return torch.where(mass > 1e-12, res / mass.clamp(min=1e-12), p_target)


def sample_draft_tokens(
    base_logits_BKV: torch.Tensor,
    first_prev_B: torch.Tensor,
    hidden_BKH: torch.Tensor,
    markov_head: MarkovHead | None,
    temperature: float,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Serial Markov sampling over a block.

    Slot k's logits are ``base_k + bias(d_k, h_k)`` with ``d_0`` the anchor; ``d_{k+1}`` is drawn
    from them before slot k+1 is computed. The rnn head carries its state across slots, as in
    its teacher-forced training unroll. Without a head all slots are sampled in parallel.

    Returns:
        tokens [B, K] (d_1..d_K) and the corrected logits [B, K, V] defining the draft law q.
    """
    if markov_head is None:
        return sample_token(base_logits_BKV, temperature, generator), base_logits_BKV
    prev, state = first_prev_B, None
    tokens, logits = [], []
    for k in range(base_logits_BKV.shape[1]):
        bias, state = markov_head.step(prev, hidden_BKH[:, k], state)
        step_logits = base_logits_BKV[:, k] + bias.to(base_logits_BKV.dtype)
        prev = sample_token(step_logits, temperature, generator)
        tokens.append(prev)
        logits.append(step_logits)
    return torch.stack(tokens, dim=1), torch.stack(logits, dim=1)
