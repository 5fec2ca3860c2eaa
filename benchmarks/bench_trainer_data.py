"""Trainer data pipeline benchmark: loader throughput vs raw reads vs what the draft step consumes.

Builds a cache with a chat-like length distribution (lognormal, median ~420 tokens, clipped at
max_seq_len) and random bf16 activations through the real cache writer, then measures:

1. raw bytes: reading every stored object of the cache with fsspec (no decode): the I/O ceiling;
2. raw unit reads: ``CacheReader.read_unit`` over all units in order (decode, no pipeline), with
   and without crc32c verification (the reader's default is on; object-existence, token-range
   and commit-record checks run in both);
3. the training loader (``CacheDataModule`` -> ``ResumableLoader``) with 0 and 2 workers, and
   with crc32c verification (the default of ``data.verify_checksums``): samples/s and tokens/s
   delivered as collated micro-batches. The loader reads every unit once, like the raw reads,
   but delivers only the train split (eval rows share the units), so "vs raw" compares wall
   time for the same unit reads. Both time their second pass (epoch 1): opening the cache and
   starting workers are once per run (per epoch for workers), not per batch;
4. the draft training step (forward + backward + AdamW) at a small realistic config on
   ``--device`` (bf16 autocast on CUDA): tokens/s it consumes, peak GPU memory, and the
   loader/step ratio;
5. padding waste of pad-to-longest, length bucketing and packing on the same lengths;
6. peak RSS of each phase (each runs in its own process).

Run: ``.venv/bin/python -P benchmarks/bench_trainer_data.py [--samples 160 --hidden 512]
[--device cuda]``
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

MAX_SEQ_LEN = 2048


def chat_lengths(n: int, seed: int = 0) -> np.ndarray:
    """Lognormal chat lengths (median ~420, long tail), clipped to [32, MAX_SEQ_LEN]."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(mean=6.05, sigma=0.7, size=n), 32, MAX_SEQ_LEN).astype(int)


def synthetic_header(hidden: int, layers: int, max_seq_len: int) -> Any:
    """A valid run header for a synthetic bf16 cache (layer ids 1..layers, 8-layer target)."""
    from sparkforge.shared.header import RunHeader

    return RunHeader.from_json({
        "producer_config": {"builder": "benchmarks/"},
        "target": {"name_or_path": "synthetic", "revision": None, "content_hash": "ab" * 32,
                   "model_type": "qwen3", "architecture": "Qwen3ForCausalLM",
                   "vocab_size": 32_000, "hidden_size": hidden, "num_hidden_layers": 8,
                   "dtype": "bfloat16", "quantization": None},
        "capture": {"layer_ids": list(range(1, layers + 1)),
                    "layer_id_convention": "hf_hidden_states_index", "final_hidden": "post_norm",
                    "engine": "hf", "engine_version": "bench", "tensor_parallel_size": 1,
                    "expert_parallel": False, "data_parallel_size": 1,
                    "max_seq_len": max_seq_len},
        "tokenizer": {"hash": "cd" * 32, "chat_template_sha256": "ef" * 32},
        "data": {"sources": [{"uri": "memory://bench", "content_hash": "01" * 32}],
                 "eval_fraction": 0.125, "seed": 0},
    })


def build_cache(uri: str, *, samples: int, hidden: int, layers: int) -> None:
    """Write a finalized bf16 cache with ``chat_lengths`` samples (every 8th in the eval split)."""
    import hashlib

    from sparkforge.manifests.finalize import finalize_cache
    from sparkforge.shared.layout import CacheSpec
    from sparkforge.shared.records import SampleRecord, UnitAccounting
    from sparkforge.shared.writer import CacheWriter, float_to_storage

    rows_per_unit = 16
    spec = CacheSpec(hidden_size=hidden, num_aux_layers=layers, hidden_dtype="bfloat16",
                     max_seq_len=MAX_SEQ_LEN, shard_rows=8192, rows_per_unit=rows_per_unit)
    writer = CacheWriter.open(uri, spec=spec, header=synthetic_header(hidden, layers, MAX_SEQ_LEN))
    lengths = chat_lengths(samples)
    rng = np.random.default_rng(1)
    for unit in range(samples // rows_per_unit):
        recs = []
        for row in range(unit * rows_per_unit, (unit + 1) * rows_per_unit):
            t = int(lengths[row])
            prompt = t // 4
            recs.append(SampleRecord(
                sample_id=row, source_row=row,
                source_hash=hashlib.sha256(str(row).encode()).hexdigest(),
                split="eval" if row % 8 == 7 else "train",
                input_ids=rng.integers(0, 32_000, t).astype(np.int32),
                loss_mask=(np.arange(t) >= prompt).astype(np.uint8),
                aux_hidden=float_to_storage(rng.standard_normal((t, layers, hidden), np.float32),
                                            "bfloat16"),
                final_hidden=float_to_storage(rng.standard_normal((t, hidden), np.float32),
                                              "bfloat16")))
        writer.write_unit(unit, recs, UnitAccounting(input_rows=rows_per_unit, written=len(recs)))
    finalize_cache(uri, expected_units=samples // rows_per_unit)


def phase_raw_bytes(uri: str) -> dict[str, float]:
    """Read every stored object once (fsspec, no decode)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(uri)
    files = [f for f in fs.find(root) if "/_" not in f[len(root):]]
    t0 = time.perf_counter()
    total = sum(len(fs.cat_file(f)) for f in files)
    return {"bytes": total, "seconds": time.perf_counter() - t0}


def phase_raw_units(uri: str, verify: bool) -> dict[str, float]:
    """Decode every unit in order with the cache reader (no shuffle, no collation)."""
    from sparkforge.manifests.open import open_cache

    reader = open_cache(uri, verify=verify)
    for _pass in range(2):  # the second pass is timed, as for the loader
        t0 = time.perf_counter()
        samples = tokens = 0
        for unit in reader.unit_ids().tolist():
            for s in reader.read_unit(unit):
                samples += 1
                tokens += int(s.input_ids.shape[0])
    return {"samples": samples, "tokens": tokens, "seconds": time.perf_counter() - t0}


def phase_loader(uri: str, workers: int, batch_size: int, verify: bool) -> dict[str, float]:
    """One epoch of the training loader: collated micro-batches delivered to the step."""
    from sparkforge.trainer.datamodule import CacheDataModule

    dm = CacheDataModule(uri, batch_size=batch_size, num_workers=workers, shuffle_buffer=64,
                         verify_checksums=verify)
    loader = dm.train_dataloader()
    for epoch in range(2):  # the second epoch is timed: reader open and worker start excluded
        loader.set_epoch(epoch)
        t0 = time.perf_counter()
        samples = tokens = 0
        for batch in loader:
            samples += int(batch["sample_ids"].numel())
            tokens += int(batch["attention_mask"].sum())
    return {"samples": samples, "tokens": tokens, "seconds": time.perf_counter() - t0}


def phase_step(uri: str, batch_size: int, steps: int, device: str) -> dict[str, float]:
    """Draft training steps (fwd + bwd + AdamW) on real batches: tokens/s the step consumes."""
    import torch

    from sparkforge.trainer.architectures.config import DraftConfig
    from sparkforge.trainer.architectures.qwen3.model import Qwen3DraftModel
    from sparkforge.trainer.datamodule import CacheDataModule
    from sparkforge.trainer.draft.draft_batch import DraftBatch
    from sparkforge.trainer.loss import compute_dspark_loss
    from sparkforge.trainer.run_config import LossSpec

    dm = CacheDataModule(uri, batch_size=batch_size, num_workers=0, shuffle_buffer=64)
    spec = dm.reader.manifest.storage.spec
    cfg = DraftConfig(
        hidden_size=spec.hidden_size, num_attention_heads=8, num_key_value_heads=4,
        head_dim=spec.hidden_size // 8, intermediate_size=3 * spec.hidden_size,
        vocab_size=32_000, num_hidden_layers=2, num_target_layers=8,
        target_layer_ids=tuple(range(spec.num_aux_layers)), block_size=7, num_anchors=32,
        markov_rank=64, mask_token_id=31_999)
    torch.manual_seed(0)
    model = Qwen3DraftModel(cfg).to(device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=6e-4)
    cuda = device.startswith("cuda")
    batches = []
    for batch in dm.train_dataloader():
        batches.append(batch)
        if len(batches) == steps + 1:
            break
    tokens, t0 = 0, 0.0
    for i, host in enumerate(batches):
        if i == 1:   # the first step warms up allocators and kernels
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        b = {k: v.to(device, non_blocking=True) for k, v in host.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            out = model(DraftBatch(b["input_ids"], b["loss_mask"], b["target_hidden_states"],
                                   b["target_last_hidden_states"],
                                   attention_mask=b["attention_mask"]))
            loss = compute_dspark_loss(out, LossSpec()).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if i >= 1:
            tokens += int(host["attention_mask"].sum())
    if cuda:
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    return {"samples": steps * batch_size, "tokens": tokens, "seconds": time.perf_counter() - t0,
            "peak_gpu_gib": peak}


def waste_table(samples: int) -> list[tuple[str, float]]:
    """Padding waste of each batching mode on the benchmark's length distribution."""
    from sparkforge.trainer.data_plan import SplitIndex, packing_waste, padding_waste, plan_epoch

    lengths = chat_lengths(max(samples, 4096), seed=2)
    index = SplitIndex.from_columns(sample_id=np.arange(lengths.size),
                                    unit=np.arange(lengths.size) // 256, length=lengths)
    rows = []
    for bs in (4, 8, 16):
        for mode in ("pad", "bucket"):
            plan = plan_epoch(index, seed=0, epoch=0, num_shares=1, share=0, batch_size=bs,
                              batching=mode)  # type: ignore[arg-type]
            rows.append((f"{mode} (batch {bs})", padding_waste(plan.batches, index.length)))
    packed = packing_waste(lengths, row_tokens=MAX_SEQ_LEN)
    rows.append((f"pack into {MAX_SEQ_LEN}-token rows (draft: unsupported)", packed))
    return rows


def _child(phase: str, uri: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one phase in a fresh process so its peak RSS is its own."""
    cmd = [sys.executable, "-P", __file__, "--phase", phase, "--uri", uri,
           "--batch_size", str(args.batch_size), "--steps", str(args.steps),
           "--device", args.device]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=160)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--device", default="cpu", help="device of the draft step (cpu, cuda)")
    p.add_argument("--phase", default=None)
    p.add_argument("--uri", default=None)
    args = p.parse_args()
    if args.phase:
        fn = {"raw_bytes": lambda: phase_raw_bytes(args.uri),
              "raw_units": lambda: phase_raw_units(args.uri, verify=False),
              "raw_units_crc": lambda: phase_raw_units(args.uri, verify=True),
              "loader0": lambda: phase_loader(args.uri, 0, args.batch_size, verify=False),
              "loader2": lambda: phase_loader(args.uri, 2, args.batch_size, verify=False),
              "loader0_crc": lambda: phase_loader(args.uri, 0, args.batch_size, verify=True),
              "step": lambda: phase_step(args.uri, args.batch_size, args.steps, args.device)}
        res = fn[args.phase]()
        res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(res))
        return
    with tempfile.TemporaryDirectory() as tmp:
        uri = str(Path(tmp) / "cache")
        t0 = time.perf_counter()
        build_cache(uri, samples=args.samples, hidden=args.hidden, layers=args.layers)
        print(f"built cache: {args.samples} samples, H={args.hidden}, F={args.layers}, "
              f"{time.perf_counter() - t0:.1f}s")
        phases = ("raw_bytes", "raw_units", "raw_units_crc", "loader0", "loader0_crc", "loader2",
                  "step")
        res = {ph: _child(ph, uri, args) for ph in phases}
    bytes_per_token = (args.layers + 1) * args.hidden * 2
    raw_s = res["raw_units"]["seconds"]
    step_tps = res["step"]["tokens"] / res["step"]["seconds"]
    print(f"\n{'phase':<34}{'samples/s':>11}{'ktok/s':>9}{'MB/s':>9}{'vs raw':>8}{'vs step':>9}"
          f"{'peak RSS MB':>13}")
    raw = res["raw_bytes"]
    print(f"{'raw bytes (fsspec, no decode)':<34}{'':>11}{'':>9}"
          f"{raw['bytes'] / raw['seconds'] / 1e6:>9.0f}{'':>8}{'':>9}{raw['peak_rss_mb']:>13.0f}")
    rows = (("raw unit reads (decode)", "raw_units"),
            ("raw unit reads, crc32c verified", "raw_units_crc"),
            ("loader, 0 workers", "loader0"), ("loader, 0 workers, crc32c", "loader0_crc"),
            ("loader, 2 workers", "loader2"),
            (f"draft step ({args.device}, fwd+bwd+AdamW)", "step"))
    for name, key in rows:
        r = res[key]
        tps = r["tokens"] / r["seconds"]
        vs_raw = f"{raw_s / r['seconds']:>8.2f}" if key != "step" else f"{'':>8}"
        print(f"{name:<34}{r['samples'] / r['seconds']:>11.1f}{tps / 1e3:>9.1f}"
              f"{tps * bytes_per_token / 1e6:>9.0f}{vs_raw}{tps / step_tps:>9.1f}"
              f"{r['peak_rss_mb']:>13.0f}")
    if res["step"].get("peak_gpu_gib"):
        print(f"draft step peak GPU memory: {res['step']['peak_gpu_gib']:.2f} GiB")
    print("vs raw: raw unit-read seconds / phase seconds for the same unit reads (the loader "
          "delivers the train split only)")
    print(f"\n{'batching (same lengths)':<50}{'padding waste':>14}")
    for name, waste in waste_table(args.samples):
        print(f"{name:<50}{waste:>13.1%}")
    print("\nreproduce: .venv/bin/python -P benchmarks/bench_trainer_data.py"
          f" --samples {args.samples}"
          f" --hidden {args.hidden} --layers {args.layers} --batch_size {args.batch_size}"
          f" --steps {args.steps} --device {args.device}")


if __name__ == "__main__":
    main()
