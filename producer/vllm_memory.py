"""Host memory for a vLLM engine on the CPU platform: sized from the run, checked before start.

vLLM's CPU worker (``vllm/v1/worker/cpu_worker.py``) reads ``gpu_memory_utilization`` as the share
of *host* memory that must be free when it starts, unless the KV cache has an explicit size
(``kv_cache_memory_bytes``; ``VLLM_CPU_KVCACHE_SPACE`` in GiB overrides it), and then fills that
whole share, less its own footprint, with KV cache. At 0.9 a start on a busy host fails, and the
worker's reason reaches the caller only as "Engine core initialization failed". Here the KV cache
always gets an explicit size (the one the run asks for, else ``DEFAULT_KV_GIB``), the share is that
plus the model weights, and a host without that much free memory is refused in one line first.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

from vllm.platforms import current_platform
from vllm.utils.cpu_resource_utils import (
    get_allowed_cpu_list,
    get_memory_node_info,
    get_visible_memory_node,
)

from sparkforge.shared.errors import ConfigError, SparkforgeError

logger = logging.getLogger(__name__)

GIB = 1 << 30
KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
DEFAULT_KV_GIB = 1
"""KV cache of a CPU engine when the run names none (the size the examples and tests run with)."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


class HostMemoryError(SparkforgeError):
    """The host has less free memory than the CPU engine needs."""


def cpu_engine_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with the CPU engine's KV size and memory share set from what the run needs.

    Unchanged off the CPU platform. Raises HostMemoryError when the KV cache plus the weights
    exceed the memory vLLM would find free on the engine's memory node.
    """
    if not current_platform.is_cpu():
        return kwargs
    kv_bytes, asked_by, setting = _kv_ask(kwargs)
    weights = weight_bytes(Path(kwargs["model"]))
    wanted = kv_bytes + weights
    free, total = _node_memory()
    if wanted > free:
        raise HostMemoryError(
            f"the vLLM CPU engine needs {_gib(wanted)} GiB of host memory (KV cache "
            f"{_gib(kv_bytes)} GiB from {asked_by} + weights {_gib(weights)} GiB) but only "
            f"{_gib(free)} of {_gib(total)} GiB is free; lower {setting} or free memory")
    share = min(1.0, math.ceil(1000 * wanted / total) / 1000)
    logger.info("CPU engine: KV cache %s GiB (%s) + weights %s GiB = gpu_memory_utilization %s "
                "of %s GiB host memory", _gib(kv_bytes), asked_by, _gib(weights), share,
                _gib(total))
    return kwargs | {"kv_cache_memory_bytes": kv_bytes, "gpu_memory_utilization": share}


def _kv_ask(kwargs: dict[str, Any]) -> tuple[int, str, str]:
    """(KV cache bytes the run asks for, what asks, the setting to change), in vLLM's precedence:
    ``VLLM_CPU_KVCACHE_SPACE`` over ``kv_cache_memory_bytes`` over the default."""
    env_setting = f"{KV_ENV} (GiB)"
    if value := os.environ.get(KV_ENV, ""):
        if not value.isdigit():
            raise ConfigError(f"{KV_ENV}={value[:40]!r} must be a whole number of GiB")
        return int(value) * GIB, f"{KV_ENV}={value}", env_setting
    if kwargs.get("kv_cache_memory_bytes") is not None:
        setting = "engine.extra.kv_cache_memory_bytes"
        return int(kwargs["kv_cache_memory_bytes"]), setting, setting
    return DEFAULT_KV_GIB * GIB, f"the default ({KV_ENV} unset)", env_setting


def weight_bytes(model_dir: Path) -> int:
    """Bytes of the checkpoint's weight files (0 for a hub name vLLM resolves itself)."""
    if not model_dir.is_dir():
        return 0
    return sum(f.stat().st_size for f in model_dir.iterdir()
               if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES))


def _node_memory() -> tuple[int, int]:
    """(available, total) bytes of the memory node vLLM's CPU worker binds, as it measures them."""
    node = get_allowed_cpu_list()[0].numa_node
    visible = get_visible_memory_node()
    info = get_memory_node_info(node if node in visible else visible[0])
    return info.available_memory, info.total_memory


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"
