"""The block layouts, DSpark's, DFlash's and DFlash2's: which slots draft, which anchors train,
which heads and block modules the draft has.

Torch-free: the draft config names its layout (``SharedDraftConfig.layout``) and checks it here; the
passes read the ``BlockLayout`` it names. Every architecture's backbone runs every layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal, get_args

if TYPE_CHECKING:
    from sparkforge.trainer.draft.config import SharedDraftConfig

Layout = Literal["dspark", "dflash", "dflash2"]
"""The block layouts: ``dspark`` (the default), ``dflash`` and ``dflash2``."""
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
    block_convs: bool = False
    """Every layer wraps its attention and its MLP in a dynamic causal convolution along the
    block (DFlash2: ``sparkforge.trainer.draft.block_conv``)."""
    candidate_selector: bool = False
    """The draft reranks its top-k tokens with the candidate selector head (DFlash2:
    ``sparkforge.trainer.draft.selector``)."""

    def num_drafts(self, block_size: int) -> int:
        """Draft tokens per block."""
        return block_size - self.first_draft_slot


DSPARK_LAYOUT = BlockLayout(first_draft_slot=0, full_block=False, prefix_mask=True, heads=True)
DFLASH_LAYOUT = BlockLayout(first_draft_slot=1, full_block=True, prefix_mask=False, heads=False)
DFLASH2_LAYOUT = BlockLayout(first_draft_slot=1, full_block=True, prefix_mask=False, heads=False,
                             block_convs=True, candidate_selector=True)
BLOCK_LAYOUTS: Mapping[str, BlockLayout] = {"dspark": DSPARK_LAYOUT, "dflash": DFLASH_LAYOUT,
                                            "dflash2": DFLASH2_LAYOUT}
"""Each ``Layout`` name's block layout."""

NO_HEADS: Mapping[str, Any] = {"markov_rank": 0, "enable_confidence_head": False,
                               "confidence_head_with_markov": False}
"""The draft config fields of a draft without heads (what a layout without ``heads`` needs)."""


CONV_FIELDS: tuple[str, ...] = ("conv_kernel_size", "conv_group_size")
"""The draft config fields of the block convolutions (read by a layout with ``block_convs``)."""
SELECTOR_FIELDS: tuple[str, ...] = ("selector_rank", "selector_top_k")
"""The draft config fields of the candidate selector (a layout with ``candidate_selector``)."""


def layout_problems(cfg: SharedDraftConfig) -> list[str]:
    """The config's layout is known; a headless layout has no head, and a block drafts >= 1;
    the block convolutions and the candidate selector fit the draft, and only a layout that
    has them sets their fields."""
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
    return out + _conv_problems(cfg, layout) + _selector_problems(cfg, layout)


def _unread(cfg: SharedDraftConfig, names: tuple[str, ...]) -> list[str]:
    defaults = {f.name: f.default for f in fields(cfg) if f.name in names}
    return [f"{name}={getattr(cfg, name)!r}: layout {cfg.layout!r} does not read it (only "
            f"'dflash2' does; leave it unset)" for name in names
            if getattr(cfg, name) != defaults[name]]


def _conv_problems(cfg: SharedDraftConfig, layout: BlockLayout) -> list[str]:
    if not layout.block_convs:
        return _unread(cfg, CONV_FIELDS)
    out = []
    if not 1 <= cfg.conv_kernel_size <= cfg.block_size:
        out.append(f"conv_kernel_size={cfg.conv_kernel_size} must be in [1, block_size="
                   f"{cfg.block_size}] (taps along the block)")
    if cfg.conv_group_size < 1 or cfg.hidden_size % cfg.conv_group_size:
        out.append(f"conv_group_size={cfg.conv_group_size} must divide hidden_size="
                   f"{cfg.hidden_size}")
    return out


def _selector_problems(cfg: SharedDraftConfig, layout: BlockLayout) -> list[str]:
    if not layout.candidate_selector:
        return _unread(cfg, SELECTOR_FIELDS)
    out = []
    if cfg.selector_rank < 1:
        out.append(f"selector_rank={cfg.selector_rank} must be >= 1")
    if not 1 <= cfg.selector_top_k <= cfg.vocab_size:
        out.append(f"selector_top_k={cfg.selector_top_k} must be in [1, vocab_size="
                   f"{cfg.vocab_size}]")
    return out
