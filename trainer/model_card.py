"""The exported draft's ``README.md``: a Hugging Face model card.

A YAML header the Hub reads (``base_model`` = the target, ``library_name``, ``tags``,
``pipeline_tag``), then the target, the draft's architecture and sizes, the cache it was trained
on (manifest sha256 and data identity), the training config, the eval table when an eval report
is given, and the ``vllm serve`` command that serves the folder.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from sparkforge.trainer.architectures import serving_format
from sparkforge.trainer.architectures.config import DSparkDraftConfig
from sparkforge.trainer.draft.block_layout import BLOCK_LAYOUTS

CARD_FILE = "README.md"
LIBRARY = "vllm"
"""What serves the draft (the Hub's library list has no entry for DSpark drafts themselves)."""


def serving_method(cfg: DSparkDraftConfig) -> str:
    """vLLM's ``speculative_config.method`` for this draft (its serving format's)."""
    return serving_format(cfg).method


def num_speculative_tokens(cfg: DSparkDraftConfig) -> int:
    """Tokens drafted per step: the block for DSpark; the block less its anchor for DFlash."""
    return BLOCK_LAYOUTS[cfg.layout].num_drafts(cfg.block_size)


def serve_command(cfg: DSparkDraftConfig, target: str, draft_dir: str) -> str:
    """The ``vllm serve`` command line that serves ``draft_dir`` as ``target``'s draft."""
    spec = {"method": serving_method(cfg), "model": draft_dir,
            "num_speculative_tokens": num_speculative_tokens(cfg)}
    return f"vllm serve {target} --speculative-config '{json.dumps(spec)}'"


def card_metadata(cfg: DSparkDraftConfig, target: str) -> dict[str, Any]:
    """The card's YAML header."""
    return {"base_model": target, "library_name": LIBRARY, "pipeline_tag": "text-generation",
            "tags": ["speculative-decoding", "draft-model", serving_method(cfg),
                     f"{cfg.architecture}-draft", "sparkforge"]}


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(v) for v in row) + " |" for row in rows]


def _draft_section(cfg: DSparkDraftConfig, sizes: Mapping[str, int]) -> list[str]:
    rows: list[tuple[str, Any]] = [(name, f"{count:,}") for name, count in sizes.items()]
    rows += [(name, getattr(cfg, name)) for name in (
        "architecture", "layout", "num_hidden_layers", "hidden_size", "intermediate_size",
        "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "block_size",
        "markov_rank", "enable_confidence_head", "target_layer_ids", "num_target_layers",
        "mask_token_id")]
    return ["## Draft", "", *_table(("field", "value"), rows)]


def _data_section(provenance: Mapping[str, Any]) -> list[str]:
    lines = ["## Training data", "",
             f"- cache: `{provenance.get('cache_uri', 'unknown')}`",
             f"- cache manifest sha256: `{provenance.get('cache_manifest_sha256', 'unknown')}`",
             f"- target content hash: `{provenance.get('target_content_hash', 'unknown')}`"]
    data = provenance.get("data") or {}
    for source in data.get("sources", []):
        hf = source.get("hf_dataset")
        what = (f"Hugging Face dataset `{hf['name']}` split `{hf['split']}`, revision "
                f"`{hf['revision'] or '-'}`, fingerprint `{hf['fingerprint']}`" if hf else
                f"`{source['uri']}` (sha256 `{source['content_hash']}`)")
        lines.append(f"- source: {what}")
    if data.get("mix"):
        lines += ["", f"Weighted mix (seed {data.get('mix_seed')}):", ""]
        lines += _table(("source", "weight", "rows drawn", "rows held"),
                        [(e["name"], e["weight"], e["rows"], e["source_rows"])
                         for e in data["mix"]])
    return lines


def _eval_section(report: Mapping[str, Any]) -> list[str]:
    spec = report.get("speculative", {})
    interval = spec.get("tau_ci95")
    tau = f"{spec.get('tau', 0.0):.3f}" + (
        f" (95% CI {interval[0]:.3f} - {interval[1]:.3f})" if interval else "")
    temperature = report.get("config", {}).get("temperature")
    lines = ["## Evaluation", "",
             f"Speculative decoding of {spec.get('prompts', '?')} prompts at temperature "
             f"{temperature}: tau (tokens per target forward) **{tau}** over "
             f"{spec.get('rounds', '?')} rounds.", ""]
    lines += _table(("draft position", "acceptance"),
                    [(k, f"{a:.3f}") for k, a in enumerate(spec.get("acceptance_by_position", []))])
    cal = spec.get("calibration")
    if cal:
        auroc = "-" if cal.get("auroc") is None else f"{cal['auroc']:.3f}"
        lines += ["", "Confidence-head calibration against accept events:", ""]
        lines += _table(("ECE", "Brier", "AUROC", "slots"),
                        [(f"{cal['ece']:.3f}", f"{cal['brier']:.3f}", auroc, cal["count"])])
    return lines


def model_card(cfg: DSparkDraftConfig, provenance: Mapping[str, Any], *, draft_dir: str,
               sizes: Mapping[str, int] | None = None,
               eval_report: Mapping[str, Any] | None = None) -> str:
    """The card's text: YAML header, then the sections of the module docstring (``sizes``:
    parameter counts by kind, tabled first in the draft section)."""
    target = str(provenance.get("target_name_or_path") or "<target>")
    training = {k: provenance[k] for k in ("training", "loss", "global_step", "epoch",
                                           "checkpoint") if k in provenance}
    body = [
        f"# DSpark draft for {target}", "",
        f"A {serving_method(cfg)} speculative-decoding draft ({cfg.num_hidden_layers}-layer "
        f"{cfg.architecture} stack, block of {cfg.block_size}) trained by sparkforge on "
        f"hidden states of `{target}` captured into a cache.", "",
        "## Serve it", "", "```bash", serve_command(cfg, target, draft_dir), "```", "",
        *_draft_section(cfg, sizes or {}), "", *_data_section(provenance), "",
        "## Training config", "", "```yaml",
        yaml.safe_dump(training, sort_keys=True).rstrip(), "```",
    ]
    if eval_report:
        body += ["", *_eval_section(eval_report)]
    header = yaml.safe_dump(card_metadata(cfg, target), sort_keys=False).rstrip()
    return f"---\n{header}\n---\n\n" + "\n".join(body) + "\n"
