"""Run every ``benchmarks/bench_*.py`` in its own interpreter and report which ones failed.

    .venv/bin/python benchmarks/run_all.py      (what ``make bench`` runs)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def main() -> int:
    """Run each benchmark in turn, streaming its table; exit 1 if any of them failed."""
    failed = []
    for script in sorted(Path(__file__).resolve().parent.glob("bench_*.py")):
        print(f"== {script.name}", flush=True)
        if subprocess.run([sys.executable, str(script)], check=False).returncode:
            failed.append(script.name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
