"""Parse the run header the producer supplies: cache spec, target, capture, tokenizer, data."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from sparkforge.manifests import fields as f
from sparkforge.shared.layout import CacheSpec
from sparkforge.shared.target_families import (
    FEATURE_SEMANTICS,
    FINAL_SEMANTICS,
    FeatureSemantics,
    FinalSemantics,
)


@dataclass(frozen=True, kw_only=True)
class TargetInfo:
    """Identity and shape of the frozen target model."""

    name_or_path: str
    revision: str | None
    content_hash: str
    """Hex digest of the target's config + weights."""
    model_type: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    dtype: str
    quantization: str | None


@dataclass(frozen=True, kw_only=True)
class CaptureInfo:
    """How hidden states were captured."""

    layer_ids: tuple[int, ...]
    """HF ``hidden_states`` indices: id k is the residual stream after k decoder layers."""
    layer_id_convention: Literal["hf_hidden_states_index"]
    final_hidden: FinalSemantics
    """``post_norm`` (RMSNorm of the last residual) or ``lm_head_input`` (the exact tensor lm_head
    consumed, for targets such as DeepSeek-V4 whose lm_head input is not a norm of one residual)."""
    engine: Literal["vllm", "hf"]
    engine_version: str
    tensor_parallel_size: int
    expert_parallel: bool
    data_parallel_size: int
    max_seq_len: int
    features: FeatureSemantics = dataclasses.field(
        default="residual", metadata={"optional_in_json": True})
    """``residual`` (the residual stream after a layer) or ``hc_mean`` (the mean over a
    hyper-connection target's streams); manifests written before this field are ``residual``."""


@dataclass(frozen=True, kw_only=True)
class TokenizerInfo:
    """Tokenizer identity."""

    hash: str
    chat_template_sha256: str | None


@dataclass(frozen=True, kw_only=True)
class DataSource:
    """One input dataset."""

    uri: str
    content_hash: str


@dataclass(frozen=True, kw_only=True)
class DataInfo:
    """Input data identity and the train/eval split rule."""

    sources: tuple[DataSource, ...]
    eval_fraction: float | None
    eval_ids: tuple[int, ...] | None
    seed: int


@dataclass(frozen=True, kw_only=True)
class RunHeader:
    """The producer-supplied sections of the manifest (stored in ``_meta/header.json``)."""

    producer_config: dict[str, Any]
    target: TargetInfo
    capture: CaptureInfo
    tokenizer: TokenizerInfo
    data: DataInfo


def _keys(*names: str) -> frozenset[str]:
    return frozenset(names)


def parse_spec(data: object, field: str = "storage.spec") -> CacheSpec:
    """The cache spec, with absurd sizes rejected."""
    d = f.obj(data, field, required=_keys("hidden_size", "num_aux_layers", "hidden_dtype",
                                          "max_seq_len", "aux_codec", "topk", "shard_rows",
                                          "rows_per_unit"))
    try:
        return _spec(d, field)
    except ValueError as exc:
        if isinstance(exc, f.ManifestError):
            raise
        raise f.ManifestError(f"manifest field {field!r}: {exc}") from exc


def _spec(d: Mapping[str, Any], field: str) -> CacheSpec:
    return CacheSpec(
        hidden_size=f.integer(d["hidden_size"], f"{field}.hidden_size", lo=1, hi=1 << 17),
        num_aux_layers=f.integer(d["num_aux_layers"], f"{field}.num_aux_layers", lo=1, hi=256),
        hidden_dtype=f.choice(d["hidden_dtype"], f"{field}.hidden_dtype",
                              ("bfloat16", "float16", "float32")),
        max_seq_len=f.integer(d["max_seq_len"], f"{field}.max_seq_len", lo=1, hi=1 << 22),
        aux_codec=f.choice(d["aux_codec"], f"{field}.aux_codec", ("lossless", "fp8")),
        topk=f.integer(d["topk"], f"{field}.topk", hi=1024),
        shard_rows=f.integer(d["shard_rows"], f"{field}.shard_rows", lo=1, hi=1 << 22),
        rows_per_unit=f.integer(d["rows_per_unit"], f"{field}.rows_per_unit", lo=1, hi=1 << 20),
    )


def parse_target(data: object) -> TargetInfo:
    """The ``target`` section."""
    d = f.obj(data, "target", required=_keys(
        "name_or_path", "revision", "content_hash", "model_type", "architecture", "vocab_size",
        "hidden_size", "num_hidden_layers", "dtype", "quantization"))
    return TargetInfo(
        name_or_path=f.string(d["name_or_path"], "target.name_or_path"),
        revision=f.optional(d["revision"], f.string, "target.revision"),
        content_hash=f.hexdigest(d["content_hash"], "target.content_hash"),
        model_type=f.string(d["model_type"], "target.model_type", max_len=128),
        architecture=f.string(d["architecture"], "target.architecture", max_len=128),
        vocab_size=f.integer(d["vocab_size"], "target.vocab_size", lo=1, hi=1 << 24),
        hidden_size=f.integer(d["hidden_size"], "target.hidden_size", lo=1, hi=1 << 17),
        num_hidden_layers=f.integer(d["num_hidden_layers"], "target.num_hidden_layers",
                                    lo=1, hi=1024),
        dtype=f.string(d["dtype"], "target.dtype", max_len=32),
        quantization=f.optional(d["quantization"], f.string, "target.quantization", max_len=128),
    )


def parse_layer_ids(data: object, field: str = "capture.layer_ids") -> tuple[int, ...]:
    """Strictly increasing, non-negative HF hidden_states indices."""
    ids = tuple(f.integer(x, f"{field}[{i}]", hi=1024)
                for i, x in enumerate(f.array(data, field, max_len=256)))
    if not ids or any(a >= b for a, b in zip(ids, ids[1:], strict=False)):
        raise f.fail(field, "a non-empty strictly increasing list", list(ids))
    return ids


def parse_capture(data: object) -> CaptureInfo:
    """The ``capture`` section."""
    d = f.obj(data, "capture", required=_keys(
        "layer_ids", "layer_id_convention", "final_hidden", "engine", "engine_version",
        "tensor_parallel_size", "expert_parallel", "data_parallel_size", "max_seq_len"),
        optional=_keys("features"))
    return CaptureInfo(
        layer_ids=parse_layer_ids(d["layer_ids"]),
        layer_id_convention=f.choice(d["layer_id_convention"], "capture.layer_id_convention",
                                     ("hf_hidden_states_index",)),
        final_hidden=f.choice(d["final_hidden"], "capture.final_hidden", FINAL_SEMANTICS),
        features=f.choice(d.get("features", "residual"), "capture.features", FEATURE_SEMANTICS),
        engine=f.choice(d["engine"], "capture.engine", ("vllm", "hf")),
        engine_version=f.string(d["engine_version"], "capture.engine_version", max_len=64),
        tensor_parallel_size=f.integer(d["tensor_parallel_size"], "capture.tensor_parallel_size",
                                       lo=1, hi=4096),
        expert_parallel=f.boolean(d["expert_parallel"], "capture.expert_parallel"),
        data_parallel_size=f.integer(d["data_parallel_size"], "capture.data_parallel_size",
                                     lo=1, hi=4096),
        max_seq_len=f.integer(d["max_seq_len"], "capture.max_seq_len", lo=1, hi=1 << 22),
    )


def parse_tokenizer(data: object) -> TokenizerInfo:
    """The ``tokenizer`` section."""
    d = f.obj(data, "tokenizer", required=_keys("hash", "chat_template_sha256"))
    return TokenizerInfo(
        hash=f.hexdigest(d["hash"], "tokenizer.hash"),
        chat_template_sha256=f.optional(d["chat_template_sha256"], f.hexdigest,
                                        "tokenizer.chat_template_sha256", length=64),
    )


def parse_data(data: object) -> DataInfo:
    """The ``data`` section: sources, split rule and seed."""
    d = f.obj(data, "data", required=_keys("sources", "seed"),
              optional=_keys("eval_fraction", "eval_ids"))
    sources = []
    for i, item in enumerate(f.array(d["sources"], "data.sources", max_len=10_000)):
        s = f.obj(item, f"data.sources[{i}]", required=_keys("uri", "content_hash"))
        sources.append(DataSource(uri=f.string(s["uri"], f"data.sources[{i}].uri"),
                                  content_hash=f.hexdigest(s["content_hash"],
                                                           f"data.sources[{i}].content_hash")))
    eval_ids = d.get("eval_ids")
    return DataInfo(
        sources=tuple(sources),
        eval_fraction=f.optional(d.get("eval_fraction"), f.number, "data.eval_fraction",
                                 lo=0.0, hi=1.0),
        eval_ids=None if eval_ids is None else tuple(
            f.integer(x, f"data.eval_ids[{i}]") for i, x in enumerate(f.array(eval_ids,
                                                                              "data.eval_ids"))),
        seed=f.integer(d["seed"], "data.seed", hi=(1 << 63) - 1),
    )


def parse_header(data: object) -> RunHeader:
    """The producer's run header; call it before writing so bad input fails early.

    Raises:
        ManifestError: naming the first bad field and its value.
    """
    d = f.obj(data, "header", required=_keys("producer_config", "target", "capture",
                                             "tokenizer", "data"))
    config = f.mapping(d["producer_config"], "producer_config")
    return RunHeader(producer_config=dict(config), target=parse_target(d["target"]),
                     capture=parse_capture(d["capture"]),
                     tokenizer=parse_tokenizer(d["tokenizer"]), data=parse_data(d["data"]))
