"""Input reading: rows/s from a Hugging Face ``save_to_disk`` dataset (ShareGPT columns, mapped
to messages) and from a weighted mix, against the same rows as one JSONL file, in one run.

The producer reads rows on the capture loop's thread, so a slow reader would idle the engine;
this measures the reader alone (no tokenizer, no engine).

    .venv/bin/python benchmarks/bench_hf_input.py [--num_rows 20000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from sparkforge.shared.dataset import describe_sources, iter_rows
from sparkforge.shared.mix import MixSource, iter_mix_rows, plan_mix

WORDS = "the draft block reads a cache shard and the target layer writes a token".split()


def _turns(i: int) -> list[dict[str, str]]:
    question = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(8 + i % 24))
    answer = " ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(40 + i % 80))
    return [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]


def _rate(read: Callable[[], Iterator[Any]], repeats: int) -> tuple[float, int]:
    best, count = float("inf"), 0
    for _ in range(repeats):
        start = time.perf_counter()
        count = sum(1 for _ in read())
        best = min(best, time.perf_counter() - start)
    return count / best, count


def main() -> None:
    """Print rows/s of each reader and its ratio to JSONL."""
    import datasets

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_rows", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        jsonl = root / "chat.jsonl"
        with jsonl.open("w") as f:
            for i in range(args.num_rows):
                f.write(json.dumps({"messages": [{"role": "user" if t["from"] == "human"
                                                  else "assistant", "content": t["value"]}
                                                 for t in _turns(i)]}) + "\n")
        folder = root / "sharegpt"
        datasets.Dataset.from_dict({"conversations": [_turns(i) for i in range(args.num_rows)]}
                                   ).save_to_disk(str(folder))
        plan = plan_mix([MixSource(data=str(jsonl), weight=1.0),
                         MixSource(data=str(folder), weight=1.0)],
                        num_rows=args.num_rows, seed=0)
        readers = {"jsonl": lambda: iter_rows(describe_sources(str(jsonl))),
                   "hf save_to_disk": lambda: iter_rows(describe_sources(str(folder))),
                   "mix jsonl+hf 1:1": lambda: iter_mix_rows(plan)}
        rates = {name: _rate(read, args.repeats) for name, read in readers.items()}
    base = rates["jsonl"][0]
    print(f"{'reader':<18} {'rows':>8} {'rows/s':>10} {'vs jsonl':>9}")
    for name, (rate, count) in rates.items():
        print(f"{name:<18} {count:>8,} {rate:>10,.0f} {rate / base:>9.2f}")
    print(f"reproduce: .venv/bin/python benchmarks/bench_hf_input.py --num_rows {args.num_rows} "
          f"--repeats {args.repeats}")


if __name__ == "__main__":
    main()
