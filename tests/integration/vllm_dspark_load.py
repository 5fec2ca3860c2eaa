"""Load an exported draft through vLLM's own DSpark, DFlash or DFlash2 classes on CPU; print a JSON
account.

Run in a separate interpreter (``python vllm_dspark_load.py TARGET DRAFT [METHOD]``, METHOD
``dspark`` (default) or ``dflash``, also for a DFlash2 draft) so the training environment never
imports vLLM. Two vLLM code paths run, no forward pass:
1. config resolution: ``EngineArgs(..., speculative_config={"method": METHOD, "model": DRAFT})``
   ``.create_engine_config()`` and the aux-layer ids vLLM derives from the draft config;
2. the class vLLM's registry resolves the draft's architecture to (``Qwen3DSparkForCausalLM``,
   ``Gemma4DSparkForCausalLM``, ``K3DSparkForCausalLM``, ``DFlashQwen3ForCausalLM``,
   ``DFlash2Qwen3ForCausalLM``), built from that config, then its ``load_weights`` on CPU; every
   parameter is compared with the checkpoint tensor(s) it was loaded from.

One in-process patch, for dspark and DFlash2 drafts only: vLLM runs DSpark and DFlash2's
candidate head only on its V2 GPU runner, which needs Triton, so ``VllmConfig`` rejects "dspark
speculative decoding" / "DFlash candidate-head drafts" on the V1 runner CPU builds use. For a
DFlash2 draft the script first records that refusal unpatched (``v1_refusal``: what serving it
on CPU answers), then removes the one entry from the V1 unsupported-feature list for the rest
of the process; nothing else is patched. DFlash runs on the V1 runner as is.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


V1_ONLY_ON_GPU = {"dspark": "dspark speculative decoding",
                  "DFlash2DraftModel": "DFlash candidate-head drafts"}
"""The V1-runner refusal the script lifts, by method or draft architecture."""


def patch_v1_rejection(feature: str) -> None:
    from vllm.config.vllm import VllmConfig

    original = VllmConfig._get_v1_model_runner_unsupported_features

    def without(self: VllmConfig) -> list[str]:
        return [f for f in original(self) if f != feature]

    VllmConfig._get_v1_model_runner_unsupported_features = without  # type: ignore[method-assign]


def engine_config(target: str, speculative: dict[str, object]) -> object:
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=target, speculative_config=speculative, max_model_len=256,
                      enable_prefix_caching=False, enforce_eager=True).create_engine_config()


def _sources(name: str, ckpt: dict[str, torch.Tensor]) -> list[str]:
    """Checkpoint keys a vLLM parameter is loaded from (stacked ones concatenated in order)."""
    bare = name.removeprefix("model.")
    if bare == "context_kv_proj.weight":  # K3: every layer's kv_a_proj_with_mqa, in layer order
        depth = len({key.split(".")[1] for key in ckpt if key.startswith("layers.")})
        return [f"layers.{i}.self_attn.kv_a_proj_with_mqa.weight" for i in range(depth)]
    stacks = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
              "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa")}
    for fused, parts in stacks.items():
        if f".{fused}." in bare:
            return [bare.replace(fused, p) for p in parts]
    return [bare] if bare in ckpt else []


_DISTRIBUTED: list[bool] = []


def main(target: str, draft: str, method: str = "dspark") -> dict[str, object]:
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
        get_eagle3_aux_layers_from_config,
    )

    draft_config = json.loads((Path(draft) / "config.json").read_text())
    speculative: dict[str, object] = {"method": method, "model": draft}
    if method == "dflash":  # vLLM takes DFlash's draft length from the command, not the config
        speculative["num_speculative_tokens"] = draft_config["block_size"] - 1
    refusal = None
    if draft_config["architectures"][0] in V1_ONLY_ON_GPU:   # what serving it on CPU answers
        try:
            engine_config(target, speculative)
        except ValueError as exc:
            refusal = str(exc)
    feature = V1_ONLY_ON_GPU.get(method) or V1_ONLY_ON_GPU.get(draft_config["architectures"][0])
    if feature is not None:
        patch_v1_rejection(feature)
    cfg = engine_config(target, speculative)
    spec = cfg.speculative_config
    architecture = spec.draft_model_config.hf_config.architectures[0]
    model_cls = ModelRegistry.resolve_model_cls(
        [architecture], spec.draft_model_config)[0]
    ckpt = load_file(str(Path(draft) / "model.safetensors"))
    with set_current_vllm_config(cfg), torch.device("cpu"):
        if not _DISTRIBUTED:   # once per process: every draft loads in the same one
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{port}")
            initialize_model_parallel(1, 1)
            _DISTRIBUTED.append(True)
        model = model_cls(vllm_config=cfg)
        model.load_weights(iter(ckpt.items()))
    params = dict(model.named_parameters())
    markov_bias = {}
    if hasattr(model, "markov_bias"):  # DSpark: the bias as served vs W2 @ W1[token] computed here
        ids = torch.arange(4)
        with set_current_vllm_config(cfg), torch.no_grad():
            served_bias = model.markov_bias(model.markov_embed(ids)).float()
        plain_bias = ckpt["markov_head.markov_w1.weight"][ids].float() @ ckpt[
            "markov_head.markov_w2.weight"].float().T
        cap = getattr(spec.draft_model_config.hf_config, "final_logit_softcapping", None)
        capped_bias = torch.tanh(plain_bias / cap) * cap if cap else plain_bias
        markov_bias = {"markov_bias_vs_plain": float((served_bias - plain_bias).abs().max()),
                       "markov_bias_vs_softcapped": float((served_bias - capped_bias).abs().max())}
    unmatched, mismatched, used = [], [], set()
    for name, param in params.items():
        keys = _sources(name, ckpt)
        if not keys or any(k not in ckpt for k in keys):
            unmatched.append(name)
            continue
        used |= set(keys)
        want = torch.cat([ckpt[k] for k in keys]).float()
        if not torch.equal(param.detach().float().cpu(), want):
            mismatched.append(name)
    return {
        "method": spec.method,
        "num_speculative_tokens": spec.num_speculative_tokens,
        "aux_layer_ids": list(get_eagle3_aux_layers_from_config(spec) or ()),
        "draft_architecture": spec.draft_model_config.hf_config.architectures,
        "model_class": type(model).__name__,
        "num_params": len(params),
        "params_without_tensor": unmatched,
        "params_not_equal": mismatched,
        "tensors_not_loaded": sorted(set(ckpt) - used),
        "confidence_head": getattr(model.model, "confidence_head", None) is not None,
        "mask_token_id": getattr(model.model, "mask_token_id", None),
        "v1_refusal": refusal,
        **markov_bias,
    }


if __name__ == "__main__":
    # TARGET DRAFT [METHOD]: one account; TARGET DRAFT METHOD DRAFT METHOD ...: a list of them.
    target_dir, rest = sys.argv[1], sys.argv[2:]
    if len(rest) <= 2:
        print("RESULT " + json.dumps(main(target_dir, *rest)))
    else:
        print("RESULT " + json.dumps([main(target_dir, d, m) for d, m in zip(
            rest[::2], rest[1::2], strict=True)]))
