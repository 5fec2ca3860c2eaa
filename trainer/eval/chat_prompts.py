"""Held-out prompts from a chat file, rendered with the target's chat template.

A row's prompt is its conversation up to (not including) its last assistant turn, rendered with
``add_generation_prompt``: exactly the tokens a serving engine would prefill before the reply.
For a vision-language target (``images``), a prompt's images are loaded and its image tokens
expanded by the target's own image processing; the prompt carries the pixel values the target is
given at every verification step. A text-only target skips image prompts (``image_content``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sparkforge.shared.dataset import describe_sources, iter_rows, json_text_field
from sparkforge.shared.errors import SparkforgeError
from sparkforge.shared.image_inputs import TargetImages
from sparkforge.shared.image_sources import ImageReader
from sparkforge.shared.images import ImageProblem, load_images, row_has_images, template_parts

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
    for m in prompt:
        if m.get("tool_calls") is not None:
            m["tool_calls"] = json_text_field(m["tool_calls"])
    if not any(m["role"] == "user" for m in prompt):
        return None, "no_user_turn"
    return prompt, ""


@dataclass(frozen=True, kw_only=True)
class Prompt:
    """One prompt: its ids and, for an image prompt, the target's extra forward inputs."""

    input_ids: np.ndarray
    """[T] int64."""
    model_inputs: Mapping[str, Any] | None = None
    """``pixel_values``, ``image_position_ids``, ``mm_token_type_ids`` (None: a text prompt)."""


def _image_prompt(messages: list[dict[str, Any]], tokenizer: Any, images: TargetImages | None,
                  reader: ImageReader, folder: str | None,
                  kwargs: Mapping[str, Any]) -> Prompt | str:
    """An image prompt rendered and expanded, or the reason it is skipped."""
    if images is None:
        return "image_content"
    loaded = load_images(messages, reader, folder=folder)
    if isinstance(loaded, ImageProblem):
        return loaded.value
    parts = [{**m, "content": template_parts(m["content"])} if isinstance(m.get("content"), list)
             else m for m in messages]
    if any(m["content"] is None for m in parts):
        return "non_string_content"
    ids = np.asarray(tokenizer.apply_chat_template(parts, add_generation_prompt=True,
                                                   tokenize=True, return_dict=True,
                                                   **kwargs)["input_ids"], dtype=np.int32)
    row = images.expand(ids, np.zeros_like(ids, dtype=np.uint8), loaded)
    if isinstance(row, ImageProblem):
        return row.value
    return Prompt(input_ids=row.input_ids.astype(np.int64), model_inputs=row.model_inputs)


def chat_prompts(uri: str, tokenizer: Any, num: int, *,
                 storage_options: Mapping[str, Any] | None = None,
                 images: TargetImages | None = None,
                 image_reader: ImageReader | None = None,
                 chat_template_kwargs: Mapping[str, Any] | None = None) -> list[Prompt]:
    """The first ``num`` usable prompts of a chat JSONL/Parquet source, rendered with the
    template variables ``chat_template_kwargs`` (the capture's, so both render alike).

    Rows without a usable prompt are skipped and counted by reason (logged).

    Raises:
        ValueError: No row of ``uri`` gives a prompt.
    """
    prompts: list[Prompt] = []
    skipped: Counter[str] = Counter()
    kwargs = dict(chat_template_kwargs or {})
    for raw in iter_rows(describe_sources(uri, storage_options=storage_options),
                         storage_options=storage_options):
        messages, why = prompt_messages(raw.row)
        if messages is None:
            skipped[why] += 1
            continue
        tools = json_text_field(raw.row.get("tools")) if raw.row is not None else None
        tools = tools if isinstance(tools, list) and tools else None
        if row_has_images({"messages": messages}):
            prompt = _image_prompt(messages, tokenizer, images, image_reader or ImageReader(),
                                   raw.folder, kwargs)
            if isinstance(prompt, str):
                skipped[prompt] += 1
                continue
        else:
            prompt = Prompt(input_ids=np.asarray(tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=True,
                return_dict=True, **kwargs)["input_ids"], dtype=np.int64))
        prompts.append(prompt)
        if len(prompts) == num:
            break
    if skipped:
        logger.warning("%s: skipped rows without a prompt: %s", uri,
                       ", ".join(f"{why} {n}" for why, n in sorted(skipped.items())))
    if not prompts:
        raise SparkforgeError(f"--prompts {uri}: no row has a conversation with a user turn "
                              f"(skipped: {dict(skipped)})")
    return prompts
