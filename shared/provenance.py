"""Provenance recorded next to every output: installed package versions and the git commit."""

from __future__ import annotations

import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path


def package_version(name: str) -> str | None:
    """Installed version of distribution ``name`` (read without importing it), or None."""
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def git_sha() -> str | None:
    """The source checkout's commit, when sparkforge runs from a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    sha = out.stdout.strip()
    return sha if len(sha) == 40 else None
