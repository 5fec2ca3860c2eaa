"""The layers import downwards only: shared <- manifests <- {producer, trainer} <- {app, api}."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "shared" / "app"
API = ROOT / "shared" / "api"
# package -> the sparkforge packages it may import (itself included).
ALLOWED = {
    "shared": {"shared"},
    "manifests": {"shared", "manifests"},
    "producer": {"shared", "manifests", "producer"},
    "trainer": {"shared", "manifests", "trainer"},
    "app": {"shared", "manifests", "producer", "trainer", "app", "api"},
    "api": {"shared", "manifests", "producer", "trainer", "app", "api"},
}


def _package_of(path: Path) -> str:
    if path.is_relative_to(API):
        return "api"
    return "app" if path.is_relative_to(APP) else path.relative_to(ROOT).parts[0]


def _imported_packages(path: Path) -> set[str]:
    """The sparkforge packages a module imports, at any depth (lazy imports included)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return {name.split(".")[1] for name in names
            if name.startswith("sparkforge.") and name.count(".") >= 1}


MODULES = sorted(p for package in ("shared", "manifests", "producer", "trainer")
                 for p in (ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(ROOT)) for p in MODULES])
def test_module_imports_only_lower_layers(path: Path) -> None:
    """No module imports a layer above its own, and nothing but the app imports sparkforge.app."""
    package = _package_of(path)
    assert _imported_packages(path) <= ALLOWED[package], path


def test_the_app_layer_exists_and_is_checked() -> None:
    """The scan above covers the app layer's modules (so a moved app would not pass silently)."""
    assert {p.name for p in MODULES if _package_of(p) == "app"} >= {"cli.py", "demo.py",
                                                                    "tiny_target.py"}
    assert _imported_packages(APP / "cli.py") >= {"manifests", "producer", "trainer"}
    assert {p.name for p in MODULES if _package_of(p) == "api"} == {"__init__.py"}
