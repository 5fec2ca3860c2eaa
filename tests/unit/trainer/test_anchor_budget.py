"""The anchor budget: kept-anchor ratio and padding with and without packing, by hand."""

from __future__ import annotations

import pytest

from sparkforge.trainer.anchor_budget import (
    AnchorSetting,
    anchor_budget,
    chat_like_index,
    setting_from_train_config,
)
from sparkforge.trainer.data_plan import SplitIndex
from sparkforge.trainer.loader_settings import LoaderSettings


def test_budget_matches_a_hand_count() -> None:
    """Four 20-token samples with 8, 8, 8, 4 valid anchors, 16 anchor slots per row.

    One sample per row keeps 28 of 64 slots; rows of 40 tokens hold two samples whatever the
    shuffle, so the rows keep min(16, 8+8) + min(16, 8+4) = 28 of 32. Equal lengths: no padding.
    """
    index = SplitIndex.from_columns(sample_id=[0, 1, 2, 3], unit=[0, 0, 1, 1],
                                    length=[20] * 4, num_loss_tokens=[9, 9, 9, 5])
    setting = AnchorSetting(num_anchors=16, block_size=4, full_block=False, loader=LoaderSettings(
        batch_size=2, max_seq_len=40))
    budget = anchor_budget(index, setting)
    assert budget["bucket"]["kept_anchor_ratio"] == pytest.approx(28 / 64)
    assert budget["pack"]["kept_anchor_ratio"] == pytest.approx(28 / 32)
    assert (budget["pack"]["tokens_per_row"], budget["pack"]["rows"]) == (40, 2)
    assert (budget["bucket"]["padding"], budget["pack"]["padding"]) == (0, 0)
    dflash = anchor_budget(index, AnchorSetting(num_anchors=16, block_size=4, full_block=True,
                                                loader=LoaderSettings(batch_size=2,
                                                                      max_seq_len=40)))
    assert dflash["bucket"]["kept_anchor_ratio"] == pytest.approx((6 + 6 + 6 + 2) / 64)


def test_packing_keeps_anchors_at_the_production_shape() -> None:
    """Chat-like lengths (mean 403, ~half supervised) and 512 anchors: packing keeps >= 0.95."""
    index = chat_like_index(2000, mean_len=403, max_len=4096, loss_fraction=0.53)
    budget = anchor_budget(index, AnchorSetting(num_anchors=512, block_size=7, full_block=False,
                                                loader=LoaderSettings(batch_size=8,
                                                                      max_seq_len=4096)))
    assert budget["bucket"]["kept_anchor_ratio"] < 0.5
    assert budget["pack"]["kept_anchor_ratio"] > 0.95
    assert budget["pack"]["padding"] < budget["bucket"]["padding"]


def test_setting_reads_the_train_config_and_names_a_bad_field() -> None:
    """model.draft / data fields with the run's defaults; a non-integer names its field."""
    setting = setting_from_train_config({"model": {"recipe": "dflash", "draft": {
        "num_anchors": 64}}, "data": {"batch_size": 4, "max_seq_len": 2048}})
    assert (setting.num_anchors, setting.full_block, setting.loader.batch_size,
            setting.loader.max_seq_len) == (64, True, 4, 2048)
    # The layout decides, on any backbone; the old architecture name still means dflash.
    assert setting_from_train_config({"model": {"draft": {"layout": "dflash",
                                                          "architecture": "gemma4"}}}).full_block
    with pytest.warns(FutureWarning, match="architecture: qwen3, layout: dflash"):
        assert setting_from_train_config({"model": {"draft": {"architecture": "dflash"}}}
                                         ).full_block
    assert not setting_from_train_config({"model": {"draft": {}}}).full_block
    with pytest.raises(ValueError, match=r"data.max_seq_len must be an integer, got 'long'"):
        setting_from_train_config({"data": {"max_seq_len": "long"}})
    # the contract's reader: every mistyped draft field is named, an unknown recipe too
    with pytest.raises(ValueError, match=r"model.recipe='dspakr' not in .*; model.draft."
                                         r"target_layer_ids must be a list of integers"):
        setting_from_train_config({"model": {"recipe": "dspakr",
                                             "draft": {"target_layer_ids": "0,1"}}})
