"""Configs of ``sparkforge export`` and ``sparkforge eval``: torch-free, so parsing them is cheap.

Attribute docstrings become the ``--help`` text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
