"""Writer process for the crash tests: writes every uncommitted unit, optionally stalls mid-unit.

Usage: crash_writer.py URI NUM_UNITS SPEC_JSON [--stall-before-commit UNIT] [--options JSON]
    [--queue_units Q [--writer_threads N]]
Prints "committed <u>" after each commit and "stalled <u>" when it parks before a commit record,
so the parent can SIGKILL it at a known point (or at a racy one, right after a commit line). With
``--queue_units`` the units go through the producer's background write queue, as in a real run,
and "queued <u>" is printed once ``submit`` of unit u returned; ``--writer_threads`` writer threads
(default 1) drain the queue.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cache_helpers import make_run_header, make_unit  # noqa: E402

from sparkforge.producer.write_queue import CapturedUnit, UnitWriteQueue  # noqa: E402
from sparkforge.shared import storage  # noqa: E402
from sparkforge.shared.layout import CacheSpec, commit_key  # noqa: E402
from sparkforge.shared.writer import CacheWriter  # noqa: E402

_STDOUT = threading.Lock()


def say(line: str) -> None:
    """Print one whole line. The writer threads and the main thread print concurrently, and
    ``print`` writes the text and its newline in two calls, so lines could interleave."""
    with _STDOUT:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def main() -> None:
    """Parse arguments and write."""
    parser = argparse.ArgumentParser()
    parser.add_argument("uri")
    parser.add_argument("num_units", type=int)
    parser.add_argument("spec")
    parser.add_argument("--stall-before-commit", type=int, default=-1)
    parser.add_argument("--options", default="{}")
    parser.add_argument("--queue_units", type=int, default=0)
    parser.add_argument("--writer_threads", type=int, default=1)
    args = parser.parse_args()
    spec = CacheSpec(**json.loads(args.spec))
    real_create = storage.exclusive_create

    def stalling_create(loc: storage.Location, key: str, data: bytes) -> None:
        if key == commit_key(spec, args.stall_before_commit):
            say(f"stalled {args.stall_before_commit}")
            time.sleep(600)
        real_create(loc, key, data)

    storage.exclusive_create = stalling_create  # type: ignore[assignment]
    writer = CacheWriter.open(args.uri, spec=spec, header=make_run_header(spec),
                              storage_options=json.loads(args.options))
    todo = [u for u in range(args.num_units) if u not in writer.committed_units()]
    if args.queue_units:
        _write_queued(writer, spec, todo, args.queue_units, args.writer_threads)
        return
    for unit in todo:
        writer.write_unit(unit, *make_unit(spec, unit))
        say(f"committed {unit}")


def _write_queued(writer: CacheWriter, spec: CacheSpec, todo: list[int], queue_units: int,
                  threads: int) -> None:
    def report(done: list[CapturedUnit]) -> None:
        for item in done:
            say(f"committed {item.unit}")

    with UnitWriteQueue(writer, queue_units=queue_units, num_threads=threads) as writes:
        for unit in todo:
            report(writes.submit(CapturedUnit(unit, *make_unit(spec, unit))))
            say(f"queued {unit}")
        report(writes.close())


if __name__ == "__main__":
    main()
