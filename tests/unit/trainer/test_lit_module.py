"""Window metrics: ratios of sums (never means of ratios); config consistency checks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sparkforge.shared.errors import SparkforgeError
from sparkforge.trainer.architectures.tiny import draft_tiny
from sparkforge.trainer.lit_module import (
    DraftLitModule,
    anchor_generator,
    trailing_window_scale,
    window_metrics,
)
from sparkforge.trainer.run_config import DraftSpec, LossSpec

SPEC = DraftSpec(mask_token_id=3, hidden_size=128, vocab_size=1024, num_target_layers=4,
                 target_layer_ids=(0, 2), num_hidden_layers=1, block_size=2, num_anchors=4,
                 markov_rank=8)


def _sums(accept_num: list[float], accept_den: list[float], loss: float) -> dict[str, torch.Tensor]:
    d = torch.float64
    return {
        "accept_num": torch.tensor(accept_num, dtype=d),
        "accept_den": torch.tensor(accept_den, dtype=d),
        "tau_num": torch.tensor(0.0, dtype=d), "tau_den": torch.tensor(0.0, dtype=d),
        "valid_anchors": torch.tensor(1.0, dtype=d),
        "anchor_candidates": torch.tensor(1.0, dtype=d),
        "kept_anchors": torch.tensor(1.0, dtype=d), "anchor_slots": torch.tensor(1.0, dtype=d),
        "supervised_slots": torch.tensor(1.0, dtype=d),
        "loss": torch.tensor(loss, dtype=d), "ce_loss": torch.tensor(loss, dtype=d),
        "l1_loss": torch.tensor(0.0, dtype=d), "confidence_loss": torch.tensor(0.0, dtype=d),
        "selector_loss": torch.tensor(0.0, dtype=d),
        "micro_batches": torch.tensor(1.0, dtype=d), "tokens": torch.tensor(100.0, dtype=d),
        "data_wait_s": torch.tensor(0.5, dtype=d),
    }


def test_window_is_a_ratio_of_sums() -> None:
    """Two micro-batches (or ranks) with 1/1 and 0/3 accepted give 1/4, not the mean 1/2."""
    a, b = _sums([1.0, 0.0], [1.0, 0.0], 2.0), _sums([0.0, 0.0], [3.0, 0.0], 4.0)
    total = {k: a[k] + b[k] for k in a}
    m = window_metrics(total, elapsed_s=2.0, world_size=1)
    assert m["accept_rate@0"] == pytest.approx(0.25)
    assert "accept_rate@1" not in m   # never measured: omitted, not 0
    assert m["loss"] == pytest.approx(3.0)   # loss terms: mean over micro-batches
    assert m["tokens_per_s"] == pytest.approx(100.0)
    assert m["data_wait_frac"] == pytest.approx(0.5)


def test_confidence_head_and_its_loss_weight_must_agree() -> None:
    """A confidence head with alpha 0 (or alpha > 0 without a head) is a config error."""
    with pytest.raises(ValueError, match="confidence_head_alpha"):
        DraftLitModule(draft=SPEC, loss=LossSpec(confidence_head_alpha=0.0))


def test_anchor_generator_depends_only_on_the_batch_position() -> None:
    """Same (seed, rank, stage, epoch, batch) -> same draws; another rank -> other draws."""
    def draw(*key: int) -> torch.Tensor:
        return torch.rand(4, generator=anchor_generator(*key))

    assert torch.equal(draw(0, 1, 0, 2, 5), draw(0, 1, 0, 2, 5))
    assert not torch.equal(draw(0, 1, 0, 2, 5), draw(0, 0, 0, 2, 5))


@pytest.mark.parametrize(("field", "value"), [("mask_token_id", 4), ("block_size", 3),
                                              ("target_layer_ids", [0, 1])])
def test_resume_refuses_a_checkpoint_with_another_draft_contract(field: str, value: Any) -> None:
    """Resuming with another mask_token_id, K or feature ids is an error naming the field."""
    lit = DraftLitModule(draft=SPEC)
    cfg = draft_tiny()
    lit.build(cfg)
    saved = {**cfg.to_dict(), field: value}
    with pytest.raises(ValueError, match=field):
        lit.on_load_checkpoint({"draft_config": saved})
    lit.on_load_checkpoint({"draft_config": cfg.to_dict()})   # the same contract resumes


@pytest.mark.parametrize(("field", "value"), [("num_hidden_layers", 2),
                                              ("intermediate_size", 96)])
def test_resume_with_another_shape_names_the_field(field: str, value: int) -> None:
    """A checkpoint of a draft with other tensor shapes is refused naming the field that differs
    (it used to reach load_state_dict, whose RuntimeError listed every missing tensor)."""
    import dataclasses

    saved = DraftLitModule(draft=SPEC)
    saved.build(dataclasses.replace(draft_tiny(), **{field: value}))
    assert saved.model is not None
    lit = DraftLitModule(draft=SPEC)
    lit.build(draft_tiny())
    checkpoint = {"draft_config": saved.model.config.to_dict(), "state_dict": saved.state_dict()}
    with pytest.raises(SparkforgeError, match=rf"cannot resume: model\.draft\.{field}: "
                                              rf"checkpoint has {value}"):
        lit.on_load_checkpoint(checkpoint)
    assert lit.model is not None
    lit.on_load_checkpoint({"draft_config": lit.model.config.to_dict(),
                            "state_dict": lit.state_dict()})   # its own weights resume


@pytest.mark.parametrize(("batch_idx", "num_batches", "accumulate", "scale"), [
    (0, 5, 2, 1.0), (3, 5, 2, 1.0), (4, 5, 2, 2.0),   # last window holds 1 of 2
    (6, 8, 3, 1.5), (5, 8, 3, 1.0),                    # last window holds 2 of 3
    (3, 4, 2, 1.0), (4, 5, 1, 1.0), (7, float("inf"), 4, 1.0),
])
def test_trailing_partial_accumulation_window_is_rescaled(batch_idx: int, num_batches: float,
                                                          accumulate: int, scale: float) -> None:
    """A window of p < accumulate micro-batches is scaled by accumulate/p (spec section 8)."""
    assert trailing_window_scale(batch_idx, num_batches, accumulate) == scale


@pytest.mark.parametrize("change", [{"l1_chunk_rows": 0}, {"ce_loss_alpha": -0.1},
                                    {"l1_loss_alpha": -1.0}, {"confidence_head_alpha": -1.0}])
def test_invalid_loss_settings_name_the_field(change: dict[str, Any]) -> None:
    """A chunk size < 1 or a negative loss weight is a ValueError naming model.loss.<field>."""
    (name,) = change
    with pytest.raises(ValueError, match=f"model.loss.{name}"):
        LossSpec(**change)


def test_nonfinite_message_names_the_samples_holding_bad_inputs() -> None:
    """A NaN loss names the batch's samples and, among them, those with non-finite inputs."""
    from sparkforge.trainer.lit_module import nonfinite_message

    batch = {"sample_ids": torch.tensor([5, 9]), "target_hidden_states": torch.zeros(2, 3, 4),
             "target_last_hidden_states": torch.zeros(2, 3, 2)}
    batch["target_hidden_states"][1, 0, 2] = float("nan")
    msg = nonfinite_message(batch, torch.tensor(float("nan")), step=3, rank=0)
    assert "at step 3 (rank 0), batch samples [5, 9]: samples [9] hold non-finite" in msg
    batch["target_hidden_states"][1, 0, 2] = 0.0
    assert "the model diverged" in nonfinite_message(batch, torch.tensor(float("inf")), step=3,
                                                     rank=0)
    assert "on another rank" in nonfinite_message(batch, torch.tensor(1.0), step=3, rank=1)
