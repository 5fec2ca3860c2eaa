"""Held-out prompts from a chat file, rendered with the target's chat template.

A row's prompt is its conversation up to (not including) its last assistant turn, rendered with
``add_generation_prompt``: exactly the tokens a serving engine would prefill before the reply.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sparkforge.shared.dataset import describe_sources, iter_rows
from sparkforge.shared.errors import SparkforgeError

logger = logging.getLogger(__name__)


def prompt_messages(row: Mapping[str, Any] | None) -> tuple[list[dict[str, Any]] | None, str]:
    """The messages before the last assistant turn, or (None, why the row has no prompt)."""
    messages = None if row is None else row.get("messages")
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        return None, "missing_messages"
    if not all(isinstance(m, Mapping) and isinstance(m.get("role"), str) for m in messages):
        return None, "malformed_message"
    roles = [m["role"] for m in messages]
    last = len(roles) - 1 - roles[::-1].index("assistant") if "assistant" in roles else len(roles)
    prompt = [dict(m) for m in messages[:last]]
    if not any(m["role"] == "user" for m in prompt):
        return None, "no_user_turn"
    return prompt, ""


def chat_prompts(uri: str, tokenizer: Any, num: int, *,
                 storage_options: Mapping[str, Any] | None = None) -> list[np.ndarray]:
    """The first ``num`` usable prompts of a chat JSONL/Parquet source as token-id arrays.

    Rows without a usable prompt are skipped and counted by reason (logged).

    Raises:
        ValueError: No row of ``uri`` gives a prompt.
    """
    prompts: list[np.ndarray] = []
    skipped: Counter[str] = Counter()
    for raw in iter_rows(describe_sources(uri, storage_options=storage_options),
                         storage_options=storage_options):
        messages, why = prompt_messages(raw.row)
        if messages is None:
            skipped[why] += 1
            continue
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
        prompts.append(np.asarray(ids, dtype=np.int64))
        if len(prompts) == num:
            break
    if skipped:
        logger.warning("%s: skipped rows without a prompt: %s", uri,
                       ", ".join(f"{why} {n}" for why, n in sorted(skipped.items())))
    if not prompts:
        raise SparkforgeError(f"--prompts {uri}: no row has a conversation with a user turn "
                              f"(skipped: {dict(skipped)})")
    return prompts
