"""Global normalisation: 2 gloo ranks with DDP-style gradient averaging equal 1 rank on the
concatenated batch (gradients and reduced metric sums)."""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparkforge.trainer.architectures.qwen3.model import Qwen3DraftModel
from sparkforge.trainer.architectures.tiny import draft_tiny
from sparkforge.trainer.loss import compute_dspark_loss
from sparkforge.trainer.metrics import all_reduce_sums, metric_sums
from sparkforge.trainer.run_config import LossSpec


def _setup() -> tuple[Qwen3DraftModel, dict[str, torch.Tensor]]:
    cfg = dataclasses.replace(draft_tiny(), markov_head_type="gated")
    torch.manual_seed(0)
    model = Qwen3DraftModel(cfg)
    g = torch.Generator().manual_seed(1)
    b, s = 4, 20
    loss_mask = torch.ones(b, s)
    loss_mask[:, :4] = 0
    loss_mask[2:, 9:] = 0  # rank 1's rows supervise far fewer slots than rank 0's
    batch = {
        "input_ids": torch.randint(0, cfg.vocab_size, (b, s), generator=g),
        "loss_mask": loss_mask,
        "target_hidden_states": torch.randn(b, s, 3 * 64, generator=g),
        "target_last_hidden_states": torch.randn(b, s, 64, generator=g),
    }
    torch.manual_seed(2)
    with torch.no_grad():
        out = model(batch)
    batch["anchor_positions"], batch["block_keep_mask"] = out.anchor_positions, out.block_keep_mask
    return model, batch


def _grads(model: Qwen3DraftModel) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    torch.set_num_threads(1)
    model, batch = _setup()
    half = {k: v[2 * rank: 2 * rank + 2] for k, v in batch.items()}
    out = model(half)
    loss = compute_dspark_loss(out, LossSpec())
    loss.loss.backward()
    for p in model.parameters():  # what DDP does: average gradients over ranks
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= 2
    sums = all_reduce_sums(metric_sums(out, loss.accept_rate, loss.weights))
    if rank == 0:
        torch.save({"grads": _grads(model), "sums": sums}, Path(out_dir) / "rank0.pt")
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
def test_two_ranks_equal_one_rank_on_the_concatenated_batch(tmp_path: Path) -> None:
    """Denominators all-reduced + world_size scaling reproduce the single-rank gradient."""
    mp.spawn(_rank_main, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    ddp: dict[str, Any] = torch.load(tmp_path / "rank0.pt")
    model, batch = _setup()
    out = model(batch)
    loss = compute_dspark_loss(out, LossSpec())
    loss.loss.backward()
    single = _grads(model)
    assert set(single) == set(ddp["grads"])
    for name, grad in single.items():
        torch.testing.assert_close(ddp["grads"][name], grad, rtol=1e-4, atol=1e-7)
    ref_sums = metric_sums(out, loss.accept_rate, loss.weights)
    for key, value in ref_sums.items():
        torch.testing.assert_close(ddp["sums"][key], value)
    # Local normalisation (mean of per-rank means) would give a different gradient here.
    local = []
    for rank in range(2):
        model.zero_grad()
        half = {k: v[2 * rank: 2 * rank + 2] for k, v in batch.items()}
        compute_dspark_loss(model(half), LossSpec()).loss.backward()
        local.append(model.fc.weight.grad.clone())
    assert not torch.allclose((local[0] + local[1]) / 2, single["fc.weight"], rtol=1e-3)
