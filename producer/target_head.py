"""The target's final RMSNorm, lm_head and logit softcap, read from the checkpoint.

vLLM's extractor returns the final residual *before* the final norm (aux id L), so for families
whose lm_head input is ``RMSNorm(h_L) * w`` the producer applies the norm itself (exact in fp32,
about one bf16 ulp from vLLM's fused norm in bf16); other families capture the lm_head input
(``sparkforge.producer.lm_head_capture``) and need no norm. Either way the final state is checked
against the engine's own prompt logprobs through ``lm_head`` and the target's softcap.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from sparkforge.producer.target_files import (
    fp8_block_size,
    load_tensor,
    locate_pieces,
    tensor_locations,
)
from sparkforge.shared.errors import SparkforgeError
from sparkforge.shared.target_config import read_target_config
from sparkforge.shared.target_families import family_of

logger = logging.getLogger(__name__)

CHECK_ROWS = 64
"""Rows per checked request whose recomputed logprobs are compared with the engine's."""
# Mean |delta logprob| by dtype: above it a warning, above 10x the run stops. A wrong layer or a
# missing norm gives errors of order 1 and more; bf16 rounding about 0.05 (measured on CPU).
CHECK_WARN = {torch.float32: 1e-3, torch.bfloat16: 0.1, torch.float16: 0.05}


class FinalStateMismatch(SparkforgeError):
    """Raised when logits recomputed from the captured final state contradict the engine's."""


@dataclass(frozen=True)
class TargetHead:
    """Final norm weight and eps, the lm_head weight (each optional; fp32 on CPU) and softcap."""

    norm_weight: torch.Tensor | None
    """None when the final state is captured as the lm_head input rather than recomputed."""
    eps: float
    lm_head_weight: torch.Tensor | None = None
    final_logit_softcapping: float | None = None

    def final_norm(self, residual_TH: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Post-norm state ``RMSNorm(residual) * w`` computed in fp32, returned in ``dtype``."""
        assert self.norm_weight is not None, "TargetHead was loaded without the final norm"
        h = residual_TH.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.norm_weight).to(dtype)

    def log_probs(self, final_TH: torch.Tensor) -> torch.Tensor:
        """fp32 ``log_softmax(softcap(lm_head(final)))`` [T, V]; needs the lm_head weight."""
        assert self.lm_head_weight is not None, "TargetHead was loaded without lm_head"
        logits = final_TH.float() @ self.lm_head_weight.T
        if (cap := self.final_logit_softcapping) is not None:
            logits = cap * torch.tanh(logits / cap)
        return torch.log_softmax(logits, dim=-1)

    def check_against_engine(
        self, ids: np.ndarray, final_TH: torch.Tensor, engine_lp: torch.Tensor
    ) -> float:
        """Compare recomputed logprobs of the actual next tokens with the engine's own.

        Args:
            ids: [T] token ids sent.
            final_TH: The post-norm final state computed offline.
            engine_lp: [T - 1] the engine's log-probability of token t + 1 at row t.

        Returns:
            Mean |delta logprob| over the first ``CHECK_ROWS`` rows (a warning is logged when it
            exceeds the dtype's bound).

        Raises:
            FinalStateMismatch: When it exceeds 10x the bound: the captured state is wrong.
        """
        rows = min(CHECK_ROWS, ids.shape[0] - 1)
        if rows < 1:
            return 0.0
        ours = self.log_probs(final_TH[:rows])
        ours = ours.gather(1, torch.from_numpy(ids[1 : rows + 1].astype(np.int64))[:, None])
        err = float((ours.squeeze(1) - engine_lp[:rows]).abs().mean())
        warn = CHECK_WARN.get(final_TH.dtype, 0.1)
        message = (
            f"logprobs recomputed from the final state differ from the engine's by "
            f"{err:.3g} on average over {rows} rows (dtype {final_TH.dtype}, warn above {warn})"
        )
        if err > 10 * warn:
            raise FinalStateMismatch(message + "; the captured final state is wrong")
        if err > warn:
            logger.warning(message)
        return err


def load_target_head(model_dir: str | Path, *, with_lm_head: bool,
                     with_norm: bool = True) -> TargetHead:
    """Read the final norm and lm_head (or the tied embedding) from a local checkpoint.

    Args:
        model_dir: The checkpoint folder.
        with_lm_head: Load lm_head (for the logprob check).
        with_norm: Load the final norm, to finish the pre-norm residual offline.

    Raises:
        ValueError: ``with_norm`` for a family whose lm_head input is not ``RMSNorm(h_L) * w``.
    """
    target = read_target_config(model_dir)
    config, family = target.text, family_of(target.model_type)
    if with_norm and not family.final_from_residual:
        raise SparkforgeError(
            f"model_type {target.model_type!r} ({family.name} family): the final state is not "
            "RMSNorm(h_L) * w and cannot be finished offline; capture the lm_head input instead"
        )
    locations = tensor_locations(Path(model_dir))
    pieces = locate_pieces(Path(model_dir), locations)
    block = fp8_block_size(config)
    return TargetHead(
        norm_weight=load_tensor(locations, pieces["norm.weight"], block) if with_norm else None,
        eps=float(config.get("rms_norm_eps", 1e-6)),
        lm_head_weight=load_tensor(locations, pieces["lm_head.weight"], block)
        if with_lm_head else None,
        final_logit_softcapping=family.scaling(config).final_logit_softcapping,
    )
