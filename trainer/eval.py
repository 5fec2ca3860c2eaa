"""``sparkforge eval``: measure a trained draft by speculative decoding with a transformers target.

Held-out prompts come from a chat file (JSONL/Parquet ``messages`` rows: the conversation up to its
last assistant turn) or from a cache's eval split (the prompt part of each sample, never trained
on; ``sparkforge produce --eval_fraction 1.0`` makes an eval-only cache). Two views are reported:
the measured acceptance of real speculative decoding (tau, per-position acceptance, calibration of
the confidence head against the accept events) and, with a cache, the teacher-forced metrics of its
eval split computed with the training run's loss settings (accept_rate@k, tau, calibration, and the
expected tokens per round and verified slots under fixed lengths and confidence thresholds).
Both taus carry a 95% bootstrap interval over prompts (eval samples); the ``matched`` section says
whether the eval split was regenerated at the temperature eval measures at and, when it was (at
T=1), whether the two taus agree within their intervals.
"""

from __future__ import annotations

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
from sparkforge.trainer.bootstrap import ratio_ci
from sparkforge.trainer.calibration import (
    auroc,
    brier_score,
    expected_calibration_error,
    policy_table,
)
from sparkforge.trainer.chat_prompts import Prompt, chat_prompts
from sparkforge.trainer.context_buckets import forced_buckets, speculative_buckets
from sparkforge.trainer.data import CacheStream, load_split_index
from sparkforge.trainer.export import load_draft, training_loss_settings
from sparkforge.trainer.job_config import EvalConfig
from sparkforge.trainer.loader_settings import LoaderSettings
from sparkforge.trainer.loss import compute_dspark_loss
from sparkforge.trainer.matched_eval import FORCED_TEMPERATURE, matched_report, split_sampling
from sparkforge.trainer.metrics import accumulate, metric_ratios, metric_sums
from sparkforge.trainer.report import reliability_bins, tau_interval, write_report
from sparkforge.trainer.run_config import LossSpec
from sparkforge.trainer.speculative import SpecDecodeResult, speculative_generate
from sparkforge.trainer.turn_kinds import TurnTags, by_kind

logger = logging.getLogger(__name__)


def _loss_spec(draft_path: str, has_confidence_head: bool) -> tuple[LossSpec, str]:
    """The training run's loss settings, or the defaults (fitted to the head) if not recorded."""
    recorded = training_loss_settings(draft_path)
    if recorded is not None:
        return LossSpec(**recorded), "training run"
    logger.warning("%s records no training loss settings: teacher-forced metrics use the "
                   "default loss weights", draft_path)
    return LossSpec(confidence_head_alpha=None if has_confidence_head else 0.0), "defaults"


def _teacher_forced(draft: Any, reader: Any, cfg: EvalConfig, loss: LossSpec,
                    device: torch.device, tags: TurnTags) -> dict[str, Any]:
    settings = LoaderSettings(batch_size=4, batching="pad", num_workers=0, read_ahead_units=1,
                              seed=cfg.seed)
    stream = CacheStream(reader, load_split_index(reader, "eval"), settings, rank=0,
                         world_size=1, shuffle=False)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    sums, blocks, per_sample, by_anchor, kinds, selector = None, [], [], [], [], []
    with torch.no_grad():
        for i, batch in enumerate(stream):
            if cfg.max_eval_batches is not None and i >= cfg.max_eval_batches:
                break
            b = {k: v.to(device) for k, v in batch.items()}
            out = draft(b["input_ids"], b["loss_mask"], b["target_hidden_states"],
                        b["target_last_hidden_states"], attention_mask=b["attention_mask"],
                        generator=gen)
            res = compute_dspark_loss(out, loss)
            sums = accumulate(sums, metric_sums(out, res.accept_rate, res.weights,
                                                res.selector_accept_rate))
            if res.accept_rate is not None:
                blocks.append(_block_rows(out, res.accept_rate))
                per_sample.append(_sample_tau_sums(out, res.accept_rate))
                by_anchor.append(_anchor_rows(out, res.accept_rate))
                kinds += [tags.kinds(ids[mask > 0]) for ids, mask in zip(
                    batch["input_ids"], batch["loss_mask"], strict=True)]
            if res.selector_accept_rate is not None:
                selector.append(_sample_tau_sums(out, res.selector_accept_rate))
    if sums is None:
        return {}
    ratios = metric_ratios(sums)
    k = draft.num_draft_tokens
    report: dict[str, Any] = {
        "metrics": ratios,
        "accept_rate_by_position": [ratios.get(f"accept_rate@{j}", 0.0) for j in range(k)],
        **_tau_intervals(per_sample, cfg.seed)}
    if per_sample:
        num, den = (np.concatenate([part[n] for part in per_sample]) for n in (0, 1))
        report["by_context"] = forced_buckets(by_anchor, cfg.context_buckets, seed=cfg.seed)
        report["by_turn"] = by_kind(num, den, kinds, unit="samples", seed=cfg.seed)
    if selector:
        report["selector"] = _selector_report(ratios, selector, k, cfg.seed)
    if blocks:
        accept, conf, valid = (np.concatenate(parts) for parts in zip(*blocks, strict=True))
        has_conf = draft.confidence_head is not None
        report["policies"] = policy_table(accept, conf if has_conf else None, valid,
                                          cfg.policy_thresholds)
        if has_conf:
            report["calibration"] = {"temperature": FORCED_TEMPERATURE,
                                     **_calibration(conf[valid], accept[valid], events=False)}
            report["reliability"] = reliability_bins(conf[valid].tolist(),
                                                     accept[valid].tolist())
    return report


def _selector_report(ratios: dict[str, float], per_sample: list[tuple[np.ndarray, ...]],
                     k: int, seed: int) -> dict[str, Any]:
    """A DFlash2 draft's teacher-forced acceptance as served (through its candidate selector):
    tau with its intervals, acceptance by position, the top-k recall of the data token."""
    return {"tau": ratios.get("selector_tau", 0.0),
            "accept_rate_by_position": [ratios.get(f"selector_accept_rate@{j}", 0.0)
                                        for j in range(k)],
            "candidate_recall": ratios.get("candidate_recall", 0.0),
            **_tau_intervals(per_sample, seed)}


def _tau_intervals(per_sample: list[tuple[np.ndarray, ...]], seed: int) -> dict[str, Any]:
    """The sample count, tau's 95% interval over samples, and tau on full blocks with its
    interval, from the batches' ``_sample_tau_sums`` (empty without any)."""
    if not per_sample:
        return {}
    num, den, full_num, full_den = (np.concatenate(parts) for parts in zip(*per_sample,
                                                                             strict=True))
    full = int(full_den.sum())
    return {"samples": int((den > 0).sum()), "tau_ci95": list(ratio_ci(num, den, seed=seed)),
            "full_blocks": {"tau": float(full_num.sum() / full) if full else 0.0,
                            "tau_ci95": list(ratio_ci(full_num, full_den, seed=seed)),
                            "blocks": full, "cut_blocks": int(den.sum()) - full}}


def _sample_tau_sums(out: Any, accept_BAK: torch.Tensor) -> tuple[np.ndarray, ...]:
    """Per sample of the batch: the sum of its blocks' expected lengths and its block count
    (the teacher-forced tau's numerator and denominator, as ``metric_sums`` counts them), then
    the same over its full blocks only (every slot inside the sample's supervised tokens).

    A block cut by the end of the sample (or of its reply) stops there as if rejected, which
    speculative decoding never does: its rounds are counted whole past ``max_new_tokens`` and
    eos. The full blocks are what the two taus are compared on (``matched_eval``)."""
    length, on = _block_lengths(out, accept_BAK)
    full = (on & out.eval_mask.bool().all(-1)).double()
    return tuple(t.cpu().numpy() for t in ((length * on).sum(-1), on.double().sum(-1),
                                           (length * full).sum(-1), full.sum(-1)))


def _block_lengths(out: Any, accept_BAK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block's expected length ``1 + sum of surviving acceptances`` [B, A] and whether it
    counts (kept, with a supervised slot), as ``metric_sums`` counts tau."""
    surv = torch.cumprod(accept_BAK.double() * out.eval_mask.double(), dim=-1)
    return 1.0 + surv.sum(-1), out.block_keep_mask & out.eval_mask.any(-1)


def _anchor_rows(out: Any, accept_BAK: torch.Tensor) -> tuple[np.ndarray, ...]:
    """Per block: anchor position, expected length, whether it counts, acceptance and the
    supervised slots (``context_buckets.forced_buckets``' rows)."""
    length, on = _block_lengths(out, accept_BAK)
    return tuple(t.cpu().numpy() for t in (out.anchor_positions, length, on,
                                           accept_BAK.double(), out.eval_mask.double()))


def _block_rows(out: Any, accept_BAK: torch.Tensor) -> tuple[np.ndarray, ...]:
    """Per kept block with data: acceptance, confidence (zeros without a head), valid slots."""
    valid_BAK = out.eval_mask > 0
    keep = valid_BAK.any(dim=-1)
    conf = (torch.sigmoid(out.confidence_logits.float()) if out.confidence_logits is not None
            else torch.zeros_like(accept_BAK))
    return (accept_BAK[keep].cpu().numpy(), conf[keep].cpu().numpy(),
            valid_BAK[keep].cpu().numpy())


def _calibration(confidence: Any, outcome: Any, *, events: bool) -> dict[str, Any]:
    """ECE, mean absolute error, Brier and (for 0/1 accept events) AUROC of the head."""
    conf, out = np.asarray(confidence, dtype=np.float64), np.asarray(outcome, dtype=np.float64)
    report: dict[str, Any] = {"count": int(conf.size),
                              "ece": expected_calibration_error(conf, out),
                              "abs_error": float(np.abs(conf - out).mean()) if conf.size else 0.0,
                              "brier": brier_score(conf, out),
                              "mean_confidence": float(conf.mean()) if conf.size else 0.0,
                              "mean_outcome": float(out.mean()) if out.size else 0.0}
    if events:
        report["auroc"] = auroc(conf, out > 0.5)
    return report


def _held_out_prompts(reader: Any, num: int, images: TargetImages | None) -> list[Prompt]:
    """The prompt part of the first ``num`` eval samples. A cache holds no pixels, so a prompt
    with image tokens is left out (counted in the log; image prompts come from ``--prompts``)."""
    prompts, without_pixels = [], 0
    index = load_split_index(reader, "eval")
    for sid in index.sample_id[:num].tolist():
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


def run_eval(cfg: EvalConfig) -> dict[str, Any]:
    """Run both evaluations and write the JSON report and PNG plot; returns the report."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if cfg.device == "auto" else cfg.device))
    draft = load_draft(cfg.draft).to(device)
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
    loss, loss_source = _loss_spec(cfg.draft, draft.confidence_head is not None)
    # Random access to a few eval samples: a crc check would read each one's whole slot (up to
    # hundreds of MB); existence, decode and token-id checks still run on every read.
    reader = (None if cfg.cache is None else
              open_cache(cfg.cache, storage_options=cfg.storage_options or None, verify=False,
                         features=dc.target_layer_ids))
    tokenizer = AutoTokenizer.from_pretrained(cfg.target)
    tags = TurnTags.from_tokenizer(tokenizer, cfg.thinking_tags, cfg.tool_call_tag)
    forced = {} if reader is None else _teacher_forced(draft, reader, cfg, loss, device, tags)
    images = target_images(cfg.target, read_target_config(cfg.target).raw)
    if cfg.prompts is not None:
        prompts = chat_prompts(cfg.prompts, tokenizer, cfg.num_prompts,
                               storage_options=cfg.storage_options, images=images,
                               image_reader=ImageReader.from_options(
                                   cfg.image_sources, storage_options=cfg.storage_options),
                               chat_template_kwargs=_template_kwargs(cfg, reader))
    else:
        prompts = _held_out_prompts(reader, cfg.num_prompts, images)
    speculative = _decode(target, draft, prompts, cfg, device, tags)
    report = {
        "config": asdict(cfg),
        "loss_settings": {"source": loss_source, **asdict(loss)},
        "speculative": speculative,
        "teacher_forced": forced,
    }
    if reader is not None:
        report["matched"] = matched_report(split_sampling(reader.manifest), cfg.temperature,
                                           speculative, forced)
    write_report(report, Path(cfg.out_dir))
    logger.info("tau %.3f over %d rounds", report["speculative"]["tau"],
                report["speculative"]["rounds"])
    return report


def _template_kwargs(cfg: EvalConfig, reader: Any) -> dict[str, Any]:
    """``--chat_template_kwargs``, else those the cache was captured with, else none."""
    if cfg.chat_template_kwargs is not None:
        return dict(cfg.chat_template_kwargs)
    recorded = {} if reader is None else reader.manifest.producer_config.get(
        "chat_template_kwargs")
    return dict(recorded) if isinstance(recorded, dict) else {}


def _decode(target: Any, draft: Any, prompts: list[Prompt], cfg: EvalConfig,
            device: torch.device, tags: TurnTags) -> dict[str, Any]:
    """Speculative decoding of every prompt: tau (with its interval), acceptance by position,
    calibration; with image prompts, the same for image and for text prompts apart
    (``by_prompt_kind``)."""
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
    report = _acceptance([run for _, run in runs], k, seed, cfg.temperature)
    report["by_context"] = speculative_buckets([run for _, run in runs], k, cfg.context_buckets,
                                               seed=seed)
    report["by_turn"] = by_kind(np.array(report["prompt_tokens"], dtype=np.float64),
                                np.array(report["prompt_rounds"], dtype=np.float64),
                                [tags.kinds(run.tokens) for _, run in runs], unit="prompts",
                                seed=seed)
    if any(kind == "image" for kind, _ in runs):
        report["by_prompt_kind"] = {
            kind: _acceptance([run for of, run in runs if of == kind], k, seed, cfg.temperature)
            for kind in ("image", "text")}
    return report


def _acceptance(runs: list[SpecDecodeResult], k: int, seed: int,
                temperature: float) -> dict[str, Any]:
    """tau, its 95% interval over prompts (with each prompt's tokens and rounds), acceptance and
    trials by position and calibration (at ``temperature``) over speculative generations."""
    rounds = [n for r in runs for n in r.tokens_per_round]
    verified = [m for r in runs for m in r.verified_per_round]
    accepted = np.sum([r.position_accepted for r in runs], axis=0) if runs else np.zeros(k)
    trials = np.sum([r.position_trials for r in runs], axis=0) if runs else np.zeros(k)
    conf = [c for r in runs for c in r.trial_confidence]
    events = [e for r in runs for e in r.trial_accepted]
    report: dict[str, Any] = {
        "tau": float(np.mean(rounds)) if rounds else 0.0, "rounds": len(rounds),
        "tau_ci95": tau_interval([list(r.tokens_per_round) for r in runs], seed=seed),
        "prompts": len(runs),
        "prompt_tokens": [sum(r.tokens_per_round) for r in runs],
        "prompt_rounds": [len(r.tokens_per_round) for r in runs],
        "verified_per_round": float(np.mean(verified)) if verified else 0.0,
        "acceptance_by_position": [float(a / t) if t else 0.0
                                   for a, t in zip(accepted, trials, strict=True)],
        "position_trials": [float(t) for t in trials],
        "position_accepted": [float(a) for a in accepted]}
    if conf:
        report["calibration"] = {"temperature": temperature,
                                 **_calibration(conf, events, events=True)}
    return report
