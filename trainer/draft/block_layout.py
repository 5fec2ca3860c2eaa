"""The block layouts, DSpark's and DFlash's: which slots draft, which anchors train, which heads.

Torch-free: the draft config names its layout (``DraftConfig.layout``) and checks it here; the
passes read the ``BlockLayout`` it names. Every architecture's backbone runs every layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

if TYPE_CHECKING:
    from sparkforge.trainer.draft.config import DraftConfig

Layout = Literal["dspark", "dflash"]
"""The block layouts: ``dspark`` (the default) and ``dflash``."""
LAYOUTS: tuple[str, ...] = get_args(Layout)


@dataclass(frozen=True, kw_only=True)
class BlockLayout:
    """Which slots of a block ``[anchor, MASK x (block_size-1)]`` draft, and which anchors train.

    Draft position j always predicts the token at anchor+j+1; the layouts differ in the block
    slot that computes it.
    """

    first_draft_slot: int
    """Block slot of draft position 0: 0 for DSpark (the anchor slot predicts anchor+1, so a
    block drafts block_size tokens), 1 for DFlash (slot k predicts the token at anchor+k, the
    anchor slot drafts nothing, so a block drafts block_size-1 tokens)."""
    full_block: bool
    """An anchor needs its whole block inside the sequence (DFlash), instead of only a
    supervised first target (DSpark)."""
    prefix_mask: bool
    """A draft position trains only if every earlier one of its block does (DSpark's cumulative
    product); DFlash masks each position on its own."""
    heads: bool
    """The draft may have the Markov and confidence heads (DSpark); a DFlash draft has neither."""

    def num_drafts(self, block_size: int) -> int:
        """Draft tokens per block."""
        return block_size - self.first_draft_slot


DSPARK_LAYOUT = BlockLayout(first_draft_slot=0, full_block=False, prefix_mask=True, heads=True)
DFLASH_LAYOUT = BlockLayout(first_draft_slot=1, full_block=True, prefix_mask=False, heads=False)
BLOCK_LAYOUTS: Mapping[str, BlockLayout] = {"dspark": DSPARK_LAYOUT, "dflash": DFLASH_LAYOUT}
"""Each ``Layout`` name's block layout."""

NO_HEADS: Mapping[str, Any] = {"markov_rank": 0, "enable_confidence_head": False,
                               "confidence_head_with_markov": False}
"""The draft config fields of a draft without heads (what a layout without ``heads`` needs)."""


def layout_problems(cfg: DraftConfig) -> list[str]:
    """The config's layout is known; a headless layout has no head, and a block drafts >= 1."""
    layout = BLOCK_LAYOUTS.get(cfg.layout)
    if layout is None:
        return [f"layout={cfg.layout!r} not in {LAYOUTS}"]
    out = []
    if not layout.heads and cfg.markov_rank:
        out.append(f"markov_rank={cfg.markov_rank}: a {cfg.layout} draft has no Markov head "
                   "(set 0)")
    if not layout.heads and (cfg.enable_confidence_head or cfg.confidence_head_with_markov):
        out.append(f"enable_confidence_head / confidence_head_with_markov: a {cfg.layout} draft "
                   "has no confidence head (set both false)")
    if cfg.block_size > 0 and layout.num_drafts(cfg.block_size) < 1:
        out.append(f"block_size={cfg.block_size}: a {cfg.layout} block drafts block_size - "
                   f"{layout.first_draft_slot} tokens, so it needs block_size >= "
                   f"{layout.first_draft_slot + 1}")
    return out
