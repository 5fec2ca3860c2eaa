"""vLLM engine options that matter on GPU inference nodes, passed through to ``vllm.LLM``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from sparkforge.shared.config_types import type_problems
from sparkforge.shared.errors import ConfigError, SparkforgeError


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """How to start the frozen target in vLLM (names follow vLLM's engine arguments)."""

    model: str
    """Local folder of the target checkpoint (config.json + weights)."""
    revision: str | None = None
    """Model revision, recorded in the manifest."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Activation dtype; FP8/NVFP4 checkpoints still run bf16 activations."""
    quantization: str | None = None
    """Weight quantization ("fp8", "modelopt_fp4", ...); None = as the checkpoint says."""
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    """KV cache dtype; "auto" uses the model's dtype."""
    tensor_parallel_size: int = 1
    """GPUs one engine shards each layer over."""
    data_parallel_size: int = 1
    """Engine replicas inside this worker."""
    enable_expert_parallel: bool = False
    """Shard MoE experts across the parallel GPUs instead of splitting each expert."""
    max_model_len: int = 4096
    """Longest sequence the engine serves, prompt and generated tokens (the default
    ``max_seq_len``): a captured sample has at most ``max_model_len - 1`` tokens."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory vLLM may claim, in (0, 1]."""
    max_num_seqs: int = 256
    """Most requests the engine schedules at once."""
    max_num_batched_tokens: int | None = None
    """Token budget per engine step; None = vLLM's default."""
    enable_chunked_prefill: bool = True
    """Split long prompts across engine steps."""
    enforce_eager: bool = False
    """Skip CUDA graph capture (faster start-up, slower steps)."""
    seed: int = 0
    """Engine random seed."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Any further vLLM engine argument, passed as-is (e.g. {"kv_cache_memory_bytes": ...})."""

    def __post_init__(self) -> None:
        typed = type_problems(self, prefix="--engine.")
        if typed:
            raise ConfigError("invalid engine options:\n  " + "\n  ".join(typed))
        problems = []
        for name in ("tensor_parallel_size", "data_parallel_size", "max_model_len", "max_num_seqs"):
            if getattr(self, name) < 1:
                problems.append(f"engine.{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            value = self.gpu_memory_utilization
            problems.append(f"engine.gpu_memory_utilization must be in (0, 1], got {value}")
        if problems:
            raise SparkforgeError("invalid engine options:\n  " + "\n  ".join(problems))
