"""The run header: written by the producer, stored at cache creation, parsed by the manifest.

``RunHeader.to_json`` and :func:`parse_header` are each other's inverse; the cache writer checks
the round trip when it opens a store, so a bad header fails before any capture.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from sparkforge.shared import fields as f
from sparkforge.shared.layer_ids import HfIndices
from sparkforge.shared.target_families import (
    FEATURE_SEMANTICS,
    FINAL_SEMANTICS,
    FeatureSemantics,
    FinalSemantics,
    TargetScaling,
    family_of,
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

    layer_ids: HfIndices
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
    embedding_scale: float = dataclasses.field(default=1.0, metadata={"optional_in_json": True})
    """Factor the target applies to its embed_tokens output (``sqrt(hidden_size)`` for Gemma);
    manifests written before this field take their target family's rule."""
    final_logit_softcapping: float | None = dataclasses.field(
        default=None, metadata={"optional_in_json": True})
    """The target's logit softcap ``cap * tanh(logits / cap)`` after lm_head, which the stored
    final state has not been through; None: no cap. Manifests written before this field read as
    None: the cap is no family constant (Gemma 2 and 4 cap at 30, Gemma 3 does not), and a Gemma
    cache that old recorded ``final_hidden=post_norm``, which a Gemma draft refuses anyway."""

    @property
    def scaling(self) -> TargetScaling:
        """The embedding scale and logit softcap as one record, to compare with a draft's."""
        return TargetScaling(embedding_scale=self.embedding_scale,
                             final_logit_softcapping=self.final_logit_softcapping)


@dataclass(frozen=True, kw_only=True)
class TokenizerInfo:
    """Tokenizer identity."""

    hash: str
    chat_template_sha256: str | None


@dataclass(frozen=True, kw_only=True)
class HfDatasetInfo:
    """A Hugging Face dataset's identity."""

    name: str
    """Hub repo id, or the ``save_to_disk`` folder."""
    revision: str | None
    """The Hub snapshot's commit; None for a ``save_to_disk`` folder."""
    split: str
    fingerprint: str
    """``datasets``' fingerprint of the split (changes with its content)."""


@dataclass(frozen=True, kw_only=True)
class SourceInfo:
    """One input dataset."""

    uri: str
    content_hash: str
    hf_dataset: HfDatasetInfo | None = dataclasses.field(
        default=None, metadata={"optional_in_json": True})
    """Set when the source is a Hugging Face dataset; absent from older manifests."""


MAX_MIX_WEIGHT = 1e12
"""Largest weight of a mix entry a header records (weights are relative: scale them down)."""


@dataclass(frozen=True, kw_only=True)
class MixInfo:
    """One source of a weighted mix and what was drawn from it."""

    name: str
    """The entry's label (its data, unless named)."""
    data: str
    weight: float
    source_rows: int
    """Rows the source holds."""
    rows: int
    """Rows drawn (repeated when above ``source_rows``, subsampled below)."""
    first_sample: int
    """Its sample ids are ``[first_sample, first_sample + rows)``."""
    first_source: int
    """Its files are ``data.sources[first_source : first_source + num_sources]``."""
    num_sources: int


@dataclass(frozen=True, kw_only=True)
class SamplingInfo:
    """How ``sparkforge regenerate`` sampled a dataset's assistant turns."""

    temperature: float
    """0 = greedy; 1 = the target's own distribution."""
    top_p: float
    top_k: int
    """-1: off."""
    seed: int
    max_tokens: int


@dataclass(frozen=True, kw_only=True)
class DataInfo:
    """Input data identity and the train/eval split rule."""

    sources: tuple[SourceInfo, ...]
    eval_fraction: float | None
    eval_ids: tuple[int, ...] | None
    seed: int
    regeneration: tuple[SamplingInfo, ...] = dataclasses.field(
        default=(), metadata={"optional_in_json": True})
    """The distinct sampling settings of regenerated sources (empty: none was regenerated, or
    a manifest older than this field)."""
    mix: tuple[MixInfo, ...] | None = dataclasses.field(
        default=None, metadata={"optional_in_json": True})
    """The weighted mix the rows were drawn from (None: every row of ``sources`` once); absent
    from older manifests."""
    mix_seed: int | None = dataclasses.field(default=None, metadata={"optional_in_json": True})
    """Seed of the mix's draws."""

    def identity(self) -> dict[str, Any]:
        """JSON-ready record of where the rows came from (for checkpoints, loggers, cards):
        each source (with a dataset's name, revision, split and fingerprint), the mix and how
        regenerated rows were sampled."""
        out: dict[str, Any] = {"sources": [
            {k: v for k, v in dataclasses.asdict(s).items() if v is not None}
            for s in self.sources]}
        if self.regeneration:
            out["regeneration"] = [dataclasses.asdict(r) for r in self.regeneration]
        if self.mix is not None:
            out["mix"] = [{"name": e.name, "data": e.data, "weight": e.weight, "rows": e.rows,
                           "source_rows": e.source_rows} for e in self.mix]
            out["mix_seed"] = self.mix_seed
        return out


@dataclass(frozen=True, kw_only=True)
class RunHeader:
    """The producer-supplied sections of the manifest (stored in ``_meta/header.json``)."""

    producer_config: dict[str, Any]
    """The producer config; its ``resolved`` entry holds facts the schema has no slot for."""
    target: TargetInfo
    capture: CaptureInfo
    tokenizer: TokenizerInfo
    data: DataInfo

    @classmethod
    def from_json(cls, data: object) -> RunHeader:
        """Parse untrusted JSON (see :func:`parse_header`)."""
        return parse_header(data)

    def to_json(self) -> dict[str, Any]:
        """The header as stored in ``_meta/header.json`` (unset split rules are left out)."""
        data = dataclasses.asdict(self.data)
        data["sources"] = [{k: v for k, v in dataclasses.asdict(s).items() if v is not None}
                           for s in self.data.sources]
        data["regeneration"] = [dataclasses.asdict(r) for r in self.data.regeneration]
        for key in ("eval_fraction", "eval_ids", "mix", "mix_seed"):
            if data[key] is None:
                del data[key]
            elif key in ("eval_ids", "mix"):
                data[key] = list(data[key])
        capture = dataclasses.asdict(self.capture)
        capture["layer_ids"] = list(self.capture.layer_ids)
        return {"producer_config": self.producer_config,
                "target": dataclasses.asdict(self.target), "capture": capture,
                "tokenizer": dataclasses.asdict(self.tokenizer), "data": data}

    @property
    def num_units(self) -> int:
        """Commit units of the whole cache (``producer_config.resolved.num_units``).

        Raises:
            ManifestError: if the producer did not record it.
        """
        return self._resolved_count("num_units")

    @property
    def num_rows(self) -> int:
        """Input rows of all sources together (``producer_config.resolved.num_rows``).

        Raises:
            ManifestError: if the producer did not record it.
        """
        return self._resolved_count("num_rows")

    def _resolved_count(self, name: str) -> int:
        field = "producer_config.resolved"
        count = f.mapping(self.producer_config.get("resolved"), field).get(name)
        return f.integer(count, f"{field}.{name}")


def _keys(*names: str) -> frozenset[str]:
    return frozenset(names)


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


def parse_layer_ids(data: object, field: str = "capture.layer_ids") -> HfIndices:
    """Strictly increasing, non-negative HF hidden_states indices."""
    ids = tuple(f.integer(x, f"{field}[{i}]", hi=1024)
                for i, x in enumerate(f.array(data, field, max_len=256)))
    if not ids or any(a >= b for a, b in zip(ids, ids[1:], strict=False)):
        raise f.fail(field, "a non-empty strictly increasing list", list(ids))
    return HfIndices(ids)


def parse_capture(data: object, target: TargetInfo) -> CaptureInfo:
    """The ``capture`` section (``target``: the parsed ``target`` section, whose family gives
    the embedding scale of manifests written before that field)."""
    d = f.obj(data, "capture", required=_keys(
        "layer_ids", "layer_id_convention", "final_hidden", "engine", "engine_version",
        "tensor_parallel_size", "expert_parallel", "data_parallel_size", "max_seq_len"),
        optional=_keys("features", "embedding_scale", "final_logit_softcapping"))
    return CaptureInfo(
        layer_ids=parse_layer_ids(d["layer_ids"]),
        layer_id_convention=f.choice(d["layer_id_convention"], "capture.layer_id_convention",
                                     ("hf_hidden_states_index",)),
        final_hidden=f.choice(d["final_hidden"], "capture.final_hidden", FINAL_SEMANTICS),
        features=f.choice(d.get("features", "residual"), "capture.features", FEATURE_SEMANTICS),
        embedding_scale=f.number(d.get("embedding_scale", family_of(target.model_type).scaling(
            {"hidden_size": target.hidden_size}).embedding_scale), "capture.embedding_scale",
                                 lo=1e-6, hi=1e6),
        final_logit_softcapping=f.optional(d.get("final_logit_softcapping"), f.number,
                                           "capture.final_logit_softcapping", lo=1e-6, hi=1e6),
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


def parse_sampling(data: object, field: str) -> SamplingInfo:
    """One regeneration sampling record (``data.regeneration[i]``)."""
    d = f.obj(data, field, required=_keys("temperature", "top_p", "top_k", "seed", "max_tokens"))
    top_k = f.integer(d["top_k"], f"{field}.top_k", lo=-1)
    if top_k == 0:
        raise f.fail(f"{field}.top_k", "-1 (off) or >= 1", top_k)
    return SamplingInfo(
        temperature=f.number(d["temperature"], f"{field}.temperature", lo=0.0, hi=1e6),
        top_p=f.number(d["top_p"], f"{field}.top_p", lo=0.0, hi=1.0), top_k=top_k,
        seed=f.integer(d["seed"], f"{field}.seed", hi=(1 << 63) - 1),
        max_tokens=f.integer(d["max_tokens"], f"{field}.max_tokens", lo=1))


def parse_data(data: object) -> DataInfo:
    """The ``data`` section: sources, split rule, seed and regeneration sampling."""
    d = f.obj(data, "data", required=_keys("sources", "seed"),
              optional=_keys("eval_fraction", "eval_ids", "regeneration", "mix", "mix_seed"))
    sources = []
    for i, item in enumerate(f.array(d["sources"], "data.sources", max_len=10_000)):
        s = f.obj(item, f"data.sources[{i}]", required=_keys("uri", "content_hash"),
                  optional=_keys("hf_dataset"))
        sources.append(SourceInfo(uri=f.string(s["uri"], f"data.sources[{i}].uri"),
                                  content_hash=f.hexdigest(s["content_hash"],
                                                           f"data.sources[{i}].content_hash"),
                                  hf_dataset=f.optional(s.get("hf_dataset"), parse_hf_dataset,
                                                        f"data.sources[{i}].hf_dataset")))
    eval_ids = d.get("eval_ids")
    mix = d.get("mix")
    return DataInfo(
        mix=None if mix is None else parse_mix(mix, len(sources)),
        mix_seed=f.optional(d.get("mix_seed"), f.integer, "data.mix_seed", hi=(1 << 63) - 1),
        sources=tuple(sources),
        eval_fraction=f.optional(d.get("eval_fraction"), f.number, "data.eval_fraction",
                                 lo=0.0, hi=1.0),
        eval_ids=None if eval_ids is None else tuple(
            f.integer(x, f"data.eval_ids[{i}]") for i, x in enumerate(f.array(eval_ids,
                                                                              "data.eval_ids"))),
        seed=f.integer(d["seed"], "data.seed", hi=(1 << 63) - 1),
        regeneration=tuple(parse_sampling(r, f"data.regeneration[{i}]") for i, r in enumerate(
            f.array(d.get("regeneration", []), "data.regeneration", max_len=10_000))),
    )


def parse_hf_dataset(data: object, field: str) -> HfDatasetInfo:
    """A source's ``hf_dataset`` identity."""
    d = f.obj(data, field, required=_keys("name", "revision", "split", "fingerprint"))
    return HfDatasetInfo(
        name=f.string(d["name"], f"{field}.name"),
        revision=f.optional(d["revision"], f.string, f"{field}.revision", max_len=256),
        split=f.string(d["split"], f"{field}.split", max_len=256),
        fingerprint=f.string(d["fingerprint"], f"{field}.fingerprint", max_len=256))


def parse_mix(data: object, num_sources: int) -> tuple[MixInfo, ...]:
    """``data.mix``: entries whose sample ranges follow each other and whose files exist."""
    entries: list[MixInfo] = []
    for i, item in enumerate(f.array(data, "data.mix", max_len=10_000)):
        field = f"data.mix[{i}]"
        d = f.obj(item, field, required=_keys("name", "data", "weight", "source_rows", "rows",
                                              "first_sample", "first_source", "num_sources"))
        entry = MixInfo(
            name=f.string(d["name"], f"{field}.name"), data=f.string(d["data"], f"{field}.data"),
            weight=f.number(d["weight"], f"{field}.weight", lo=0.0, hi=MAX_MIX_WEIGHT),
            source_rows=f.integer(d["source_rows"], f"{field}.source_rows"),
            rows=f.integer(d["rows"], f"{field}.rows"),
            first_sample=f.integer(d["first_sample"], f"{field}.first_sample"),
            first_source=f.integer(d["first_source"], f"{field}.first_source"),
            num_sources=f.integer(d["num_sources"], f"{field}.num_sources", lo=1))
        prev = entries[-1] if entries else None
        if entry.first_sample != (0 if prev is None else prev.first_sample + prev.rows):
            raise f.fail(f"{field}.first_sample", "the end of the previous entry's rows",
                         entry.first_sample)
        if entry.first_source + entry.num_sources > num_sources:
            raise f.fail(f"{field}.num_sources", f"files within the {num_sources} data.sources",
                         entry.num_sources)
        entries.append(entry)
    return tuple(entries)


def parse_header(data: object) -> RunHeader:
    """The producer's run header; call it before writing so bad input fails early.

    Raises:
        ManifestError: naming the first bad field and its value.
    """
    d = f.obj(data, "header", required=_keys("producer_config", "target", "capture",
                                             "tokenizer", "data"))
    config = f.mapping(d["producer_config"], "producer_config")
    target = parse_target(d["target"])
    return RunHeader(producer_config=dict(config), target=target,
                     capture=parse_capture(d["capture"], target),
                     tokenizer=parse_tokenizer(d["tokenizer"]), data=parse_data(d["data"]))
