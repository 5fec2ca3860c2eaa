"""Draft training throughput on CPU and the chunked-L1 loss's peak memory as the vocabulary grows.

Part 1: forward+backward context tokens/s of a Qwen3-0.6B-shaped 2-layer draft (DSpark loss) and,
as the baseline in the same run, the DFlash-style ablation (no Markov, no confidence, CE only).
Part 2: extra peak RSS of the loss (CE + L1, forward+backward) over fixed bf16 logits, chunked
(128 rows, checkpointed) vs the unchunked computation, each case in a fresh subprocess.

Reproduce: .venv/bin/python -P benchmarks/bench_draft.py
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F  # noqa: N812

from sparkforge.trainer.architectures.config import DraftConfig
from sparkforge.trainer.architectures.qwen3.model import Qwen3DraftModel
from sparkforge.trainer.architectures.qwen3.tiny import draft_qwen3_small
from sparkforge.trainer.loss import chunked_row_terms, compute_dspark_loss, l1_distance
from sparkforge.trainer.run_config import LossSpec


def _throughput(cfg: DraftConfig, seq_len: int, steps: int, device: str = "cpu",
                attn: str = "sdpa", loss: LossSpec = LossSpec()) -> float:  # noqa: B008
    torch.manual_seed(0)
    model = Qwen3DraftModel(cfg, attn_implementation=attn).to(device)
    h, f = cfg.hidden_size, cfg.num_features
    batch = {
        "input_ids": torch.randint(0, cfg.vocab_size, (1, seq_len)),
        "loss_mask": (torch.arange(seq_len) >= seq_len // 4).float()[None],
        "target_hidden_states": torch.randn(1, seq_len, f * h),
        "target_last_hidden_states": torch.randn(1, seq_len, h),
    }
    batch = {k: v.to(device) for k, v in batch.items()}
    cuda = device.startswith("cuda")
    if loss.l1_loss_alpha == 0 and not cfg.enable_confidence_head:
        batch.pop("target_last_hidden_states")
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            value = compute_dspark_loss(model(batch), loss).loss
        value.backward()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return seq_len / (sum(times[1:]) / steps)  # first step is warm-up


def _peak_rss_kib() -> int:
    """VmHWM of this process (Linux)."""
    with open("/proc/self/status") as status:  # noqa: PTH123
        line = next(x for x in status if x.startswith("VmHWM:"))
    return int(line.split()[1])


def _reset_peak_rss_kib() -> int:
    """Reset VmHWM to the current RSS and return it: ru_maxrss would inherit the parent's peak
    across fork+exec, which hid every loss allocation in a first version of this script."""
    with open("/proc/self/clear_refs", "w") as refs:  # noqa: PTH123
        refs.write("5")
    return _peak_rss_kib()


def _loss_terms(mode: str, draft: torch.Tensor, teacher: torch.Tensor, ids: torch.Tensor) -> None:
    if mode == "chunked":
        ce, l1 = chunked_row_terms(draft, teacher, ids, 128)
        assert l1 is not None
    else:
        ce = F.cross_entropy(draft.float(), ids, reduction="none")
        l1 = l1_distance(draft, teacher)
    (ce + l1).sum().backward()


def _mem_case(mode: str, vocab: int, rows: int) -> None:
    """Child process: print the loss's extra peak RSS (MiB) over the already-allocated inputs."""
    torch.manual_seed(0)
    # Warm-up on a tiny input: lazy imports (checkpoint pulls in more of torch) and thread pools
    # must not count as loss memory.
    tiny = torch.randn(4, 8, requires_grad=True)
    _loss_terms(mode, tiny, torch.randn(4, 8), torch.zeros(4, dtype=torch.long))
    draft = torch.randn(rows, vocab, dtype=torch.bfloat16, requires_grad=True)
    teacher = torch.randn(rows, vocab, dtype=torch.bfloat16)
    ids = torch.randint(0, vocab, (rows,))
    draft.grad = torch.zeros_like(draft)  # the gradient buffer is part of the inputs
    base = _reset_peak_rss_kib()
    _loss_terms(mode, draft, teacher, ids)
    peak = _peak_rss_kib()
    print(f"{(peak - base) / 1024:.1f}")


def _run_mem(mode: str, vocab: int, rows: int) -> float:
    # Small mmap threshold: every tensor is its own mapping, returned on free, so the peak RSS
    # tracks live tensor memory instead of glibc arena reuse.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "1"}
    out = subprocess.run([sys.executable, "-P", __file__, "--mem-case", mode, str(vocab),
                          str(rows)], capture_output=True, text=True, check=True, env=env)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    """Run both parts and print the tables."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--num-anchors", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--mem-cases", nargs="*", default=[
        "8192x512", "32768x512", "131072x512", "131072x256", "131072x1024", "131072x2048"],
        help="VOCABxROWS loss-memory cases")
    parser.add_argument("--mem-case", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (bf16 autocast on cuda)")
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "flex"],
                        help="draft attention (flex needs CUDA for its backward)")
    args = parser.parse_args()
    if args.mem_case:
        _mem_case(args.mem_case[0], int(args.mem_case[1]), int(args.mem_case[2]))
        return
    torch.manual_seed(0)
    dspark = dataclasses.replace(draft_qwen3_small(), num_anchors=args.num_anchors)
    dflash = dataclasses.replace(dspark, markov_rank=0, enable_confidence_head=False,
                                 confidence_head_with_markov=False)
    tps_dspark = _throughput(dspark, args.seq_len, args.steps, args.device, args.attn)
    tps_dflash = _throughput(dflash, args.seq_len, args.steps, args.device, args.attn, LossSpec(
        ce_loss_alpha=1.0, l1_loss_alpha=0.0, confidence_head_alpha=0.0))
    print(f"device={args.device} attn={args.attn} threads={torch.get_num_threads()} H=1024 "
          f"layers=2 V=151936 K=7 A={args.num_anchors} S={args.seq_len}")
    print("| config | fwd+bwd context tokens/s |")
    print("|---|---|")
    print(f"| DSpark (r=256, confidence, CE+L1+BCE) | {tps_dspark:.1f} |")
    print(f"| DFlash ablation (CE only) baseline | {tps_dflash:.1f} |")
    print(f"| ratio DSpark / baseline | {tps_dspark / tps_dflash:.2f} |")
    if args.device.startswith("cuda"):
        print(f"peak GPU memory: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    print("\nCE+L1 loss fwd+bwd: extra peak RSS over the bf16 logits (MiB)")
    print("| vocab | rows | unchunked | chunked (128 rows) | ratio |")
    print("|---|---|---|---|---|")
    for case in args.mem_cases:
        vocab, rows = (int(x) for x in case.split("x"))
        plain, chunk = _run_mem("plain", vocab, rows), _run_mem("chunked", vocab, rows)
        print(f"| {vocab} | {rows} | {plain:.0f} | {chunk:.0f} | {plain / chunk:.1f}x |")
    print(f"\nreproduce: .venv/bin/python -P benchmarks/bench_draft.py --device {args.device} "
          f"--attn {args.attn} --seq-len {args.seq_len} --steps {args.steps} --mem-cases "
          + " ".join(args.mem_cases))


if __name__ == "__main__":
    main()
