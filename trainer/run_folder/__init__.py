"""Where a run's files and checkpoints live.

This package's top level stays free of torch and Lightning (the console script imports it);
the checkpoint-folder lock, a Lightning callback, is in ``run_folder.checkpoints``.

The run folder is the one folder a run without a logger or ``--trainer.default_root_dir``
writes into.

Lightning's default root is the current directory, so ``--trainer.logger false`` used to leave
``checkpoints/`` and ``config.yaml`` there. Such a run writes under
``runs/dspark/config-<hash>-seed<seed>/`` instead, next to the CSV logger's version folders. The
hash is over the parsed config without ``--ckpt_path`` and the run's length (``RUN_LENGTH_KEYS``;
``--config`` file names are not part of a dumped config), so every DDP rank, parsing the same
command line, names the same folder without communicating, and a rerun of the same config finds
its folder again: ``--ckpt_path last`` resumes (or extends) it, and a fresh run there is refused
by the checkpoint-folder lock, which says why. A changed setting or seed gets a new folder.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

RUNS_DIR = "runs"
RUN_NAME = "dspark"
"""The CSV logger's ``save_dir`` and ``name``: logged runs write ``runs/dspark/version_N/``."""
HASH_CHARS = 12
RUN_LENGTH_KEYS = ("ckpt_path", "trainer.max_steps", "trainer.max_epochs", "trainer.max_time")
"""Config keys left out of the hash: resuming a run, or training it longer, is the same run."""


def wants_run_folder(trainer_config: Mapping[str, Any]) -> bool:
    """True for a run whose outputs would land in the current directory: no logger and no
    ``default_root_dir``."""
    logger = trainer_config.get("logger")
    return trainer_config.get("default_root_dir") is None and (logger is False or logger == [])


def run_folder(config_yaml: str, seed: Any) -> Path:
    """``runs/dspark/config-<hash>-seed<seed>`` for this dumped config, hashed without
    ``RUN_LENGTH_KEYS``."""
    config = yaml.safe_load(config_yaml)
    for key in RUN_LENGTH_KEYS:
        *parents, leaf = key.split(".")
        section = config
        for name in parents:
            section = section.get(name) or {}
        section.pop(leaf, None)
    text = json.dumps(config, sort_keys=True, default=str)
    digest = hashlib.sha256(text.encode()).hexdigest()[:HASH_CHARS]
    return Path(RUNS_DIR) / RUN_NAME / f"config-{digest}-seed{seed}"
