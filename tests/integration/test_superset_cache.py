"""One cache, many drafts: a draft on a subset of a superset cache trains as on its own cache."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from cache_helpers import write_tiny_cache

from sparkforge.app.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY_YAML = ROOT / "trainer" / "examples" / "tiny.yaml"
STEPS = 6


RECIPE_ARGS = {"dspark": (), "dflash2": ("--model.recipe", "dflash2",
                                         "--model.draft.markov_rank", "null")}


def _losses(cache: str, out: Path, feature_ids: str, recipe: str) -> dict[int, float]:
    """train/loss by step of a short run of the tiny draft (of ``recipe``) on ``feature_ids``."""
    assert main(["train", "--config", str(TINY_YAML), "--data.uri", cache,
                 "--model.draft.target_layer_ids", feature_ids, *RECIPE_ARGS[recipe],
                 "--trainer.logger.init_args.save_dir", str(out), "--trainer.log_every_n_steps",
                 "1", "--trainer.max_steps", str(STEPS), "--trainer.limit_val_batches", "0",
                 "--model.scheduler.total_steps", "60"]) == 0
    run_dir = sorted(out.glob("dspark/version_*"))[-1]
    with (run_dir / "metrics.csv").open() as f:
        return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f)
                if r.get("train/loss")}


@pytest.fixture(scope="module")
def superset_cache(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Every portable feature of the 4-layer tiny target: HF indices [1, 2, 3]."""
    return write_tiny_cache(str(tmp_path_factory.mktemp("superset") / "cache"), tiny_target,
                            layer_ids=(1, 2, 3))


@pytest.mark.slow
@pytest.mark.parametrize(("feature_ids", "exact_hf_ids", "recipe"),
                         [("[0, 2]", (1, 3), "dspark"), ("[1]", (2,), "dflash2")],
                         ids=["features-0-2", "feature-1-dflash2"])
def test_subset_draft_trains_as_on_its_exact_cache(superset_cache: str, tiny_target: Path,
                                                   tmp_path: Path, feature_ids: str,
                                                   exact_hf_ids: tuple[int, ...],
                                                   recipe: str) -> None:
    """A draft on a subset of a superset cache logs the same losses as on a cache of its layers
    (DSpark bit for bit; DFlash2 within fp32 rounding: 8e-8 relative at one of six steps)."""
    exact = write_tiny_cache(str(tmp_path / "exact"), tiny_target, layer_ids=exact_hf_ids)
    from_superset = _losses(superset_cache, tmp_path / "superset-run", feature_ids, recipe)
    from_exact = _losses(exact, tmp_path / "exact-run", feature_ids, recipe)
    assert sorted(from_superset) == list(range(1, STEPS + 1))
    if recipe == "dspark":
        assert from_superset == from_exact
    else:
        assert from_superset == pytest.approx(from_exact, rel=1e-6, abs=0)
