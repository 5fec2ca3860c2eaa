"""The DSpark Markov head (rank-r bigram bias, three variants) and the confidence head.

Shape suffixes follow the legend in ``sparkforge.trainer.draft.model`` (``...``: any leading dims).
"""

from __future__ import annotations

import torch
from torch import nn

from sparkforge.trainer.draft.config import DSparkDraftConfig


class MarkovHead(nn.Module):
    """Bias ``W2(W1[prev])`` on each slot's logits; gated and rnn variants also read ``h``.

    Args:
        vocab_size: V (rows of ``markov_w1``, outputs of ``markov_w2``).
        rank: r > 0.
        hidden_size: H, read by the gated and rnn variants.
        head_type: "vanilla" (serving engines build only this one), "gated" or "rnn".
    """

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, head_type: str) -> None:
        super().__init__()
        self.head_type = head_type
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        if head_type == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif head_type == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def step(
        self, prev_ids: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One slot: bias for ``prev_ids [...]`` and ``hidden [..., H]``.

        Returns:
            bias [..., V] in the hidden's dtype, and the new rnn state [..., r] (None otherwise).
        """
        emb = self.markov_w1(prev_ids).to(hidden.dtype)
        if self.head_type == "vanilla":
            return self.markov_w2(emb), None
        if self.head_type == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, emb], dim=-1)))
            return self.markov_w2(gate * emb), None
        if state is None:
            state = hidden.new_zeros(*hidden.shape[:-1], self.rank)
        g, c, o = self.joint_proj(torch.cat([state, emb, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(g)
        new_state = gate * state + (1 - gate) * torch.tanh(c)
        return self.markov_w2(torch.tanh(o)), new_state

    def forward(self, prev_ids_K: torch.Tensor, hidden_KH: torch.Tensor) -> torch.Tensor:
        """Teacher-forced bias for a block: ``prev [..., K]``, ``h [..., K, H]`` -> [..., K, V].

        Vanilla and gated run all slots at once; rnn unrolls the K steps with its state.
        """
        if self.head_type != "rnn":
            return self.step(prev_ids_K, hidden_KH)[0]
        state = None
        out = []
        for k in range(prev_ids_K.shape[-1]):
            bias, state = self.step(prev_ids_K[..., k], hidden_KH[..., k, :], state)
            out.append(bias)
        return torch.stack(out, dim=-2)


class ConfidenceHead(nn.Module):
    """Linear(H (+r) -> 1) with bias over ``[h ; W1[prev]]`` or ``h``; returns fp32 logits."""

    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, 1)

    def forward(self, hidden: torch.Tensor, markov_feat: torch.Tensor | None) -> torch.Tensor:
        """``hidden [..., H]``, optional ``markov_feat [..., r]`` -> logits [...] fp32."""
        feats = hidden if markov_feat is None else torch.cat(
            [hidden, markov_feat.to(hidden.dtype)], dim=-1
        )
        logits: torch.Tensor = self.proj(feats)
        return logits.squeeze(-1).float()


def head_shapes(cfg: DSparkDraftConfig) -> dict[str, tuple[int, ...]]:
    """The exported tensors of the Markov and confidence heads and their shapes."""
    h, v, r = cfg.hidden_size, cfg.vocab_size, cfg.markov_rank
    shapes: dict[str, tuple[int, ...]] = {}
    if r > 0:
        shapes |= {"markov_head.markov_w1.weight": (v, r), "markov_head.markov_w2.weight": (v, r)}
    if cfg.enable_confidence_head:
        width = h + (r if cfg.confidence_head_with_markov and r > 0 else 0)
        shapes |= {"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)}
    return shapes
