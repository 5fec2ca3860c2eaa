"""DFlash2's candidate selector: a low-rank head that reranks each draft slot's top-k tokens.

Serving (vLLM's DFlash2 speculator) drafts slot j from the ``selector_top_k`` tokens with the
largest base logits only: candidate c scores ``base[c] + sum_r P[prev, r] * (W h)[r] * S[c, r]``,
with ``P``/``S`` the predecessor and successor codebooks, ``W`` the hidden projection, ``h`` the
slot's hidden state and ``prev`` the token drafted at the slot before (the anchor for the
first). The slot's draft law is ``softmax(scores / T)`` over the candidates (zero elsewhere);
the walk samples the slots in order. Training teacher-forces ``prev`` with the data's previous
token and trains the selector with a k-way cross-entropy to the data token; when the data token
is not among the top-k it replaces the last (weakest) candidate, so every supervised slot has a
label (the public DFlash2 training rule).

Shape suffixes follow the legend in ``sparkforge.trainer.draft.model``; C is the candidates.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from sparkforge.trainer.draft.sampling import sample_token


class CandidateSelector(nn.Module):
    """Predecessor and successor codebooks [V, r] and the hidden projection H -> r.

    Args:
        vocab_size: V.
        hidden_size: H.
        rank: r (``selector_rank``).
        top_k: Candidates per slot (``selector_top_k``).
        init_std: Std of the normal init of all three weights.
    """

    def __init__(self, vocab_size: int, hidden_size: int, *, rank: int, top_k: int,
                 init_std: float) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        for weight in (self.predecessor_codebook, self.successor_codebook,
                       self.hidden_projection.weight):
            nn.init.normal_(weight, std=init_std)

    def edge_scores(self, base_V: torch.Tensor, hidden_H: torch.Tensor, prev: torch.Tensor,
                    cand_C: torch.Tensor) -> torch.Tensor:
        """Scores ``[..., C]`` of candidates ``cand [..., C]`` after token ``prev [...]``.

        ``base [..., V]`` are the slot's base logits, ``hidden [..., H]`` its hidden state.
        """
        context_R = self.predecessor_codebook[prev] * self.hidden_projection(hidden_H).to(
            self.predecessor_codebook.dtype)
        pair_C = torch.einsum("...r,...cr->...c", context_R, self.successor_codebook[cand_C])
        return base_V.gather(-1, cand_C) + pair_C.to(base_V.dtype)


def candidate_scores(selector: CandidateSelector, base_BAKV: torch.Tensor,
                     hidden_BAKH: torch.Tensor, prev_BAK: torch.Tensor,
                     target_BAK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The serving candidates [B, A, K, C] (top-C base logits) and the scores [B, A, K, C+1] of
    those candidates and, last, of the data token (teacher-forced ``prev``)."""
    cand = base_BAKV.detach().topk(selector.top_k, dim=-1).indices
    scored = torch.cat([cand, target_BAK[..., None]], dim=-1)
    return cand, selector.edge_scores(base_BAKV, hidden_BAKH, prev_BAK, scored)


def training_candidates(cand_WC: torch.Tensor, scores_WC1: torch.Tensor,
                        target_W: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The k-way training problem of each row: the candidates' scores with the data token in
    the last place when the top-k misses it, the data token's index, and whether the top-k held
    it.

    Returns:
        logits [W, C], label index [W] (int64) and hit [W] (bool).
    """
    top_k = cand_WC.shape[-1]
    match = cand_WC == target_W[..., None]
    hit = match.any(-1)
    label = torch.where(hit, match.long().argmax(-1), top_k - 1)
    last = torch.where(hit, scores_WC1[..., top_k - 1], scores_WC1[..., top_k])
    return torch.cat([scores_WC1[..., :top_k - 1], last[..., None]], dim=-1), label, hit


def selector_cross_entropy(cand_WC: torch.Tensor, scores_WC1: torch.Tensor,
                           target_W: torch.Tensor) -> torch.Tensor:
    """Per-row k-way cross-entropy of the selector to the data token (fp32) -> [W]."""
    logits, label, _ = training_candidates(cand_WC, scores_WC1, target_W)
    return F.cross_entropy(logits.float(), label, reduction="none")


class ServedAcceptance(NamedTuple):
    """One row per supervised slot of the selector's draft as served at T=1, and its ceilings."""

    accept: torch.Tensor
    """``sum_c min(p(c), q(c))``: the acceptance of the selector's law ``q`` against ``p``."""
    candidate_mass: torch.Tensor
    """``p(candidates)``: the most any law on these candidates can accept (``q = p`` there)."""
    top_k_mass: torch.Tensor
    """The teacher's own top-k mass: the most any draft with this ``selector_top_k`` can
    accept; below 1 by what a flat teacher spreads past its top k."""


@torch.no_grad()
def served_acceptance(cand_WC: torch.Tensor, scores_WC: torch.Tensor, teacher_WV: torch.Tensor,
                      chunk_rows: int) -> ServedAcceptance:
    """The acceptance of the selector's draft law ``q`` (softmax of the serving candidates'
    scores, zero off them) against the teacher's ``p`` at T=1, and its two ceilings, each [W].

    The teacher's log-normaliser is taken ``chunk_rows`` rows at a time (one fp32 [rows, V]
    temporary)."""
    q = torch.softmax(scores_WC.float(), dim=-1)
    parts = ServedAcceptance(*(q.new_zeros(q.shape[0]) for _ in ServedAcceptance._fields))
    for lo in range(0, q.shape[0], chunk_rows):
        hi = lo + chunk_rows
        logp = teacher_WV[lo:hi].float().log_softmax(dim=-1)
        p_cand = logp.gather(-1, cand_WC[lo:hi]).exp()
        parts.accept[lo:hi] = torch.minimum(p_cand, q[lo:hi]).sum(-1)
        parts.candidate_mass[lo:hi] = p_cand.sum(-1)
        parts.top_k_mass[lo:hi] = logp.topk(q.shape[-1], dim=-1).values.exp().sum(-1)
    return parts


@torch.no_grad()
def sample_with_selector(selector: CandidateSelector, base_BKV: torch.Tensor,
                         first_prev_B: torch.Tensor, hidden_BKH: torch.Tensor,
                         temperature: float,
                         generator: torch.Generator | None = None,
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The serving walk over a block: slot j drafts from its candidates' scores after the token
    drafted at slot j-1 (the anchor first), argmax at T ~ 0.

    Returns:
        tokens [B, K] and logits [B, K, V] defining the draft law q (each slot's scores on its
        candidates, -inf elsewhere).
    """
    prev = first_prev_B
    tokens, logits = [], []
    for j in range(base_BKV.shape[1]):
        cand = base_BKV[:, j].topk(selector.top_k, dim=-1).indices
        scores = selector.edge_scores(base_BKV[:, j], hidden_BKH[:, j], prev, cand)
        law = torch.full_like(base_BKV[:, j], float("-inf")).scatter(-1, cand, scores)
        prev = sample_token(law, temperature, generator)
        tokens.append(prev)
        logits.append(law)
    return torch.stack(tokens, dim=1), torch.stack(logits, dim=1)
