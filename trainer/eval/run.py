"""``sparkforge eval``: measure a trained draft by speculative decoding, as a reference decoder
and as served.

Held-out prompts come from a chat file (JSONL/Parquet ``messages`` rows: the conversation up to its
last assistant turn) or from a cache's eval split (the prompt part of each sample, never trained
on; ``sparkforge produce --eval_fraction 1.0`` makes an eval-only cache). Up to three views are
reported, each tau with its 95% bootstrap interval over prompts (eval samples):
- ``speculative``: the reference decoder (a transformers target at batch 1) on those prompts:
  tau, per-position acceptance, calibration of the confidence head against the accept events;
- ``teacher_forced`` (with a cache): the eval split's metrics with the training run's loss
  settings (``sparkforge.trainer.eval.forced``), and ``matched``: whether the split was
  regenerated at eval's temperature and, when it was (at T=1), whether the two taus agree;
- ``served`` (``--engine vllm`` or ``--endpoint``): the same prompts through a serving engine
  (``sparkforge.trainer.eval.served``), and ``reconciliation``: served tau beside the other two,
  with a verdict for each (``sparkforge.trainer.eval.reconcile``).
With a cache and a confidence head, ``confidence_calibration`` fits STS of the head on half the
eval split (``sparkforge.trainer.eval.head_calibration``) and writes the file engines read.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from sparkforge.manifests.open import open_cache
from sparkforge.shared.errors import SparkforgeError
from sparkforge.shared.image_inputs import TargetImages, target_images
from sparkforge.shared.image_sources import ImageReader
from sparkforge.shared.target_config import read_target_config
from sparkforge.shared.target_families import loads_as_image_text
from sparkforge.trainer.data import load_split_index
from sparkforge.trainer.eval.acceptance import acceptance_report
from sparkforge.trainer.eval.chat_prompts import Prompt, chat_prompts
from sparkforge.trainer.eval.context_buckets import speculative_buckets
from sparkforge.trainer.eval.decode_result import SpecDecodeResult
from sparkforge.trainer.eval.forced import teacher_forced
from sparkforge.trainer.eval.head_calibration import (
    SlotRows,
    calibration_contents,
    calibration_study,
    speculative_rows,
)
from sparkforge.trainer.eval.matched import matched_report, split_sampling
from sparkforge.trainer.eval.reconcile import reconcile
from sparkforge.trainer.eval.report import write_report
from sparkforge.trainer.eval.served import check_servable, measure_served
from sparkforge.trainer.eval.speculative import speculative_generate
from sparkforge.trainer.eval.sts import CALIBRATION_FILE
from sparkforge.trainer.eval.turn_kinds import TurnTags, by_kind
from sparkforge.trainer.export import load_draft, training_loss_settings
from sparkforge.trainer.job_config import EvalConfig
from sparkforge.trainer.run_config import LossSpec

logger = logging.getLogger(__name__)


def _loss_spec(draft_path: str, has_confidence_head: bool) -> tuple[LossSpec, str]:
    """The training run's loss settings, or the defaults (fitted to the head) if not recorded."""
    recorded = training_loss_settings(draft_path)
    if recorded is not None:
        return LossSpec(**recorded), "training run"
    logger.warning("%s records no training loss settings: teacher-forced metrics use the "
                   "default loss weights", draft_path)
    return LossSpec(confidence_head_alpha=None if has_confidence_head else 0.0), "defaults"


def _held_out_prompts(reader: Any, num: int, images: TargetImages | None) -> list[Prompt]:
    """The prompt part of the first ``num`` eval samples. A cache holds no pixels, so a prompt
    with image tokens is left out (counted in the log; image prompts come from ``--prompts``)."""
    prompts, without_pixels = [], 0
    index = load_split_index(reader, "eval")
    for sid in index.sample_id.tolist()[:num]:
        sample = reader.read_sample(sid)
        first = int(np.argmax(sample.loss_mask > 0))
        ids = np.asarray(sample.input_ids[:first], dtype=np.int64)
        if images is not None and (ids == images.image_token_id).any():
            without_pixels += 1
        elif first > 0:
            prompts.append(Prompt(input_ids=ids))
    if without_pixels:
        logger.warning("left out %d held-out image prompts of the cache (it stores no pixels; "
                       "pass --prompts with the chat file to decode image prompts)",
                       without_pixels)
    return prompts


def _same_head(target_weight: torch.Tensor, draft_weight: torch.Tensor) -> bool:
    """Whether the draft's lm_head is the target's, at the bf16 precision exports store."""
    ours, theirs = draft_weight.float(), target_weight.float()
    if torch.equal(ours, ours.bfloat16().float()):   # exported in bf16: round the target too
        theirs = theirs.bfloat16().float()
    return torch.equal(ours, theirs)


def _load_target(cfg: EvalConfig, draft: Any, device: torch.device) -> Any:
    """The target in transformers (float32), checked against the draft's sizes and head."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = (AutoModelForImageTextToText if loads_as_image_text(
        read_target_config(cfg.target).model_type) else AutoModelForCausalLM)
    target = auto.from_pretrained(cfg.target, dtype=torch.float32)
    target = target.to(device).eval()  # type: ignore[arg-type]  # odd transformers stub
    dc, tc = draft.config, target.config.get_text_config()
    mismatch = [f"{n}: draft {a}, target {b}" for n, a, b in (
        ("hidden_size", dc.hidden_size, tc.hidden_size),
        ("vocab_size", dc.vocab_size, tc.vocab_size),
        ("num_target_layers", dc.num_target_layers, tc.num_hidden_layers)) if a != b]
    if mismatch:
        raise SparkforgeError(f"draft {cfg.draft} does not fit target {cfg.target}: "
                              + "; ".join(mismatch))
    frozen = target.get_output_embeddings()
    if frozen is not None and not _same_head(frozen.weight, draft.lm_head.weight):
        logger.warning("%s's lm_head differs from the one the draft was trained with: the draft's "
                       "teacher was another model (or precision)", cfg.target)
    return target


def _prompts(cfg: EvalConfig, reader: Any, tokenizer: Any) -> list[Prompt]:
    """The prompts every decoder measures: ``--prompts`` rows, else the cache's eval split."""
    images = target_images(cfg.target, read_target_config(cfg.target).raw)
    if cfg.prompts is None:
        return _held_out_prompts(reader, cfg.num_prompts, images)
    return chat_prompts(cfg.prompts, tokenizer, cfg.num_prompts,
                        storage_options=cfg.storage_options, images=images,
                        image_reader=ImageReader.from_options(
                            cfg.image_sources, storage_options=cfg.storage_options),
                        chat_template_kwargs=_template_kwargs(cfg, reader))


def _template_kwargs(cfg: EvalConfig, reader: Any) -> dict[str, Any]:
    """``--chat_template_kwargs``, else those the cache was captured with, else none."""
    if cfg.chat_template_kwargs is not None:
        return dict(cfg.chat_template_kwargs)
    recorded = {} if reader is None else reader.manifest.producer_config.get(
        "chat_template_kwargs")
    return dict(recorded) if isinstance(recorded, dict) else {}


def run_eval(cfg: EvalConfig) -> dict[str, Any]:
    """Run every evaluation asked for and write the JSON report and PNG plot; returns the
    report."""
    from transformers import AutoTokenizer

    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if cfg.device == "auto" else cfg.device))
    draft = load_draft(cfg.draft).to(device)
    serves = cfg.engine != "none" or cfg.endpoint is not None
    if serves:
        check_servable(cfg, draft.config)
    target = _load_target(cfg, draft, device) if cfg.reference else None
    loss, loss_source = _loss_spec(cfg.draft, draft.confidence_head is not None)
    # Random access to a few eval samples: a crc check would read each one's whole slot (up to
    # hundreds of MB); existence, decode and token-id checks still run on every read.
    reader = (None if cfg.cache is None else
              open_cache(cfg.cache, storage_options=cfg.storage_options or None, verify=False,
                         features=draft.config.target_layer_ids))
    tokenizer = AutoTokenizer.from_pretrained(cfg.target)
    tags = TurnTags.from_tokenizer(tokenizer, cfg.thinking_tags, cfg.tool_call_tag)
    forced, blocks = ({}, []) if reader is None else teacher_forced(draft, reader, cfg, loss,
                                                                   device, tags)
    prompts = _prompts(cfg, reader, tokenizer)
    speculative, runs = ({}, []) if target is None else _decode(target, draft, prompts, cfg,
                                                                device, tags)
    report: dict[str, Any] = {
        "config": asdict(cfg),
        "loss_settings": {"source": loss_source, **asdict(loss)},
        "speculative": speculative,
        "teacher_forced": forced,
    }
    if reader is not None:
        report["matched"] = matched_report(split_sampling(reader.manifest), cfg.temperature,
                                           speculative, forced)
    if cfg.fit_calibration and draft.confidence_head is not None and len(blocks) >= 2:
        report["confidence_calibration"] = _calibrate(cfg, blocks, runs, draft.num_draft_tokens)
    if serves:
        report.update(_served(cfg, draft, prompts, report, runs))
    write_report(report, Path(cfg.out_dir))
    if speculative:
        logger.info("tau %.3f over %d rounds", speculative["tau"], speculative["rounds"])
    return report


def _calibrate(cfg: EvalConfig, blocks: list[SlotRows], runs: list[SpecDecodeResult],
               k: int) -> dict[str, Any]:
    """STS of the head (and of ``max q``) fitted on the even eval batches, tested on the odd ones
    and on the speculative accept events; writes the calibration file serving engines read."""
    spec = speculative_rows(runs, k) if runs else None
    section = calibration_study(SlotRows.concat(blocks[0::2]), SlotRows.concat(blocks[1::2]),
                                spec)
    path = Path(cfg.out_dir) / CALIBRATION_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(calibration_contents(section), indent=2) + "\n")
    return {**section, "file": str(path)}


def _served(cfg: EvalConfig, draft: Any, prompts: list[Prompt], report: dict[str, Any],
            runs: list[SpecDecodeResult]) -> dict[str, Any]:
    """The ``served`` and ``reconciliation`` sections, on the text prompts (a server is sent
    token ids, which carry no pixels)."""
    text = [i for i, p in enumerate(prompts) if p.model_inputs is None]
    if len(text) < len(prompts):
        logger.warning("served eval leaves out %d image prompts (it sends token ids only)",
                       len(prompts) - len(text))
    served, records = measure_served(cfg, draft.config,
                                     [prompts[i].input_ids.tolist() for i in text])
    spec = report["speculative"]
    reference = spec.get("by_prompt_kind", {}).get("text", spec)
    return {"served": served,
            "reconciliation": reconcile(
                served, records, reference=reference,
                reference_runs=[runs[i] for i in text] if runs else [],
                forced=report["teacher_forced"], matched=report.get("matched"),
                k=draft.num_draft_tokens, temperature=cfg.temperature)}


def _decode(target: Any, draft: Any, prompts: list[Prompt], cfg: EvalConfig,
            device: torch.device, tags: TurnTags
            ) -> tuple[dict[str, Any], list[SpecDecodeResult]]:
    """Speculative decoding of every prompt: tau (with its interval), acceptance by position,
    calibration, tau by context length and by kind of turn; with image prompts, the same for
    image and for text prompts apart (``by_prompt_kind``). Also returns each prompt's run, in
    prompt order."""
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    eos = getattr(target.config, "eos_token_id", None)
    runs: list[tuple[str, SpecDecodeResult]] = []   # (prompt kind, run), in prompt order
    for prompt in tqdm(prompts, desc="speculative decoding", unit="prompt"):
        inputs = (None if prompt.model_inputs is None else
                  {name: value.to(device) for name, value in prompt.model_inputs.items()})
        res = speculative_generate(target, draft, torch.from_numpy(prompt.input_ids).to(device),
                                   max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                   confidence_threshold=cfg.confidence_threshold,
                                   eos_token_id=eos if isinstance(eos, int) else None,
                                   generator=gen, target_inputs=inputs)
        runs.append(("text" if inputs is None else "image", res))
    k, seed = draft.num_draft_tokens, cfg.seed
    report = acceptance_report([run for _, run in runs], k, seed, cfg.temperature)
    report["by_context"] = speculative_buckets([run for _, run in runs], k, cfg.context_buckets,
                                               seed=seed)
    report["by_turn"] = by_kind(np.array(report["prompt_tokens"], dtype=np.float64),
                                np.array(report["prompt_rounds"], dtype=np.float64),
                                [tags.kinds(run.tokens) for _, run in runs], unit="prompts",
                                seed=seed)
    if any(kind == "image" for kind, _ in runs):
        report["by_prompt_kind"] = {
            kind: acceptance_report([run for of, run in runs if of == kind], k, seed,
                                    cfg.temperature)
            for kind in ("image", "text")}
    return report, [run for _, run in runs]
