"""``sparkforge eval``: measure a trained draft by speculative decoding with a transformers target.

Held-out prompts come from the cache's eval split (the prompt part of each sample, never trained
on). Two views are reported: the measured acceptance of real speculative decoding (tau, per-position
acceptance) and the teacher-forced metrics of the eval split (accept_rate@k, tau, confidence
calibration with a reliability table).
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
from sparkforge.trainer.data import CacheStream, load_split_index
from sparkforge.trainer.export import load_draft
from sparkforge.trainer.job_config import EvalConfig
from sparkforge.trainer.loss import compute_dspark_loss
from sparkforge.trainer.metrics import accumulate, metric_ratios, metric_sums
from sparkforge.trainer.report import reliability_bins, write_report
from sparkforge.trainer.run_config import LossSpec
from sparkforge.trainer.speculative import speculative_generate

logger = logging.getLogger(__name__)


def _teacher_forced(draft: Any, reader: Any, cfg: EvalConfig,
                    device: torch.device) -> dict[str, Any]:
    stream = CacheStream(lambda: reader, load_split_index(reader, "eval"), rank=0, world_size=1,
                         num_workers=0, batch_size=4, batching="pad", shuffle=False,
                         shuffle_buffer=1, pool_batches=1, seed=cfg.seed, read_ahead_units=1)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    sums, conf_all, acc_all = None, [], []
    with torch.no_grad():
        for i, batch in enumerate(stream):
            if cfg.max_eval_batches is not None and i >= cfg.max_eval_batches:
                break
            b = {k: v.to(device) for k, v in batch.items()}
            out = draft(b["input_ids"], b["loss_mask"], b["target_hidden_states"],
                        b["target_last_hidden_states"], attention_mask=b["attention_mask"],
                        generator=gen)
            res = compute_dspark_loss(out, LossSpec())
            sums = accumulate(sums, metric_sums(out, res.accept_rate, res.weights))
            if out.confidence_logits is not None and res.accept_rate is not None:
                on = out.eval_mask
                conf_all += torch.sigmoid(out.confidence_logits[on]).tolist()
                acc_all += res.accept_rate[on].tolist()
    if sums is None:
        return {}
    ratios = metric_ratios(sums)
    k = draft.config.block_size
    return {"metrics": ratios, "reliability": reliability_bins(conf_all, acc_all),
            "accept_rate_by_position": [ratios.get(f"accept_rate@{j}", 0.0) for j in range(k)]}


def _held_out_prompts(reader: Any, num: int) -> list[np.ndarray]:
    prompts = []
    index = load_split_index(reader, "eval")
    for sid in index.sample_id.tolist()[:num]:
        sample = reader.read_sample(sid)
        first = int(np.argmax(sample.loss_mask > 0))
        if first > 0:
            prompts.append(np.asarray(sample.input_ids[:first], dtype=np.int64))
    return prompts


def _same_head(target_weight: torch.Tensor, draft_weight: torch.Tensor) -> bool:
    """Whether the draft's lm_head is the target's, at the bf16 precision exports store."""
    ours, theirs = draft_weight.float(), target_weight.float()
    if torch.equal(ours, ours.bfloat16().float()):   # exported in bf16: round the target too
        theirs = theirs.bfloat16().float()
    return torch.equal(ours, theirs)


def run_eval(cfg: EvalConfig) -> dict[str, Any]:
    """Run both evaluations and write the JSON report and PNG plot; returns the report."""
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if cfg.device == "auto" else cfg.device))
    draft = load_draft(cfg.draft).to(device)
    target = AutoModelForCausalLM.from_pretrained(cfg.target, dtype=torch.float32)
    target = target.to(device).eval()  # type: ignore[arg-type]
    dc, tc = draft.config, target.config
    mismatch = [f"{n}: draft {a}, target {b}" for n, a, b in (
        ("hidden_size", dc.hidden_size, tc.hidden_size),
        ("vocab_size", dc.vocab_size, tc.vocab_size),
        ("num_target_layers", dc.num_target_layers, tc.num_hidden_layers)) if a != b]
    if mismatch:
        raise ValueError(f"draft {cfg.draft} does not fit target {cfg.target}: "
                         + "; ".join(mismatch))
    frozen = target.get_output_embeddings()
    if frozen is not None and not _same_head(frozen.weight, draft.lm_head.weight):
        logger.warning("%s's lm_head differs from the one the draft was trained with: the draft's "
                       "teacher was another model (or precision)", cfg.target)
    # Random access to a few eval samples: a crc check would read each one's whole slot (up to
    # hundreds of MB); existence, decode and token-id checks still run on every read.
    reader = open_cache(cfg.cache, storage_options=cfg.storage_options or None, verify=False)
    forced = _teacher_forced(draft, reader, cfg, device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    rounds: list[int] = []
    accepted, trials = np.zeros(dc.block_size), np.zeros(dc.block_size)
    eos = getattr(tc, "eos_token_id", None)
    for prompt in tqdm(_held_out_prompts(reader, cfg.num_prompts), desc="speculative decoding",
                       unit="prompt"):
        res = speculative_generate(target, draft, torch.from_numpy(prompt).to(device),
                                   max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                   confidence_threshold=cfg.confidence_threshold,
                                   eos_token_id=eos if isinstance(eos, int) else None,
                                   generator=gen)
        rounds += res.tokens_per_round
        accepted += res.position_accepted
        trials += res.position_trials
    report = {
        "config": asdict(cfg),
        "speculative": {
            "tau": float(np.mean(rounds)) if rounds else 0.0, "rounds": len(rounds),
            "acceptance_by_position": [float(a / t) if t else 0.0
                                       for a, t in zip(accepted, trials, strict=True)],
            "position_trials": trials.tolist()},
        "teacher_forced": forced,
    }
    write_report(report, Path(cfg.out_dir))
    logger.info("tau %.3f over %d rounds", report["speculative"]["tau"], len(rounds))
    return report
