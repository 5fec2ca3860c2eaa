"""Measure a draft as served: eval's prompts through vLLM (``--engine vllm``) or any running
OpenAI-compatible server (``--endpoint``), at each concurrency and draft length.

Each (draft length, concurrency) run sends every prompt once and reads the acceptance the server
reports (``sparkforge.trainer.eval.served_metrics``) and its tokens/s; with a baseline (the target
served without the draft, same engine arguments) each run's speedup is its tokens/s over the
baseline's at the same concurrency. ``--engine vllm`` starts one engine per draft length (and one
for the baseline), each in a child process (``sparkforge.trainer.eval.served_engine``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from sparkforge.shared.errors import ConfigError, SparkforgeError
from sparkforge.trainer.eval.acceptance import acceptance_report
from sparkforge.trainer.eval.decode_result import SpecDecodeResult
from sparkforge.trainer.eval.served_client import (
    RequestRun,
    metrics_page,
    run_requests,
    served_model,
)
from sparkforge.trainer.eval.served_engine import cpu_token_budget, vllm_server
from sparkforge.trainer.eval.served_metrics import (
    counters_acceptance,
    parse_counters,
    request_rounds,
)
from sparkforge.trainer.job_config import EvalConfig
from sparkforge.trainer.model_card import num_speculative_tokens, serving_method

logger = logging.getLogger(__name__)

CPU_DSPARK = ("vLLM serves DSpark drafts only on GPU (its V2 model runner needs Triton, which "
              "CPU builds lack): measure a DFlash draft here, or run --engine vllm on a GPU")


def check_servable(cfg: EvalConfig, draft_cfg: Any) -> None:
    """Refuse, before any decoding, a served measurement that cannot run."""
    if cfg.engine != "vllm":
        return
    if not Path(cfg.draft).is_dir():
        raise ConfigError(f"--engine vllm serves an exported draft folder, got {cfg.draft}: "
                          "run sparkforge export --engine vllm first")
    if serving_method(draft_cfg) == "dspark" and not torch.cuda.is_available():
        raise ConfigError(CPU_DSPARK)


def speculative_config(cfg: EvalConfig, draft_cfg: Any, k: int) -> dict[str, Any]:
    """vLLM's ``--speculative-config`` that serves the exported draft with ``k`` tokens a step."""
    return {"method": serving_method(draft_cfg), "model": str(Path(cfg.draft).resolve()),
            "num_speculative_tokens": k, "draft_sample_method": cfg.served.draft_sample_method}


def _acceptance(run: RequestRun, before: str, after: str, cfg: EvalConfig,
                ) -> tuple[dict[str, Any], list[SpecDecodeResult] | None]:
    """A run's acceptance: per request (with its interval) when every response has its counts
    and the options allow, else the ``/metrics`` counters' change (``before`` -> ``after``)."""
    delta = parse_counters(after).minus(parse_counters(before))
    source = cfg.served.acceptance_source
    per_request = all(c.spec is not None for c in run.completions)
    if source == "per_request" and not per_request:
        raise SparkforgeError("the server's answers carry no per-request acceptance (vLLM: "
                              "start it with --per-request-spec-decode-metrics detailed)")
    if source == "counters" or not per_request:
        return counters_acceptance(delta), None
    results = [request_rounds(c.spec, c.tokens) for c in run.completions if c.spec is not None]
    k = int(run.completions[0].spec["num_spec_tokens"]) if run.completions[0].spec else 0
    report = acceptance_report(results, k, cfg.seed, cfg.temperature)
    report.update(source="per_request",
                  counters={"rounds": int(delta.drafts), "accepted_tokens": int(delta.accepted)})
    return report, results


def _measure(url: str, prompts: Sequence[Sequence[int]], cfg: EvalConfig, *,
             speculative: bool) -> list[tuple[dict[str, Any], list[SpecDecodeResult] | None]]:
    """Every concurrency level against one server: its tokens/s and (``speculative``) the
    acceptance it reports."""
    model = served_model(url)
    out: list[tuple[dict[str, Any], list[SpecDecodeResult] | None]] = []
    for concurrency in cfg.served.concurrency:
        before = metrics_page(url) if speculative else ""
        run = run_requests(url, model, prompts, concurrency=concurrency,
                           max_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                           seed=cfg.seed, timeout_s=cfg.served.request_timeout_s)
        timing = {"concurrency": concurrency, "wall_s": run.wall_s,
                  "generated_tokens": sum(c.num_tokens for c in run.completions),
                  "tokens_per_s": run.tokens_per_s}
        if not speculative:
            out.append((timing, None))
            continue
        acceptance, results = _acceptance(run, before, metrics_page(url), cfg)
        out.append(({**timing, **acceptance}, results))
    return out


def _with_speedup(runs: list[dict[str, Any]], baseline: list[dict[str, Any]]) -> None:
    by_level = {b["concurrency"]: b["tokens_per_s"] for b in baseline}
    for run in runs:
        base = by_level.get(run["concurrency"])
        if base:
            run["speedup"] = run["tokens_per_s"] / base


def _token_budget(cfg: EvalConfig, prompts: Sequence[Sequence[int]], k: int) -> int | None:
    """On a CPU host, the token budget that keeps every prefill whole at up to ``k`` drafted
    tokens a step (``cpu_token_budget``); every server of a run gets the same."""
    if torch.cuda.is_available():
        return None
    return cpu_token_budget([len(p) for p in prompts], max(cfg.served.concurrency), k,
                            cfg.served.max_model_len)


def _served_by_vllm(cfg: EvalConfig, draft_cfg: Any, prompts: Sequence[Sequence[int]],
                    ) -> tuple[list[tuple[int, dict[str, Any], Any]], list[dict[str, Any]]]:
    """One engine per draft length, then (``baseline``) one without the draft."""
    logs = Path(cfg.out_dir) / "served_logs"
    runs = []
    ks = cfg.served.num_speculative_tokens or [num_speculative_tokens(draft_cfg)]
    budget = _token_budget(cfg, prompts, max(ks))
    for k in ks:
        with vllm_server(cfg.target, speculative_config(cfg, draft_cfg, k), cfg.served,
                         log=logs / f"k{k}.log", seed=cfg.seed, token_budget=budget) as url:
            runs += [(k, report, results) for report, results in
                     _measure(url, prompts, cfg, speculative=True)]
    baseline = []
    if cfg.served.baseline:
        with vllm_server(cfg.target, None, cfg.served, log=logs / "baseline.log",
                         seed=cfg.seed, token_budget=budget) as url:
            baseline = [timing for timing, _ in _measure(url, prompts, cfg, speculative=False)]
    return runs, baseline


def measure_served(cfg: EvalConfig, draft_cfg: Any, prompts: Sequence[Sequence[int]],
                   ) -> tuple[dict[str, Any], dict[tuple[int, int], list[SpecDecodeResult]]]:
    """The ``served`` section of the report, and each per-request run's records by
    (draft length, concurrency) for the reconciliation with the reference decoder."""
    if cfg.endpoint is not None:
        url = cfg.endpoint.rstrip("/")
        measured = _measure(url, prompts, cfg, speculative=True)
        runs = [(len(report.get("acceptance_by_position", [])), report, results)
                for report, results in measured]
        baseline = ([] if cfg.served.baseline_endpoint is None else
                    [t for t, _ in _measure(cfg.served.baseline_endpoint.rstrip("/"), prompts,
                                            cfg, speculative=False)])
    else:
        runs, baseline = _served_by_vllm(cfg, draft_cfg, prompts)
    reports = [{"num_speculative_tokens": k, **report} for k, report, _ in runs]
    _with_speedup(reports, baseline)
    section = {"engine": cfg.engine if cfg.endpoint is None else "endpoint",
               "url": cfg.endpoint, "method": serving_method(draft_cfg),
               "prompts": len(prompts), "runs": reports, "baseline": baseline}
    records = {(k, report["concurrency"]): results for k, report, results in runs
               if results is not None}
    for report in reports:
        logger.info("served k=%d, %d in flight: tau %.3f, %.1f tokens/s",
                    report["num_speculative_tokens"], report["concurrency"], report["tau"],
                    report["tokens_per_s"])
    return section, records
