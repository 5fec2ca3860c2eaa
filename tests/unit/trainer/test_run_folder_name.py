"""The run folder of a run without a logger: which settings name a new folder; the old path of
the checkpoint-folder lock."""

from __future__ import annotations

import importlib
import sys

import pytest
import yaml

from sparkforge.shared.renamed import RENAMES_DROPPED_IN
from sparkforge.trainer.run_folder import checkpoints, run_folder, wants_run_folder

CONFIG = {"seed_everything": 0, "ckpt_path": None,
          "model": {"optimizer": {"lr": 3e-3}},
          "trainer": {"max_steps": 20, "max_epochs": None, "max_time": None, "logger": False}}


def _folder(seed: int = 0, **trainer: object) -> str:
    config = {**CONFIG, "trainer": {**CONFIG["trainer"], **trainer}}
    return str(run_folder(yaml.safe_dump(config), seed))


def test_resuming_or_training_longer_keeps_the_folder_other_settings_do_not() -> None:
    """ckpt_path and the run length are left out of the hash; a setting or the seed is not."""
    base = _folder()
    assert base.startswith("runs/dspark/config-")
    assert base.endswith("-seed0")
    assert _folder(max_steps=200, max_time="00:01:00:00") == base
    resumed = yaml.safe_dump({**CONFIG, "ckpt_path": "last"})
    assert str(run_folder(resumed, 0)) == base
    changed = yaml.safe_dump({**CONFIG, "model": {"optimizer": {"lr": 1e-3}}})
    assert str(run_folder(changed, 0)) != base
    assert _folder(seed=1) != base
    assert _folder(gradient_clip_val=0.5) != base


def test_only_a_run_without_logger_and_root_folder_gets_one() -> None:
    """An explicit default_root_dir or any logger keeps Lightning's own layout."""
    assert wants_run_folder({"logger": False})
    assert wants_run_folder({"logger": []})
    assert not wants_run_folder({"logger": False, "default_root_dir": "out"})
    assert not wants_run_folder({"logger": {"class_path": "CSVLogger"}})


def test_the_old_checkpoint_folder_module_is_the_new_one_with_a_future_warning(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``sparkforge.trainer.ckpt_folder`` still imports: the same module as
    ``run_folder.checkpoints``, with a FutureWarning naming it and the version dropping the old
    path."""
    monkeypatch.delitem(sys.modules, "sparkforge.trainer.ckpt_folder", raising=False)
    with pytest.warns(FutureWarning, match=r"sparkforge\.trainer\.ckpt_folder is renamed "
                      rf"sparkforge\.trainer\.run_folder\.checkpoints; .*{RENAMES_DROPPED_IN}"):
        old = importlib.import_module("sparkforge.trainer.ckpt_folder")
    assert old is checkpoints
    assert old.CheckpointFolderLock is checkpoints.CheckpointFolderLock
