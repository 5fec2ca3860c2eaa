"""Held-out prompts from a chat file are exactly the tokens the cache's prompt part holds."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from sparkforge.trainer.eval.chat_prompts import chat_prompts, prompt_messages

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Count to 3"},
        {"role": "assistant", "content": "1 2 3"}]


def test_prompt_is_the_conversation_before_the_last_assistant_turn() -> None:
    """Everything up to the last assistant turn is kept; rows without a user turn are refused."""
    messages, why = prompt_messages({"messages": CHAT})
    assert messages == CHAT[:4]
    assert why == ""
    assert prompt_messages({"messages": CHAT[:2]}) == (CHAT[:2], "")
    assert prompt_messages({"messages": [CHAT[0], CHAT[2]]}) == (None, "no_user_turn")
    assert prompt_messages({"text": "x"}) == (None, "missing_messages")
    assert prompt_messages({"messages": [{"content": "x"}]}) == (None, "malformed_message")


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_prompt_ids_end_where_the_assistant_mask_starts(tiny_target: Path, tmp_path: Path,
                                                        fmt: str) -> None:
    """The prompt equals the rendered chat up to the first token of the last assistant reply."""
    tok = AutoTokenizer.from_pretrained(tiny_target)
    rows = [{"messages": CHAT}, {"messages": [CHAT[0]]}, {"messages": CHAT[:3]}]
    path = tmp_path / f"chats.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    prompts = chat_prompts(str(path), tok, 5)
    assert len(prompts) == 2   # the system-only row has no prompt
    for prompt, chat in zip(prompts, (CHAT, CHAT[:3]), strict=True):
        full = tok.apply_chat_template(chat, tokenize=True, return_dict=True,
                                       return_assistant_tokens_mask=True)
        mask = full["assistant_masks"]
        last_start = max(i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1]))
        assert prompt.input_ids.tolist() == full["input_ids"][:last_start]


def test_a_file_without_prompts_is_an_error(tiny_target: Path, tmp_path: Path) -> None:
    """No usable row: the error names the flag and the skip reasons."""
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "no messages"}) + "\n")
    with pytest.raises(ValueError, match="--prompts .*missing_messages"):
        chat_prompts(str(path), AutoTokenizer.from_pretrained(tiny_target), 3)
