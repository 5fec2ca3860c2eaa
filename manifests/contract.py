"""The training contract: does a cache's manifest fit a training run? Every mismatch named.

This is the single implementation shared by ``sparkforge validate --against`` and the trainer's
pre-flight check. Each problem is one line naming the run field and the manifest field with both
values, so one failed launch shows everything to fix.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from sparkforge.manifests.schema import CacheManifest

logger = logging.getLogger(__name__)

HIDDEN_DTYPES = ("bfloat16", "float16", "float32")
EMPTY_TRAIN_SPLIT = "the cache's train split is empty"


class CacheContractError(ValueError):
    """Raised when a cache cannot feed a training run; the message lists every mismatch."""


class TrainConfigError(ValueError):
    """Raised when a training config lacks or mistypes a field the contract needs."""


@dataclass(frozen=True, kw_only=True)
class RunContract:
    """What a training run expects of the cache (the draft's target-facing fields)."""

    target_layer_ids: tuple[int, ...]
    """DSpark feature ids (0-based: id l = HF hidden_states[l+1])."""
    hidden_size: int
    vocab_size: int
    num_target_layers: int
    mask_token_id: int
    max_seq_len: int
    """Longest sample the run is sized for (the cache's capture.max_seq_len must not exceed it)."""
    target_model_type: str | None = None
    """Expected target ``model_type``; None accepts any."""
    need_eval_split: bool = False


def contract_problems(manifest: CacheManifest, run: RunContract, *,
                      split_counts: Mapping[str, int]) -> list[str]:
    """Every way ``manifest`` fails to serve ``run``; empty when it fits.

    Args:
        manifest: The parsed manifest.
        run: The run's expectations.
        split_counts: Samples per split in the cache's index.
    """
    target, capture, spec = manifest.target, manifest.capture, manifest.storage.spec
    problems: list[str] = []

    def differ(run_field: str, want: object, cache_field: str, have: object) -> None:
        if want != have:
            problems.append(f"{run_field}={want!r} but the cache's {cache_field}={have!r}")

    if not manifest.complete:
        problems.append("cache is not complete (manifest complete=false): finalize it first")
    hf_ids = tuple(i + 1 for i in run.target_layer_ids)
    if tuple(capture.layer_ids) != hf_ids:
        problems.append(
            f"model.target_layer_ids={list(run.target_layer_ids)} needs capture.layer_ids (HF "
            f"hidden_states indices = id + 1) {list(hf_ids)}, but the cache has "
            f"{list(capture.layer_ids)}")
    differ("capture.layer_id_convention", "hf_hidden_states_index",
           "capture.layer_id_convention", capture.layer_id_convention)
    differ("capture.final_hidden", "post_norm", "capture.final_hidden", capture.final_hidden)
    differ("model.hidden_size", run.hidden_size, "target.hidden_size", target.hidden_size)
    differ("model.hidden_size", run.hidden_size, "storage.spec.hidden_size", spec.hidden_size)
    differ("model.vocab_size", run.vocab_size, "target.vocab_size", target.vocab_size)
    differ("model.num_target_layers", run.num_target_layers, "target.num_hidden_layers",
           target.num_hidden_layers)
    differ("len(model.target_layer_ids)", len(run.target_layer_ids),
           "storage.spec.num_aux_layers", spec.num_aux_layers)
    if run.target_model_type is not None:
        differ("model.target_model_type", run.target_model_type, "target.model_type",
               target.model_type)
    if not 0 <= run.mask_token_id < target.vocab_size:
        problems.append(f"model.mask_token_id={run.mask_token_id} is outside the cache's "
                        f"vocabulary [0, target.vocab_size={target.vocab_size})")
    if capture.max_seq_len > run.max_seq_len:
        problems.append(f"data.max_seq_len={run.max_seq_len} is shorter than the cache's "
                        f"capture.max_seq_len={capture.max_seq_len}")
    if spec.hidden_dtype not in HIDDEN_DTYPES:
        problems.append(f"storage.spec.hidden_dtype={spec.hidden_dtype!r} not in {HIDDEN_DTYPES}")
    if spec.aux_codec != "lossless":
        logger.warning("cache stores features with the lossy %r codec", spec.aux_codec)
    return problems + _split_problems(split_counts, need_eval=run.need_eval_split)


def _split_problems(split_counts: Mapping[str, int], *, need_eval: bool) -> list[str]:
    problems = []
    if split_counts.get("train", 0) == 0:
        problems.append(EMPTY_TRAIN_SPLIT)
    if need_eval and split_counts.get("eval", 0) == 0:
        problems.append("validation is on (trainer.limit_val_batches > 0) but the cache's eval "
                        "split is empty")
    return problems


def check_contract(manifest: CacheManifest, run: RunContract, *,
                   split_counts: Mapping[str, int], uri: str = "cache") -> None:
    """Raise ``CacheContractError`` listing every mismatch between ``manifest`` and ``run``."""
    problems = contract_problems(manifest, run, split_counts=split_counts)
    if problems:
        raise CacheContractError(
            f"{uri} cannot feed this run ({len(problems)} problem(s)):\n  "
            + "\n  ".join(problems))


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """DFlash rule: n ids evenly spaced in [1, L-3], round(1 + i*(L-4)/(n-1)) (half-even).

    Chosen over NeMo's [1, L-1] rule because it never includes the last layer (L=36 ->
    [1,9,17,25,33], DeepSpec's released Qwen3-4B/8B ids). Small targets fall back to [0, L-2].
    """
    top = num_target_layers - 3
    n = max(1, num_draft_layers)
    if top < 1:
        return tuple(range(max(0, num_target_layers - 1)))[:n] or (0,)
    n = min(n, top)
    if n == 1:
        return (top,)
    step = (top - 1) / (n - 1)
    return tuple(sorted({round(1 + i * step) for i in range(n)}))


def run_contract_from_train_config(config: str | Path | Mapping[str, Any]) -> RunContract:
    """The contract of a ``sparkforge train`` YAML config (or its already-loaded mapping).

    Reads ``model.draft.{target_layer_ids, hidden_size, vocab_size, num_target_layers,
    mask_token_id, target_model_type, num_hidden_layers}``, ``data.max_seq_len`` (trainer default
    4096) and, as ``sparkforge train`` does, needs an eval split when
    ``trainer.limit_val_batches`` (default 1.0) is non-zero and validation is scheduled
    (``val_check_interval`` set or ``check_val_every_n_epoch``, default 1, not null). Missing
    ``target_layer_ids`` follow :func:`default_target_layer_ids`.

    Raises:
        TrainConfigError: naming every missing or mistyped field.
        FileNotFoundError: if the config file does not exist.
    """
    data = _load_yaml(config) if isinstance(config, str | Path) else config
    draft = _section(data, "model", "draft")
    train = _section(data, "data")
    trainer = _section(data, "trainer")
    problems: list[str] = []

    def integer(section: Mapping[str, Any], name: str, where: str, default: int | None) -> int:
        value = section.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{where}.{name} must be an integer, got {value!r}")
            return 0
        return value

    sizes = {name: integer(draft, name, "model.draft", None)
             for name in ("hidden_size", "vocab_size", "num_target_layers", "mask_token_id")}
    depth = integer(draft, "num_hidden_layers", "model.draft", 5)
    max_seq_len = integer(train, "max_seq_len", "data", 4096)
    ids = draft.get("target_layer_ids")
    if ids is None:
        ids = default_target_layer_ids(sizes["num_target_layers"], depth)
    elif not isinstance(ids, list | tuple) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids):
        problems.append(f"model.draft.target_layer_ids must be a list of integers, got {ids!r}")
    model_type = draft.get("target_model_type")
    if model_type is not None and not isinstance(model_type, str):
        problems.append(f"model.draft.target_model_type must be a string, got {model_type!r}")
    if problems:
        raise TrainConfigError("train config: " + "; ".join(problems))
    # Lightning validates every epoch by default (check_val_every_n_epoch=1) even when
    # val_check_interval is unset; only limit_val_batches=0 or no interval at all turns it off.
    need_eval = bool(trainer.get("limit_val_batches", 1.0)) and (
        trainer.get("val_check_interval") is not None
        or trainer.get("check_val_every_n_epoch", 1) is not None)
    return RunContract(target_layer_ids=tuple(ids), max_seq_len=max_seq_len,
                       target_model_type=model_type, need_eval_split=need_eval, **sizes)


def _load_yaml(path: str | Path) -> Mapping[str, Any]:
    text = Path(path).read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise TrainConfigError(f"{path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise TrainConfigError(f"{path} must hold a YAML mapping, got {type(data).__name__}")
    return data


def _section(data: Mapping[str, Any], *path: str) -> Mapping[str, Any]:
    node: Any = data
    for i, key in enumerate(path):
        node = node.get(key, {}) if isinstance(node, Mapping) else None
        if not isinstance(node, Mapping):
            raise TrainConfigError(f"train config: {'.'.join(path[:i + 1])} must be a mapping, "
                                   f"got {node!r}")
    out: Mapping[str, Any] = node
    return out
