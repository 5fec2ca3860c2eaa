"""The Gemma4-shaped draft, of every layout: the layer stack vLLM's ``Gemma4DSparkForCausalLM``
serves.

Each layer is a Gemma sandwich (input_layernorm -> attention -> post_attention_layernorm -> +res
-> pre_feedforward_layernorm -> GeGLU MLP -> post_feedforward_layernorm -> +res) with
``attention_k_eq_v`` attention: no ``v_proj``, the values are the raw key projection under a
weightless ``v_norm``, q/k are RMS-normed per head, and the softmax scale is 1.0. Every norm
(those of the layers, the context ``hidden_norm`` and the final ``norm``) is Gemma's: weight
applied in fp32 before the cast back. The embedding is scaled by sqrt(H) (rounded to the model
dtype, as served) and the lm_head logits are softcapped as the target's are (both from the draft
config). Context injection, anchors, the Markov and confidence heads, the loss and the metrics
are the shared ones: only the layer (a configuration of the shared ``DraftDecoderLayer``) and
the norm class differ from ``Qwen3DraftModel``.

Shape suffixes follow the legend in ``sparkforge.trainer.draft.model``.
"""

from __future__ import annotations

import functools
from typing import Any

from sparkforge.shared.renamed import renamed_attribute
from sparkforge.trainer.draft.layers import (
    DraftAttention,
    DraftDecoderLayer,
    GemmaRMSNorm,
    gelu_tanh,
)
from sparkforge.trainer.draft.model import DraftModel

Gemma4DraftLayer = functools.partial(
    DraftDecoderLayer, attention=functools.partial(DraftAttention, k_eq_v=True,
                                                   softmax_scale=1.0, norm=GemmaRMSNorm),
    norm=GemmaRMSNorm, act=gelu_tanh, sandwich=True)
"""One Gemma4 draft layer (full attention, ``attention_k_eq_v``, sandwich norms, GeGLU)."""


class Gemma4DraftModel(DraftModel):
    """The draft with Gemma4 layers and norms; same batch, outputs and inference API.

    Takes ``DraftModel``'s arguments; the config names ``architecture="gemma4"``. Its old name
    is ``Gemma4DSparkModel``; the exported ``config.json`` still names vLLM's
    ``Gemma4DSparkModel``.
    """

    layer_factory = Gemma4DraftLayer
    architecture = "gemma4"
    norm_class = GemmaRMSNorm


RENAMED = {"Gemma4DSparkModel": "Gemma4DraftModel", "Gemma4DSparkLayer": "Gemma4DraftLayer"}
"""Old names this module still serves, each as its new name (``renamed_attribute``)."""


def __getattr__(name: str) -> Any:
    """An old name of ``RENAMED``, with a FutureWarning naming its replacement."""
    return renamed_attribute(__name__, name, RENAMED)
