"""``sparkforge demo``: the whole pipeline on an embedded tiny target, through the public CLI.

Each stage runs as its own ``sparkforge`` process, exactly as a user would run it on a cluster:
build a tiny Qwen3 target and chat rows offline, regenerate on-policy responses with vLLM, capture
hidden states with vLLM into a cache, validate the cache against the training config, train a
DSpark draft with Lightning, export it in the served format, and measure its acceptance.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

# The producer captures DSpark feature ids [0, 1, 2] (HF hidden_states 1..3) of the 4-layer target.
PRODUCER_YAML = """\
data: {out}/regenerated
output: {out}/cache
engine:
  model: {out}/target
  dtype: float32
  max_model_len: 512
  max_num_seqs: 32
  enforce_eager: true
layer_ids: [0, 1, 2]
hidden_dtype: bfloat16
rows_per_unit: 32
shard_rows: 2048
eval_fraction: 0.125
overlong: truncate
parity_samples: 4
scratch_dir: {out}/scratch
window: 32
"""

TRAIN_YAML = """\
seed_everything: 0
model:
  draft:
    mask_token_id: 3
    hidden_size: 128
    vocab_size: 1024
    num_target_layers: 4
    target_layer_ids: [0, 1, 2]
    num_hidden_layers: 1
    block_size: 4
    num_anchors: 16
    markov_rank: 32
    target_model_type: qwen3
  optimizer:
    class_path: torch.optim.AdamW
    lr: 3.0e-3
    betas: [0.9, 0.95]
  scheduler:
    warmup_steps: 20
    min_lr_ratio: 0.1
  attn_implementation: sdpa
data:
  uri: {out}/cache
  max_seq_len: 512
  batch_size: 4
  num_workers: 0
trainer:
  accelerator: cpu
  devices: 1
  max_steps: {steps}
  log_every_n_steps: 10
  default_root_dir: {out}/train
  logger:
    class_path: lightning.pytorch.loggers.CSVLogger
    init_args:
      save_dir: {out}/train
      name: dspark
  enable_progress_bar: true
"""


def _run(stage: str, args: Sequence[str], timings: dict[str, float]) -> None:
    """Run one ``sparkforge`` stage (or a module) as a subprocess; stop the demo if it fails."""
    print(f"\n=== {stage}: {' '.join(args)}", flush=True)
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-P", *args], check=False)
    timings[stage] = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"demo stopped: stage {stage!r} exited with {result.returncode}")


def _cli(*args: str) -> list[str]:
    return ["-m", "sparkforge.shared.cli", *args]


def _latest_checkpoint(train_dir: Path) -> Path:
    ckpts = sorted(train_dir.rglob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    if not ckpts:
        raise SystemExit(f"demo stopped: training wrote no checkpoint under {train_dir}")
    return ckpts[-1]


def run_demo(out: Path, *, rows: int, train_steps: int) -> dict[str, float]:
    """Run every stage into ``out``; returns seconds per stage."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "producer.yaml").write_text(PRODUCER_YAML.format(out=out))
    (out / "train.yaml").write_text(TRAIN_YAML.format(out=out, steps=train_steps))
    timings: dict[str, float] = {}
    _run("target", ["-m", "sparkforge.producer.tiny_target", str(out / "target"),
                    "--rows", str(rows)], timings)
    _run("regenerate", _cli("regenerate", "--data", str(out / "target" / "chat.jsonl"),
                            "--engine.model", str(out / "target"), "--engine.dtype", "float32",
                            "--engine.max_model_len", "512", "--engine.enforce_eager", "true",
                            "--output", str(out / "regenerated"), "--temperature", "0.0",
                            "--max_tokens", "64"), timings)
    _run("produce", _cli("produce", "--config", str(out / "producer.yaml")), timings)
    _run("validate", _cli("validate", str(out / "cache"), "--deep",
                          "--against", str(out / "train.yaml")), timings)
    _run("inspect", _cli("inspect", str(out / "cache")), timings)
    _run("train", _cli("train", "--config", str(out / "train.yaml")), timings)
    _run("export", _cli("export", str(_latest_checkpoint(out / "train")), str(out / "draft"),
                        "--overwrite", "true"), timings)
    _run("eval", _cli("eval", "--draft", str(out / "draft"), "--target", str(out / "target"),
                      "--cache", str(out / "cache"), "--out_dir", str(out / "eval"),
                      "--num_prompts", "8", "--max_new_tokens", "48", "--temperature", "1.0"),
         timings)
    return timings


def main(argv: Sequence[str] | None = None) -> int:
    """``sparkforge demo [--out_dir DIR] [--rows N] [--train_steps N]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "demo":
        args = args[1:]
    parser = argparse.ArgumentParser(prog="sparkforge demo", description=__doc__)
    parser.add_argument("--out_dir", type=Path, default=Path("demo-out"),
                        help="where every stage writes (default demo-out)")
    parser.add_argument("--rows", type=int, default=128, help="chat rows to build")
    parser.add_argument("--train_steps", type=int, default=300,
                        help="optimizer steps of the train stage (default 300)")
    ns = parser.parse_args(args)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    out = ns.out_dir.resolve()
    timings = run_demo(out, rows=ns.rows, train_steps=ns.train_steps)
    print("\n=== demo summary")
    for stage, seconds in timings.items():
        print(f"  {stage:<11} {seconds:7.1f} s")
    report = json.loads((out / "eval" / "eval_report.json").read_text())
    print(f"  measured tau (T=1, speculative decoding): {report['speculative']['tau']:.3f}")
    teacher_forced_tau = report["teacher_forced"]["metrics"]["tau"]
    print(f"  teacher-forced tau on the eval split:     {teacher_forced_tau:.3f}")
    print(f"  outputs under {out} (cache, train logs, draft, eval/acceptance_by_position.png)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
