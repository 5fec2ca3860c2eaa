"""Cache write/read throughput vs raw numpy memmap of the same bytes, and compression ratio.

Activations: a tiny Qwen3 target (built locally, nothing downloaded) runs a plain HF forward; its
bf16 sign+exponent bytes are spread to a realistic hidden size by concatenating channel-permuted
vectors of different tokens, with fresh random mantissa bytes (the mantissa byte of real bf16
activations is incompressible, so this keeps the exponent statistics without fake repeats).

    .venv/bin/python benchmarks/bench_cache.py [--hidden_size 2048] [--num_tokens 32768]
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from sparkforge.manifests.finalize import finalize_cache
from sparkforge.manifests.open import open_cache
from sparkforge.manifests.summary import summarize_cache
from sparkforge.shared.dtypes import float_to_storage
from sparkforge.shared.layout import CacheSpec
from sparkforge.shared.records import SampleRecord, UnitAccounting
from sparkforge.shared.writer import CacheWriter

SEQ_LEN, LAYER_IDS = 1024, (1, 2, 3)


def tiny_activations(workdir: Path, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """aux [T, 3, 128] and post-norm final [T, 128] float32 from the tiny target's forward."""
    import torch
    from transformers import AutoModelForCausalLM

    from sparkforge.app.tiny_target import build_tiny_target

    model = AutoModelForCausalLM.from_pretrained(build_tiny_target(workdir / "target"),
                                                 dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    aux, final = [], []
    with torch.no_grad():
        for _ in range(max(1, num_tokens // 8 // SEQ_LEN)):
            ids = torch.from_numpy(rng.integers(4, 1024, (1, SEQ_LEN)))
            hs = model(ids, output_hidden_states=True).hidden_states
            aux.append(torch.stack([hs[k][0] for k in LAYER_IDS], 1).numpy())
            final.append(hs[-1][0].numpy())
    return np.concatenate(aux), np.concatenate(final)


def widen(x: np.ndarray, num_tokens: int, hidden_size: int, rng: np.random.Generator) -> np.ndarray:
    """[num_tokens, ..., hidden_size] bf16 bits: permuted real vectors, random mantissa byte."""
    blocks = []
    for _ in range(hidden_size // x.shape[-1]):
        src = x[rng.integers(0, len(x), num_tokens)]
        blocks.append(rng.permuted(src, axis=-1))
    bits = float_to_storage(np.concatenate(blocks, axis=-1), "bfloat16")
    return (bits & 0xFF00) | rng.integers(0, 256, bits.shape, dtype=np.uint16)


def make_samples(aux: np.ndarray, final: np.ndarray) -> list[SampleRecord]:
    """Samples of SEQ_LEN tokens (bf16 bits already in storage form)."""
    rng, out = np.random.default_rng(1), []
    for i in range(len(aux) // SEQ_LEN):
        rows = slice(i * SEQ_LEN, (i + 1) * SEQ_LEN)
        out.append(SampleRecord(
            sample_id=i, source_row=i, source_hash=hashlib.sha256(str(i).encode()).hexdigest(),
            split="train", input_ids=rng.integers(0, 1024, SEQ_LEN).astype(np.int32),
            loss_mask=(np.arange(SEQ_LEN) > 300).astype(np.uint8),
            aux_hidden=aux[rows], final_hidden=final[rows]))
    return out


def write_cache(uri: str, samples: list[SampleRecord], spec: CacheSpec) -> float:
    """Seconds to write every unit of 8 samples and finalize."""
    from cache_helpers import make_run_header

    start = time.perf_counter()
    writer = CacheWriter.open(uri, spec=spec, header=make_run_header(spec))
    units = len(samples) // 8
    for u in range(units):
        writer.write_unit(u, samples[u * 8:(u + 1) * 8], UnitAccounting(input_rows=8, written=8))
    finalize_cache(uri, expected_units=units)
    return time.perf_counter() - start


def cache_spec(samples: list[SampleRecord], **kw: Any) -> CacheSpec:
    """The bench's spec for these samples (units of 8 rows)."""
    h, f = samples[0].final_hidden.shape[-1], samples[0].aux_hidden.shape[1]
    return CacheSpec(hidden_size=h, num_aux_layers=f, hidden_dtype="bfloat16",
                     max_seq_len=SEQ_LEN, rows_per_unit=8, **kw)


def read_all(uri: str, *, verify: bool, features: tuple[int, ...] | None = None) -> float:
    """Seconds to read every unit, as the trainer does."""
    reader = open_cache(uri, verify=verify, features=features)
    start = time.perf_counter()
    for unit in reader.unit_ids().tolist():
        reader.read_unit(unit)
    return time.perf_counter() - start


def bench_cache(root: Path, samples: list[SampleRecord], aux_codec: str) -> dict[str, float]:
    """Write (units + finalize) and sequential read of the cache, without and with crc32c."""
    uri = str(root / f"cache-{aux_codec}")
    write_s = write_cache(uri, samples, cache_spec(samples, aux_codec=aux_codec))
    read = {verify: read_all(uri, verify=verify) for verify in (False, True)}
    s = summarize_cache(uri)
    return {"write_s": write_s, "read_s": read[False], "read_verify_s": read[True],
            "ratio": s["compression_ratio"], "stored": s["data_bytes"]}


def bench_layout(root: Path, samples: list[SampleRecord], version: int,
                 repeats: int = 3) -> dict[str, float]:
    """A lossless cache in format ``version``: write, aux ratio, reads and the bytes they take.

    Reads (best of ``repeats``): all layers without and with crc32c, and a draft reading 1 of
    F layers (crc32c on, the trainer's default). Bytes count every get() from the zarr store.
    """
    from cache_helpers import counting_reads

    uri = str(root / f"layout-v{version}")
    write_s = write_cache(uri, samples, cache_spec(samples, format_version=version))
    aux = [a for name, a in summarize_cache(uri)["arrays"].items()
           if name.partition(".")[0] == "aux_hidden"]
    out: dict[str, float] = {"write_s": write_s,
                             "ratio": (sum(a["logical_bytes"] for a in aux)
                                       / sum(a["stored_bytes"] for a in aux))}
    runs = {"full": {"verify": False}, "full_crc": {"verify": True},
            "subset": {"verify": True, "features": (0,)}}
    for _ in range(repeats):
        for name, kw in runs.items():
            with counting_reads() as stores:
                elapsed = read_all(uri, **kw)  # type: ignore[arg-type]
            out[f"{name}_s"] = min(out.get(f"{name}_s", elapsed), elapsed)
            out[f"{name}_bytes"] = sum(st.bytes_read for st in stores)
            out[f"{name}_aux_bytes"] = sum(n for st in stores for array, n in
                                           st.bytes_by_array.items()
                                           if array.partition(".")[0] == "aux_hidden")
    return out


def bench_memmap(root: Path, samples: list[SampleRecord]) -> dict[str, float]:
    """The same arrays as raw files: tofile, then a memmap read that touches every byte."""
    names = ("input_ids", "loss_mask", "aux_hidden", "final_hidden")
    start = time.perf_counter()
    for name in names:
        np.concatenate([getattr(s, name) for s in samples]).tofile(root / f"{name}.raw")
    write_s = time.perf_counter() - start
    start = time.perf_counter()
    for name in names:
        mm = np.memmap(root / f"{name}.raw", mode="r", dtype=getattr(samples[0], name).dtype)
        for i in range(0, len(mm), 1 << 24):
            np.array(mm[i:i + (1 << 24)])
    return {"write_s": write_s, "read_s": time.perf_counter() - start}


def bench_finite_check(samples: list[SampleRecord]) -> float:
    """Seconds the producer spends proving every stored hidden value finite."""
    from sparkforge.producer.capture import non_finite_problem

    start = time.perf_counter()
    problems = [non_finite_problem(s, "bfloat16") for s in samples]
    elapsed = time.perf_counter() - start
    assert problems == [None] * len(samples)
    return elapsed


def main() -> int:
    """Run both codecs and print the table and the command to reproduce it."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden_size", type=int, default=2048)
    p.add_argument("--num_tokens", type=int, default=32768)
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # cache_helpers
    with tempfile.TemporaryDirectory() as tmp:
        root, rng = Path(tmp), np.random.default_rng(2)
        aux, final = tiny_activations(root, args.num_tokens)
        n = args.num_tokens // SEQ_LEN * SEQ_LEN
        samples = make_samples(widen(aux, n, args.hidden_size, rng),
                               widen(final, n, args.hidden_size, rng))
        logical = sum(s.aux_hidden.nbytes + s.final_hidden.nbytes + s.input_ids.nbytes
                      + s.loss_mask.nbytes for s in samples) / 1e6
        base = bench_memmap(root, samples)
        rows = [(codec, bench_cache(root, samples, codec)) for codec in ("lossless", "fp8")]
        finite_s = bench_finite_check(samples)
        layouts = [(v, bench_layout(root, samples, v)) for v in (1, 2)]
        shutil.rmtree(root / "target", ignore_errors=True)
    print(f"H={args.hidden_size}, 3 aux layers + final, bf16, {n:,} tokens, "
          f"{logical:.0f} MB logical (bf16 in memory); memmap baseline in the same run:")
    print("ratio: logical bytes of the stored dtypes / stored bytes; vs bf16: bf16 logical / "
          "stored (fp8 codes count as 1 byte in 'ratio')")
    print(f"memmap write {logical / base['write_s']:.0f} MB/s, "
          f"read {logical / base['read_s']:.0f} MB/s (page cache hot)")
    print(f"{'codec':<9} {'ratio':>6} {'vs bf16':>8} {'B/tok':>7} {'write MB/s':>11} "
          f"{'vs memmap':>10} "
          f"{'read MB/s':>10} {'vs memmap':>10} {'read+crc MB/s':>14} {'ktok/s read':>12}")
    for codec, r in rows:
        print(f"{codec:<9} {r['ratio']:>6.3f} {logical * 1e6 / r['stored']:>8.3f} "
              f"{r['stored'] / n:>7.0f} "
              f"{logical / r['write_s']:>11.0f} {base['write_s'] / r['write_s']:>10.3f} "
              f"{logical / r['read_s']:>10.0f} {base['read_s'] / r['read_s']:>10.3f} "
              f"{logical / r['read_verify_s']:>14.0f} {n / r['read_s'] / 1e3:>12.1f}")
    print(f"NaN/inf check before commit: {logical / finite_s:.0f} MB/s, "
          f"{finite_s / rows[0][1]['write_s']:.1%} of the lossless write time")
    f = samples[0].aux_hidden.shape[1]
    mb = sum(s.aux_hidden.nbytes + s.final_hidden.nbytes for s in samples) / 1e6
    print(f"\naux_hidden layout (lossless bf16, {f} layers, shards of 8192 rows; reads go "
          f"through open_cache, best of 3; MB/s over {mb:.0f} MB of aux + final hidden; "
          f"'1 of {f}' reads one layer with crc32c; MB read counts every zarr store get()):")
    print(f"{'format':<24} {'aux ratio':>9} {'write MB/s':>10} {'full MB/s':>9} "
          f"{'full+crc MB/s':>13} {f'1 of {f} s':>8} {'aux MB read: full':>17} "
          f"{f'1 of {f}':>7} {'all MB read: full':>17} {f'1 of {f}':>7}")
    names = {1: "1: (c, F, H) chunks", 2: "2: one array per layer"}
    for v, r in layouts:
        print(f"{names[v]:<24} {r['ratio']:>9.3f} {mb / r['write_s']:>10.0f} "
              f"{mb / r['full_s']:>9.0f} {mb / r['full_crc_s']:>13.0f} {r['subset_s']:>8.3f} "
              f"{r['full_crc_aux_bytes'] / 1e6:>17.1f} {r['subset_aux_bytes'] / 1e6:>7.1f} "
              f"{r['full_crc_bytes'] / 1e6:>17.1f} {r['subset_bytes'] / 1e6:>7.1f}")
    old, new = layouts[0][1], layouts[1][1]
    print(f"format 2 / format 1: write {old['write_s'] / new['write_s']:.2f}x, full read "
          f"{old['full_s'] / new['full_s']:.2f}x, "
          f"full+crc {old['full_crc_s'] / new['full_crc_s']:.2f}x, "
          f"1-of-{f} read {old['subset_s'] / new['subset_s']:.2f}x faster, "
          f"{new['subset_aux_bytes'] / old['subset_aux_bytes']:.2f}x the aux bytes")
    print("reproduce: .venv/bin/python benchmarks/bench_cache.py "
          f"--hidden_size {args.hidden_size} --num_tokens {args.num_tokens}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
