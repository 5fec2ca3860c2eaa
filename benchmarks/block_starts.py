"""Where speculative decoding starts its blocks, and what that does to the first slot's acceptance.

Teacher-forced tau averages blocks anchored at every position of the eval split's replies;
speculative decoding anchors each block right after the previous round's last token, which is a
rejection in most rounds of a weak draft. When a draft's acceptance runs in stretches along the
text, a block after a rejection starts in a hard stretch, and speculative tau sits below
teacher-forced tau without either being wrong. For each converged-study draft (``bench_quality.py
--study converged``) this measures the first draft slot's acceptance at T=1:

- teacher-forced, over the anchors of the first ``--max_new_tokens`` reply tokens (the stretch
  speculative decoding covers): at every anchor, and weighted by the previous anchor's
  rejection (``1 - a[t-1]``) or acceptance (``a[t-1]``), the previous anchor's slot drafting the
  token this one starts from;
- speculative (``sparkforge eval``'s reference decoder, its prompts, seed and eos): the accepted
  fraction, and its expectation ``sum(min(p, q))`` along the same path (read from each verified
  slot's target and draft laws), which is free of the accept draws' noise; and that expectation
  once more with each rejection's token (the next anchor) drawn from ``p`` instead of the
  residual ``max(p - q, 0)`` (not lossless), which tells the anchor token's part in the gap from
  the block start's.

Reproduce (under a CPU minute per draft):
    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python -P benchmarks/block_starts.py \
        --out_dir bench-quality-out/study
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out_dir", type=Path, default=Path("bench-quality-out/study"),
                   help="a converged study's --out_dir (train/, cache_T1.0/, target/)")
    p.add_argument("--drafts", nargs="+",
                   default=["dspark", "dflash", "dflash2", "dflash2_top64"])
    p.add_argument("--num_prompts", type=int, default=16)
    p.add_argument("--max_new_tokens", type=int, default=48)
    p.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results")
    return p.parse_args(argv)


def _first_slot_accept(draft: Any, loss: Any, batch: dict[str, torch.Tensor],
                       anchors: torch.Tensor) -> tuple[list[float | None], list[int]]:
    """The served first-slot acceptance at each of ``anchors`` [1, A] (None where unsupervised)."""
    from sparkforge.trainer.draft.draft_batch import DraftBatch, FixedAnchors
    from sparkforge.trainer.loss import compute_dspark_loss

    keep = torch.ones_like(anchors, dtype=torch.bool)
    out = draft(DraftBatch(batch["input_ids"], batch["loss_mask"], batch["target_hidden_states"],
                           batch["target_last_hidden_states"],
                           attention_mask=batch["attention_mask"]), FixedAnchors(anchors, keep))
    res = compute_dspark_loss(out, loss)
    accept = (res.selector.accept if res.selector is not None else res.accept_rate)[0, :, 0]
    return [float(a) if on else None for a, on in zip(
        accept.tolist(), (out.eval_mask[0, :, 0] > 0).tolist(), strict=True)], anchors[0].tolist()


def forced_first_slot(draft: Any, loss: Any, reader: Any, window: int) -> dict[str, float]:
    """Teacher-forced first-slot acceptance over the first ``window`` tokens of each eval reply:
    at every anchor, after a rejection and after an acceptance at the anchor before."""
    from sparkforge.trainer.data import CacheStream, load_split_index
    from sparkforge.trainer.loader_settings import LoaderSettings

    settings = LoaderSettings(batch_size=1, batching="pad", num_workers=0, read_ahead_units=1,
                              seed=0)
    pairs = []   # (acceptance at anchor t-1, at anchor t)
    with torch.no_grad():
        for batch in CacheStream(reader, load_split_index(reader, "eval"), settings, rank=0,
                                 world_size=1, shuffle=False):
            reply = torch.nonzero(batch["loss_mask"][0] > 0).flatten()
            anchors = reply[:window][None]
            accept, at = _first_slot_accept(draft, loss, batch, anchors)
            pairs += [(accept[i - 1], accept[i]) for i in range(1, len(accept))
                      if at[i] == at[i - 1] + 1 and None not in (accept[i - 1], accept[i])]
    before, now = np.array(pairs).T
    return {"anchors": len(pairs), "every_anchor": float(now.mean()),
            "after_rejection": float(((1 - before) * now).sum() / (1 - before).sum()),
            "after_acceptance": float((before * now).sum() / before.sum())}


@contextmanager
def _expected_acceptance(into: list[list[float]], anchor_from_p: bool) -> Iterator[None]:
    """While open, each verified round of the reference decoder appends its slots' expected
    acceptance ``sum(min(p, q))`` (through the slot it stopped at) to ``into``; with
    ``anchor_from_p``, a rejection's token (the next anchor) is drawn from ``p`` instead of the
    residual (not lossless: it tells the anchor token's part from the block start's)."""
    from sparkforge.trainer.draft.sampling import sample_from_probs
    from sparkforge.trainer.eval import speculative

    verify = speculative.verify_draft

    def recording(draft_m: torch.Tensor, q_mV: torch.Tensor, p_m1V: torch.Tensor,
                  generator: torch.Generator | None = None) -> tuple[int, int]:
        n, nxt = verify(draft_m, q_mV, p_m1V, generator)
        into.append(torch.minimum(p_m1V[: q_mV.shape[0]], q_mV).sum(-1)[: n + 1].tolist())
        if anchor_from_p and n < draft_m.shape[0]:
            nxt = int(sample_from_probs(p_m1V[n], generator))
        return n, nxt

    speculative.verify_draft = recording
    try:
        yield
    finally:
        speculative.verify_draft = verify


def speculative_first_slot(draft: Any, target: Any, prompts: list[Any], max_new_tokens: int,
                           anchor_from_p: bool = False) -> dict[str, float]:
    """T=1 reference decoding as ``sparkforge eval`` runs it (seed 0, eos): tau, the first slot's
    accepted fraction and its expectation along the same path."""
    from sparkforge.trainer.eval.speculative import speculative_generate

    gen, expected, runs = torch.Generator().manual_seed(0), [], []
    with _expected_acceptance(expected, anchor_from_p):
        for prompt in prompts:
            runs.append(speculative_generate(
                target, draft, torch.from_numpy(prompt.input_ids), max_new_tokens=max_new_tokens,
                temperature=1.0, eos_token_id=target.config.eos_token_id, generator=gen))
    rounds = sum(r.position_trials[0] for r in runs)
    return {"rounds": rounds,
            "tau": 1 + sum(sum(r.position_accepted) for r in runs) / rounds,
            "accepted": sum(r.position_accepted[0] for r in runs) / rounds,
            "expected": float(np.mean([slots[0] for slots in expected]))}


def _measure(out: Path, name: str, ns: argparse.Namespace, target: Any) -> dict[str, Any]:
    from sparkforge.manifests.open import open_cache
    from sparkforge.trainer.eval.run import _held_out_prompts, _loss_spec
    from sparkforge.trainer.export import load_draft

    ckpt = out / "train" / f"converged_{name}" / "ckpt" / "last.ckpt"
    draft = load_draft(ckpt).eval()
    loss, _ = _loss_spec(str(ckpt), draft.confidence_head is not None)
    reader = open_cache(str(out / "cache_T1.0"), verify=False,
                        features=draft.config.target_layer_ids)
    prompts = _held_out_prompts(reader, ns.num_prompts, None)
    return {"teacher_forced": forced_first_slot(draft, loss, reader, ns.max_new_tokens),
            "speculative": speculative_first_slot(draft, target, prompts, ns.max_new_tokens),
            "anchor_from_p": speculative_first_slot(draft, target, prompts, ns.max_new_tokens,
                                                    anchor_from_p=True)}


def main(argv: list[str] | None = None) -> int:
    """Measure each draft, write ``block_starts.json`` and print the table."""
    from transformers import AutoModelForCausalLM

    ns = _parse(argv)
    out = ns.out_dir.resolve()
    missing = [n for n in ns.drafts if not (out / "train" / f"converged_{n}" / "ckpt" /
                                            "last.ckpt").is_file()]
    if missing:
        raise SystemExit(f"{out} holds no converged-study draft {', '.join(missing)}: run "
                         "benchmarks/bench_quality.py --study converged --out_dir there first")
    target = AutoModelForCausalLM.from_pretrained(out / "target", dtype=torch.float32).eval()
    rows = {name: _measure(out, name, ns, target) for name in ns.drafts}
    ns.results.mkdir(parents=True, exist_ok=True)
    (ns.results / "block_starts.json").write_text(json.dumps(
        {"command": "OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python -P "
                    "benchmarks/block_starts.py " + " ".join(sys.argv[1:]),
         "drafts": rows}, indent=1) + "\n")
    print("| first draft slot, T=1 | " + " | ".join(rows) + " |\n|---|" + "---|" * len(rows))
    for label, side, key in (
            ("teacher-forced, every anchor", "teacher_forced", "every_anchor"),
            ("teacher-forced, after a rejection", "teacher_forced", "after_rejection"),
            ("teacher-forced, after an acceptance", "teacher_forced", "after_acceptance"),
            ("speculative, expected along the path", "speculative", "expected"),
            ("speculative, accepted", "speculative", "accepted"),
            ("the same, a rejection's token drawn from p, expected", "anchor_from_p", "expected")):
        print(f"| {label} | " + " | ".join(f"{r[side][key]:.3f}" for r in rows.values()) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
