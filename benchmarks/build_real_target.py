"""Build the real small target that ships in ``shared/app/code_target/`` (seeded, reproducible).

A Qwen3ForCausalLM of a few million parameters with its own byte-level BPE tokenizer and the ChatML
template with ``{% generation %}`` markers, trained as a plain language model on chat rows cut from
the Python standard library's training files (see ``sparkforge.app.code_target``). Rendered
chats are packed into fixed-length blocks. The held-out loss is measured on chats from the
held-out files and compared with a unigram model of the training tokens, to show it learned.

    nice -n 10 .venv/bin/python -P benchmarks/build_real_target.py --out shared/app/code_target

Writes ``config.json``, ``model.safetensors`` (bf16), the tokenizer files and ``build_info.json``
(the command, the losses, the interpreter whose stdlib was the corpus).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from sparkforge.app.code_target import code_chats, read_source, source_files
from sparkforge.app.tiny_text import build_tokenizer


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("shared/app/code_target"))
    p.add_argument("--vocab_size", type=int, default=2048)
    p.add_argument("--hidden_size", type=int, default=256)
    p.add_argument("--num_hidden_layers", type=int, default=4)
    p.add_argument("--intermediate_size", type=int, default=512)
    p.add_argument("--head_dim", type=int, default=64)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--eval_blocks", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _packed(tok: object, files: list[Path], seq_len: int, seed: int) -> torch.Tensor:
    """Render the chats of ``files``, concatenate them, cut the tokens into ``seq_len`` rows."""
    ids: list[int] = []
    for row in code_chats(files, seed=seed):
        ids += tok.apply_chat_template(  # type: ignore[attr-defined]
            row["messages"], tokenize=True, return_dict=True)["input_ids"]
    usable = len(ids) // seq_len * seq_len
    return torch.tensor(ids[:usable], dtype=torch.long).view(-1, seq_len)


def _unigram_loss(train: torch.Tensor, held_out: torch.Tensor, vocab: int) -> float:
    """Cross-entropy (nats) of held-out tokens under add-one-smoothed training token frequencies."""
    counts = np.bincount(train.flatten().numpy(), minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[held_out.flatten().numpy()].mean())


def _eval_loss(model: torch.nn.Module, blocks: torch.Tensor, batch: int) -> float:
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(blocks), batch):
            x = blocks[i:i + batch]
            total += float(model(input_ids=x, labels=x).loss) * len(x)
    model.train()
    return total / len(blocks)


def build(args: argparse.Namespace) -> dict[str, object]:
    """Train the target into ``args.out``; returns the build record also written there."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    train_files, held_files = source_files("train"), source_files("held_out")
    build_tokenizer(out, vocab_size=args.vocab_size,
                    corpus=(read_source(f) for f in train_files))
    tok = AutoTokenizer.from_pretrained(out)
    train = _packed(tok, train_files, args.seq_len, args.seed)
    held = _packed(tok, held_files, args.seq_len, args.seed)[:args.eval_blocks]
    print(f"{len(train_files)} train files -> {train.numel():,} tokens; {len(held_files)} "
          f"held-out files -> {held.numel():,} eval tokens", flush=True)
    config = Qwen3Config(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size, num_hidden_layers=args.num_hidden_layers,
        num_attention_heads=args.hidden_size // args.head_dim,
        num_key_value_heads=max(1, args.hidden_size // args.head_dim // 2),
        head_dim=args.head_dim, max_position_embeddings=4096, rms_norm_eps=1e-6,
        tie_word_embeddings=False, initializer_range=0.02, bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    model = Qwen3ForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup) * (
        0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))))
    gen = torch.Generator().manual_seed(args.seed)
    curve = []
    for step in range(args.steps):
        x = train[torch.randint(len(train), (args.batch_size,), generator=gen)]
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % 100 == 0 or step + 1 == args.steps:
            held_loss, train_loss = _eval_loss(model, held, args.batch_size), loss.item()
            curve.append({"step": step + 1, "train_loss": train_loss, "held_out_loss": held_loss})
            print(f"step {step + 1:5d}  train {train_loss:.3f}  held-out {held_loss:.3f}  "
                  f"{time.perf_counter() - start:6.0f} s", flush=True)
    model.to(torch.bfloat16).save_pretrained(str(out))
    record = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "python": platform.python_version(), "parameters": params,
        "train_files": len(train_files), "held_out_files": len(held_files),
        "train_tokens": train.numel(), "held_out_tokens": held.numel(),
        "held_out_loss": curve[-1]["held_out_loss"],
        "unigram_held_out_loss": _unigram_loss(train, held, args.vocab_size),
        "uniform_loss": math.log(args.vocab_size), "curve": curve,
        "seconds": round(time.perf_counter() - start, 1),
    }
    (out / "build_info.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    record = build(_parse(argv))
    print(f"{record['parameters']:,} parameters; held-out loss {record['held_out_loss']:.3f} nats "
          f"vs unigram {record['unigram_held_out_loss']:.3f}, uniform {record['uniform_loss']:.3f}"
          f" ({record['seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
