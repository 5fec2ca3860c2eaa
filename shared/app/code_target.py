"""A real small target: a Qwen3 code model trained on the Python standard library's own source.

The demo and the quality benchmark need a target whose next-token distribution has structure (a
randomly initialised model's is nearly flat, so every draft position accepts alike). Every machine
that runs sparkforge has the Python standard library, so its ``.py`` files are the corpus: no
download. Files are split by a hash of their path: the target trains on ~90% of them and chat rows
for drafts come from the held-out rest. A chat row asks the assistant to continue a code prefix; the
reply is the code that follows.

The trained weights ship as package data (``shared/app/code_target/``, bf16);
``benchmarks/build_real_target.py`` rebuilds them (seeded) and
``python -m sparkforge.app.code_target OUT --rows N`` copies them to ``OUT`` with a chat
JSONL of held-out rows.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sysconfig
import zlib
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

from sparkforge.app.tiny_text import write_chats
from sparkforge.shared.errors import SparkforgeError

USER_PROMPT = "Continue this code:\n"
HELD_OUT_BUCKETS = 10
"""A file is held out when crc32(relative path) % HELD_OUT_BUCKETS == 0 (about 10% of files)."""
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib",
                        "__pycache__"})


def stdlib_root() -> Path:
    """The directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relative_path: str) -> bool:
    """Whether a stdlib file (path relative to the stdlib root) is held out of training."""
    return zlib.crc32(relative_path.encode()) % HELD_OUT_BUCKETS == 0


def source_files(split: str, root: Path | None = None) -> list[Path]:
    """The stdlib ``.py`` files of one split (``train`` or ``held_out``), sorted by path.

    Test suites and vendored packages are left out: they are large and unlike ordinary code.
    """
    if split not in ("train", "held_out"):
        raise SparkforgeError(f"split={split!r}: expected 'train' or 'held_out'")
    root = root or stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _SKIP_DIRS.intersection(rel.parts[:-1]):
            continue
        if is_held_out(rel.as_posix()) == (split == "held_out"):
            files.append(path)
    return files


def read_source(path: Path) -> str:
    """A source file's text (bad bytes replaced), tabs expanded, trailing spaces dropped."""
    text = path.read_text(encoding="utf-8", errors="replace").expandtabs(4)
    return "\n".join(line.rstrip() for line in text.splitlines())


def _line_spans(lines: list[str], start: int, max_chars: int) -> int:
    """The end index of the longest run of whole lines from ``start`` within ``max_chars``."""
    end, used = start, 0
    while end < len(lines) and used + len(lines[end]) + 1 <= max_chars:
        used += len(lines[end]) + 1
        end += 1
    return end


def code_chats(files: list[Path], *, seed: int = 0, prefix_chars: int = 360,
               reply_chars: int = 240) -> Iterator[dict[str, object]]:
    """Chat rows (OpenAI ``messages``) cut from ``files``: a code prefix and its continuation.

    Each file is cut into consecutive windows of whole lines: up to ``prefix_chars`` for the user's
    prefix, then up to ``reply_chars`` for the assistant's continuation. Windows whose prefix or
    reply is blank are skipped. The order is deterministic for a given ``seed``.
    """
    rng = random.Random(seed)
    row = 0
    for path in files:
        lines = read_source(path).splitlines()
        start = rng.randrange(4)
        while start < len(lines):
            mid = _line_spans(lines, start, prefix_chars)
            end = _line_spans(lines, mid, reply_chars)
            if mid == start or end == mid:
                start = max(end, start + 1)
                continue
            prefix, reply = "\n".join(lines[start:mid]), "\n".join(lines[mid:end])
            start = end
            if not prefix.strip() or not reply.strip():
                continue
            yield {"id": row, "messages": [
                {"role": "user", "content": USER_PROMPT + prefix},
                {"role": "assistant", "content": reply},
            ]}
            row += 1


def held_out_chats(num_rows: int, *, seed: int = 0) -> list[dict[str, object]]:
    """``num_rows`` chat rows from held-out files, drawn evenly across them (seeded)."""
    rows = list(code_chats(source_files("held_out"), seed=seed))
    if len(rows) < num_rows:
        raise SparkforgeError(f"rows={num_rows}: the held-out standard-library files give only "
                              f"{len(rows)} chat rows")
    picked = sorted(random.Random(seed).sample(range(len(rows)), num_rows))
    return [{**rows[i], "id": n} for n, i in enumerate(picked)]


def packaged_target() -> Path:
    """The directory of the shipped trained target (config, bf16 weights, tokenizer)."""
    return Path(str(resources.files("sparkforge.app") / "code_target"))


def copy_target(out_dir: Path) -> Path:
    """Copy the shipped target into ``out_dir`` (created) and return it."""
    src = packaged_target()
    if not (src / "model.safetensors").is_file():
        raise FileNotFoundError(f"{src} holds no trained target: run "
                                "benchmarks/build_real_target.py to build it")
    out_dir.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.is_file():
            shutil.copy2(item, out_dir / item.name)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    """``python -m sparkforge.app.code_target OUT [--rows N]``: target + held-out chats."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--rows", type=int, default=0, help="also write OUT/chat.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    copy_target(args.out_dir)
    if args.rows:
        write_chats(args.out_dir / "chat.jsonl", held_out_chats(args.rows, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
