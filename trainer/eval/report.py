"""Write the evaluation report: a JSON file and a PNG of acceptance by draft position."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sparkforge.trainer.eval.bootstrap import ratio_ci

logger = logging.getLogger(__name__)

REPORT_JSON = "eval_report.json"
REPORT_PNG = "acceptance_by_position.png"


def tau_interval(rounds_per_prompt: Sequence[Sequence[int]], *,
                 seed: int = 0) -> tuple[float, float] | None:
    """The 95% bootstrap interval of tau (tokens per round over all rounds), resampling prompts
    (``sparkforge.trainer.eval.bootstrap``); None under two prompts."""
    used = [r for r in rounds_per_prompt if len(r)]
    if len(used) < 2:
        return None
    return ratio_ci([sum(r) for r in used], [len(r) for r in used], seed=seed)


def reliability_bins(confidence: Sequence[float], accept: Sequence[float], *,
                     num_bins: int = 10) -> list[dict[str, float]]:
    """Group slots by predicted confidence; each bin's mean confidence vs mean acceptance."""
    bins: list[list[tuple[float, float]]] = [[] for _ in range(num_bins)]
    for c, a in zip(confidence, accept, strict=True):
        bins[min(int(c * num_bins), num_bins - 1)].append((c, a))
    out = []
    for i, items in enumerate(bins):
        if items:
            out.append({"lo": i / num_bins, "hi": (i + 1) / num_bins, "count": len(items),
                        "confidence": sum(c for c, _ in items) / len(items),
                        "accept": sum(a for _, a in items) / len(items)})
    return out


def plot_acceptance(report: Mapping[str, Any], path: Path) -> None:
    """Per-position acceptance bars (measured and teacher-forced) and a reliability plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_pos, ax_cal) = plt.subplots(1, 2, figsize=(11, 4))
    measured = report.get("speculative", {}).get("acceptance_by_position", [])
    forced = report.get("teacher_forced", {}).get("accept_rate_by_position", [])
    width = 0.4
    temp = report.get("config", {}).get("temperature")
    if measured:
        ax_pos.bar([k - width / 2 for k in range(len(measured))], measured, width,
                   label=f"measured (speculative decoding, T={temp})")
    if forced:
        ax_pos.bar([k + width / 2 for k in range(len(forced))], forced, width,
                   label="teacher-forced, analytic at T=1 (eval split)")
    tau = report.get("speculative", {}).get("tau")
    ax_pos.set_title(f"Acceptance by draft position (tau = {tau:.2f})" if tau else
                     "Acceptance by draft position")
    ax_pos.set_xticks(range(max(len(measured), len(forced))))
    ax_pos.set_xlabel("draft position k (0 = first drafted token)")
    ax_pos.set_ylabel("conditional acceptance")
    ax_pos.set_ylim(0, 1)
    ax_pos.legend(loc="upper right", fontsize=8)
    bins = report.get("teacher_forced", {}).get("reliability", [])
    ax_cal.plot([0, 1], [0, 1], "k--", linewidth=1, label="perfect calibration")
    if bins:
        ax_cal.plot([b["confidence"] for b in bins], [b["accept"] for b in bins], "o-",
                    label="confidence head")
    ax_cal.set_title("Confidence calibration (eval split)")
    ax_cal.set_xlabel("predicted acceptance (sigmoid of confidence)")
    ax_cal.set_ylabel("analytic acceptance")
    ax_cal.set_xlim(0, 1)
    ax_cal.set_ylim(0, 1)
    ax_cal.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(report: Mapping[str, Any], out_dir: str | Path) -> tuple[Path, Path]:
    """Write ``eval_report.json`` and ``acceptance_by_position.png`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / REPORT_JSON, out / REPORT_PNG
    json_path.write_text(json.dumps(report, indent=2, sort_keys=True, default=str) + "\n")
    plot_acceptance(report, png_path)
    logger.info("wrote %s and %s", json_path, png_path)
    return json_path, png_path
