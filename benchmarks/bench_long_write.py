"""Writer memory for one long sample: one slot as long as the sample vs fixed 4K-row slots.

Each case writes one bf16 sample of ``L`` tokens (``--layers`` aux layers and the final state,
``--hidden`` wide) with ``CacheWriter.write_unit`` in a process of its own and reports the peak
resident memory the write adds to that process (``ru_maxrss`` after the write minus the resident
bytes before it, the sample already built in blocks so that building it peaks lower). With
``shard_rows = L`` (one slot per sample, the only layout before a sample could span slots) the
writer's shard buffers hold (F + 1) x L x H x 2 bytes; with a fixed ``shard_rows`` they hold one
slot whatever ``L``. The ratio column is each fixed-slot case over the one-slot case of the same
length, in the same run.

Reproduce (about 2 minutes on 2 shared cores):
    nice -n 10 .venv/bin/python -P benchmarks/bench_long_write.py
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import psutil

BLOCK_ROWS = 4096


def _sample(length: int, hidden: int, layers: int):
    """One bf16 sample of ``length`` tokens, converted block by block (no float32 copy whole)."""
    from sparkforge.shared.dtypes import float_to_storage
    from sparkforge.shared.records import SampleRecord

    rng = np.random.default_rng(length)
    aux = np.empty((length, layers, hidden), np.uint16)
    final = np.empty((length, hidden), np.uint16)
    for lo in range(0, length, BLOCK_ROWS):
        n = min(BLOCK_ROWS, length - lo)
        aux[lo:lo + n] = float_to_storage(rng.standard_normal((n, layers, hidden), np.float32),
                                          "bfloat16")
        final[lo:lo + n] = float_to_storage(rng.standard_normal((n, hidden), np.float32),
                                            "bfloat16")
    return SampleRecord(sample_id=0, source_row=0, split="train",
                        source_hash=hashlib.sha256(b"0").hexdigest(),
                        input_ids=rng.integers(0, 32_000, length).astype(np.int32),
                        loss_mask=np.ones(length, np.uint8), aux_hidden=aux, final_hidden=final)


def _case(length: int, shard_rows: int, hidden: int, layers: int) -> dict[str, float]:
    """Write the sample once; the peak bytes the write added and the slots it filled."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_trainer_data import synthetic_header

    from sparkforge.shared.layout import CacheSpec
    from sparkforge.shared.records import UnitAccounting
    from sparkforge.shared.writer import CacheWriter

    spec = CacheSpec(hidden_size=hidden, num_aux_layers=layers, hidden_dtype="bfloat16",
                     max_seq_len=length, shard_rows=shard_rows, rows_per_unit=1)
    sample = _sample(length, hidden, layers)
    with tempfile.TemporaryDirectory() as tmp:
        writer = CacheWriter.open(f"{tmp}/cache", spec=spec,
                                  header=synthetic_header(hidden, layers, length))
        before = psutil.Process().memory_info().rss
        writer.write_unit(0, [sample], UnitAccounting(input_rows=1, written=1))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"sample_mib": (sample.aux_hidden.nbytes + sample.final_hidden.nbytes) / 2**20,
            "added_mib": (peak - before) / 2**20, "slots": -(-length // shard_rows)}


def main() -> None:
    """Run each (length, shard_rows) case in its own process and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--lengths", nargs="+", type=int, default=[8192, 32768, 131072])
    parser.add_argument("--shard_rows", type=int, default=4096)
    parser.add_argument("--case", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(_case(*args.case, args.hidden, args.layers)))
        return
    print("| tokens per sample | hidden bytes of the sample (MiB) | shard_rows | slots | peak "
          "RSS the write adds (MiB) | / one slot |")
    print("|---|---|---|---|---|---|")
    for length in args.lengths:
        base = None
        for shard_rows in (length, args.shard_rows):
            out = subprocess.run([sys.executable, "-P", __file__, "--hidden", str(args.hidden),
                                  "--layers", str(args.layers), "--case", str(length),
                                  str(shard_rows)], check=True, capture_output=True, text=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            base = base or r
            print(f"| {length} | {r['sample_mib']:.0f} | {shard_rows} | {r['slots']} | "
                  f"{r['added_mib']:.0f} | {r['added_mib'] / base['added_mib']:.2f} |",
                  flush=True)
    print(f"\nreproduce: nice -n 10 .venv/bin/python -P benchmarks/bench_long_write.py "
          f"--hidden {args.hidden} --layers {args.layers} --lengths "
          f"{' '.join(map(str, args.lengths))} --shard_rows {args.shard_rows}")


if __name__ == "__main__":
    main()
