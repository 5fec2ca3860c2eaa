"""Export a training checkpoint as the HF-style DSpark draft that vLLM and SGLang load as-is.

The layout is the one format both engines load: a Qwen3-shaped ``config.json`` built with
``transformers.Qwen3Config`` plus the DSpark fields, bare tensor keys in bf16 ``model.safetensors``,
and a provenance file beside it. The exporter refuses drafts an engine would load wrongly or
silently half-initialise, and checks its own key set and shapes before writing anything.
"""

from __future__ import annotations

import json
import logging
import pickle
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file

from sparkforge.shared.provenance import package_version
from sparkforge.trainer.draft_config import DSparkDraftConfig, serving_config

logger = logging.getLogger(__name__)

Engine = Literal["vllm", "sglang", "any"]
OPTIONAL_KEYS = ("embed_tokens.weight", "lm_head.weight")
# Never written: a non-persistent buffer (rotary inv_freq) and tensors vLLM skips or drops.
TRAINING_ONLY = ("rotary_emb.", "t2d", "mask_embedding")


class ExportError(ValueError):
    """Raised when a checkpoint cannot be exported as a servable draft; lists every reason."""


def serving_problems(cfg: DSparkDraftConfig, engine: Engine) -> list[str]:
    """Reasons ``engine`` could not serve this draft correctly (empty when it can)."""
    problems = []
    last = cfg.num_target_layers - 1
    bad_ids = [i for i in cfg.target_layer_ids if i < 0 or i >= last]
    if bad_ids:
        problems.append(
            f"target_layer_ids {bad_ids} outside [0, {last - 1}]: vLLM serves id {last} (the last "
            "layer) pre-norm while training saw it post-norm, and SGLang cannot capture -1")
    if not 0 <= cfg.mask_token_id < cfg.vocab_size:
        problems.append(f"mask_token_id={cfg.mask_token_id} must be below "
                        f"vocab_size={cfg.vocab_size}")
    if cfg.embedding_scale != 1.0 or cfg.final_logit_softcapping:
        problems.append("the draft uses a Gemma-style embedding scale or logit softcap, which the "
                        "Qwen3-shaped serving format cannot express")
    if engine in ("vllm", "any"):
        if cfg.markov_rank == 0:
            problems.append("markov_rank=0: vLLM's DSpark draft has no rank-0 path (markov_rank "
                            "must be > 0)")
        elif cfg.markov_head_type != "vanilla":
            problems.append(f"markov_head_type={cfg.markov_head_type!r}: vLLM builds only the "
                            "vanilla Markov head and fails to load gated/rnn weights")
    if engine in ("sglang", "any") and not cfg.enable_confidence_head:
        problems.append("enable_confidence_head=False: SGLang builds the confidence head anyway "
                        "and refuses a draft without its weights")
    return problems


def hf_config(cfg: DSparkDraftConfig) -> dict[str, Any]:
    """``config.json`` contents: a Qwen3Config with the DSpark fields."""
    from transformers import Qwen3Config

    fields = serving_config(cfg)
    fields["max_window_layers"] = cfg.num_hidden_layers
    out: dict[str, Any] = Qwen3Config(**fields, dtype="bfloat16").to_dict()
    assert out["model_type"] == "qwen3", out["model_type"]
    assert out["architectures"] == ["Qwen3DSparkModel"], out["architectures"]
    return out


def expected_shapes(cfg: DSparkDraftConfig) -> dict[str, tuple[int, ...]]:
    """Every required tensor and its shape for this config (11 per draft layer + 7 shared)."""
    h, hd, i_sz, v, r = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size,
                         cfg.markov_rank)
    nq, nkv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, cfg.num_features * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for layer in range(cfg.num_hidden_layers):
        p = f"layers.{layer}."
        shapes |= {
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (nq, h), p + "self_attn.k_proj.weight": (nkv, h),
            p + "self_attn.v_proj.weight": (nkv, h), p + "self_attn.o_proj.weight": (h, nq),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (i_sz, h), p + "mlp.up_proj.weight": (i_sz, h),
            p + "mlp.down_proj.weight": (h, i_sz),
        }
        if cfg.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (nq,), p + "self_attn.k_proj.bias": (nkv,),
                       p + "self_attn.v_proj.bias": (nkv,)}
    if r > 0:
        shapes |= {"markov_head.markov_w1.weight": (v, r), "markov_head.markov_w2.weight": (v, r)}
    if cfg.enable_confidence_head:
        width = h + (r if cfg.confidence_head_with_markov and r > 0 else 0)
        shapes |= {"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)}
    return shapes


def key_problems(cfg: DSparkDraftConfig, tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Exact key-set and shape check: vLLM never reports a missing tensor, so we must."""
    want = expected_shapes(cfg) | {k: (cfg.vocab_size, cfg.hidden_size) for k in OPTIONAL_KEYS}
    problems = [f"missing tensor {k} {list(s)}" for k, s in want.items()
                if k not in tensors and k not in OPTIONAL_KEYS]
    problems += [f"unexpected tensor {k}" for k in tensors if k not in want]
    problems += [f"{k}: shape {list(tensors[k].shape)}, expected {list(s)}"
                 for k, s in want.items() if k in tensors and tuple(tensors[k].shape) != s]
    return problems


def draft_tensors(state_dict: Mapping[str, torch.Tensor], *,
                  prefix: str = "model.") -> dict[str, torch.Tensor]:
    """Bare draft keys from a Lightning state dict: strip the holder prefix and ``_orig_mod.``."""
    out = {}
    for key, value in state_dict.items():
        if not key.startswith(prefix):
            continue
        bare = key[len(prefix):].replace("_orig_mod.", "")
        if not any(bare.startswith(t) or t in bare for t in TRAINING_ONLY):
            out[bare] = value
    return out


def _versions() -> dict[str, str]:
    return {name: package_version(name) or "not installed"
            for name in ("sparkforge", "torch", "transformers", "lightning", "safetensors")}


def export_draft(
    cfg: DSparkDraftConfig,
    tensors: Mapping[str, torch.Tensor],
    out_dir: str | Path,
    *,
    engine: Engine = "any",
    include_embeddings: bool = True,
    provenance: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Check and write the servable draft directory; nothing is written if a check fails.

    Raises:
        ExportError: listing every serving and key-set problem.
    """
    out = Path(out_dir)
    tensors = {k: v for k, v in tensors.items() if include_embeddings or k not in OPTIONAL_KEYS}
    problems = serving_problems(cfg, engine) + key_problems(cfg, tensors)
    if out.exists() and any(out.iterdir()) and not overwrite:
        problems.append(f"{out} exists and is not empty (pass --overwrite to replace it)")
    if problems:
        raise ExportError("cannot export a servable DSpark draft:\n  " + "\n  ".join(problems))
    bf16 = {k: (v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach()).contiguous()
            for k, v in sorted(tensors.items())}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    save_file(bf16, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(hf_config(cfg), indent=2, sort_keys=True) + "\n")
    info = {"draft_config": cfg.to_dict(), "engine_checked": engine, "versions": _versions(),
            **dict(provenance or {})}
    (tmp / "sparkforge_export.json").write_text(json.dumps(info, indent=2, default=str) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.replace(out)
    logger.info("exported %d tensors (%s) to %s", len(bf16), engine, out)
    return out


def read_checkpoint(
    ckpt_path: str | Path,
) -> tuple[DSparkDraftConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """The draft config, bare draft tensors and provenance of a ``sparkforge train`` checkpoint."""
    # weights_only: a checkpoint is a pickle, and a foreign one could run code on load; ours holds
    # only tensors and plain containers (lit_module saves hyperparameters as dicts).
    try:
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ExportError(f"{ckpt_path} holds objects other than tensors and plain containers: "
                          "not a sparkforge train checkpoint") from exc
    if "draft_config" not in ckpt:
        raise ExportError(f"{ckpt_path} has no draft_config: not a sparkforge train checkpoint")
    provenance = {"checkpoint": str(ckpt_path), "global_step": ckpt.get("global_step"),
                  "epoch": ckpt.get("epoch"), **ckpt.get("sparkforge_provenance", {})}
    cfg = DSparkDraftConfig.from_dict(ckpt["draft_config"])
    return cfg, draft_tensors(ckpt["state_dict"]), provenance


def export_checkpoint(ckpt_path: str | Path, out_dir: str | Path, **kwargs: Any) -> Path:
    """Export a ``sparkforge train`` Lightning checkpoint (see ``export_draft`` for options)."""
    cfg, tensors, provenance = read_checkpoint(ckpt_path)
    return export_draft(cfg, tensors, out_dir, provenance=provenance, **kwargs)


def draft_config_from_hf(config: Mapping[str, Any]) -> DSparkDraftConfig:
    """Read a DSpark ``config.json`` (ours, DeepSpec's or NeMo's Qwen3-shaped drafts)."""
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "vocab_size", "rms_norm_eps", "rope_parameters",
            "max_position_embeddings", "attention_bias", "num_hidden_layers", "block_size",
            "num_anchors", "markov_rank", "markov_head_type", "enable_confidence_head",
            "confidence_head_with_markov", "mask_token_id", "target_layer_ids",
            "num_target_layers", "initializer_range")
    fields = {k: config[k] for k in keys if config.get(k) is not None}
    return DSparkDraftConfig(**fields)


def load_draft(path: str | Path) -> Any:
    """A ``DSparkDraftModel`` from an exported directory or a ``sparkforge train`` checkpoint.

    Every required tensor must be present with its shape (the export self-check).
    """
    from safetensors.torch import load_file

    from sparkforge.trainer.model import DSparkDraftModel

    root = Path(path)
    if root.is_dir():
        cfg = draft_config_from_hf(json.loads((root / "config.json").read_text()))
        tensors = load_file(str(root / "model.safetensors"))
    else:
        cfg, tensors, _ = read_checkpoint(root)
    problems = key_problems(cfg, tensors)
    if problems:
        raise ExportError(f"{root} is not a complete DSpark draft:\n  " + "\n  ".join(problems))
    model = DSparkDraftModel(cfg)
    model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    return model.eval()
