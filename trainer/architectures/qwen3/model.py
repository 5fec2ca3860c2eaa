"""The Qwen3-shaped DSpark draft: the shared draft with its own defaults, which every engine
loads for a target of any family.

Each layer is pre-norm (RMSNorm -> attention -> +res -> RMSNorm -> SwiGLU MLP -> +res) with
q/k RMS-normed per head and RoPE over ``head_dim`` in two halves; the context projection is
``fc`` with ``hidden_norm``, the final norm ``norm``, and the init is HF's normal one. These are
``DraftModel``'s defaults, so this model changes none of them; parameter names are the
checkpoint keys vLLM and SGLang load for a Qwen3-shaped DSpark (and DFlash) draft.
"""

from __future__ import annotations

from sparkforge.trainer.draft.model import DraftModel


class Qwen3DraftModel(DraftModel):
    """The Qwen3-shaped draft (HF normal init; embed/lm_head from the target).

    Takes ``DraftModel``'s arguments; it builds a config of any ``architecture``, as the
    class did under its old name ``DSparkDraftModel``.
    """
