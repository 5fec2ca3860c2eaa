"""The one torch-free reader of a ``sparkforge train`` YAML: its draft section and its contract.

``sparkforge train`` parses the file through LightningCLI; ``validate --against`` and
``plan --against`` must not load torch, so they read it here instead: ``read_draft_section``
type-checks ``model.recipe`` and ``model.draft`` once, and both the cache contract
(``contract_from_train_config``) and the anchor budget (``sparkforge.trainer.anchor_budget``)
take their fields from it, with the values ``train`` gives what is unset.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, get_args

import yaml

from sparkforge.manifests.contract import RunContract
from sparkforge.shared.config_yaml import load_yaml_file
from sparkforge.shared.errors import ConfigError
from sparkforge.shared.target_families import (
    FEATURE_SEMANTICS,
    FINAL_SEMANTICS,
    FeatureSemantics,
    FinalSemantics,
)
from sparkforge.trainer.loader_settings import LoaderSettings
from sparkforge.trainer.run_config import DraftSpec, RecipeName, validation_on

T = TypeVar("T")

SIZE_FIELDS = ("hidden_size", "vocab_size", "num_target_layers", "mask_token_id")
"""The target's sizes in ``model.draft``: the contract needs them, ``train`` has no default."""


class TrainConfigError(ConfigError):
    """Raised when a training config lacks or mistypes a field the contract needs."""


@dataclass(frozen=True, kw_only=True)
class DraftSection:
    """``model.recipe`` and ``model.draft`` of a train config, type-checked; unset fields are
    None, or ``DraftSpec``'s default where ``train`` has one (see ``DraftSpec`` for each)."""

    recipe: RecipeName = "dspark"
    hidden_size: int | None = None
    vocab_size: int | None = None
    num_target_layers: int | None = None
    mask_token_id: int | None = None
    num_hidden_layers: int = DraftSpec.num_hidden_layers
    block_size: int = DraftSpec.block_size
    num_anchors: int = DraftSpec.num_anchors
    target_layer_ids: tuple[int, ...] | None = None
    target_model_type: str | None = None
    target_features: FeatureSemantics | None = None
    target_final: FinalSemantics | None = None
    architecture: str | None = None
    """As written (the old ``dflash`` included: ``read_legacy`` rewrites it where it matters)."""
    layout: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)


def read_draft_section(data: Mapping[str, Any], problems: list[str], *,
                       required: Collection[str] = ()) -> DraftSection:
    """The draft section of a loaded train config.

    Args:
        data: The whole config mapping.
        problems: Each missing (of ``required``) or mistyped field is appended here, naming it;
            such a field reads as unset.
        required: Fields of ``SIZE_FIELDS`` that must be set.

    Raises:
        TrainConfigError: ``model`` or ``model.draft`` is not a mapping.
    """
    recipe = _choice(_section(data, "model"), "recipe", get_args(RecipeName), "model", problems)
    draft = _section(data, "model", "draft")
    values: dict[str, Any] = {
        name: _integer(draft, name, problems, default=None, required=name in required)
        for name in SIZE_FIELDS}
    values["num_hidden_layers"] = _integer(draft, "num_hidden_layers", problems,
                                           default=DraftSpec.num_hidden_layers)
    for name in ("block_size", "num_anchors"):
        values[name] = _integer(draft, name, problems, default=getattr(DraftSpec, name),
                                minimum=1)
    ids = draft.get("target_layer_ids")
    if ids is not None and (not isinstance(ids, list | tuple) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids)):
        problems.append(f"model.draft.target_layer_ids must be a list of integers, got {ids!r}")
        ids = None
    for name in ("target_model_type", "architecture", "layout"):
        value = draft.get(name)
        if value is not None and not isinstance(value, str):
            problems.append(f"model.draft.{name} must be a string, got {value!r}")
            value = None
        values[name] = value
    overrides = draft.get("overrides") or {}
    if not isinstance(overrides, Mapping):
        problems.append(f"model.draft.overrides must be a mapping, got {overrides!r}")
        overrides = {}
    return DraftSection(
        **values, recipe=recipe or "dspark",
        target_layer_ids=None if ids is None else tuple(ids),
        target_features=_choice(draft, "target_features", FEATURE_SEMANTICS, "model.draft",
                                problems),
        target_final=_choice(draft, "target_final", FINAL_SEMANTICS, "model.draft", problems),
        overrides=dict(overrides))


def contract_from_train_config(config: str | Path | Mapping[str, Any], *,
                               target_config: Mapping[str, Any] | None = None) -> RunContract:
    """The contract of a ``sparkforge train`` YAML config (or its already-loaded mapping).

    Reads the draft section (``read_draft_section``, the target's sizes required), ``data``
    (as :class:`LoaderSettings`, for its ``max_seq_len``) and the ``trainer.limit_val_batches``;
    everything unset takes the value ``sparkforge train`` gives it. With ``target_config`` (the
    cache's ``config.json``, which ``train`` builds the draft from) the draft's embedding scale
    and softcap are part of the contract.

    Raises:
        TrainConfigError: naming every missing or mistyped field.
        FileNotFoundError: if the config file does not exist.
    """
    data = load_train_yaml(config) if isinstance(config, str | Path) else config
    trainer = _section(data, "trainer")
    problems: list[str] = []
    draft = read_draft_section(data, problems, required=SIZE_FIELDS)
    try:
        max_seq_len = LoaderSettings.from_train_config(data).max_seq_len
    except ConfigError as exc:
        problems.append(str(exc).removeprefix("train config: "))
        max_seq_len = 0
    if problems:
        raise TrainConfigError("train config: " + "; ".join(problems))
    spec = DraftSpec(**{name: getattr(draft, name) for name in SIZE_FIELDS},
                     num_hidden_layers=draft.num_hidden_layers,
                     target_model_type=draft.target_model_type,
                     target_features=draft.target_features, target_final=draft.target_final,
                     target_layer_ids=draft.target_layer_ids, overrides=draft.overrides)
    need_eval = validation_on(trainer.get("limit_val_batches"))
    return spec.contract(max_seq_len=max_seq_len, need_eval_split=need_eval,
                         target_config=target_config)


def load_train_yaml(path: str | Path) -> Mapping[str, Any]:
    """A train config file as a mapping.

    Raises:
        TrainConfigError: the file is not YAML or not a mapping.
        FileNotFoundError: if the file does not exist.
    """
    try:
        data = load_yaml_file(path)
    except yaml.YAMLError as exc:
        raise TrainConfigError(f"{path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise TrainConfigError(f"{path} must hold a YAML mapping, got {type(data).__name__}")
    return data


def _integer(section: Mapping[str, Any], name: str, problems: list[str], *,
             default: int | None, required: bool = False, minimum: int | None = None
             ) -> int | None:
    """``model.draft.<name>``: ``default`` when unset, else an integer (a problem otherwise)."""
    value = section.get(name, default)
    if value is None and default is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or (
            minimum is not None and value < minimum):
        bound = "" if minimum is None else f" >= {minimum}"
        problems.append(f"model.draft.{name} must be an integer{bound}, got {value!r}")
        return default
    return value


def _choice(section: Mapping[str, Any], name: str, options: tuple[T, ...], where: str,
            problems: list[str]) -> T | None:
    """``<where>.<name>``: None when unset, else one of ``options`` (a problem otherwise)."""
    value = section.get(name)
    if value is None:
        return None
    found = next((o for o in options if o == value), None)
    if found is None:
        problems.append(f"{where}.{name}={value!r} not in {list(options)}")
    return found


def _section(data: Mapping[str, Any], *path: str) -> Mapping[str, Any]:
    node: Any = data
    for i, key in enumerate(path):
        node = node.get(key, {}) if isinstance(node, Mapping) else None
        if not isinstance(node, Mapping):
            raise TrainConfigError(f"train config: {'.'.join(path[:i + 1])} must be a mapping, "
                                   f"got {node!r}")
    out: Mapping[str, Any] = node
    return out
