"""The target's identity for the cache header and the files the trainer needs from it.

The trainer recomputes teacher logits from the post-norm state, so the cache carries the target's
``config.json``, tokenizer files and ``embed_tokens`` / ``lm_head`` / final-norm weights
(dspark-algorithm.md section 15), dequantized to the cache's hidden dtype.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save as save_safetensors

from sparkforge.producer.engine_options import EngineOptions
from sparkforge.shared.header import TargetInfo

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json",
)
_FINGERPRINT_BYTES = 1 << 20
_FLOAT8 = {torch.float8_e4m3fn, torch.float8_e5m2}


def resolve_model_dir(engine: EngineOptions) -> Path:
    """A local folder holding the checkpoint: the path itself, or the Hugging Face cache copy."""
    path = Path(engine.model)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(engine.model, revision=engine.revision))


def read_config(model_dir: Path) -> dict[str, Any]:
    """``config.json`` with the text model's sizes lifted to the top (multimodal checkpoints)."""
    config: dict[str, Any] = json.loads((model_dir / "config.json").read_text())
    return {**config, **config.get("text_config", {})}


def content_hash(model_dir: Path) -> str:
    """Fingerprint of config and weights: config bytes, and per weight file its name, size,
    safetensors header and first and last MiB (hashing every byte of a 1 TB target is too slow)."""
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for file in sorted(model_dir.glob("*.safetensors")):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with file.open("rb") as f:
            digest.update(f.read(_FINGERPRINT_BYTES))
            f.seek(max(0, size - _FINGERPRINT_BYTES))
            digest.update(f.read())
    return digest.hexdigest()


def target_identity(engine: EngineOptions, model_dir: Path) -> TargetInfo:
    """The header's ``target`` section."""
    config = read_config(model_dir)
    quant = config.get("quantization_config") or {}
    return TargetInfo(
        name_or_path=engine.model,
        revision=engine.revision,
        content_hash=content_hash(model_dir),
        model_type=config["model_type"],
        architecture=(config.get("architectures") or [config["model_type"]])[0],
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        num_hidden_layers=config["num_hidden_layers"],
        dtype=str(config.get("dtype") or config.get("torch_dtype") or engine.dtype),
        quantization=engine.quantization or quant.get("quant_method"),
    )


def _tensor_locations(model_dir: Path) -> dict[str, Path]:
    locations: dict[str, Path] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            locations.update(dict.fromkeys(f.keys(), file))
    return locations


def _load(locations: dict[str, Path], name: str) -> torch.Tensor:
    with safe_open(str(locations[name]), framework="pt") as f:
        tensor: torch.Tensor = f.get_tensor(name)
    if tensor.dtype not in _FLOAT8:
        return tensor.float()
    scale_name = next((name + s for s in ("_scale_inv", "_scale") if name + s in locations), None)
    if scale_name is None:
        raise ValueError(f"target: {name} is {tensor.dtype} without a scale tensor")
    with safe_open(str(locations[scale_name]), framework="pt") as f:
        scale: torch.Tensor = f.get_tensor(scale_name).float()
    if scale.numel() > 1:  # block scales, e.g. [ceil(O/128), ceil(I/128)]
        rows, cols = (-(-n // s) for n, s in zip(tensor.shape, scale.shape, strict=True))
        scale = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
        scale = scale[: tensor.shape[0], : tensor.shape[1]]
    return tensor.float() * scale


def _find(locations: dict[str, Path], suffix: str, exclude: str = "\0") -> str | None:
    names = sorted((n for n in locations if n.endswith(suffix) and exclude not in n), key=len)
    return names[0] if names else None


def target_files(model_dir: Path, *, hidden_dtype: str) -> dict[str, bytes]:
    """config.json, tokenizer files and ``weights.safetensors`` (embed, lm_head, norm) as bytes.

    Raises:
        ValueError: A weight is missing or quantized in a format this cannot dequantize.
    """
    locations = _tensor_locations(model_dir)
    config = read_config(model_dir)
    embed = _find(locations, "embed_tokens.weight")
    head = _find(locations, "lm_head.weight")
    norm = _find(locations, "norm.weight", exclude="layers.")
    if head is None and config.get("tie_word_embeddings"):
        head = embed
    found = {"embed_tokens": embed, "lm_head": head, "norm": norm}
    missing = [k for k, v in found.items() if not v]
    if missing:
        raise ValueError(f"target: checkpoint {model_dir} has no {missing} weight")
    dtype = getattr(torch, hidden_dtype)
    weights = {f"{key}.weight": _load(locations, str(name)).to(dtype).contiguous()
               for key, name in found.items()}
    files = {"config.json": (model_dir / "config.json").read_bytes()}
    files |= {n: (model_dir / n).read_bytes() for n in TOKENIZER_FILES if (model_dir / n).exists()}
    files["weights.safetensors"] = save_safetensors(weights)
    return files
