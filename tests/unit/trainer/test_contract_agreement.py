"""`validate --against` and `train` derive the same training contract from every shipped config."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sparkforge.app.demo import train_config
from sparkforge.trainer.cli import train_cli
from sparkforge.trainer.run import run_contract
from sparkforge.trainer.run_config import contract_from_train_config

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "trainer" / "examples").glob("*.yaml"))
# Hardware settings only: they let a GPU config build its Trainer on CPU and never reach the
# contract, which reads the draft, data.max_seq_len and the validation schedule.
ON_CPU = ["--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.num_nodes", "1",
          "--trainer.strategy", "auto", "--trainer.precision", "32-true"]


def _config(source: Path | str, tmp_path: Path) -> Path:
    """An example's path, or a config written for the demo / the unset-schedule variant."""
    if isinstance(source, Path):
        return source
    if source == "demo":
        config = train_config(tmp_path / "demo", steps=10)
    else:  # Lightning still validates each epoch when both schedule options are null
        config = yaml.safe_load(EXAMPLES[-1].read_text())
        config["trainer"].update(val_check_interval=None, check_val_every_n_epoch=None)
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


SOURCES = [*EXAMPLES, "demo", "no-schedule"]


@pytest.mark.parametrize("source", SOURCES, ids=[str(getattr(s, "name", s)) for s in SOURCES])
def test_validate_and_train_build_the_same_contract(source: Path | str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The contract `validate --against` reads from a train YAML equals the one `train` checks."""
    monkeypatch.chdir(tmp_path)  # loggers and checkpoint folders land here, never in the repo
    path = _config(source, tmp_path)
    cli = train_cli(["--config", str(path), *ON_CPU])
    from_train = run_contract(cli.model, cli.datamodule, cli.trainer)
    assert contract_from_train_config(path) == from_train


def test_building_the_contract_imports_no_torch() -> None:
    """Building a contract (what `validate --against` does) loads neither torch nor Lightning."""
    code = ("import sys; from sparkforge.trainer.run_config import contract_from_train_config; "
            f"contract_from_train_config({str(EXAMPLES[-1])!r}); "
            "print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]", out.stderr
