"""Draft quality on the real small target: DSpark vs the DFlash recipe vs DSpark from fp8.

From one set of regenerated chats of the shipped code target (``sparkforge.app.code_target``),
two caches are produced (bf16 lossless and fp8 aux), and three drafts are trained with the same
steps, batches and seed through the public CLI:

- ``dspark``: ``trainer/examples/code_target.yaml`` as it ships (Markov head, confidence head,
  0.1 CE + 0.9 L1 + 1.0 BCE);
- ``dflash``: the DFlash recipe (``--model.recipe dflash``: the DFlash draft, no Markov or
  confidence head, CE with the DFlash decay), with block size 8, i.e. 7 drafts per block like
  dspark's K=7;
- ``dspark_fp8``: the dspark recipe trained from the fp8 cache.

Each is evaluated with ``sparkforge eval`` on the bf16 cache's eval split (held-out prompts,
speculative decoding at T=0 and T=1, teacher-forced metrics and calibration). The table, a JSON
record and two PNGs (acceptance by position; loss and teacher-forced tau vs step) go to
``--results`` (default ``benchmarks/results/``).

Reproduce (the defaults are the recorded run's sizes; about 13 minutes on 2 shared CPU cores):
    nice -n 10 .venv/bin/python -P benchmarks/bench_quality.py

``--study converged`` trains dspark, dflash and dflash2 (``--model.recipe dflash2``: DFlash's
draft with block convolutions and the top-k candidate selector; once with its public 16
candidates, once with 64) for ``--converge_steps`` each on one T=1 cache with the same
supervised slots, and tabulates held-out teacher-forced and speculative tau with intervals
(``converged.json``, ``converged_curves.png``).

``--sweep`` then trains the dspark recipe with a few changed defaults (learning rate, anchors,
loss decay gamma, warmup) and once more with other seeds (the run-to-run noise) on the same cache,
and compares tau at T=0, T=1 and teacher-forced (``sweep.json``).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TRAIN_EXAMPLE = REPO / "trainer" / "examples" / "code_target.yaml"
PRODUCER_EXAMPLE = REPO / "producer" / "examples" / "code_target.yaml"

RECIPE_ARGS: dict[str, list[str]] = {
    "dspark": [],
    # The DFlash recipes: their draft (the anchor slot drafts nothing, so block_size 8 drafts the
    # same 7 tokens per block as dspark's 7) and objective (CE with the DFlash decay; DFlash2
    # adds its candidate selector's CE). DFlash2 keeps its public defaults: 2 taps, groups of
    # 16 channels, selector rank 256, top-16 candidates.
    "dflash": ["--model.recipe", "dflash", "--model.draft.block_size", "8"],
    "dflash2": ["--model.recipe", "dflash2", "--model.draft.block_size", "8"],
    # DFlash2 with 64 candidates: the code target is flat (at T=1 its own top-16 holds half its
    # mass, which caps a top-16 draft's acceptance per slot), and serving reads the k it exports.
    "dflash2_top64": ["--model.recipe", "dflash2", "--model.draft.block_size", "8",
                      "--model.draft.overrides", '{"selector_top_k": 64}'],
}
"""The recipes' command-line changes to ``trainer/examples/code_target.yaml``."""
DRAFTS: dict[str, tuple[str, list[str]]] = {
    "dspark": ("cache", RECIPE_ARGS["dspark"]),
    "dflash": ("cache", RECIPE_ARGS["dflash"]),
    "dspark_fp8": ("cache_fp8", RECIPE_ARGS["dspark"]),
}
"""The main run's drafts: its cache and its changes."""
CONVERGED = ("dspark", "dflash", "dflash2", "dflash2_top64")
"""The recipes the converged study trains, on one cache with the same supervised slots."""
SELECTOR_CANDIDATES = ("candidate_recall", "candidate_teacher_mass", "teacher_top_k_mass")
"""What eval reports of a DFlash2 draft's top-k candidates: how often they hold the data token,
the teacher's mass on them and in its own top-k (the ceilings of the served acceptance)."""


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out_dir", type=Path, default=Path("bench-quality-out"))
    p.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--rows", type=int, default=384, help="chat rows (held-out stdlib files)")
    p.add_argument("--steps", type=int, default=150, help="optimizer steps per draft")
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--num_prompts", type=int, default=12, help="prompts decoded per eval")
    p.add_argument("--max_new_tokens", type=int, default=48)
    p.add_argument("--drafts", nargs="+", choices=list(DRAFTS), default=list(DRAFTS),
                   help="train and evaluate only these (runs of the others can go in parallel "
                        "into the same --out_dir; a run with all of them reuses every output "
                        "and writes the results)")
    p.add_argument("--study", choices=("temperature", "converged"), default=None,
                   help="instead: the regeneration-temperature study (regenerate at each of "
                        "--regen_temperatures, train dspark on each, eval at T=0 and T=1), or "
                        "the converged dspark vs dflash vs dflash2 comparison (--converge_steps "
                        "each, on the T=1 cache of the temperature study)")
    p.add_argument("--regen_temperatures", nargs="+", default=["0.0", "0.6", "1.0"])
    p.add_argument("--eval_fraction", type=float, default=0.25,
                   help="the studies' eval split (enough held-out prompts for an interval)")
    p.add_argument("--converge_steps", type=int, default=1200)
    p.add_argument("--recipes", nargs="+", choices=CONVERGED, default=list(CONVERGED),
                   help="with --study converged: train and tabulate only these")
    p.add_argument("--collect", action="store_true",
                   help="with --study temperature: run nothing, tabulate what is in --out_dir")
    p.add_argument("--sweep", nargs="*", type=int, default=None,
                   help="instead: train the dspark recipe with the SWEEP changes of these "
                        "indices (none given: all; 0 is the recipe unchanged, the main run's "
                        "dspark draft) on the caches of an earlier run in --out_dir and compare "
                        "tau (T=0, T=1, teacher-forced); runs of other indices can go in parallel")
    return p.parse_args(argv)


# Changes to trainer/examples/code_target.yaml tried by --sweep (the recipe's own values first).
SWEEP: dict[str, list[str]] = {
    "example (lr 1e-2, warmup 20, anchors 32, gamma 4)": [],
    "lr 6e-4 (the package default)": ["--model.optimizer.lr", "6e-4"],
    "lr 3e-3 (the example's previous value)": ["--model.optimizer.lr", "3e-3"],
    "lr 3e-2": ["--model.optimizer.lr", "3e-2"],
    "anchors 64": ["--model.draft.num_anchors", "64"],
    "gamma 7 (slower decay)": ["--model.loss.loss_decay_gamma", "7"],
    "warmup 5": ["--model.scheduler.warmup_steps", "5"],
    # The recipe unchanged but for every seed (init, anchors, data order): run-to-run noise.
    "example, seed 1 (noise)": ["--seed_everything", "1", "--model.seed", "1", "--data.seed", "1"],
    "example, seed 2 (noise)": ["--seed_everything", "2", "--model.seed", "2", "--data.seed", "2"],
}


def _sweep(out: Path, ns: argparse.Namespace, results: Path) -> int:
    """Train each SWEEP variant on ``out``'s bf16 cache; tabulate tau at T=0, T=1 and forced."""
    if not (out / "cache" / "manifest.json").is_file():
        raise SystemExit(f"--sweep needs the caches of an earlier run in {out}")
    timings: dict[str, float] = {}
    rows = []
    for i, (label, extra) in enumerate(SWEEP.items()):
        if ns.sweep and i not in ns.sweep:
            continue
        # The unchanged recipe is the main run's dspark draft (reused when it exists).
        # Runs are named by their changes, so an out_dir of an older SWEEP is never misread.
        name = "dspark" if not extra else "sweep_" + "_".join(a.lstrip("-") for a in extra)
        rec = _train_and_eval(out, ns, name, "cache", extra, timings)
        rep = rec["T1.0"]
        rows.append({"variant": label, "run": name, "tau_T0": rec["T0.0"]["speculative"]["tau"],
                     "tau_T1": rep["speculative"]["tau"],
                     "tau_teacher_forced": rep["teacher_forced"]["metrics"]["tau"],
                     "final_loss": rec["curve"][-1]["loss"] if rec["curve"] else None,
                     "train_s": rec["train_s"]})
    (results / "sweep.json").write_text(json.dumps(
        {"command": "nice -n 10 .venv/bin/python -P benchmarks/bench_quality.py "
                    + " ".join(sys.argv[1:]), "steps": ns.steps, "rows": rows,
         "timings_s": timings}, indent=1) + "\n")
    print("| variant | tau T=0 | tau T=1 | tau teacher-forced (T=1) |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['tau_T0']:.3f} | {r['tau_T1']:.3f} | "
              f"{r['tau_teacher_forced']:.3f} |")
    return 0


def _regen_cache(out: Path, ns: argparse.Namespace, temp: str,
                 timings: dict[str, float]) -> str:
    """Regenerate the study's chats at ``temp`` and capture them (kept from an earlier run)."""
    name = f"cache_T{temp}"
    if (out / name / "manifest.json").is_file():
        return name
    if not (out / "target" / "chat.jsonl").is_file():
        subprocess.run([sys.executable, "-P", "-m", "sparkforge.app.code_target",
                        str(out / "target"), "--rows", str(ns.rows)], check=True)
    regen = out / f"regenerated_T{temp}"
    _run(["regenerate", "--data", str(out / "target" / "chat.jsonl"),
          "--engine.model", str(out / "target"), "--engine.dtype", "float32",
          "--engine.max_model_len", "512", "--engine.enforce_eager", "true",
          "--engine.enable_chunked_prefill", "false", "--output", str(regen),
          "--temperature", temp, "--top_p", "1.0", "--max_tokens", "96", "--seed", "0",
          "--progress", "false"], timings, f"regenerate T={temp}")
    _run(["produce", "--config", str(PRODUCER_EXAMPLE), "--data", str(regen),
          "--output", str(out / name), "--engine.model", str(out / "target"),
          "--eval_fraction", str(ns.eval_fraction), "--scratch_dir", str(out / "scratch"),
          "--parity_samples", "0", "--progress", "false"], timings, f"produce {name}")
    return name


def _cell(report: dict[str, Any]) -> dict[str, Any]:
    """One evaluation's speculative tau with its interval, the prompts a half-width of 5% of
    tau would take (the half-width shrinks as 1/sqrt(prompts)), and its calibration."""
    spec = report["speculative"]
    half = (spec["tau_ci95"][1] - spec["tau_ci95"][0]) / 2
    return {"tau": spec["tau"], "ci95": spec["tau_ci95"], "prompts": spec["prompts"],
            "half_width_pct": 100 * half / spec["tau"],
            "prompts_for_5pct": math.ceil(spec["prompts"] * (half / (0.05 * spec["tau"])) ** 2),
            "ece": spec.get("calibration", {}).get("ece"),
            "abs_error": spec.get("calibration", {}).get("abs_error")}


def _collected(out: Path, name: str) -> dict[str, Any]:
    """What earlier runs left of one draft's evaluations (for a partial table)."""
    rec: dict[str, Any] = {"train_s": None}
    for temp in ("0.0", "1.0"):
        path = out / "eval" / f"{name}_T{temp}" / "eval_report.json"
        if path.is_file():
            rec[f"T{temp}"] = json.loads(path.read_text())
    return rec


def _temperature_row(temp: str, rec: dict[str, Any]) -> dict[str, Any]:
    """One regeneration temperature's row; an evaluation that did not run is None."""
    greedy, sampled = rec.get("T0.0"), rec.get("T1.0")
    either = sampled or greedy   # teacher-forced metrics do not depend on eval's temperature
    forced = None if either is None else either["teacher_forced"]
    return {"regen_temperature": float(temp),
            "T0": None if greedy is None else _cell(greedy),
            "T1": None if sampled is None else _cell(sampled),
            "teacher_forced": None if forced is None else {
                "tau": forced["metrics"]["tau"], "ci95": forced.get("tau_ci95"),
                "ece": forced.get("calibration", {}).get("ece")},
            "matched_T1": None if sampled is None else sampled.get("matched", {}).get("agreement"),
            "train_s": rec["train_s"]}


def _temperature_study(out: Path, ns: argparse.Namespace, results: Path) -> int:
    """Regenerate the same chats at each temperature, train dspark on each, eval at T=0 and 1
    (``--collect``: only tabulate what earlier runs left in ``out``)."""
    timings: dict[str, float] = {}
    rows = []
    for temp in ns.regen_temperatures:
        name = f"regen_T{temp}"
        if ns.collect:
            rec = _collected(out, name)
        else:
            cache = _regen_cache(out, ns, temp, timings)
            rec = _train_and_eval(out, ns, name, cache, [], timings, eval_cache=cache)
        rows.append(_temperature_row(temp, rec))
        rows.sort(key=lambda r: r["regen_temperature"])
        (results / "regen_temperature.json").write_text(json.dumps(
            {"command": _command(), "steps": ns.steps, "rows": ns.rows,
             "eval_fraction": ns.eval_fraction, "num_prompts": ns.num_prompts,
             "max_new_tokens": ns.max_new_tokens, "table": rows, "timings_s": timings},
            indent=1) + "\n")
    print(_temperature_table(rows))
    return 0


def _ci(cell: dict[str, Any] | None) -> str:
    if cell is None:
        return "not run"
    lo, hi = cell["ci95"] or (float("nan"), float("nan"))
    return f"{cell['tau']:.2f} [{lo:.2f}, {hi:.2f}]"


def _at(cell: dict[str, Any] | None, key: str) -> Any:
    return None if cell is None else cell[key]


def _temperature_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| regenerated at | spec. tau T=0 [95% CI] | spec. tau T=1 [95% CI] | "
             "teacher-forced tau, own eval split [95% CI] | agree at T=1 | ECE T=1 | "
             "prompts for +-5% at T=0 / T=1 |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        agree = r["matched_T1"]
        verdict = "-" if agree is None else ("yes" if agree["agree"] else "no")
        lines.append(f"| T={r['regen_temperature']:g} | {_ci(r['T0'])} | {_ci(r['T1'])} | "
                     f"{_ci(r['teacher_forced'])} | {verdict} | {_fmt(_at(r['T1'], 'ece'))} | "
                     f"{_at(r['T0'], 'prompts_for_5pct') or '-'} / "
                     f"{_at(r['T1'], 'prompts_for_5pct') or '-'} |")
    return "\n".join(lines)


def _gain_last_fifth(curve: list[dict[str, float]], steps: int, window: int) -> float:
    """Relative gain of tau (mean of ``window`` points) from 80% of the run to its end."""
    return _tau_at(curve, steps, window) / _tau_at(curve, 0.8 * steps, window) - 1.0


def _tau_at(curve: list[dict[str, float]], step: float, window: int = 3) -> float:
    """Mean teacher-forced tau as served (a DFlash2 draft's through its candidate selector) of
    the ``window`` log points up to ``step``."""
    taus = [c.get("served_tau", c["tau"]) for c in curve if c["step"] <= step][-window:]
    return sum(taus) / len(taus) if taus else float("nan")


def _forced(report: dict[str, Any]) -> dict[str, Any]:
    """The eval split's teacher-forced tau as served (DFlash2: through its candidate selector)
    with its interval, its full-block tau, and the base distribution's tau."""
    forced = report["teacher_forced"]
    served = forced.get("selector") or forced
    return {"tau": served.get("tau", forced["metrics"]["tau"]), "ci95": served.get("tau_ci95"),
            "full_blocks": served.get("full_blocks"), "base_tau": forced["metrics"]["tau"],
            **{key: served.get(key) for key in SELECTOR_CANDIDATES}}


def _converged_row(rec: dict[str, Any], ns: argparse.Namespace) -> dict[str, Any]:
    return {"T0": _cell(rec["T0.0"]), "T1": _cell(rec["T1.0"]),
            "teacher_forced": _forced(rec["T1.0"]),
            "teacher_forced_tau": _forced(rec["T1.0"])["tau"],
            "matched_T1": rec["T1.0"].get("matched", {}).get("agreement"),
            "gain_last_fifth": _gain_last_fifth(rec["val_curve"], ns.converge_steps, 1),
            "train_gain_last_fifth": _gain_last_fifth(rec["curve"], ns.converge_steps, 5),
            "val_tau_at_short_run": _tau_at(rec["val_curve"], ns.steps, 1),
            "val_tau_at_end": _tau_at(rec["val_curve"], ns.converge_steps, 1),
            "train_tau_at_short_run": _tau_at(rec["curve"], ns.steps),
            "train_tau_at_end": _tau_at(rec["curve"], ns.converge_steps),
            "train_s": rec["train_s"]}


def _converged_study(out: Path, ns: argparse.Namespace, results: Path) -> int:
    """dspark, dflash and dflash2 trained for --converge_steps on the T=1 cache: curves, ratios
    and the table.

    Convergence is judged on the held-out teacher-forced tau as served (the validation split,
    once an epoch; DFlash2's through its candidate selector): training-batch tau also counts
    what the draft memorises of chats it has seen many times, and goes on rising after the
    held-out tau has stopped."""
    timings: dict[str, float] = {}
    cache = _regen_cache(out, ns, "1.0", timings)
    records = {name: _train_and_eval(out, ns, f"converged_{name}", cache, RECIPE_ARGS[name],
                                     timings, eval_cache=cache, steps=ns.converge_steps)
               for name in CONVERGED if name in ns.recipes}
    by = {name: _converged_row(rec, ns) for name, rec in records.items()}
    ratio = {}
    for a, b in (("dspark", "dflash"), ("dspark", "dflash2"), ("dflash2", "dflash"),
                 ("dflash2_top64", "dflash"), ("dflash2_top64", "dflash2")):
        if a not in by or b not in by:
            continue
        ratio |= {f"{a}/{b} {k}": by[a][k]["tau"] / by[b][k]["tau"] for k in ("T0", "T1")}
        ratio[f"{a}/{b} teacher_forced"] = by[a]["teacher_forced_tau"] / by[b]["teacher_forced_tau"]
        for key in ("val_tau_at_short_run", "val_tau_at_end"):
            ratio[f"{a}/{b} {key}"] = by[a][key] / by[b][key]
    (results / "converged.json").write_text(json.dumps(
        {"command": _command(), "steps": ns.converge_steps, "short_run_steps": ns.steps,
         "drafts": by, "ratios": ratio, "timings_s": timings,
         "curves": {n: r["curve"] for n, r in records.items()},
         "val_curves": {n: r["val_curve"] for n, r in records.items()}}, indent=1) + "\n")
    _plot_converged(records, ns.steps, results)
    print(_converged_table(by))
    print("; ".join(f"{k} {v:.3f}" for k, v in ratio.items()))
    return 0


def _converged_table(by: dict[str, dict[str, Any]]) -> str:
    """The converged study's rows, one column per recipe."""
    names = list(by)
    rows = [
        ("held-out teacher-forced tau as served, short run / end",
         lambda r: f"{r['val_tau_at_short_run']:.2f} / {r['val_tau_at_end']:.2f}"),
        ("held-out tau gain over the last fifth", lambda r: f"{r['gain_last_fifth']:+.1%}"),
        ("training-batch tau gain over the last fifth",
         lambda r: f"{r['train_gain_last_fifth']:+.1%}"),
        ("spec. tau T=0 [95% CI]", lambda r: _ci(r["T0"])),
        ("spec. tau T=1 [95% CI]", lambda r: _ci(r["T1"])),
        ("teacher-forced tau as served, eval split [95% CI]", lambda r: _ci(r["teacher_forced"])),
        ("  drafting from the base distribution (every token)",
         lambda r: f"{r['teacher_forced']['base_tau']:.2f}"),
        ("  top-k candidates: data token among them / teacher's mass on them / in its top-k",
         lambda r: _selector_cells(r["teacher_forced"])),
        ("spec. T=1 - teacher-forced (full blocks) [95% CI]",
         lambda r: _agreement(r["matched_T1"])),
    ]
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lines += [f"| {label} | " + " | ".join(cell(by[n]) for n in names) + " |"
              for label, cell in rows]
    return "\n".join(lines)


def _selector_cells(forced: dict[str, Any]) -> str:
    """A DFlash2 draft's candidate recall and the teacher's mass its served acceptance is capped
    by ("-" for a draft without the selector)."""
    if forced.get("candidate_recall") is None:
        return "-"
    return " / ".join(_fmt(forced.get(key), ".2f") for key in SELECTOR_CANDIDATES)


def _agreement(agree: dict[str, Any] | None) -> str:
    if agree is None:
        return "-"
    lo, hi = agree["difference_ci95"]
    return f"{agree['difference']:+.2f} [{lo:+.2f}, {hi:+.2f}]"


def _plot_converged(records: dict[str, dict[str, Any]], short: int, results: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rec in records.items():
        served = [c.get("served_tau", c["tau"]) for c in rec["val_curve"]]
        line, = ax.plot([c["step"] for c in rec["val_curve"]], served, marker="o",
                        label=f"{name}, held-out")
        ax.plot([c["step"] for c in rec["curve"]],
                [c.get("served_tau", c["tau"]) for c in rec["curve"]],
                color=line.get_color(), alpha=0.4, label=f"{name}, training batches")
    ax.axvline(short, color="k", linestyle=":", label=f"short run ({short} steps)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("teacher-forced tau as served (DFlash2: its selector's)")
    ax.set_title("DSpark, DFlash and DFlash2 on the code target (the converged study)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(results / "converged_curves.png", dpi=90)
    plt.close(fig)


def _command() -> str:
    return "nice -n 10 .venv/bin/python -P benchmarks/bench_quality.py " + " ".join(sys.argv[1:])


def _run(args: list[str], timings: dict[str, float], stage: str) -> None:
    print(f"\n=== {stage}: sparkforge {' '.join(args)}", flush=True)
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-P", "-m", "sparkforge.app.cli", *args],
                            check=False)
    timings[stage] = time.perf_counter() - start
    if result.returncode:
        raise SystemExit(f"stage {stage!r} exited with {result.returncode}")


def _prepare(out: Path, ns: argparse.Namespace, timings: dict[str, float]) -> None:
    """Target, chats, regenerated replies and both caches (kept when an earlier run made them)."""
    if all((out / name / "manifest.json").is_file() for name in ("cache", "cache_fp8")):
        print(f"reusing the caches in {out}")
        return
    start = time.perf_counter()
    subprocess.run([sys.executable, "-P", "-m", "sparkforge.app.code_target",
                    str(out / "target"), "--rows", str(ns.rows)], check=True)
    timings["target"] = time.perf_counter() - start
    _run(["regenerate", "--data", str(out / "target" / "chat.jsonl"),
          "--engine.model", str(out / "target"), "--engine.dtype", "float32",
          "--engine.max_model_len", "512", "--engine.enforce_eager", "true",
          "--engine.enable_chunked_prefill", "false", "--output", str(out / "regenerated"),
          "--temperature", "1.0", "--top_p", "1.0", "--max_tokens", "96", "--seed", "0"],
         timings, "regenerate")
    for name, codec in (("cache", "lossless"), ("cache_fp8", "fp8")):
        _run(["produce", "--config", str(PRODUCER_EXAMPLE), "--data", str(out / "regenerated"),
              "--output", str(out / name), "--engine.model", str(out / "target"),
              "--aux_codec", codec, "--scratch_dir", str(out / "scratch"),
              "--parity_samples", "0", "--progress", "false"], timings, f"produce {name}")


def _train_and_eval(out: Path, ns: argparse.Namespace, name: str, cache: str,
                    extra: list[str], timings: dict[str, float],
                    temperatures: tuple[str, ...] = ("0.0", "1.0"), eval_cache: str = "cache",
                    steps: int | None = None) -> dict[str, Any]:
    """Train one draft (``steps``, default ``--steps``) and evaluate it on ``eval_cache``'s eval
    split; a stage whose output an earlier run left is reused."""
    steps = ns.steps if steps is None else steps
    run_dir = out / "train" / name
    ckpt = run_dir / "ckpt" / "last.ckpt"
    # last.ckpt is also written at every epoch end: only the step-N checkpoint marks a finished run.
    if not any((run_dir / "ckpt").glob(f"*-step={steps}.ckpt")):
        shutil.rmtree(run_dir, ignore_errors=True)  # an interrupted run is trained again
        _run(["train", "--config", str(TRAIN_EXAMPLE), "--data.uri", str(out / cache),
              "--trainer.max_steps", str(steps), "--data.batch_size", str(ns.batch_size),
              "--trainer.default_root_dir", str(run_dir),
              "--checkpoint.dirpath", str(run_dir / "ckpt"),
              "--trainer.logger.class_path", "lightning.pytorch.loggers.CSVLogger",
              "--trainer.logger.init_args.save_dir", str(run_dir),
              "--trainer.logger.init_args.name", "log", "--trainer.enable_progress_bar", "false",
              *extra], timings, f"train {name}")
    # Fit time: from the logger's first file to the last checkpoint (process start-up excluded).
    started = next(run_dir.rglob("hparams.yaml")).stat().st_mtime
    curve, val_curve = _curves(next(run_dir.rglob("metrics.csv")))
    record: dict[str, Any] = {"train_s": ckpt.stat().st_mtime - started, "curve": curve,
                              "val_curve": val_curve}
    for temp in temperatures:
        eval_dir = out / "eval" / f"{name}_T{temp}"
        if not (eval_dir / "eval_report.json").is_file():
            _run(["eval", "--draft", str(ckpt), "--target", str(out / "target"),
                  "--cache", str(out / eval_cache), "--out_dir", str(eval_dir),
                  "--num_prompts", str(ns.num_prompts), "--max_new_tokens",
                  str(ns.max_new_tokens), "--temperature", temp],
                 timings, f"eval {name} T={temp}")
        record[f"T{temp}"] = json.loads((eval_dir / "eval_report.json").read_text())
    return record


def _curves(path: Path) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """From one read of the CSV log: step, train loss and teacher-forced tau of every logged
    window, and step and teacher-forced tau of every validation pass (the held-out split); a
    DFlash2 run's also hold ``served_tau``, its candidate selector's tau (what serving gets)."""
    train, val = [], []
    with path.open() as f:
        for row in csv.DictReader(f):
            if row.get("train/loss") and row.get("train/tau"):
                train.append({"step": float(row["step"]), "loss": float(row["train/loss"]),
                              "tau": float(row["train/tau"]),
                              **_served(row.get("train/selector_tau"))})
            if row.get("val/tau"):
                val.append({"step": float(row["step"]), "tau": float(row["val/tau"]),
                            **_served(row.get("val/selector_tau"))})
    return train, val


def _served(selector_tau: str | None) -> dict[str, float]:
    return {"served_tau": float(selector_tau)} if selector_tau else {}


def _summary(name: str, rec: dict[str, Any]) -> dict[str, Any]:
    greedy, sampled = rec["T0.0"], rec["T1.0"]
    forced = sampled["teacher_forced"]
    cal = sampled["speculative"].get("calibration", {})
    return {
        "draft": name, "tau_T0": greedy["speculative"]["tau"],
        "tau_T1": sampled["speculative"]["tau"],
        "tau_teacher_forced": forced["metrics"].get("tau", 0.0),
        "accept_by_position_T0": greedy["speculative"]["acceptance_by_position"],
        "accept_by_position_T1": sampled["speculative"]["acceptance_by_position"],
        "accept_teacher_forced": forced["accept_rate_by_position"],
        "ece": cal.get("ece"), "brier": cal.get("brier"), "auroc": cal.get("auroc"),
        "ece_teacher_forced": forced.get("calibration", {}).get("ece"),
        "brier_teacher_forced": forced.get("calibration", {}).get("brier"),
        "policies": forced.get("policies", []), "train_s": rec["train_s"],
        "final_loss": rec["curve"][-1]["loss"] if rec["curve"] else None,
    }


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _table(rows: list[dict[str, Any]]) -> str:
    head = ("| draft | tau T=0 | tau T=1 | tau teacher-forced | accept by position (T=0) "
            "| ECE | Brier | AUROC | train s |\n|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        pos = " ".join(f"{a:.2f}" for a in r["accept_by_position_T0"])
        lines.append(f"| {r['draft']} | {r['tau_T0']:.3f} | {r['tau_T1']:.3f} | "
                     f"{r['tau_teacher_forced']:.3f} | {pos} | {_fmt(r['ece'])} | "
                     f"{_fmt(r['brier'])} | {_fmt(r['auroc'])} | {r['train_s']:.0f} |")
    return "\n".join(lines)


def _policy_table(policies: list[dict[str, Any]]) -> str:
    """The dspark draft's teacher-forced verification policies as a markdown table."""
    lines = ["| dspark policy (teacher-forced, T=1) | tokens/round | verified slots | "
             "accepted/verified |", "|---|---|---|---|"]
    lines += [f"| {p['policy']} | {p['tokens_per_round']:.3f} | {p['verified_slots']:.2f} | "
              f"{p['accepted_per_verified']:.3f} |" for p in policies]
    return "\n".join(lines)


def _plot(records: dict[str, dict[str, Any]], rows: list[dict[str, Any]], results: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        for ax, key, title in ((axes[0], "accept_by_position_T0", "speculative decoding, T=0"),
                               (axes[1], "accept_teacher_forced", "teacher-forced, T=1")):
            vals = r[key]
            ax.bar([k + (i - 1) * width for k in range(len(vals))], vals, width,
                   label=r["draft"])
            ax.set_title(f"Acceptance by draft position ({title})")
            ax.set_xlabel("draft position k")
            ax.set_ylim(0, 1)
    axes[0].set_ylabel("conditional acceptance")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(results / "quality_acceptance.png", dpi=90)
    plt.close(fig)
    fig, (ax_loss, ax_tau) = plt.subplots(1, 2, figsize=(11, 3.8))
    for name, rec in records.items():
        steps = [c["step"] for c in rec["curve"]]
        ax_loss.plot(steps, [c["loss"] for c in rec["curve"]], label=name)
        ax_tau.plot(steps, [c["tau"] for c in rec["curve"]], label=name)
    ax_loss.set_title("training loss (each draft's own objective)")
    ax_tau.set_title("teacher-forced tau on training batches")
    for ax in (ax_loss, ax_tau):
        ax.set_xlabel("optimizer step")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(results / "quality_curves.png", dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Prepare the caches, train and evaluate the three drafts, write the results."""
    ns = _parse(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    out, results = ns.out_dir.resolve(), ns.results.resolve()
    results.mkdir(parents=True, exist_ok=True)
    if ns.sweep is not None:
        return _sweep(out, ns, results)
    if ns.study is not None:
        study = _temperature_study if ns.study == "temperature" else _converged_study
        return study(out, ns, results)
    timings: dict[str, float] = {}
    start = time.perf_counter()
    _prepare(out, ns, timings)
    records = {name: _train_and_eval(out, ns, name, cache, extra, timings)
               for name, (cache, extra) in DRAFTS.items() if name in ns.drafts}
    if set(records) != set(DRAFTS):
        print(f"done: {', '.join(records)}; run with every draft to write the results")
        return 0
    rows = [_summary(name, rec) for name, rec in records.items()]
    by = {r["draft"]: r for r in rows}
    ratios = {
        "dspark_over_dflash_tau_T0": by["dspark"]["tau_T0"] / by["dflash"]["tau_T0"],
        "dspark_over_dflash_tau_T1": by["dspark"]["tau_T1"] / by["dflash"]["tau_T1"],
        "fp8_minus_bf16_tau_T0": by["dspark_fp8"]["tau_T0"] - by["dspark"]["tau_T0"],
        "fp8_minus_bf16_tau_T1": by["dspark_fp8"]["tau_T1"] - by["dspark"]["tau_T1"],
    }
    command = "nice -n 10 .venv/bin/python -P benchmarks/bench_quality.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    record = {"command": command.strip(), "args": {k: str(v) for k, v in vars(ns).items()},
              "drafts": rows, "ratios": ratios, "timings_s": timings,
              "wall_s": time.perf_counter() - start,
              "curves": {name: rec["curve"] for name, rec in records.items()}}
    (results / "quality.json").write_text(json.dumps(record, indent=1) + "\n")
    _plot(records, rows, results)
    print("\n" + _table(rows))
    print("\n" + _policy_table(by["dspark"]["policies"]))
    print("\n" + "; ".join(f"{k} {v:+.3f}" if "minus" in k else f"{k} {v:.3f}"
                          for k, v in ratios.items()))
    print(f"wall {record['wall_s']:.0f} s; reproduce: {record['command']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
