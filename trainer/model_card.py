"""The exported draft's ``README.md``: a Hugging Face model card.

A YAML header the Hub reads (``base_model`` = the target, ``library_name``, ``tags``,
``pipeline_tag``), then the target, the draft's architecture and sizes, the cache it was trained
on (manifest sha256 and data identity), the training config, the eval table when an eval report
is given, and the ``vllm serve`` command that serves the folder.

Names come from the user's paths and data (a target folder may be called anything), so every one
is escaped where it lands: for the shell in the serve command (``shlex.quote``), for markdown in
text and table cells (HTML and markdown punctuation escaped, line breaks flattened), and code
spans and fences are longer than any backtick run they hold.
"""

from __future__ import annotations

import html
import json
import re
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from sparkforge.trainer.architectures import serving_format
from sparkforge.trainer.architectures.config import DraftConfig
from sparkforge.trainer.draft.block_layout import BLOCK_LAYOUTS
from sparkforge.trainer.eval.sts import CALIBRATION_FILE

CARD_FILE = "README.md"
LIBRARY = "vllm"
"""What serves the draft (the Hub's library list has no entry for DSpark drafts themselves)."""


def serving_method(cfg: DraftConfig) -> str:
    """vLLM's ``speculative_config.method`` for this draft (its serving format's)."""
    return serving_format(cfg).method


def num_speculative_tokens(cfg: DraftConfig) -> int:
    """Tokens drafted per step: the block for DSpark; the block less its anchor for DFlash."""
    return BLOCK_LAYOUTS[cfg.layout].num_drafts(cfg.block_size)


def serve_command(cfg: DraftConfig, target: str, draft_dir: str) -> str:
    """The ``vllm serve`` command line that serves ``draft_dir`` as ``target``'s draft (each
    argument quoted for a POSIX shell)."""
    spec = {"method": serving_method(cfg), "model": draft_dir,
            "num_speculative_tokens": num_speculative_tokens(cfg)}
    return (f"vllm serve {shlex.quote(target)} --speculative-config "
            f"{shlex.quote(json.dumps(spec))}")


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_MARKDOWN_PUNCTUATION = re.compile(r"([\\`*_\[\]|~!#])")
"""What makes inline markdown (emphasis, links, images, code, table cells, a heading's closing
``#``) where it is not at a line start (names never are)."""


def markdown_text(text: object) -> str:
    """``text`` as literal markdown: one line, HTML escaped, markdown punctuation escaped."""
    flat = _CONTROL.sub(" ", str(text))
    return _MARKDOWN_PUNCTUATION.sub(r"\\\1", html.escape(flat, quote=False))


def markdown_code(text: object) -> str:
    """``text`` as one inline code span (on one line, whatever backticks it holds)."""
    flat = _CONTROL.sub(" ", str(text))
    fence = "`" * (_longest_backtick_run(flat) + 1)
    pad = " " if flat.startswith("`") or flat.endswith("`") else ""
    return f"{fence}{pad}{flat}{pad}{fence}"


def _fenced(language: str, text: str) -> list[str]:
    """A fenced code block longer than any backtick run of ``text``."""
    fence = "`" * max(3, _longest_backtick_run(text) + 1)
    return [f"{fence}{language}", text, fence]


def _longest_backtick_run(text: str) -> int:
    return max((len(run) for run in re.findall(r"`+", text)), default=0)


def card_metadata(cfg: DraftConfig, target: str) -> dict[str, Any]:
    """The card's YAML header."""
    return {"base_model": target, "library_name": LIBRARY, "pipeline_tag": "text-generation",
            "tags": ["speculative-decoding", "draft-model", serving_method(cfg),
                     f"{cfg.architecture}-draft", "sparkforge"]}


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(markdown_text(v) for v in row) + " |" for row in rows]


def _draft_section(cfg: DraftConfig, sizes: Mapping[str, int]) -> list[str]:
    rows: list[tuple[str, Any]] = [(name, f"{count:,}") for name, count in sizes.items()]
    rows += [(name, getattr(cfg, name)) for name in (
        "architecture", "layout", "num_hidden_layers", "hidden_size", "intermediate_size",
        "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "block_size",
        "markov_rank", "enable_confidence_head", "target_layer_ids", "num_target_layers",
        "mask_token_id")]
    return ["## Draft", "", *_table(("field", "value"), rows)]


def _data_section(provenance: Mapping[str, Any]) -> list[str]:
    code = markdown_code
    lines = ["## Training data", "",
             f"- cache: {code(provenance.get('cache_uri', 'unknown'))}",
             f"- cache manifest sha256: {code(provenance.get('cache_manifest_sha256', 'unknown'))}",
             f"- target content hash: {code(provenance.get('target_content_hash', 'unknown'))}"]
    data = provenance.get("data") or {}
    for source in data.get("sources", []):
        hf = source.get("hf_dataset")
        what = (f"Hugging Face dataset {code(hf['name'])} split {code(hf['split'])}, revision "
                f"{code(hf['revision'] or '-')}, fingerprint {code(hf['fingerprint'])}" if hf else
                f"{code(source['uri'])} (sha256 {code(source['content_hash'])})")
        lines.append(f"- source: {what}")
    if data.get("mix"):
        lines += ["", f"Weighted mix (seed {markdown_text(data.get('mix_seed'))}):", ""]
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


def _metric(row: Mapping[str, Any], view: str, name: str) -> str:
    value = row.get(view, {}).get(name)
    return "-" if value is None else f"{value:.3f}"


def _calibration_section(cal: Mapping[str, Any]) -> list[str]:
    """The STS fit: each estimator before and after, and which engines read the file."""
    rows = [(name, _metric(row, "teacher_forced", "ece"), _metric(row, "speculative", "ece"),
             _metric(row, "speculative", "auroc"), _metric(row, "speculative_trials", "ece"),
             _metric(row, "speculative_trials", "auroc"))
            for name, row in cal["estimators"].items()]
    temps = " ".join(f"{t:.3f}" for t in cal["temperatures"]["head"])
    return ["## Confidence calibration", "",
            f"Per-slot temperatures of the confidence head (sequential temperature scaling, fitted "
            f"on {cal['fit_blocks']} teacher-forced blocks of the eval split, tested on "
            f"{cal['test_blocks']} others): `{temps}`, in `{CALIBRATION_FILE}`. `max q` is the "
            "draft's top probability, the head-free estimator.", "",
            *_table(("estimator", "ECE of survival (teacher-forced)", "ECE of survival (served "
                     "events)", "AUROC (served events)", "ECE per trial", "AUROC per trial"),
                    rows), "",
            "Engines that read the file (one temperature per draft slot, applied as "
            "`sigmoid(logit / T)` before the survival product):", "",
            f"- SGLang: `--speculative-dspark-confidence-sts-path {CALIBRATION_FILE}` (key "
            "`temperatures`, exactly one per slot)",
            "- TensorRT-LLM: the DSpark decoding config's STS path (`confidence_sts_path`; its "
            "loader reads `sts_temperatures` or `temperatures`)",
            f"- DeepSpec: `eval.py --confidence-calibration-path {CALIBRATION_FILE}` (key "
            "`temperatures`, one per block slot)",
            "- vLLM (0.32) reads no calibration file."]


def model_card(cfg: DraftConfig, provenance: Mapping[str, Any], *, draft_dir: str,
               sizes: Mapping[str, int] | None = None,
               eval_report: Mapping[str, Any] | None = None) -> str:
    """The card's text: YAML header, then the sections of the module docstring (``sizes``:
    parameter counts by kind, tabled first in the draft section)."""
    target = str(provenance.get("target_name_or_path") or "<target>")
    training = {k: provenance[k] for k in ("training", "loss", "global_step", "epoch",
                                           "checkpoint") if k in provenance}
    body = [
        f"# DSpark draft for {markdown_text(target)}", "",
        f"A {serving_method(cfg)} speculative-decoding draft ({cfg.num_hidden_layers}-layer "
        f"{cfg.architecture} stack, block of {cfg.block_size}) trained by sparkforge on "
        f"hidden states of {markdown_code(target)} captured into a cache.", "",
        "## Serve it", "", *_fenced("bash", serve_command(cfg, target, draft_dir)), "",
        *([serving_format(cfg).serving_note + ".", ""] if serving_format(cfg).serving_note
          else []),
        *_draft_section(cfg, sizes or {}), "", *_data_section(provenance), "",
        "## Training config", "",
        *_fenced("yaml", yaml.safe_dump(training, sort_keys=True).rstrip()),
    ]
    if eval_report:
        body += ["", *_eval_section(eval_report)]
        if eval_report.get("confidence_calibration"):
            body += ["", *_calibration_section(eval_report["confidence_calibration"])]
    header = yaml.safe_dump(card_metadata(cfg, target), sort_keys=False).rstrip()
    return f"---\n{header}\n---\n\n" + "\n".join(body) + "\n"
