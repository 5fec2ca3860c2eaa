"""The real small target: its stdlib corpus split, its chat rows and the shipped weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparkforge.app.code_target import (
    USER_PROMPT,
    code_chats,
    copy_target,
    held_out_chats,
    read_source,
    source_files,
    stdlib_root,
)


def test_split_is_disjoint_and_about_a_tenth() -> None:
    """Train and held-out files never overlap; about 10% of the files are held out."""
    train, held = source_files("train"), source_files("held_out")
    assert not set(train) & set(held)
    assert 0.05 < len(held) / (len(train) + len(held)) < 0.15
    assert all("test" not in p.relative_to(stdlib_root()).parts[:-1] for p in train + held)
    with pytest.raises(ValueError, match="split='eval'"):
        source_files("eval")


def test_a_reply_is_the_code_that_follows_its_prefix() -> None:
    """Prefix and reply are consecutive whole lines of the same file."""
    files = source_files("held_out")[:3]
    sources = [read_source(f) for f in files]
    rows = list(code_chats(files, seed=1))
    assert len(rows) > 10
    for row in rows:
        user, reply = (m["content"] for m in row["messages"])  # type: ignore[attr-defined]
        assert user.startswith(USER_PROMPT)
        snippet = user.removeprefix(USER_PROMPT) + "\n" + reply
        assert any(snippet in s for s in sources)
        assert len(user) <= len(USER_PROMPT) + 360
        assert len(reply) <= 240


def test_held_out_rows_are_seeded_and_numbered() -> None:
    """The same seed gives the same rows, ids 0..n-1; too many rows is an error naming rows."""
    a, b = held_out_chats(20, seed=3), held_out_chats(20, seed=3)
    assert a == b
    assert [r["id"] for r in a] == list(range(20))
    assert held_out_chats(20, seed=4) != a
    with pytest.raises(ValueError, match="rows=10000000"):
        held_out_chats(10_000_000)


@pytest.mark.slow
def test_shipped_target_beats_the_unigram_baseline(tmp_path: Path) -> None:
    """The packaged bf16 target predicts held-out code far better than token frequencies do."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = copy_target(tmp_path / "target")
    info = json.loads((target / "build_info.json").read_text())
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    losses = []
    with torch.no_grad():
        for row in held_out_chats(8, seed=0):
            ids = tok.apply_chat_template(row["messages"], tokenize=True,
                                          return_dict=True)["input_ids"]
            x = torch.tensor([ids])
            losses.append(float(model(input_ids=x, labels=x).loss))
    assert sum(losses) / len(losses) < info["unigram_held_out_loss"] - 1.0
    assert "{% generation %}" in tok.chat_template
    assert tok.convert_tokens_to_ids("<|mask|>") == 3
