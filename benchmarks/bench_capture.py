"""Capture throughput of VllmSource vs plain vLLM prefill of the same prompts, in one run.

Reproduce:
    VLLM_CPU_KVCACHE_SPACE=2 .venv/bin/python -P benchmarks/bench_capture.py \
        --num-prompts 64 --prompt-len 512 --hidden-size 512 --num-layers 8

Both engines run the same token-id prompts with prefix caching off and ``max_tokens=1``; the
baseline has no speculative config and no connector. The capture side reports where its wall time
goes (engine steps incl. the in-worker gather, file load, checks, final norm, the rest of the loop).
Both engines stay up and run interleaved repeats; the best of each is compared.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--window", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--verify-every", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--in-process", action="store_true", help="VLLM_ENABLE_V1_MULTIPROCESSING=0"
    )
    return parser.parse_args()


def start_baseline(engine, prompts):
    """A plain engine (no speculative config, no connector) and a timed prefill of ``prompts``."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from sparkforge.producer.vllm_source import engine_kwargs

    llm = LLM(**engine_kwargs(engine), skip_tokenizer_init=True)
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    token_prompts = [TokensPrompt(prompt_token_ids=p.tolist()) for p in prompts]

    def run() -> float:
        start = time.perf_counter()
        llm.generate(token_prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    return llm, run


def start_capture(engine, prompts, args):
    """A VllmSource and a timed capture of ``prompts`` that also returns its time breakdown."""
    from sparkforge.producer.source import CaptureRequest
    from sparkforge.producer.vllm_source import VllmSource

    layer_ids = sorted({1, args.num_layers // 2, args.num_layers - 2})
    source = VllmSource(
        engine, layer_ids=layer_ids, window=args.window, verify_every=args.verify_every
    )
    requests = [CaptureRequest(sample_id=i, input_ids=p) for i, p in enumerate(prompts)]

    def run() -> tuple[float, dict[str, float]]:
        source.timings = dict.fromkeys(source.timings, 0.0)
        start = time.perf_counter()
        results = list(source.capture(requests))
        elapsed = time.perf_counter() - start
        assert all(r.error is None for r in results), [r.error for r in results if r.error]
        return elapsed, dict(source.timings)

    return source, run


def main() -> None:
    args = parse_args()
    if args.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from sparkforge.app.tiny_target import build_tiny_target
    from sparkforge.producer.engine_options import EngineOptions

    model = build_tiny_target(
        Path(tempfile.mkdtemp(prefix="bench-target-")),
        num_hidden_layers=args.num_layers,
        hidden_size=args.hidden_size,
        head_dim=64,
    )
    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(4, 1000, args.prompt_len).astype(np.int32) for _ in range(args.num_prompts)
    ]
    engine = EngineOptions(
        model=str(model),
        dtype=args.dtype,
        max_model_len=args.prompt_len + 16,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=True,
    )
    tokens = args.num_prompts * args.prompt_len
    llm, baseline = start_baseline(engine, prompts)
    source, capture = start_capture(engine, prompts, args)
    baseline(), capture()  # warm-up both engines
    # Interleaved repeats, best of each: the host is shared and noisy.
    base_runs, cap_runs = [], []
    for _ in range(args.repeats):
        base_runs.append(baseline())
        cap_runs.append(capture())
    llm.llm_engine.engine_core.shutdown()
    source.close()
    base_s = min(base_runs)
    cap_s, timings = min(cap_runs, key=lambda run: run[0])
    rows = [("plain prefill", base_s), ("capture", cap_s)]
    print(
        f"\n{tokens} tokens: {args.num_prompts} x {args.prompt_len}, H={args.hidden_size}, "
        f"L={args.num_layers}, {args.dtype}, window={args.window}, "
        f"{'in-process' if args.in_process else 'multiprocess'}"
    )
    print(f"{'run':<16}{'wall s':>10}{'tok/s':>12}")
    for name, secs in rows:
        print(f"{name:<16}{secs:>10.3f}{tokens / secs:>12.0f}")
    print(
        f"capture / plain wall time: {cap_s / base_s:.3f} (best of {args.repeats}; all plain "
        f"{[round(b, 2) for b in base_runs]}, capture {[round(c, 2) for c, _ in cap_runs]})"
    )
    other = cap_s - sum(timings.values())
    print(f"{'capture part':<16}{'s':>10}{'share':>12}")
    for name, secs in [*timings.items(), ("loop other", other)]:
        print(f"{name:<16}{secs:>10.3f}{secs / cap_s:>12.1%}")
    print(
        "reproduce: VLLM_CPU_KVCACHE_SPACE=2 .venv/bin/python -P benchmarks/bench_capture.py "
        + " ".join(
            f"--{k.replace('_', '-')} {v}"
            for k, v in vars(args).items()
            if v is not None and not isinstance(v, bool)
        )
        + (" --in-process" if args.in_process else "")
    )


if __name__ == "__main__":
    main()
