"""Test helper: load an exported draft through vLLM's DSpark or DFlash classes in a separate
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
    out = subprocess.run([sys.executable, "-P", str(LOAD_SCRIPT), str(target), str(draft), method],
                         capture_output=True, text=True, timeout=timeout, check=False)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return result
