"""Resolve exported drafts' configs through vLLM's speculative config; print a JSON account.

Run in a separate interpreter (``python vllm_draft_resolve.py TARGET DRAFT [DRAFT ...]``) so the
training environment never imports vLLM. For each draft it builds ``EngineArgs(...,
speculative_config={"method": "dspark", "model": DRAFT}).create_engine_config()`` and reports the
model type and architecture vLLM gave the draft (its config rewrites turn GLM, DeepSeek and Kimi
model types into MTP drafters) or the error it raised. No weights are loaded; the one patch is
the V1-runner rejection that ``vllm_dspark_load`` also removes.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # run with -P: the sibling script is not on it
from vllm_dspark_load import V1_ONLY_ON_GPU, patch_v1_rejection  # noqa: E402

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def resolve(target: str, draft: str) -> dict[str, object]:
    from vllm.engine.arg_utils import EngineArgs

    try:
        cfg = EngineArgs(model=target, speculative_config={"method": "dspark", "model": draft},
                         max_model_len=256, enable_prefix_caching=False,
                         enforce_eager=True).create_engine_config()
    except Exception as exc:  # recorded: a draft vLLM cannot resolve is a result here
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}
    hf_config = cfg.speculative_config.draft_model_config.hf_config
    return {"method": cfg.speculative_config.method, "model_type": hf_config.model_type,
            "architectures": list(hf_config.architectures)}


if __name__ == "__main__":
    patch_v1_rejection(V1_ONLY_ON_GPU["dspark"])
    accounts = {draft: resolve(sys.argv[1], draft) for draft in sys.argv[2:]}
    print("RESULT " + json.dumps(accounts))
