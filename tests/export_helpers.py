"""Test helper: load exported drafts through vLLM's DSpark, DFlash or DFlash2 classes in a separate
interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

LOAD_SCRIPT = Path(__file__).parent / "integration" / "vllm_dspark_load.py"


def load_in_vllm(target: Path, draft: Path, *, method: str = "dspark",
                 timeout: int = 600) -> dict[str, Any]:
    """Run ``vllm_dspark_load.py TARGET DRAFT METHOD`` and return its ``RESULT`` JSON account."""
    account: dict[str, Any] = _script_result(LOAD_SCRIPT, [target, draft, method], timeout)
    return account


def load_all_in_vllm(target: Path, drafts: list[tuple[Path, str]], *,
                     timeout: int = 600) -> list[dict[str, Any]]:
    """``load_in_vllm`` of several (draft, method) pairs in one interpreter (one vLLM start-up)."""
    args: list[Any] = [target, *(x for pair in drafts for x in pair)]
    accounts: list[dict[str, Any]] = _script_result(LOAD_SCRIPT, args, timeout)
    return accounts


RESOLVE_SCRIPT = Path(__file__).parent / "integration" / "vllm_draft_resolve.py"


def resolve_in_vllm(target: Path, drafts: list[Path], *, timeout: int = 600) -> dict[str, Any]:
    """Run ``vllm_draft_resolve.py TARGET DRAFT...``: per draft, vLLM's model type and class."""
    resolved: dict[str, Any] = _script_result(RESOLVE_SCRIPT, [target, *drafts], timeout)
    return resolved


def _script_result(script: Path, args: list[Any], timeout: int) -> Any:
    """Run ``script`` in a fresh interpreter; its ``RESULT {json}`` stdout line, parsed."""
    out = subprocess.run([sys.executable, "-P", str(script), *map(str, args)],
                         capture_output=True, text=True, timeout=timeout, check=False)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, out.stderr[-3000:]
    return json.loads(line.removeprefix("RESULT "))


def eval_report(draft: Path, target: Path, cache: Path | str, out_dir: Path) -> dict[str, Any]:
    """``sparkforge eval`` of a draft on 2 held-out prompts x 8 greedy tokens; its report."""
    from sparkforge.app.cli import main

    assert main(["eval", "--draft", str(draft), "--target", str(target), "--cache", str(cache),
                 "--out_dir", str(out_dir), "--num_prompts", "2", "--max_new_tokens", "8",
                 "--temperature", "0.0"]) == 0
    report: dict[str, Any] = json.loads((out_dir / "eval_report.json").read_text())
    return report


class _RunsCode:
    """A pickle that would create ``marker`` when loaded (a foreign checkpoint running code)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (Path.touch, (self.marker,))


def foreign_checkpoint(kind: str, path: Path) -> Path:
    """Random bytes or a code-running pickle at ``path``; the marker beside it must never appear."""
    import numpy as np
    import torch

    if kind == "random_bytes":
        path.write_bytes(np.random.default_rng(0).bytes(4096))
    else:
        torch.save({"draft_config": {}, "x": _RunsCode(path.with_suffix(".ran"))}, path)
    return path
