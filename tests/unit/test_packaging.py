"""Packaging guards: every package folder ships in the wheel, and the import direction holds."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_listed_in_pyproject() -> None:
    """Each folder with an __init__.py under a mapped package is in [tool.setuptools].packages."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    owners = {ROOT / folder: dotted for dotted, folder in config["package-dir"].items()}
    found = set()
    for folder in owners:
        for init in folder.rglob("__init__.py"):
            # A folder mapped on its own (sparkforge.app in shared/app) belongs to that mapping.
            owner = max((f for f in owners if init.parent.is_relative_to(f)),
                        key=lambda f: len(f.parts))
            found.add(".".join([owners[owner], *init.parent.relative_to(owner).parts]))
    assert found == set(config["packages"])


@pytest.mark.parametrize(
    ("module", "forbidden"),
    [
        ("sparkforge.trainer", "vllm"),
        ("sparkforge.manifests.cli", "torch"),
        ("sparkforge.manifests.cli", "vllm"),
        ("sparkforge.app.cli", "torch"),
        ("sparkforge.trainer.run_folder", "lightning"),
    ],
)
def test_import_does_not_pull_in(module: str, forbidden: str) -> None:
    """Importing a package must not import a heavy dependency it does not need."""
    code = f"import sys, {module}; print({forbidden!r} in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False", out.stderr


def test_finalize_runs_without_torch(tmp_path: Path) -> None:
    """`sparkforge finalize` is a manifest job: it runs without torch or the producer's run."""
    code = ("import sys; from sparkforge.app.cli import main; "
            f"code = main(['finalize', '--output', {str(tmp_path)!r}]); "
            "heavy = ('torch', 'sparkforge.producer.run'); "
            "print(code, sorted(m for m in heavy if m in sys.modules))")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "1 []", out.stderr  # 1: the empty folder holds no run
