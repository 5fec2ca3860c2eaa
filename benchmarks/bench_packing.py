"""Packed rows against bucketed rows: kept anchors, tokens per row, supervised slots per second.

Chat-like sample lengths (log-normal, mean 550 tokens, capped at 4096, half of each sample
supervised) are planned into micro-batches exactly as a training run does (``data_plan``, epoch
0), collated by the trainer's ``collate`` from synthetic cached samples, and trained (forward,
loss, backward, AdamW) by a narrow DSpark draft with the production recipe's shape (5 layers,
K=7, 512 anchors, Qwen3-8B's MLP width and vocabulary). ``--scale s`` divides the lengths, the
row length, the anchors, the MLP width and the vocabulary by s, which keeps every ratio (anchors
per supervised token, samples per row, the cost shares of a block query) and fits a CPU;
``--scale 1`` is the production shape. Both batchings step in turn in one process, so the ratio
is against a baseline of the same run.

Goals (issue 21): kept-anchor ratio >= 0.95 packed, >= 2x supervised slots per second.

Run: ``.venv/bin/python -P benchmarks/bench_packing.py [--scale 8 --steps 20 --threads 2]``

``--quality OUT_DIR`` instead trains the shipped code target's draft
(``trainer/examples/code_target.yaml``) on the bf16 cache of an earlier
``benchmarks/bench_quality.py`` run in OUT_DIR, bucketed as it ships (4 rows of one sample, 32
anchors each) and packed (2 rows of up to 512 tokens, 64 anchors each: the same 128 anchor slots
per step), for the same steps and seeds, and compares the teacher-forced tau of the eval split
at the same number of supervised slots.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sparkforge.shared.dtypes import float_to_storage
from sparkforge.shared.reader import CachedSample
from sparkforge.trainer.anchor_budget import chat_like_index
from sparkforge.trainer.architectures import build_draft
from sparkforge.trainer.architectures.config import DraftConfig
from sparkforge.trainer.architectures.tiny import draft_tiny
from sparkforge.trainer.data import collate
from sparkforge.trainer.data_plan import Batching, SplitIndex, plan_epoch
from sparkforge.trainer.loss import compute_dspark_loss
from sparkforge.trainer.run_config import LossSpec


def draft(scale: int) -> DraftConfig:
    """A narrow draft (H=64) with the Qwen3-8B recipe's per-slot cost mix, scaled by 1/scale.

    A block query's cost is about H * (layers * (4H + 3I + 2P) + V) for P attended keys, MLP
    width I and vocabulary V; dividing P, I and V by the same scale keeps the shares of the MLP,
    the attention and the head, which decide what a longer packed row costs. 5 layers, K=7,
    512 anchors, Markov rank 256 (all but K divided by the scale).
    """
    return dataclasses.replace(
        draft_tiny(vocab_size=151_936 // scale), num_hidden_layers=5,
        intermediate_size=12_288 // scale, block_size=7, num_anchors=512 // scale,
        markov_rank=256 // scale)


def sample(sample_id: int, length: int, cfg: DraftConfig,
           rng: np.random.Generator) -> CachedSample:
    """A cached sample: the first half prompt (loss 0), the second half supervised."""
    mask = np.zeros(length, dtype=np.uint8)
    mask[length - max(length // 2, 1):] = 1
    feats = rng.standard_normal((length, cfg.num_features, cfg.hidden_size), dtype=np.float32)
    final = rng.standard_normal((length, cfg.hidden_size), dtype=np.float32)
    return CachedSample(sample_id=sample_id, split="train",
                        input_ids=rng.integers(0, cfg.vocab_size, length).astype(np.int32),
                        loss_mask=mask, aux_hidden=float_to_storage(feats, "bfloat16"),
                        final_hidden=float_to_storage(final, "bfloat16"), topk_ids=None,
                        topk_logprobs=None)


def batches(index: SplitIndex, batching: Batching, *, batch_size: int, row_tokens: int,
            count: int, cfg: DraftConfig) -> list[dict[str, torch.Tensor]]:
    """The first ``count`` micro-batches of epoch 0, collated."""
    plan = plan_epoch(index, seed=0, epoch=0, num_shares=1, share=0, batch_size=batch_size,
                      batching=batching, shuffle_buffer=512, row_tokens=row_tokens)
    rng = np.random.default_rng(1)
    out = []
    for i, positions in enumerate(plan.batches[:count]):
        ids = index.sample_id[positions].tolist()
        samples = [sample(s, int(index.length[p]), cfg, rng) for s, p in zip(ids, positions,
                                                                              strict=True)]
        out.append(collate(samples, ids, None if plan.rows is None else plan.rows[i]))
    return out


def step(model: torch.nn.Module, opt: torch.optim.Optimizer,
         batch: dict[str, torch.Tensor], gen: torch.Generator) -> dict[str, float]:
    """One training step; its time, kept anchors, supervised slots and real tokens."""
    start = time.perf_counter()
    hidden = {k: batch[k].float() for k in ("target_hidden_states", "target_last_hidden_states")}
    out = model(batch | hidden, generator=gen)
    res = compute_dspark_loss(out, LossSpec())
    res.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return {"s": time.perf_counter() - start, "kept": float(out.block_keep_mask.sum()),
            "slots": float(out.block_keep_mask.numel()), "supervised": float(out.eval_mask.sum()),
            "tokens": float(batch["attention_mask"].sum()),
            "rows": float(batch["input_ids"].shape[0]),
            "row_len": float(batch["input_ids"].numel())}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Step bucketed and packed batches in turn; sums per batching."""
    torch.set_num_threads(args.threads)
    cfg = draft(args.scale)
    row_tokens = 4096 // args.scale
    index = chat_like_index(4000, mean_len=550 / args.scale, max_len=row_tokens,
                            loss_fraction=0.5)
    sets = {"bucket": batches(index, "bucket", batch_size=args.bucket_batch,
                              row_tokens=row_tokens, count=args.steps + 1, cfg=cfg),
            "pack": batches(index, "pack", batch_size=1, row_tokens=row_tokens,
                            count=args.steps + 1, cfg=cfg)}
    models, opts = {}, {}
    for name in sets:
        torch.manual_seed(0)
        models[name] = build_draft(cfg, attn_implementation="sdpa")
        opts[name] = torch.optim.AdamW([p for p in models[name].parameters()
                                        if p.requires_grad], lr=1e-3)
    sums: dict[str, dict[str, float]] = {name: {} for name in sets}
    gen = torch.Generator().manual_seed(0)
    for i in range(args.steps + 1):
        for name, batch_list in sets.items():
            got = step(models[name], opts[name], batch_list[i], gen)
            if i == 0:
                continue  # warm-up step
            for key, value in got.items():
                sums[name][key] = sums[name].get(key, 0.0) + value
    result: dict[str, Any] = {"scale": args.scale, "num_anchors": cfg.num_anchors,
                              "block_size": cfg.block_size, "row_tokens": row_tokens,
                              "bucket_batch": args.bucket_batch, "steps": args.steps}
    for name, s in sums.items():
        result[name] = {"kept_anchor_ratio": s["kept"] / s["slots"],
                        "tokens_per_row": s["tokens"] / s["rows"],
                        "fill_ratio": s["tokens"] / s["row_len"],
                        "supervised_slots_per_s": s["supervised"] / s["s"],
                        "step_s": s["s"] / args.steps}
    result["speedup"] = (result["pack"]["supervised_slots_per_s"]
                         / result["bucket"]["supervised_slots_per_s"])
    return result


def table(result: dict[str, Any]) -> str:
    """The markdown table of one run."""
    lines = ["| batching | kept-anchor ratio | real tokens / row | fill | supervised slots/s | "
             "step s |", "|---|---|---|---|---|---|"]
    for name in ("bucket", "pack"):
        r = result[name]
        lines.append(f"| {name} | {r['kept_anchor_ratio']:.2f} | {r['tokens_per_row']:,.0f} | "
                     f"{r['fill_ratio']:.2f} | {r['supervised_slots_per_s']:,.0f} | "
                     f"{r['step_s']:.3f} |")
    lines.append(f"\npacked / bucketed supervised slots per second: {result['speedup']:.2f}x")
    return "\n".join(lines)


REPO = Path(__file__).resolve().parent.parent
QUALITY_RUNS = {"bucket": [], "pack": ["--data.batching", "pack", "--data.batch_size", "2",
                                       "--model.draft.num_anchors", "64"]}


def train_code_target(out: Path, name: str, seed: int, steps: int) -> list[dict[str, float]]:
    """One ``sparkforge train`` of the code target's draft; its validations by step.

    Each row: step, teacher-forced tau of the eval split and the supervised slots trained so far.
    """
    run_dir = out / "packing" / f"{name}_seed{seed}"
    if not (run_dir / "done").is_file():
        subprocess.run([sys.executable, "-P", "-m", "sparkforge.app.cli", "train", "--config",
                        str(REPO / "trainer" / "examples" / "code_target.yaml"),
                        "--data.uri", str(out / "cache"), "--trainer.max_steps", str(steps),
                        "--trainer.val_check_interval", str(steps // 3),
                        "--trainer.check_val_every_n_epoch", "null",
                        "--trainer.log_every_n_steps", "1",
                        "--seed_everything", str(seed), "--model.seed", str(seed),
                        "--data.seed", str(seed), "--checkpoint.dirpath", str(run_dir / "ckpt"),
                        "--trainer.logger.init_args.save_dir", str(run_dir),
                        *QUALITY_RUNS[name]], check=True)
        (run_dir / "done").write_text("")
    slots, rows = 0.0, []
    with next(run_dir.rglob("metrics.csv")).open() as f:
        for row in csv.DictReader(f):
            if row.get("train/supervised_slots"):
                slots += float(row["train/supervised_slots"])
            if row.get("val/tau"):
                rows.append({"step": float(row["step"]), "val_tau": float(row["val/tau"]),
                             "supervised_slots": slots})
    return rows


def quality(out: Path, steps: int, seeds: list[int]) -> dict[str, Any]:
    """Bucketed and packed code-target drafts: teacher-forced tau by supervised slots."""
    if not (out / "cache" / "manifest.json").is_file():
        raise SystemExit(f"--quality needs the bf16 cache of a bench_quality.py run in {out}")
    runs = {f"{name}_seed{seed}": train_code_target(out, name, seed, steps)
            for seed in seeds for name in QUALITY_RUNS}
    print("| run | " + " | ".join(f"step {int(v['step'])}" for v in next(iter(runs.values())))
          + " |\n|---|" + "---|" * len(next(iter(runs.values()))))
    for name, rows in runs.items():
        print(f"| {name} | " + " | ".join(f"tau {v['val_tau']:.3f} at {v['supervised_slots']:,.0f}"
                                          " slots" for v in rows) + " |")
    return {"steps": steps, "seeds": seeds, "runs": runs}


def main(argv: list[str]) -> int:
    """Parse, run, print the table, the JSON and the command."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=int, default=8,
                   help="divide lengths, row length and anchors by this (1 = production)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per batching")
    p.add_argument("--bucket_batch", type=int, default=1,
                   help="samples per bucketed micro-batch (the production configs use 1)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--quality", type=Path, metavar="OUT_DIR",
                   help="instead: bucketed vs packed code-target drafts (see above)")
    p.add_argument("--quality_steps", type=int, default=150)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = p.parse_args(argv)
    if args.quality:
        result = quality(args.quality, args.quality_steps, args.seeds)
    else:
        result = run(args)
        print(table(result))
    print(json.dumps(result, indent=1))
    print("reproduce: .venv/bin/python -P benchmarks/bench_packing.py "
          + shlex.join(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
