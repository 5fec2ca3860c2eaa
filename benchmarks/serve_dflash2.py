"""Serve a trained DFlash2 draft with vLLM and compare it with sparkforge's own decoding.

On the shipped code target: cut ``--rows`` chats, capture them with the transformers backend,
train the DFlash2 recipe (``--model.recipe dflash2``, block 8) for ``--steps``, export it for
vLLM, then serve it with ``speculative_config={"method": "dflash", "model": DRAFT,
"num_speculative_tokens": 7}``:

- on a GPU (vLLM's V2 model runner, which drafts through the candidate head): greedy outputs
  with the draft must equal the target's greedy outputs without it (speculation is lossless),
  and vLLM's mean acceptance length is printed beside ``sparkforge eval``'s speculative tau at
  T=0 on the same prompts (the same draft law, so they should be close: a gap over 10% is
  flagged);
- on a CPU (``--cpu``): vLLM's V1 runner must refuse the draft ("DFlash candidate-head drafts")
  instead of serving it as DFlash.

Exit 0 when every check passed. ``benchmarks/gpu_check.sh`` runs it (untested on a GPU so far).

    python -P benchmarks/serve_dflash2.py --out_dir /tmp/serve-dflash2          # GPU
    python -P benchmarks/serve_dflash2.py --out_dir /tmp/serve-dflash2 --cpu --steps 4 --rows 48
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TRAIN_EXAMPLE = REPO / "trainer" / "examples" / "code_target.yaml"
PRODUCER_EXAMPLE = REPO / "producer" / "examples" / "code_target.yaml"
REFUSAL = "DFlash candidate-head drafts"
"""What vLLM's V1 runner names when it refuses a DFlash2 draft."""


def _sparkforge(*args: str) -> None:
    print("+ sparkforge " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-P", "-m", "sparkforge.app.cli", *args], check=True)


def _prepare(out: Path, ns: argparse.Namespace) -> Path:
    """Target, cache, trained and exported DFlash2 draft (each kept from an earlier run)."""
    draft = out / "draft"
    if (draft / "config.json").is_file():
        return draft
    subprocess.run([sys.executable, "-P", "-m", "sparkforge.app.code_target", str(out / "target"),
                    "--rows", str(ns.rows)], check=True)
    _sparkforge("produce", "--config", str(PRODUCER_EXAMPLE), "--backend", "hf",
                "--data", str(out / "target" / "chat.jsonl"), "--output", str(out / "cache"),
                "--engine.model", str(out / "target"), "--eval_fraction", "0.25",
                "--scratch_dir", str(out / "scratch"), "--parity_samples", "0",
                "--progress", "false")
    _sparkforge("train", "--config", str(TRAIN_EXAMPLE), "--data.uri", str(out / "cache"),
                "--model.recipe", "dflash2", "--model.draft.block_size", "8",
                "--trainer.max_steps", str(ns.steps), "--trainer.accelerator", "auto",
                "--checkpoint.dirpath", str(out / "ckpt"), "--trainer.logger", "false",
                "--trainer.default_root_dir", str(out / "run"),
                "--trainer.enable_progress_bar", "false")
    _sparkforge("export", str(out / "ckpt" / "last.ckpt"), str(draft), "--engine", "vllm")
    return draft


def _prompts(out: Path, num: int) -> list[list[int]]:
    """The prompt token ids of the cache's first ``num`` eval samples."""
    from sparkforge.manifests.open import open_cache
    from sparkforge.trainer.data import load_split_index

    reader = open_cache(str(out / "cache"), verify=False)
    prompts = []
    for sid in load_split_index(reader, "eval").sample_id.tolist()[:num]:
        sample = reader.read_sample(sid)
        first = int(sample.loss_mask.argmax())
        if first > 0:
            prompts.append([int(t) for t in sample.input_ids[:first]])
    return prompts


def _spec_config(draft: Path) -> dict[str, Any]:
    k = json.loads((draft / "config.json").read_text())["block_size"]
    return {"method": "dflash", "model": str(draft), "num_speculative_tokens": k - 1}


def _cpu_refuses(out: Path, draft: Path) -> bool:
    from vllm.engine.arg_utils import EngineArgs

    try:
        EngineArgs(model=str(out / "target"), speculative_config=_spec_config(draft),
                   max_model_len=512, enforce_eager=True).create_engine_config()
    except ValueError as exc:
        print(f"vLLM CPU refuses the DFlash2 draft: {str(exc).splitlines()[1].strip()}")
        return REFUSAL in str(exc)
    print("FAILED: vLLM's CPU engine accepted the DFlash2 draft")
    return False


def _acceptance_length(llm: Any) -> float:
    """1 + accepted / drafts from the engine's speculative-decoding counters."""
    counters = {m.name.removesuffix("_total"): m.value for m in llm.get_metrics()
                if hasattr(m, "value")}
    drafts = counters.get("vllm:spec_decode_num_drafts", 0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0)
    return 1.0 + accepted / drafts if drafts else float("nan")


def _served(out: Path, draft: Path, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Greedy generations with and without the draft, and the served acceptance length."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)   # stops at eos, as eval
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    common = {"model": str(out / "target"), "dtype": "float32", "max_model_len": 512,
              "gpu_memory_utilization": 0.3, "disable_log_stats": False}
    plain = LLM(**common)
    want = [o.outputs[0].token_ids for o in plain.generate(inputs, params)]
    del plain
    spec = LLM(**common, speculative_config=_spec_config(draft))
    got = [o.outputs[0].token_ids for o in spec.generate(inputs, params)]
    return {"lossless": [list(a) == list(b) for a, b in zip(got, want, strict=True)],
            "acceptance_length": _acceptance_length(spec)}


def _reference_tau(out: Path, draft: Path, num_prompts: int, max_tokens: int) -> float:
    _sparkforge("eval", "--draft", str(draft), "--target", str(out / "target"), "--cache",
                str(out / "cache"), "--out_dir", str(out / "eval"), "--num_prompts",
                str(num_prompts), "--max_new_tokens", str(max_tokens), "--temperature", "0.0")
    report = json.loads((out / "eval" / "eval_report.json").read_text())
    return float(report["speculative"]["tau"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out_dir", type=Path, required=True)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--num_prompts", type=int, default=16)
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--cpu", action="store_true", help="check vLLM's CPU refusal instead")
    ns = p.parse_args(argv)
    for name, value in (("HF_HUB_OFFLINE", "1"), ("VLLM_HOST_IP", "127.0.0.1"),
                        ("VLLM_CPU_KVCACHE_SPACE", "1")):
        os.environ.setdefault(name, value)
    out = ns.out_dir.resolve()
    draft = _prepare(out, ns)
    if ns.cpu:
        return 0 if _cpu_refuses(out, draft) else 1
    prompts = _prompts(out, ns.num_prompts)
    served = _served(out, draft, prompts, ns.max_tokens)
    ours = _reference_tau(out, draft, ns.num_prompts, ns.max_tokens)
    lossless = all(served["lossless"])
    gap = abs(served["acceptance_length"] - ours) / ours
    print(f"served greedy outputs equal the target's: {sum(served['lossless'])} of "
          f"{len(prompts)} prompts")
    print(f"mean acceptance length: vLLM {served['acceptance_length']:.3f}, sparkforge eval "
          f"(T=0, same prompts) {ours:.3f}, gap {gap:.1%}" + ("" if gap <= 0.10 else " FLAGGED"))
    return 0 if lossless and gap <= 0.10 else 1


if __name__ == "__main__":
    raise SystemExit(main())
