"""The target's final RMSNorm and lm_head, read from the checkpoint, to finish captured states.

vLLM's extractor returns the final residual *before* the final norm (aux id L), so the producer
applies ``RMSNorm(h_L) * w`` itself (exact in fp32, about one bf16 ulp from vLLM's fused norm in
bf16) and checks the result against the engine's own prompt logprobs through ``lm_head``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from sparkforge.shared.target_config import read_target_config

logger = logging.getLogger(__name__)

# Families whose lm_head input is not RMSNorm(h_L) * w (offset norms, hyper-connection heads,
# softcaps): the vLLM backend cannot finish their final state offline.
UNSUPPORTED_MODEL_TYPES = frozenset(
    {"gemma", "gemma2", "gemma3", "gemma4", "deepseek_v4", "kimi_k3"}
)
CHECK_ROWS = 64
"""Rows per checked request whose recomputed logprobs are compared with the engine's."""
# Mean |delta logprob| by dtype: above it a warning, above 10x the run stops. A wrong layer or a
# missing norm gives errors of order 1 and more; bf16 rounding about 0.05 (measured on CPU).
CHECK_WARN = {torch.float32: 1e-3, torch.bfloat16: 0.1, torch.float16: 0.05}


class FinalStateMismatch(ValueError):
    """Raised when logits recomputed from the captured final state contradict the engine's."""


_NORM_NAMES = (
    "model.norm.weight",
    "model.language_model.norm.weight",
    "language_model.model.norm.weight",
)
_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")
_EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    names: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names.update(dict.fromkeys(f.keys(), file))
    return names


def load_checkpoint_tensor(model_dir: str | Path, candidates: tuple[str, ...]) -> torch.Tensor:
    """Load the first of ``candidates`` found in the checkpoint's safetensors files.

    Raises:
        ValueError: If none of the names is in the checkpoint.
    """
    files = _tensor_files(Path(model_dir))
    for name in candidates:
        if name in files:
            with safe_open(str(files[name]), framework="pt") as f:
                tensor: torch.Tensor = f.get_tensor(name)
                return tensor
    raise ValueError(f"checkpoint {model_dir} has none of the tensors {list(candidates)}")


@dataclass(frozen=True)
class TargetHead:
    """Final norm weight and eps, and optionally the lm_head weight, all fp32 on CPU."""

    norm_weight: torch.Tensor
    eps: float
    lm_head_weight: torch.Tensor | None = None

    def final_norm(self, residual_TH: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Post-norm state ``RMSNorm(residual) * w`` computed in fp32, returned in ``dtype``."""
        h = residual_TH.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.norm_weight).to(dtype)

    def log_probs(self, final_TH: torch.Tensor) -> torch.Tensor:
        """fp32 ``log_softmax(lm_head(final))`` [T, V]; needs the lm_head weight."""
        assert self.lm_head_weight is not None, "TargetHead was loaded without lm_head"
        return torch.log_softmax(final_TH.float() @ self.lm_head_weight.T, dim=-1)

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
            f"logprobs recomputed from the final post-norm state differ from the engine's by "
            f"{err:.3g} on average over {rows} rows (dtype {final_TH.dtype}, warn above {warn})"
        )
        if err > 10 * warn:
            raise FinalStateMismatch(message + "; the captured final state is wrong")
        if err > warn:
            logger.warning(message)
        return err


def load_target_head(model_dir: str | Path, *, with_lm_head: bool) -> TargetHead:
    """Read the final norm (and lm_head, or the tied embedding) from a local checkpoint.

    Raises:
        ValueError: For architectures whose lm_head input is not ``RMSNorm(h_L) * w``.
    """
    target = read_target_config(model_dir)
    config = target.text
    if target.model_type in UNSUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {target.model_type!r}: the final state is not RMSNorm(h_L) * w, so "
            "the vllm backend cannot finish it offline; use backend 'hf'"
        )
    norm = load_checkpoint_tensor(model_dir, _NORM_NAMES).float()
    head = None
    if with_lm_head:
        names = _EMBED_NAMES if config.get("tie_word_embeddings") else _HEAD_NAMES + _EMBED_NAMES
        head = load_checkpoint_tensor(model_dir, names).float()
    return TargetHead(
        norm_weight=norm, eps=float(config.get("rms_norm_eps", 1e-6)), lm_head_weight=head
    )
