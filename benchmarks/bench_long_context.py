"""One training step of a tiny draft at 2K / 8K / 32K tokens per row: peak memory and step time.

Each (context, attention) case runs in a fresh interpreter: one warm-up step, then one measured
step (forward, DSpark loss, backward) of a one-row batch with the production recipe's anchors
(512 blocks of 7), printing the step's extra peak RSS over the built model and batch, its wall
time and its CPU time. ``dense`` is one SDPA mask over the row's whole ``[A*K, S + A*K]`` grid
(the trainer's SDPA path before anchor chunking, forced here by lifting the chunk limit);
``chunked`` is the default SDPA path, chunked over anchors above 4M query-key pairs per row.
The dense 32K case is run only with ``--dense_32k`` (it needs several GB).

The second table is the arithmetic on paper (``paper_gib``) for a Qwen3-8B-sized draft (H=4096,
5 layers, 32 heads of 128, 8 KV heads, 5 features, bf16, the same anchors) at 32K and 128K
tokens: what grows with the context, and what each attention path adds.

Reproduce: .venv/bin/python -P benchmarks/bench_long_context.py [--dense_32k]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

GIB = 1 << 30
SEQ_LENS = (2048, 8192, 32768)


def _vm_kib(field: str) -> int:
    """A ``/proc/self/status`` memory field of this process, in KiB (Linux)."""
    with open("/proc/self/status") as status:  # noqa: PTH123
        return int(next(x for x in status if x.startswith(field + ":")).split()[1])


def _case(seq_len: int, attention: str) -> dict[str, float]:
    """Child process: build the draft and a row, warm up, then measure one step."""
    import dataclasses

    import torch

    from sparkforge.trainer.architectures.config import DraftConfig
    from sparkforge.trainer.architectures.qwen3.model import Qwen3DraftModel
    from sparkforge.trainer.draft import anchor_chunks
    from sparkforge.trainer.loss import compute_dspark_loss
    from sparkforge.trainer.run_config import LossSpec

    if attention == "dense":
        anchor_chunks.DENSE_GRID_LIMIT = 1 << 62
    cfg = DraftConfig(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        intermediate_size=256, vocab_size=1024, num_hidden_layers=1, num_target_layers=8,
        target_layer_ids=(1, 3, 5), block_size=7, num_anchors=512, markov_rank=32,
        mask_token_id=3, max_position_embeddings=seq_len,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(0)
    model = Qwen3DraftModel(dataclasses.replace(cfg))
    h, f = cfg.hidden_size, cfg.num_features
    batch = {"input_ids": torch.randint(0, cfg.vocab_size, (1, seq_len)),
             "loss_mask": (torch.arange(seq_len) >= seq_len // 4).float()[None],
             "target_hidden_states": torch.randn(1, seq_len, f * h),
             "target_last_hidden_states": torch.randn(1, seq_len, h)}

    def step() -> None:
        model.zero_grad(set_to_none=False)
        compute_dspark_loss(model(batch), LossSpec()).loss.backward()

    step()  # warm-up: thread pools, lazy imports, gradient buffers
    with open("/proc/self/clear_refs", "w") as refs:  # noqa: PTH123 - reset VmHWM to VmRSS
        refs.write("5")
    base = _vm_kib("VmRSS")
    wall, cpu = time.perf_counter(), time.process_time()
    step()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"peak_mib": (_vm_kib("VmHWM") - base) / 1024, "wall_s": wall, "cpu_s": cpu}


def _run(seq_len: int, attention: str) -> dict[str, float]:
    # Small mmap threshold: each tensor is its own mapping, returned on free, so the peak RSS
    # follows live tensor memory rather than glibc's arena reuse.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "1"}
    out = subprocess.run([sys.executable, "-P", __file__, "--case", str(seq_len), attention],
                         capture_output=True, text=True, check=True, env=env)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def paper_gib(seq_len: int, *, attention: str, hidden: int = 4096, layers: int = 5,
              heads: int = 32, kv_heads: int = 8, head_dim: int = 128, features: int = 5,
              anchors: int = 512, block: int = 7, chunk_pairs: int = 1 << 22) -> float:
    """GiB one row of ``seq_len`` keeps for one training step of a Qwen3-8B-sized draft (bf16).

    ``context``, linear in S: the inputs (features, final state), the context projection (its
    output, RMSNorm's fp32 copy and output) and per layer the context keys and values kept for
    the backward pass (k_proj out, k_norm's fp32 copy and output, three rotation tensors, v, and
    their concatenation with the blocks: 10 [S, G*D] bf16 tensors). Attention over the grid of
    ``A*K`` queries by ``S + A*K`` keys: ``dense`` keeps the bool mask and its bf16 additive
    copy (what SDPA's flash and memory-efficient kernels read; they keep no scores);
    ``scores`` also keeps per layer the fp32 scores and probabilities of every head (SDPA's math
    kernel, the DeepSeek-V4 sink attention); ``chunked`` keeps one chunk's scores at most;
    ``flex`` keeps the log-sum-exp per query and head (its kernel never forms the grid).
    """
    q = anchors * block
    grid = q * (seq_len + q)
    bf16, fp32 = 2, 4
    per_token = (features + 1) * hidden * bf16 + hidden * (bf16 + fp32 + bf16)
    per_token += layers * kv_heads * head_dim * bf16 * 10
    gib = {
        "context": seq_len * per_token,
        "dense": grid * (1 + bf16),
        "scores": grid * (1 + bf16) + layers * heads * grid * fp32 * 2,
        "chunked": min(chunk_pairs, grid) * (1 + bf16 + heads * fp32 * 2),
        "flex": layers * heads * q * fp32,
    }[attention]
    return gib / GIB


def main() -> None:
    """Measure every case and print both tables."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--case", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--dense_32k", action="store_true", help="also run dense at 32K")
    parser.add_argument("--paper", action="store_true", help="print the paper table only")
    args = parser.parse_args()
    if args.case:
        print(json.dumps(_case(int(args.case[0]), args.case[1])))
        return
    if not args.paper:
        _measure(args.dense_32k)
    _paper_table()
    print(f"\nreproduce: .venv/bin/python -P benchmarks/bench_long_context.py"
          f"{' --dense_32k' if args.dense_32k else ''}{' --paper' if args.paper else ''}")


def _measure(dense_32k: bool) -> None:
    """The measured table, one fresh interpreter per case."""
    print("tiny draft (H=128, 1 layer, 4 heads of 32, V=1024), A=512 anchors, K=7, one row")
    print("| context | attention | peak RSS over model+batch (MiB) | step wall s | step CPU s |")
    print("|---|---|---|---|---|")
    for seq_len in SEQ_LENS:
        for attention in ("dense", "chunked"):
            if attention == "dense" and seq_len > 8192 and not dense_32k:
                continue
            r = _run(seq_len, attention)
            print(f"| {seq_len} | {attention} | {r['peak_mib']:.0f} | {r['wall_s']:.2f} | "
                  f"{r['cpu_s']:.2f} |", flush=True)


def _paper_table() -> None:
    """``paper_gib`` for every column at 32K and 128K tokens."""
    print("\nQwen3-8B-sized draft on paper, GiB per row (paper_gib)")
    kinds = ("context", "dense", "scores", "chunked", "flex")
    print("| tokens | linear in S | dense mask | dense scores | chunked | flex |")
    print("|---|" + "---|" * len(kinds))
    for seq_len in (32_768, 131_072):
        cells = " | ".join(f"{paper_gib(seq_len, attention=a):.2f}" for a in kinds)
        print(f"| {seq_len} | {cells} |")

if __name__ == "__main__":
    main()
