"""Cache writer throughput vs cores, and fp8 quantisation speed: numpy reference vs torch.

    .venv/bin/python -P benchmarks/bench_writer.py [--hidden 1024 --layers 3 --tokens 16384]

1. Writer MB/s per core count: each count runs in its own process pinned to that many CPUs
   (``sched_setaffinity``) with the producer's ``writer_threads`` set to match (as many writer
   threads in its ``UnitWriteQueue`` and codec threads in zarr's pool), writing the same bf16
   units (lossless: Blosc zstd-1 + byte shuffle); MB/s counts the raw hidden-state bytes (aux +
   final) per wall second, data generation excluded. "busy cores" is the process's CPU time over
   wall time, and "MB per CPU-s" the bytes per CPU second: on a shared host, where other processes
   take cores, wall MB/s cannot scale but these two still show whether the writer spreads over
   the cores it is given.
   MB per CPU-s is the per-core figure ``sparkforge plan`` uses.
2. Overlap: the same units written after a capture stand-in that sleeps as long as writing one
   unit took (a GPU prefill leaves the host CPU idle, so a sleep models it), once inline (capture,
   write, capture, ...) and once through the producer's ``UnitWriteQueue``, with 1 core.
3. fp8 e4m3 quantisation of the same bf16 activations: the numpy reference
   (``sparkforge.shared.dtypes``) vs the producer's torch version (``sparkforge.producer.fp8``) on
   CPU, and on CUDA when one is present; MB/s of bf16 input. Both give identical bytes (checked).

Activations: standard normal values times a lognormal per-token scale, stored as bf16 bits, so the
exponent byte varies from token to token as in real activations and the mantissa is random.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def make_units(num_tokens: int, hidden: int, layers: int, seq_len: int, rows_per_unit: int):
    """Units of bf16 samples of ``seq_len`` tokens (token ids and masks included)."""
    import hashlib

    from sparkforge.shared.dtypes import float_to_storage
    from sparkforge.shared.records import SampleRecord, UnitAccounting

    rng = np.random.default_rng(0)
    units = []
    num_samples = num_tokens // seq_len
    for unit in range(-(-num_samples // rows_per_unit)):
        rows = range(unit * rows_per_unit, min(num_samples, (unit + 1) * rows_per_unit))
        records = []
        for row in rows:
            scale = rng.lognormal(0.0, 0.7, (seq_len, 1, 1)).astype(np.float32)
            aux = rng.standard_normal((seq_len, layers, hidden), np.float32) * scale
            final = rng.standard_normal((seq_len, hidden), np.float32)
            records.append(SampleRecord(
                sample_id=row, source_row=row, split="train",
                source_hash=hashlib.sha256(str(row).encode()).hexdigest(),
                input_ids=rng.integers(0, 32_000, seq_len).astype(np.int32),
                loss_mask=np.ones(seq_len, np.uint8),
                aux_hidden=float_to_storage(aux, "bfloat16"),
                final_hidden=float_to_storage(final, "bfloat16")))
        units.append((unit, records, UnitAccounting(input_rows=len(rows), written=len(records))))
    return units


def _pinned_setup(args: argparse.Namespace, cores: int):
    """Pin this process to ``cores`` CPUs with as many codec threads; the units and their spec."""
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:cores])
    from sparkforge.shared.layout import CacheSpec
    from sparkforge.shared.storage import set_codec_threads

    set_codec_threads(cores)
    units = make_units(args.tokens, args.hidden, args.layers, args.seq_len, args.rows_per_unit)
    spec = CacheSpec(hidden_size=args.hidden, num_aux_layers=args.layers, hidden_dtype="bfloat16",
                     max_seq_len=args.seq_len, rows_per_unit=args.rows_per_unit,
                     shard_rows=args.shard_rows)
    return units, spec


def _header(args: argparse.Namespace):
    """The synthetic run header of bench_trainer_data (a sibling script)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_trainer_data import synthetic_header

    return synthetic_header(args.hidden, args.layers, args.seq_len)


def phase_write(args: argparse.Namespace) -> dict[str, float]:
    """Write every unit as the producer does with ``writer_threads = args.cores``: through its
    queue, ``args.cores`` writer threads and as many codec threads on ``args.cores`` CPUs."""
    from sparkforge.producer.write_queue import CapturedUnit, UnitWriteQueue
    from sparkforge.shared.writer import CacheWriter

    units, spec = _pinned_setup(args, args.cores)
    with tempfile.TemporaryDirectory() as tmp:
        writer = CacheWriter.open(f"{tmp}/cache", spec=spec,
                                  header=_header(args))
        start, cpu_start = time.perf_counter(), _cpu_seconds()
        with UnitWriteQueue(writer, queue_units=2, num_threads=args.cores) as writes:
            for unit in units:
                writes.submit(CapturedUnit(*unit))
            writes.close()
        seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu_start
    hidden_bytes = sum(r.aux_hidden.nbytes + r.final_hidden.nbytes for _, rs, _ in units
                       for r in rs)
    return {"bytes": hidden_bytes, "seconds": seconds, "cpu_seconds": cpu}


def _cpu_seconds() -> float:
    """CPU time of this process, all threads (user + system)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def phase_overlap(args: argparse.Namespace) -> dict[str, float]:
    """Inline vs queued writes behind a capture stand-in as long as one unit's write."""
    from sparkforge.producer.write_queue import CapturedUnit, UnitWriteQueue
    from sparkforge.shared.writer import CacheWriter

    units, spec = _pinned_setup(args, 1)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        header = _header(args)
        warm = CacheWriter.open(f"{tmp}/warm", spec=spec, header=header)
        start = time.perf_counter()
        warm.write_unit(*units[0])
        capture_s = time.perf_counter() - start
        inline = CacheWriter.open(f"{tmp}/inline", spec=spec, header=header)
        start = time.perf_counter()
        for unit in units:
            time.sleep(capture_s)
            inline.write_unit(*unit)
        out["inline"] = time.perf_counter() - start
        queued = CacheWriter.open(f"{tmp}/queued", spec=spec, header=header)
        start = time.perf_counter()
        with UnitWriteQueue(queued, queue_units=2, num_threads=1) as writes:
            for unit in units:
                time.sleep(capture_s)
                writes.submit(CapturedUnit(*unit))
            writes.close()
        out["queued"] = time.perf_counter() - start
    out["capture_s"] = capture_s * len(units)
    return out


def fp8_rows(args: argparse.Namespace) -> list[tuple[str, float]]:
    """MB/s of bf16 input for the numpy reference and torch (CPU, and CUDA if present)."""
    import torch

    from sparkforge.producer.fp8 import quantize_e4m3 as quantize_torch
    from sparkforge.shared.dtypes import float_to_storage, quantize_e4m3, storage_to_float32

    rng = np.random.default_rng(1)
    tokens = min(args.tokens, 4096)
    x = rng.standard_normal((tokens, args.layers, args.hidden), np.float32)
    bits = float_to_storage(x * rng.lognormal(0, 0.7, (tokens, 1, 1)).astype(np.float32),
                            "bfloat16")
    tensor = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)

    def timed(fn):
        fn()  # warm-up
        start = time.perf_counter()
        out = fn()
        return out, bits.nbytes / (time.perf_counter() - start) / 1e6

    (ref_codes, ref_scale), np_mbs = timed(lambda: quantize_e4m3(storage_to_float32(bits,
                                                                                    "bfloat16")))
    (codes, scale), cpu_mbs = timed(lambda: quantize_torch(tensor))
    assert np.array_equal(codes.numpy(), ref_codes)
    assert np.array_equal(scale.numpy(), ref_scale)
    rows = [("numpy reference (CPU)", np_mbs),
            (f"torch, CPU ({torch.get_num_threads()} threads)", cpu_mbs)]
    if torch.cuda.is_available():
        gpu = tensor.cuda()

        def on_gpu():
            out = quantize_torch(gpu)
            torch.cuda.synchronize()
            return out

        (codes, _), gpu_mbs = timed(on_gpu)
        assert np.array_equal(codes.cpu().numpy(), ref_codes)
        rows.append((f"torch, {torch.cuda.get_device_name()}", gpu_mbs))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--rows_per_unit", type=int, default=4)
    p.add_argument("--shard_rows", type=int, default=4096)
    p.add_argument("--max_cores", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--cores", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--overlap", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.cores or args.overlap:
        print(json.dumps(phase_overlap(args) if args.overlap else phase_write(args)))
        return
    shape = (f"--hidden {args.hidden} --layers {args.layers} --tokens {args.tokens} "
             f"--seq_len {args.seq_len} --rows_per_unit {args.rows_per_unit} "
             f"--shard_rows {args.shard_rows}")
    results = {}
    for cores in range(1, args.max_cores + 1):
        cmd = [sys.executable, "-P", __file__, *shape.split(), "--cores", str(cores)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        results[cores] = json.loads(out.strip().splitlines()[-1])
    print(f"\nwriter, bf16 lossless, H={args.hidden}, F={args.layers} + final, "
          f"{args.tokens} tokens")
    print(f"{'cores':>5}{'MB/s':>9}{'vs 1 core':>11}{'busy cores':>12}{'MB per CPU-s':>14}")
    base = results[1]["bytes"] / results[1]["seconds"]
    for cores, r in results.items():
        mbs = r["bytes"] / r["seconds"]
        print(f"{cores:>5}{mbs / 1e6:>9.0f}{mbs / base:>11.2f}"
              f"{r['cpu_seconds'] / r['seconds']:>12.2f}"
              f"{r['bytes'] / r['cpu_seconds'] / 1e6:>14.0f}")
    cmd = [sys.executable, "-P", __file__, *shape.split(), "--overlap"]
    lap = json.loads(subprocess.run(cmd, capture_output=True, text=True,
                                    check=True).stdout.strip().splitlines()[-1])
    print(f"\noverlap, 1 core: capture stand-in {lap['capture_s']:.2f} s in all")
    print(f"{'writes':<34}{'wall s':>8}{'vs inline':>11}")
    for name in ("inline", "queued"):
        print(f"{name:<34}{lap[name]:>8.2f}{lap['inline'] / lap[name]:>11.2f}")
    print(f"\nfp8 e4m3 quantisation, [{min(args.tokens, 4096)}, {args.layers}, {args.hidden}] bf16")
    rows = fp8_rows(args)
    for name, mbs in rows:
        print(f"{name:<40}{mbs:>9.0f} MB/s{mbs / rows[0][1]:>8.1f}x")
    print(f"\nreproduce: .venv/bin/python -P benchmarks/bench_writer.py {shape}")


if __name__ == "__main__":
    main()
