"""The target's identity for the cache header and the files the trainer needs from it.

The trainer recomputes teacher logits from the final state, so the cache carries the target's
``config.json``, tokenizer files and the pieces its family lists (``embed_tokens``, ``lm_head``,
the final norm, and for DeepSeek-V4 the ``hc_head`` weights), dequantized to the cache's hidden
dtype and stored under the family's cache names whatever the checkpoint calls them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save as save_safetensors

from sparkforge.producer.dequant import FP8, dequantize, is_quantized
from sparkforge.producer.engine_options import EngineOptions
from sparkforge.shared.errors import ConfigError, SparkforgeError
from sparkforge.shared.header import TargetInfo
from sparkforge.shared.target_config import read_target_config
from sparkforge.shared.target_families import family_of_config

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json",
)
_FINGERPRINT_BYTES = 1 << 20


def resolve_model_dir(engine: EngineOptions) -> Path:
    """A local folder holding the checkpoint: the path itself, or the Hugging Face cache copy.

    Raises:
        ConfigError: ``engine.model`` names no checkpoint folder and no Hub model it can get.
    """
    path = Path(engine.model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"--engine.model {engine.model}: the folder holds no config.json "
                              "(not a checkpoint)")
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return Path(snapshot_download(engine.model, revision=engine.revision))
    except HFValidationError as exc:
        raise ConfigError(f"--engine.model {engine.model}: neither a checkpoint folder nor a "
                          "Hugging Face model id") from exc
    except OSError as exc:  # not cached and not reachable, no such repo or revision
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"--engine.model {engine.model}: not a local folder, and the Hugging "
                          f"Face Hub could not provide it ({type(exc).__name__}: {first[:200]})"
                          ) from exc


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
    config = read_target_config(model_dir).text
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


def tensor_locations(model_dir: Path) -> dict[str, Path]:
    """Every tensor name of the checkpoint -> its safetensors file (the index when there is one)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    locations: dict[str, Path] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            locations.update(dict.fromkeys(f.keys(), file))
    return locations


def fp8_block_size(config: dict[str, Any]) -> tuple[int, ...] | None:
    """``quantization_config.weight_block_size`` of a block-scaled FP8 checkpoint, if any."""
    block = (config.get("quantization_config") or {}).get("weight_block_size")
    return tuple(int(b) for b in block) if block else None


def _scale_name(locations: dict[str, Path], name: str) -> str | None:
    candidates = [name + "_scale_inv", name + "_scale"]
    if name.endswith(".weight"):  # DeepSeek's release names the scale of X.weight X.scale
        candidates.append(name.removesuffix(".weight") + ".scale")
    return next((c for c in candidates if c in locations), None)


def load_tensor(locations: dict[str, Path], name: str,
                block: tuple[int, ...] | None = None) -> torch.Tensor:
    """One checkpoint tensor in fp32; FP8 and packed FP4 weights times their block scales.

    ``block`` is the checkpoint's FP8 ``weight_block_size``; FP4 blocks follow from the shapes.

    Raises:
        ValueError: A quantized weight without a scale tensor, or with a scale grid that does
            not fit it.
    """
    with safe_open(str(locations[name]), framework="pt") as f:
        tensor: torch.Tensor = f.get_tensor(name)
    if not is_quantized(tensor):
        return tensor.float()
    scale_name = _scale_name(locations, name)
    if scale_name is None:
        raise SparkforgeError(f"target: {name} is {tensor.dtype} without a scale tensor")
    with safe_open(str(locations[scale_name]), framework="pt") as f:
        scale: torch.Tensor = f.get_tensor(scale_name)
    try:
        return dequantize(tensor, scale, block if tensor.dtype in FP8 else None)
    except ValueError as exc:
        raise SparkforgeError(f"target: {name} with {scale_name}: {exc}") from exc


def _is_top_level(name: str) -> bool:
    parts = name.split(".")
    return "layers" not in parts and "mtp" not in parts


def _find(names: Iterable[str], endings: tuple[str, ...]) -> str | None:
    for ending in endings:
        hits = sorted((n for n in names if (n == ending or n.endswith("." + ending))
                       and _is_top_level(n)), key=len)
        if hits:
            return hits[0]
    return None


def locate_pieces(model_dir: Path, locations: dict[str, Path]) -> dict[str, str]:
    """Cache name -> checkpoint name of every target piece the family lists.

    A tied checkpoint (``tie_word_embeddings``) without its own output projection reuses the
    embedding.

    Raises:
        ValueError: Naming every piece the checkpoint lacks and the names looked for.
    """
    config = read_target_config(model_dir).text
    family = family_of_config(config)
    found = {key: _find(locations, endings) for key, endings in family.pieces.items()}
    if found["lm_head.weight"] is None and config.get("tie_word_embeddings"):
        found["lm_head.weight"] = found["embed_tokens.weight"]
    missing = {key: family.pieces[key] for key, name in found.items() if name is None}
    if missing:
        wanted = "; ".join(f"{key.removesuffix('.weight')} (a name ending in "
                           f"{' or '.join(endings)})" for key, endings in missing.items())
        raise SparkforgeError(f"target: checkpoint {model_dir} ({family.name} family) has no "
                              f"{wanted}")
    return {key: str(name) for key, name in found.items()}


def target_files(model_dir: Path, *, hidden_dtype: str) -> dict[str, bytes]:
    """config.json, tokenizer files and ``weights.safetensors`` (the family's pieces) as bytes.

    Raises:
        ValueError: A weight is missing or quantized in a format this cannot dequantize.
    """
    locations = tensor_locations(model_dir)
    dtype = getattr(torch, hidden_dtype)
    block = fp8_block_size(read_target_config(model_dir).text)
    weights = {key: load_tensor(locations, name, block).to(dtype).contiguous()
               for key, name in locate_pieces(model_dir, locations).items()}
    files = {"config.json": (model_dir / "config.json").read_bytes()}
    files |= {n: (model_dir / n).read_bytes() for n in TOKENIZER_FILES if (model_dir / n).exists()}
    files["weights.safetensors"] = save_safetensors(weights)
    return files
