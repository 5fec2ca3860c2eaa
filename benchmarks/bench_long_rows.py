"""Long rows on the shipped code target: a draft trained on short rows against one trained on long.

The code target (``sparkforge.app.code_target``) serves 4,096 positions. Two drafts of
``trainer/examples/code_target.yaml`` (one layer, K=7, 32 anchors a row, batch 4, the same steps
and seed) train through the public CLI:

- ``short``: the demo's rows (a 360-character code prefix and its 240-character continuation,
  about 200 tokens) from the target's own training files, ``data.max_seq_len 512``;
- ``long``: whole files from the same files, cut into rows of up to 12,000 characters (up to
  4,096 tokens: a 360-character prefix, then the rest as the reply), ``data.max_seq_len 4096``.

Both see the same number of anchor blocks per step; only where the blocks sit differs. Each is
evaluated with ``sparkforge eval`` on held-out files cut the long way (teacher-forced, on the
file text), and by speculative decoding at T=1 from prompts that end 360, 3,000 and 9,000
characters into held-out files, so the rounds fall in every context bucket (``--context_buckets
256 1024 2048``). The captures use the HF backend (the text is the files', not regenerated).
The short-row draft is the baseline: each bucket's row also gives the long-row draft's tau over
the short-row draft's in the same run (above 1: training on long rows helped in that bucket).
The table and ``long_rows.json`` go to ``--results``; a rerun with the same flags and
``--out_dir`` reuses the caches, checkpoints and reports already there.

Reproduce (about 40 minutes on 2 shared CPU cores; 2.5 GB of caches under ``--out_dir``):
    nice -n 10 .venv/bin/python -P benchmarks/bench_long_rows.py
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BUCKETS = ("256", "1024", "2048")
LONG_CHARS = 12_000
PREFIX_CHARS = 360
PROMPT_CHARS = (360, 3_000, 9_000)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out_dir", type=Path, default=Path("bench-long-rows-out"))
    p.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--long_rows", type=int, default=160, help="long training rows")
    p.add_argument("--short_rows", type=int, default=1200, help="short training rows")
    p.add_argument("--eval_rows", type=int, default=32, help="long held-out rows")
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--num_prompts", type=int, default=24)
    p.add_argument("--max_new_tokens", type=int, default=48)
    return p.parse_args(argv)


def _long_chats(files: list[Path], limit: int) -> list[dict[str, Any]]:
    """Rows cut from whole files: a code prefix, then up to ``LONG_CHARS`` of what follows."""
    from sparkforge.app.code_target import USER_PROMPT, read_source

    rows: list[dict[str, Any]] = []
    for path in files:
        text = read_source(path)
        for start in range(0, len(text), LONG_CHARS):
            window = text[start:start + LONG_CHARS]
            cut = window.rfind("\n", 0, PREFIX_CHARS) + 1 or PREFIX_CHARS
            prefix, reply = window[:cut], window[cut:]
            if len(reply) < LONG_CHARS // 4 or not prefix.strip():
                continue
            rows.append({"id": len(rows), "messages": [
                {"role": "user", "content": USER_PROMPT + prefix},
                {"role": "assistant", "content": reply}]})
            if len(rows) == limit:
                return rows
    return rows


def _prompts(files: list[Path], num: int) -> list[dict[str, Any]]:
    """Prompts ending ``PROMPT_CHARS`` into held-out files (the reply left to the target)."""
    from sparkforge.app.code_target import USER_PROMPT, read_source

    rows = []
    long_files = [p for p in files if len(read_source(p)) > max(PROMPT_CHARS) + 2_000]
    for i in range(num):
        text = read_source(long_files[i // len(PROMPT_CHARS) % len(long_files)])
        prefix = text[:text.rfind("\n", 0, PROMPT_CHARS[i % len(PROMPT_CHARS)]) + 1]
        rows.append({"messages": [{"role": "user", "content": USER_PROMPT + prefix},
                                  {"role": "assistant", "content": ""}]})
    return rows


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(*args: str) -> None:
    cmd = [sys.executable, "-P", "-m", "sparkforge.app.cli", *args]
    print("+", " ".join(cmd[3:]), flush=True)
    subprocess.run(cmd, check=True)


def _produce(data: Path, out: Path, target: Path, *, max_len: int, eval_fraction: float) -> None:
    if (out / "manifest.json").exists():
        return
    _run("produce", "--config", str(REPO / "producer" / "examples" / "code_target.yaml"),
         "--backend", "hf", "--data", str(data), "--output", str(out), "--engine.model",
         str(target), "--engine.max_model_len", str(max_len), "--max_seq_len", str(max_len),
         "--shard_rows", str(max(4096, max_len)), "--rows_per_unit", "16",
         "--eval_fraction", str(eval_fraction), "--progress", "false")


def _train(name: str, cache: Path, out: Path, args: argparse.Namespace, max_len: int) -> Path:
    ckpt_dir = out / "train" / name
    if not (ckpt_dir / "last.ckpt").exists():
        _run("train", "--config", str(REPO / "trainer" / "examples" / "code_target.yaml"),
             "--data.uri", str(cache), "--data.max_seq_len", str(max_len),
             "--trainer.max_steps", str(args.steps), "--trainer.logger", "false",
             "--trainer.default_root_dir", str(out / "train"),
             "--checkpoint.dirpath", str(ckpt_dir))
    return ckpt_dir / "last.ckpt"


def _evaluate(name: str, ckpt: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    report_dir = out / "eval" / name
    if not (report_dir / "eval_report.json").exists():
        _run("eval", "--draft", str(ckpt), "--target", str(out / "target"), "--cache",
             str(out / "cache_eval"), "--prompts", str(out / "prompts.jsonl"),
             "--num_prompts", str(args.num_prompts), "--max_new_tokens",
             str(args.max_new_tokens), "--temperature", "1.0",
             "--context_buckets", f"[{','.join(BUCKETS)}]",
             "--out_dir", str(report_dir))
    report: dict[str, Any] = json.loads((report_dir / "eval_report.json").read_text())
    return report


def _cell(entry: dict[str, Any], unit: str) -> str:
    ci = entry.get("tau_ci95")
    interval = f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""
    return f"{entry['tau']:.2f}{interval} ({entry['blocks']} {unit})" if entry["blocks"] else "-"


def _ratio(long: dict[str, Any], short: dict[str, Any]) -> str:
    return f"{long['tau'] / short['tau']:.2f}" if long["blocks"] and short["blocks"] else "-"


def _table(results: dict[str, Any]) -> list[str]:
    """Per bucket: each draft's two taus, then the long draft's over the short draft's."""
    lines = ["| context | draft trained on | teacher-forced tau (blocks) | speculative tau T=1 "
             "(rounds) |", "|---|---|---|---|"]
    for name, res in results.items():
        for forced, spec in zip(res["teacher_forced"], res["speculative"], strict=True):
            lines.append(f"| {forced['bucket']} | {name} rows | {_cell(forced, 'blocks')} | "
                         f"{_cell(spec, 'rounds')} |")
    for b, (forced, spec) in enumerate(zip(results["long"]["teacher_forced"],
                                           results["long"]["speculative"], strict=True)):
        short = results["short"]
        lines.append(f"| {forced['bucket']} | long / short | "
                     f"{_ratio(forced, short['teacher_forced'][b])} | "
                     f"{_ratio(spec, short['speculative'][b])} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Build the data, produce the caches, train both drafts, evaluate, print the table."""
    from sparkforge.app.code_target import code_chats, copy_target, source_files

    args = _parse(argv)
    out = args.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    flags = {k: str(v) for k, v in vars(args).items() if k not in ("out_dir", "results")}
    if (out / "flags.json").exists() and json.loads((out / "flags.json").read_text()) != flags:
        raise SystemExit(f"{out} holds a run with other flags ({out / 'flags.json'}); "
                         "give another --out_dir")
    (out / "flags.json").write_text(json.dumps(flags, indent=2) + "\n")
    target = out / "target"
    if not (target / "model.safetensors").exists():
        copy_target(target)
    train_files, held_out = source_files("train"), source_files("held_out")
    random.Random(0).shuffle(train_files)  # long rows from many files, not the first few
    short = [{**r, "id": i} for i, r in zip(range(args.short_rows), code_chats(train_files),
                                                   strict=False)]
    data = {"short": _write(out / "short.jsonl", short),
            "long": _write(out / "long.jsonl", _long_chats(train_files, args.long_rows)),
            "eval": _write(out / "eval.jsonl", _long_chats(held_out, args.eval_rows))}
    _write(out / "prompts.jsonl", _prompts(held_out, args.num_prompts))
    _produce(data["short"], out / "cache_short", target, max_len=512, eval_fraction=0.05)
    _produce(data["long"], out / "cache_long", target, max_len=4096, eval_fraction=0.05)
    _produce(data["eval"], out / "cache_eval", target, max_len=4096, eval_fraction=1.0)
    results = {}
    for name, max_len in (("short", 512), ("long", 4096)):
        ckpt = _train(name, out / f"cache_{name}", out, args, max_len)
        report = _evaluate(name, ckpt, out, args)
        results[name] = {view: report[key].get("by_context", []) for view, key in (
            ("teacher_forced", "teacher_forced"), ("speculative", "speculative"))}
        results[name]["tau"] = {"teacher_forced": report["teacher_forced"]["metrics"]["tau"],
                                "speculative": report["speculative"]["tau"]}
    print("\n" + "\n".join(_table(results)))
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "long_rows.json").write_text(json.dumps(
        {"config": flags, "results": results},
        indent=2) + "\n")
    print("\nreproduce: nice -n 10 .venv/bin/python -P benchmarks/bench_long_rows.py "
          + " ".join(f"--{k} {v}" for k, v in flags.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
