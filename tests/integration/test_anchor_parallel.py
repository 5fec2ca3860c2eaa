"""Anchor parallelism: 2 gloo ranks, each training half of a row's anchors, equal one process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from anchor_parallel_step import anchor_shard, build, row, step
from ddp_ranks import start_ranks

pytestmark = pytest.mark.slow


def test_two_ranks_on_half_the_anchors_each_equal_the_whole_step(tmp_path: Path) -> None:
    """Both ranks hold the whole context and draw the same anchors; each trains every second
    one. The averaged gradients (as DDP averages them) and the summed loss equal one process
    training all anchors, because the loss divides by the weight sum over every rank."""
    worker = Path(__file__).with_name("anchor_parallel_worker.py")
    procs = start_ranks([sys.executable, "-P", str(worker), str(tmp_path)],
                        env={"PYTHONPATH": str(Path(__file__).parent)},
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-3000:]
    got = torch.load(tmp_path / "rank0.pt")
    model, batch = build(), row()
    anchors, keep = anchor_shard(model, batch, 0, 1)
    want_loss = step(model, batch, anchors, keep)
    want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert want
    assert got["grads"].keys() == want.keys()
    torch.testing.assert_close(got["loss"], want_loss, atol=1e-6, rtol=1e-5)
    assert sum(float(g.abs().sum()) for g in want.values()) > 0
    for name, grad in want.items():
        torch.testing.assert_close(got["grads"][name], grad, atol=1e-6, rtol=1e-5, msg=name)
