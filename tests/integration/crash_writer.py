"""Writer process for the crash tests: writes every uncommitted unit, optionally stalls mid-unit.

Usage: crash_writer.py URI NUM_UNITS SPEC_JSON [--stall-before-commit UNIT] [--options JSON]
Prints "committed <u>" after each commit and "stalled <u>" when it parks before a commit record,
so the parent can SIGKILL it at a known point (or at a racy one, right after a commit line).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cache_helpers import make_run_header, make_unit  # noqa: E402

from sparkforge.shared import storage  # noqa: E402
from sparkforge.shared.layout import CacheSpec, commit_key  # noqa: E402
from sparkforge.shared.writer import CacheWriter  # noqa: E402


def main() -> None:
    """Parse arguments and write."""
    parser = argparse.ArgumentParser()
    parser.add_argument("uri")
    parser.add_argument("num_units", type=int)
    parser.add_argument("spec")
    parser.add_argument("--stall-before-commit", type=int, default=-1)
    parser.add_argument("--options", default="{}")
    args = parser.parse_args()
    spec = CacheSpec(**json.loads(args.spec))
    real_create = storage.exclusive_create

    def stalling_create(loc: storage.Location, key: str, data: bytes) -> None:
        if key == commit_key(args.stall_before_commit):
            print(f"stalled {args.stall_before_commit}", flush=True)
            time.sleep(600)
        real_create(loc, key, data)

    storage.exclusive_create = stalling_create  # type: ignore[assignment]
    writer = CacheWriter.open(args.uri, spec=spec, header=make_run_header(spec),
                              storage_options=json.loads(args.options))
    done = writer.committed_units()
    for unit in range(args.num_units):
        if unit not in done:
            writer.write_unit(unit, *make_unit(spec, unit))
            print(f"committed {unit}", flush=True)


if __name__ == "__main__":
    main()
