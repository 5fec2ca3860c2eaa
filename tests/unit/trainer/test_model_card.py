"""The model card: its header parses as a Hugging Face card; serving command and tables."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from huggingface_hub import ModelCard

from sparkforge.trainer.architectures.tiny import draft_tiny
from sparkforge.trainer.eval.report import tau_interval
from sparkforge.trainer.model_card import model_card, serve_command

PROVENANCE = {
    "target_name_or_path": "Qwen/Qwen3-8B", "cache_uri": "s3://b/cache",
    "cache_manifest_sha256": "ab" * 32, "target_content_hash": "cd" * 32,
    "data": {"sources": [
        {"uri": "chat.jsonl", "content_hash": "01" * 32},
        {"uri": "hf://org/sg:train", "content_hash": "02" * 32, "hf_dataset": {
            "name": "org/sg", "revision": "f" * 40, "split": "train", "fingerprint": "fp1"}}],
        "mix": [{"name": "chat", "data": "chat.jsonl", "weight": 3.0, "rows": 90,
                 "source_rows": 40}, {"name": "sg", "data": "hf://org/sg:train",
                                      "weight": 1.0, "rows": 30, "source_rows": 500}],
        "mix_seed": 5},
    "training": {"recipe": "dspark", "optimizer": {"lr": 0.001}}, "global_step": 10}
REPORT = {"config": {"temperature": 0.0},
          "speculative": {"tau": 2.5, "tau_ci95": [2.25, 2.75], "rounds": 40, "prompts": 8,
                          "acceptance_by_position": [0.8, 0.5],
                          "calibration": {"ece": 0.1, "brier": 0.2, "auroc": 0.7,
                                          "count": 64}}}


def test_card_header_and_sections() -> None:
    """Header fields via huggingface_hub; data identity, mix, eval and calibration tables."""
    cfg = draft_tiny()
    card = ModelCard(model_card(cfg, PROVENANCE, draft_dir="out/d", eval_report=REPORT))
    assert card.data.base_model == "Qwen/Qwen3-8B"
    assert (card.data.library_name, card.data.pipeline_tag) == ("vllm", "text-generation")
    assert "speculative-decoding" in card.data.tags
    text = card.text
    assert serve_command(cfg, "Qwen/Qwen3-8B", "out/d") in text
    assert "Hugging Face dataset `org/sg` split `train`, revision `" + "f" * 40 in text
    assert "| chat | 3.0 | 90 | 40 |" in text
    assert "seed 5" in text
    assert "**2.500 (95% CI 2.250 - 2.750)**" in text
    assert "| 0 | 0.800 |" in text
    assert "| 1 | 0.500 |" in text
    assert "| 0.100 | 0.200 | 0.700 | 64 |" in text
    assert "lr: 0.001" in text


@pytest.mark.parametrize(("layout", "method", "tokens"), [("dspark", "dspark", 7),
                                                            ("dflash", "dflash", 6)])
def test_serve_command_method_and_tokens(layout: str, method: str, tokens: int) -> None:
    """DSpark drafts the whole block; DFlash the block less its anchor (block_size - 1)."""
    heads = {} if layout != "dflash" else {
        "markov_rank": 0, "enable_confidence_head": False, "confidence_head_with_markov": False}
    cfg = dataclasses.replace(draft_tiny(), block_size=7, layout=layout, **heads)
    assert serve_command(cfg, "t", "d") == (
        "vllm serve t --speculative-config "
        f"'{{\"method\": \"{method}\", \"model\": \"d\", \"num_speculative_tokens\": {tokens}}}'")


def test_tau_interval_resamples_prompts() -> None:
    """Equal prompts give a point; two prompts of 2 and 4 tokens per round give resampled taus
    in {2, 3, 4}, so the interval lies in [2, 4] around tau = 3; one prompt gives none."""
    assert tau_interval([[3, 3], [3, 3]]) == (3.0, 3.0)
    lo, hi = tau_interval([[2, 2], [4, 4]])  # type: ignore[misc]
    assert 2.0 <= lo < 3.0 < hi <= 4.0
    assert tau_interval([[2, 2], [4, 4]]) == (lo, hi)  # seeded
    assert tau_interval([[5]]) is None


# Target names a dataset author or a careless folder could produce. The shell payloads only ever
# touch a file in the test's own folder: run against unquoted code (the defect this test must
# catch), whatever a payload holds is executed for real.
HOSTILE = ["/models/my model", "x; touch {tmp}/pwned #", "$(touch {tmp}/pwned)", "a'b\"c",
           "evil</code><script>alert(1)</script>", "line\n# Injected heading\n<img src=x>",
           "```\ntouch {tmp}/pwned\n```", "`tick` | cell | *star* [link](http://x)"]


def _tokens(text: str) -> list[Any]:
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark").enable("table").parse(text)


def _inline_text(token: Any) -> str:
    return "".join(c.content for c in token.children or [] if c.type in ("text", "code_inline"))


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_target_name_stays_one_argument_and_literal_markdown(name: str,
                                                                       tmp_path: Path) -> None:
    """A real shell given the serve command (``printf`` standing in for ``vllm``) gets the same
    five arguments whatever the target's name, and runs nothing the name holds; rendered by a
    CommonMark parser, the card holds no HTML, no heading, link, image or emphasis the name made,
    and shows the name literally (it used to go in raw)."""
    target = name.format(tmp=tmp_path)
    cfg = draft_tiny()
    draft_dir = f"out/{target}"
    text = model_card(cfg, {**PROVENANCE, "target_name_or_path": target,
                            "cache_uri": target}, draft_dir=draft_dir)
    command = serve_command(cfg, target, draft_dir)
    assert command.startswith("vllm serve ")
    shell = subprocess.run(["/bin/sh", "-c", "printf '%s\\0' " + command], check=False,
                           capture_output=True, cwd=tmp_path,
                           env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert shell.returncode == 0, shell.stderr
    argv = shell.stdout.decode().split("\0")[:-1]
    assert argv[:3] == ["vllm", "serve", target]
    assert argv[3] == "--speculative-config"
    assert json.loads(argv[4])["model"] == draft_dir
    assert len(argv) == 5
    assert not (tmp_path / "pwned").exists()
    tokens = _tokens(text.split("---\n", 2)[2])
    kinds = {t.type for t in tokens} | {c.type for t in tokens for c in t.children or []}
    assert not kinds & {"html_block", "html_inline", "link_open", "image", "em_open",
                        "strong_open"}, kinds
    headings = [_inline_text(tokens[i + 1]) for i, t in enumerate(tokens)
                if t.type == "heading_open"]
    shown = target.replace("\n", " ")
    assert headings[0] == f"DSpark draft for {shown}"
    assert all(not h.startswith("Injected") for h in headings)
    fences = [t for t in tokens if t.type == "fence"]
    assert [f.info for f in fences] == ["bash", "yaml"]
    assert fences[0].content.strip() == command
    paragraph = next(_inline_text(tokens[i + 1]) for i, t in enumerate(tokens)
                     if t.type == "paragraph_open" and "hidden states of" in tokens[i + 1].content)
    assert shown in paragraph


def test_card_tables_the_confidence_calibration_and_its_engines() -> None:
    """With an STS fit in the report the card shows each estimator before and after and names
    the engines that read confidence_calibration.json."""
    fit = {"teacher_forced": {"ece": 0.02}, "speculative": {"ece": 0.03, "auroc": 0.71},
           "speculative_trials": {"ece": 0.04, "auroc": 0.66}}
    raw = {"teacher_forced": {"ece": 0.09}}
    report = {**REPORT, "confidence_calibration": {
        "fit_blocks": 50, "test_blocks": 40, "temperatures": {"head": [1.25, 0.5]},
        "estimators": {"head": raw, "head + STS": fit, "max_q": raw, "max_q + STS": raw}}}
    text = model_card(draft_tiny(), PROVENANCE, draft_dir="out/d", eval_report=report)
    assert "## Confidence calibration" in text
    assert "`1.250 0.500`" in text
    assert "| head + STS | 0.020 | 0.030 | 0.710 | 0.040 | 0.660 |" in text
    assert r"| max\_q | 0.090 | - | - | - | - |" in text   # markdown-escaped: shows max_q
    assert "--speculative-dspark-confidence-sts-path confidence_calibration.json" in text
    assert "--confidence-calibration-path" in text
