"""Capture of long samples: producer peak memory and tokens/s at 2K / 8K / 32K tokens per sample.

Each (backend, length) case runs ``sparkforge produce`` as its own process on a tiny Qwen3
target (H=256, 4 layers, fp32, 40,960 positions) over pre-tokenized rows of that length
(``--rows`` of them, the same token count at every length), features 0, 1, 2 and the final
state in bf16. The benchmark samples the resident memory of the producer's whole process tree
(the vLLM engine's processes included) every 0.2 s and reports its peak over the run, and the
capture's own tokens/s from the produce summary, each with its ratio to the shortest length of
the same backend in the same run (the baseline: a capture whose memory is bounded by a chunk
keeps the RSS ratio near 1 while the sample grows 16x). vLLM runs with chunked prefill
(``max_num_batched_tokens`` 2048, so a 32K sample is prefilled in 16 steps). A sample longer
than a shard spans several; each case sets ``shard_rows = max(4096, length)`` (one shard per
sample) unless ``--shard_rows`` lists sizes, which runs each (backend, length) once per size,
e.g. ``--lengths 32768 --shard_rows 32768 4096``: the ratio column then compares the writer
holding one 4K-row slot per array with one 32K-row slot. The engine's ``max_model_len`` is one
more than the sample (vLLM refuses a prompt that leaves no room for the one token a capture
asks for). The engine's KV-cache space (``VLLM_CPU_KVCACHE_SPACE`` GiB, 1 unless set) must hold
a sample's hidden-state blocks besides its attention KV: T x 4 x H x 4 bytes, 512 MiB at 32K
tokens and ``--hidden_size 1024`` (run that with ``VLLM_CPU_KVCACHE_SPACE=2``).

``--old REV`` runs every case once more on revision REV's code (its tree on PYTHONPATH), right
after this code's, so one run compares them: e.g. the producer before HF chunks streamed to the
writer. ``--hf_batch_tokens`` is passed to this code only (the HF backend's tokens per forward,
and the chunk length of a longer sample).

Reproduce (about 15 minutes on 2 shared cores):
    nice -n 10 .venv/bin/python -P benchmarks/bench_long_capture.py
    nice -n 10 .venv/bin/python -P benchmarks/bench_long_capture.py --backends hf --old 55941c2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

LENGTHS = (2048, 8192, 32768)
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_scale_read (old_code)


def _tree_rss(proc: psutil.Process) -> int:
    """Resident bytes of a process and its descendants (0 for those already gone)."""
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            continue
    return total


def _target(root: Path, hidden_size: int) -> Path:
    """The tiny target at 40,960 positions; ``hidden_size`` other than 256 widens its residual
    stream (and its MLP to 2 x 256) but keeps its attention (8 heads of 32, 4 KV heads), so the
    captured features grow with H while the forward's attention cost stays that of H=256."""
    from sparkforge.app.tiny_target import build_tiny_target

    out = build_tiny_target(root / "target", hidden_size=256, head_dim=32)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = 40_960
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if hidden_size != 256:
        import torch
        from transformers import AutoConfig, Qwen3ForCausalLM

        wide = AutoConfig.from_pretrained(str(out))
        wide.hidden_size = hidden_size
        torch.manual_seed(0)
        Qwen3ForCausalLM(wide).save_pretrained(str(out))
    return out


def _rows(path: Path, length: int, num: int, vocab: int = 1024) -> Path:
    """``num`` pre-tokenized rows of ``length`` tokens: a 64-token prompt, the rest supervised."""
    import numpy as np

    rng = np.random.default_rng(length)
    with path.open("w") as f:
        for _ in range(num):
            ids = rng.integers(8, vocab, length).tolist()
            f.write(json.dumps({"input_ids": ids,
                                "loss_mask": [0] * 64 + [1] * (length - 64)}) + "\n")
    return path


def _case(root: Path, target: Path, backend: str, length: int, tokens: int,
          shard_rows: int, *, code: Path | None, extra: list[str]) -> dict[str, float]:
    """One produce run; ``code``: a folder to put first on PYTHONPATH (another revision)."""
    num = max(1, tokens // length)
    data = _rows(root / f"rows_{length}.jsonl", length, num)
    out = root / f"cache_{backend}_{length}_{shard_rows}_{'old' if code else 'new'}"
    cmd = [sys.executable, "-P", "-m", "sparkforge.app.cli", "produce", "--data", str(data),
           "--output", str(out), "--backend", backend, "--engine.model", str(target),
           "--engine.dtype", "float32", "--engine.max_model_len", str(length + 1),
           "--engine.max_num_batched_tokens", "2048", "--engine.enforce_eager", "true",
           "--layer_ids", "[0,1,2]", "--max_seq_len", str(length),
           "--shard_rows", str(shard_rows), "--rows_per_unit", "1",
           "--parity_samples", "0", "--scratch_dir", str(root / "scratch"),
           "--progress", "false", *extra]
    env = dict(os.environ)
    if code is not None:
        env["PYTHONPATH"] = f"{code}{os.pathsep}{env.get('PYTHONPATH', '')}"
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    watched, peak, done = psutil.Process(proc.pid), [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            peak[0] = max(peak[0], _tree_rss(watched))

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    text, _ = proc.communicate()
    done.set()
    thread.join()
    if proc.returncode:
        raise SystemExit(f"{backend} at {length}: produce exited {proc.returncode}\n"
                         f"{text[-3000:]}")
    written = re.search(r"written\s*\|?\s*([\d,]+)", text)
    rate = re.search(r"throughput\s*\|?\s*([\d,]+) tokens/s", text)
    if not (written and rate) or int(written.group(1).replace(",", "")) != num:
        raise SystemExit(f"{backend} at {length}: not all {num} samples written\n{text[-3000:]}")
    return {"samples": num, "peak_mib": peak[0] / 2**20,
            "tokens_per_s": float(rate.group(1).replace(",", ""))}


def main() -> None:
    """Measure every case and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=65_536, help="tokens per case")
    parser.add_argument("--backends", nargs="+", default=["hf", "vllm"])
    parser.add_argument("--lengths", nargs="+", type=int, default=list(LENGTHS),
                        help="tokens per sample; the first is each backend's baseline")
    parser.add_argument("--shard_rows", nargs="+", type=int, default=None,
                        help="rows per shard, each run per length (default: max(4096, length))")
    parser.add_argument("--hf_batch_tokens", type=int, default=None,
                        help="this code's --hf_batch_tokens (default: the producer's)")
    parser.add_argument("--old", help="also run every case on this git revision's code")
    parser.add_argument("--hidden_size", type=int, default=256,
                        help="the target's H (attention stays 8 x 32 heads)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    extra = ([] if args.hf_batch_tokens is None else
             ["--hf_batch_tokens", str(args.hf_batch_tokens)])
    with tempfile.TemporaryDirectory(prefix="bench-long-capture-") as tmp:
        root = Path(tmp)
        target = _target(root, args.hidden_size)
        codes: list[tuple[str, Path | None]] = [("this", None)]
        if args.old:
            from bench_scale_read import old_code

            codes.append((args.old, old_code(args.old, root / "old")))
        print("| backend | code | tokens per sample | shard_rows | samples | peak RSS of the "
              "producer tree (MiB) | RSS / first | capture tokens/s | tokens/s / first |")
        print("|---|---|---|---|---|---|---|---|---|")
        for backend in args.backends:
            base: dict[str, float] = {}
            for length in args.lengths:
                for shard_rows in args.shard_rows or [max(4096, length)]:
                    for name, code in codes:
                        start = time.perf_counter()
                        r = _case(root, target, backend, length, args.tokens, shard_rows,
                                  code=code, extra=[] if code else extra)
                        base = base or r
                        print(f"| {backend} | {name} | {length} | {shard_rows} | "
                              f"{r['samples']:.0f} | {r['peak_mib']:.0f} | "
                              f"{r['peak_mib'] / base['peak_mib']:.2f} | "
                              f"{r['tokens_per_s']:.0f} | "
                              f"{r['tokens_per_s'] / base['tokens_per_s']:.2f} |"
                              f"  <!-- {time.perf_counter() - start:.0f} s -->", flush=True)
    shards = f" --shard_rows {' '.join(map(str, args.shard_rows))}" if args.shard_rows else ""
    old = f" --old {args.old}" if args.old else ""
    chunk = f" --hf_batch_tokens {args.hf_batch_tokens}" if args.hf_batch_tokens else ""
    chunk += f" --hidden_size {args.hidden_size}" if args.hidden_size != 256 else ""
    print(f"\nreproduce: nice -n 10 .venv/bin/python -P benchmarks/bench_long_capture.py "
          f"--tokens {args.tokens} --backends {' '.join(args.backends)} "
          f"--lengths {' '.join(map(str, args.lengths))}{shards}{chunk}{old}")


if __name__ == "__main__":
    main()
