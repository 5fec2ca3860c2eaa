"""The DFlash draft: the DSpark backbone with DFlash's block layout and no Markov/confidence head.

A DFlash block is ``[anchor, MASK x (K-1)]`` at positions ``anchor .. anchor+K-1``; slot k >= 1
predicts the token at anchor+k and the anchor slot drafts nothing, which is what vLLM's DFlash
proposer feeds (a bonus token and K-1 mask queries) and samples (the mask queries). An anchor
needs its whole block inside the sequence, and each draft position is supervised on its own.
The layers, context projection, KV injection and attention mask are DSpark's, so the parameter
names are the DSpark draft's minus the heads.
"""

from __future__ import annotations

from typing import Any

from sparkforge.shared.errors import ConfigError
from sparkforge.trainer.architectures.config import DSparkDraftConfig
from sparkforge.trainer.draft.anchors import DFLASH_LAYOUT
from sparkforge.trainer.draft.model import DSparkDraftModel


def dflash_draft(config: DSparkDraftConfig, **kwargs: Any) -> DSparkDraftModel:
    """A freshly initialised DFlash draft (keyword arguments as ``DSparkDraftModel``'s).

    Raises:
        ValueError: the config is not a DFlash draft's (``architecture`` other than dflash).
    """
    if config.architecture != "dflash":
        raise ConfigError(f"architecture={config.architecture!r}: a DFlash draft needs "
                         "architecture 'dflash'")
    return DSparkDraftModel(config, layout=DFLASH_LAYOUT, **kwargs)
