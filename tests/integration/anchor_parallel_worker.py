"""One rank of the 2-process anchor-parallel step (gloo), launched by test_anchor_parallel.py.

Every rank holds the whole row (its context), samples the same anchors and trains only every
``world``-th of them; gradients are averaged as DDP averages them. Rank 0 writes the averaged
gradients and the loss numerator summed over ranks to ``OUT/rank0.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from anchor_parallel_step import anchor_shard, build, row, step


def main(out: Path) -> None:
    """Join the group, train this rank's share of the anchors once, average the gradients."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, batch = build(), row()
    anchors, keep = anchor_shard(model, batch, rank, world)
    loss = step(model, batch, anchors, keep)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for grad in grads.values():
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        grad /= world
    dist.all_reduce(loss, op=dist.ReduceOp.SUM)
    if rank == 0:
        torch.save({"grads": grads, "loss": loss}, out / "rank0.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
