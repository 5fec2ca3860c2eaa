"""Configs of ``sparkforge export`` and ``sparkforge eval``: torch-free, so parsing them is cheap.

Attribute docstrings become the ``--help`` text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from sparkforge.shared.config_types import type_problems
from sparkforge.shared.errors import ConfigError, SparkforgeError
from sparkforge.shared.image_sources import parse_image_sources
from sparkforge.trainer.architectures import Engine


@dataclass(frozen=True, kw_only=True)
class ExportConfig:
    """Export a training checkpoint as a vLLM / SGLang servable DSpark draft."""

    ckpt: str
    """Lightning checkpoint written by ``sparkforge train``."""
    out_dir: str
    """Directory to write (config.json, model.safetensors, sparkforge_export.json)."""
    engine: Engine = "any"
    """Engine the draft must be servable by: vllm, sglang or any (both)."""
    include_embeddings: bool = True
    """Ship exact copies of the target's embed_tokens / lm_head (engines share them when equal)."""
    overwrite: bool = False
    """Replace an existing export in ``out_dir`` instead of refusing."""
    eval_report: str | None = None
    """An ``eval_report.json`` of ``sparkforge eval`` whose tau, acceptance by position and
    calibration go into the model card (``README.md``)."""

    def __post_init__(self) -> None:
        typed = type_problems(self, prefix="export.")
        if typed:
            raise ConfigError("invalid export config:\n  " + "\n  ".join(typed))


@dataclass(frozen=True, kw_only=True)
class ServedOptions:
    """How ``sparkforge eval --engine vllm`` starts the target with the draft, and how the
    served measurement (``--engine`` or ``--endpoint``) sends its requests."""

    tensor_parallel_size: int = 1
    """GPUs the engine shards each layer over (vLLM's ``--tensor-parallel-size``)."""
    enable_expert_parallel: bool = False
    """Shard MoE experts across the parallel GPUs (vLLM's ``--enable-expert-parallel``)."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Activation dtype of the engine (the reference decoder runs the target in float32)."""
    max_model_len: int = 4096
    """Longest prompt plus generation the engine accepts."""
    num_speculative_tokens: list[int] = field(default_factory=list)
    """Tokens drafted per step; each value starts its own engine (a sweep). Empty: the draft's
    own (its block for DSpark, the block less its anchor for DFlash), the only value the
    reference decoder is compared at."""
    draft_sample_method: Literal["probabilistic", "greedy"] = "probabilistic"
    """vLLM's ``speculative_config.draft_sample_method``: "probabilistic" samples draft tokens
    from the draft's distribution and accepts by the probability ratio (what the reference
    decoder does, so the two are comparable at T>0); "greedy" (vLLM's own default) drafts the
    argmax and accepts it with the target's probability, which accepts less at T>0. Equal at
    T=0."""
    concurrency: list[int] = field(default_factory=lambda: [1])
    """Requests in flight; each value sends every prompt again (e.g. [1, 8, 64])."""
    baseline: bool = True
    """With ``--engine vllm``: also start the target without the draft, for tokens/s without
    it and the speedup."""
    baseline_endpoint: str | None = None
    """With ``--endpoint``: a server of the same target without a draft, for the speedup."""
    extra_args: list[str] = field(default_factory=list)
    """Further ``vllm serve`` arguments, as is (e.g. ["--enforce-eager", "--gpu-memory-utilization",
    "0.8"])."""
    python: str | None = None
    """Interpreter with vLLM installed that runs the server (default: this one)."""
    startup_timeout_s: float = 1800.0
    """Longest wait for a started engine to answer ``/health``."""
    request_timeout_s: float = 600.0
    """Longest wait for one completion."""
    acceptance_source: Literal["auto", "per_request", "counters"] = "auto"
    """Where served acceptance is read: each response's own counts (vLLM with
    ``--per-request-spec-decode-metrics``, which ``--engine vllm`` sets; gives the interval over
    prompts), the ``/metrics`` counters' change over the run, or per-request when the responses
    carry it and counters otherwise."""

    def problems(self) -> list[str]:
        """What is wrong with these options, one line each."""
        out = [f"eval.served.{name}={value} must be >= 1" for name, value in (
            ("tensor_parallel_size", self.tensor_parallel_size),
            ("max_model_len", self.max_model_len)) if value < 1]
        out += [f"eval.served.concurrency: {c} must be >= 1" for c in self.concurrency if c < 1]
        out += [f"eval.served.num_speculative_tokens: {k} must be >= 1"
                for k in self.num_speculative_tokens if k < 1]
        if not self.concurrency:
            out.append("eval.served.concurrency must name at least one level")
        return out


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Evaluate a draft against its target."""

    draft: str
    """A ``sparkforge train`` checkpoint (.ckpt) or an exported draft directory."""
    target: str
    """Local path of the target model (transformers format)."""
    out_dir: str
    """Where eval_report.json and acceptance_by_position.png are written."""
    cache: str | None = None
    """A cache whose eval split gives teacher-forced metrics (and prompts, without --prompts)."""
    prompts: str | None = None
    """Chat JSONL/Parquet (file, folder or glob, any fsspec URI) whose prompts are decoded."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options of the cache (e.g. S3 endpoint)."""
    image_sources: list[str] = field(default_factory=list)
    """Image prompts of a VL target: where their images may be read from besides data URIs,
    inline bytes and the prompts file's own folder (as ``sparkforge produce --image_sources``)."""
    num_prompts: int = 64
    """Held-out prompts decoded speculatively. On the shipped code target at T=1 the 95% interval
    of tau was +-6.8% at 32 prompts of 64 tokens, so 64 prompts give about +-5% (it shrinks as
    1/sqrt(prompts)); greedy decoding varies more between prompts (+-16% at 32: about 320)."""
    max_new_tokens: int = 128
    """Tokens generated per prompt."""
    temperature: float = 1.0
    """1 = the target's own distribution, the temperature ``regenerate`` samples at by default,
    so the eval split matches what is measured; 0 = greedy (the output equals the target's
    greedy decoding)."""
    confidence_threshold: float | None = None
    """Verify only the slots before the first confidence below this value."""
    policy_thresholds: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
    """Confidence thresholds of the teacher-forced verification-policy table."""
    max_eval_batches: int | None = None
    """Limit teacher-forced batches (None: the whole eval split)."""
    context_buckets: tuple[int, ...] = (1024, 4096, 16384)
    """Context lengths (tokens before a block's anchor) cutting the ``by_context`` buckets of
    both taus: the default gives <1K, 1K-4K, 4K-16K and >=16K."""
    thinking_tags: tuple[str, ...] = ("<think>", "</think>")
    """Text marking a thinking turn (either tag) for the ``by_turn`` split of both taus."""
    tool_call_tag: str = "<tool_call>"
    """Text marking a turn that calls a tool, for the ``by_turn`` split."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Template variables rendering ``--prompts`` (e.g. ``{"enable_thinking": true}``); None:
    those the cache was captured with (its manifest's ``producer_config``), else none."""
    seed: int = 0
    """Seed of the teacher-forced anchor sampling and of T > 0 token sampling."""
    device: str = "auto"
    """"auto" (cuda when available), "cpu" or "cuda"."""
    fit_calibration: bool = True
    """With a cache and a confidence head: fit per-slot temperatures of the head (STS) on half
    the eval split, report the head and the head-free ``max q`` before and after on the other
    half and on the speculative accept events, and write ``confidence_calibration.json`` (the
    file TensorRT-LLM, SGLang and DeepSpec read) beside the report."""
    reference: bool = True
    """Decode with the reference decoder (a transformers target at batch 1). False for a target
    too large for that: the report then has the served and teacher-forced tau only."""
    engine: Literal["none", "vllm"] = "none"
    """"vllm": also measure the draft as served: the target in vLLM (``vllm serve`` in a child
    process, so eval never imports vLLM) with the exported draft as its speculative_config."""
    endpoint: str | None = None
    """Also measure a running OpenAI-compatible server (vLLM or SGLang) that serves the target
    with this draft, at this base URL (e.g. http://127.0.0.1:8000)."""
    served: ServedOptions = field(default_factory=ServedOptions)
    """Engine arguments and request settings of the served measurement."""

    def __post_init__(self) -> None:
        typed = type_problems(self, prefix="eval.")
        if typed:
            raise ConfigError("invalid eval config:\n  " + "\n  ".join(typed))
        problems = [f"eval.{n}={v} must be >= 1" for n, v in (
            ("num_prompts", self.num_prompts), ("max_new_tokens", self.max_new_tokens)) if v < 1]
        if self.temperature < 0:
            problems.append(f"eval.temperature={self.temperature} must be >= 0")
        if self.cache is None and self.prompts is None:
            problems.append("eval needs --cache or --prompts (or both)")
        if self.engine != "none" and self.endpoint is not None:
            problems.append("eval takes --engine or --endpoint, not both")
        serves = self.engine != "none" or self.endpoint is not None
        if not (self.reference or serves or self.cache):
            problems.append("eval.reference=false needs --engine, --endpoint or --cache: "
                            "nothing would be measured")
        problems += self.served.problems() if serves else []
        edges = self.context_buckets
        if any(e < 1 for e in edges) or any(b <= a for a, b in zip(edges, edges[1:], strict=False)):
            problems.append(f"eval.context_buckets={list(edges)}: expected positive, strictly "
                            "increasing token counts")
        problems += [f"eval.policy_thresholds: {t} is outside [0, 1]"
                     for t in self.policy_thresholds if not 0.0 <= t <= 1.0]
        try:
            parse_image_sources(self.image_sources)
        except ValueError as exc:
            problems.append(str(exc))
        if problems:
            raise SparkforgeError("invalid eval config:\n  " + "\n  ".join(problems))
