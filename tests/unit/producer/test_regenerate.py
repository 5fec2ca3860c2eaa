"""Regeneration prompts: the turns before the last assistant turn, or a skip reason."""

from __future__ import annotations

import pytest

from sparkforge.producer.chat_rows import SkipReason
from sparkforge.producer.config import RegenerateConfig
from sparkforge.producer.engine_options import EngineOptions
from sparkforge.producer.regenerate import Prompt, prompt_of

CFG = RegenerateConfig(data="d.jsonl", output="out", engine=EngineOptions(model="m"))
USER = {"role": "user", "content": "q"}
ANSWER = {"role": "assistant", "content": "a"}
CALL = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}
RESULT = {"role": "tool", "content": "4", "tool_call_id": "c"}


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ({"messages": [USER, ANSWER]}, Prompt([USER])),
        ({"messages": [USER, ANSWER, USER, ANSWER]}, Prompt([USER, ANSWER, USER])),
        ({"messages": [USER]}, Prompt([USER])),
        ({"messages": [ANSWER]}, SkipReason.MISSING_MESSAGES),
        ({"messages": [{"role": "alien", "content": "x"}]}, SkipReason.UNKNOWN_ROLE),
        (None, SkipReason.MALFORMED_JSON),
        ({"messages": [USER, CALL, RESULT, ANSWER]}, Prompt([USER, CALL, RESULT])),
        ({"messages": [USER, ANSWER], "tools": [{"type": "function"}]},
         Prompt([USER], [{"type": "function"}])),
        ({"messages": [USER, ANSWER], "tools": '[{"type": "function"}]'},
         Prompt([USER], [{"type": "function"}])),
        ({"messages": [USER, ANSWER], "tools": "not json"}, SkipReason.BAD_TOOL_CALLS),
    ],
)
def test_prompt_is_everything_before_the_last_answer(row: dict | None, expected: object) -> None:
    """The last assistant turn is dropped; prompt-only rows are kept with their tool calls, tool
    results and tool schemas (also given as JSON text); bad rows get a reason."""
    assert prompt_of(row, CFG) == expected


def test_bad_sampling_settings_name_their_flags() -> None:
    """Invalid sampling settings are reported together, by flag."""
    with pytest.raises(ValueError, match="--temperature") as info:
        RegenerateConfig(data="d", output="o", engine=EngineOptions(model="m"), temperature=-1,
                         top_p=0.0, top_k=0, max_tokens=0)
    assert "--top_p" in str(info.value)
    assert "--top_k must be -1 (off) or >= 1, got 0" in str(info.value)
    assert "--max_tokens" in str(info.value)
