"""A chat row's checks before any template runs: the OpenAI message shape, tool fields, the
reasoning policy, and the typed reason a row is skipped.

Every check returns a ``SkipReason`` instead of raising, so a long job counts what it skipped
and why and goes on; the reasons' values are the manifest's accounting keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any, Literal

from sparkforge.shared.dataset import LINE_TOO_LONG, json_text_field
from sparkforge.shared.images import ImageProblem, is_image_part, template_parts

ReasoningPolicy = Literal["keep", "drop"]
ROLES = frozenset({"system", "user", "assistant", "tool"})
TOOL_FIELDS = ("tool_calls", "tool_call_id", "name")
"""Message fields passed to the template as given (OpenAI tool calling)."""


class SkipReason(StrEnum):
    """Why a row was not written; the values are the manifest's accounting keys."""

    MALFORMED_JSON = "malformed_json"
    LINE_TOO_LONG = LINE_TOO_LONG
    """A JSONL line longer than ``max_line_bytes`` (skipped unread)."""
    MISSING_MESSAGES = "missing_messages"
    UNKNOWN_ROLE = "unknown_role"
    NON_STRING_CONTENT = "non_string_content"
    MISSING_ASSISTANT = "missing_assistant"
    EMPTY_ASSISTANT = "empty_assistant"
    TEMPLATE_ERROR = "template_error"
    TEMPLATE_TIMEOUT = "template_timeout"
    """The template's rendering of the row ran past ``template_row_seconds``."""
    UNSTABLE_TEMPLATE = "unstable_template"
    BAD_TOOL_CALLS = "bad_tool_calls"
    BAD_PRETOKENIZED = "bad_pretokenized"
    TOO_LONG = "too_long"
    NO_LOSS_TOKENS = "no_loss_tokens"
    IMAGE_CONTENT = "image_content"
    """A message carries an image part and the target (or backend) captures text only."""
    IMAGE_MISSING = ImageProblem.MISSING.value
    IMAGE_UNREADABLE = ImageProblem.UNREADABLE.value
    IMAGE_NOT_A_FILE = ImageProblem.NOT_A_FILE.value
    IMAGE_TOO_MANY_BYTES = ImageProblem.TOO_MANY_BYTES.value
    IMAGE_READ_TIMEOUT = ImageProblem.READ_TIMEOUT.value
    IMAGE_PROTOCOL_REFUSED = ImageProblem.PROTOCOL_REFUSED.value
    IMAGE_SOURCE_REFUSED = ImageProblem.SOURCE_REFUSED.value
    IMAGE_PATH_REFUSED = ImageProblem.PATH_REFUSED.value
    IMAGE_ADDRESS_REFUSED = ImageProblem.ADDRESS_REFUSED.value
    IMAGE_UNDECODABLE = ImageProblem.UNDECODABLE.value
    IMAGE_TOO_LARGE = ImageProblem.TOO_LARGE.value
    IMAGE_SHAPE_UNSUPPORTED = ImageProblem.SHAPE_UNSUPPORTED.value
    IMAGE_PROCESSING_FAILED = ImageProblem.PROCESSING_FAILED.value
    TOO_MANY_IMAGES = ImageProblem.TOO_MANY.value
    """Image rows of a VL target (``sparkforge.shared.images.ImageProblem`` says which is which)."""
    NON_FINITE_ACTIVATIONS = "non_finite_activations"
    """The target produced NaN or inf for the row (``non_finite: skip``)."""


def clean_messages(
    messages: object, reasoning: ReasoningPolicy, *, images: bool = False
) -> list[dict[str, Any]] | SkipReason:
    """Check the OpenAI ``messages`` shape and apply the reasoning policy.

    With ``images``, a content list of text and image parts reaches the template as
    ``{"type": "text" | "image"}`` parts (a Parquet row's content is such a list even without
    images); without, an image part skips the row (``image_content``).

    ``keep`` passes ``reasoning_content`` to the template; ``drop`` removes it. ``tool_calls``,
    ``tool_call_id`` and ``name`` reach the template as given, so a template that renders tool
    calls supervises the text that serving renders. An assistant turn that only calls tools may
    have ``content: null``.
    """
    if not isinstance(messages, list) or not messages:
        return SkipReason.MISSING_MESSAGES
    clean: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, Mapping):
            return SkipReason.UNKNOWN_ROLE
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            return SkipReason.UNKNOWN_ROLE
        tool_fields = _tool_fields(message)
        if tool_fields is None:
            return SkipReason.BAD_TOOL_CALLS
        content = message.get("content")
        if isinstance(content, list) and (images or any(is_image_part(p) for p in content)):
            if not images:
                return SkipReason.IMAGE_CONTENT
            content = template_parts(content)
            if content is None:
                return SkipReason.NON_STRING_CONTENT
        reasoning_text = message.get("reasoning_content")
        content_ok = (isinstance(content, str) or (content is None and "tool_calls" in tool_fields)
                      or (images and isinstance(content, list)))
        if not content_ok or not isinstance(reasoning_text, str | None):
            return SkipReason.NON_STRING_CONTENT
        out: dict[str, Any] = {"role": role, "content": content, **tool_fields}
        if reasoning == "keep" and reasoning_text:
            out["reasoning_content"] = reasoning_text
        if role == "assistant" and not (
            _has_text(content) or out.get("reasoning_content") or "tool_calls" in out
        ):
            return SkipReason.EMPTY_ASSISTANT
        clean.append(out)
    return clean


def _has_text(content: str | list[dict[str, Any]] | None) -> bool:
    """Whether message content holds non-blank text (a string, or text parts)."""
    if isinstance(content, list):
        return any(p.get("text", "").strip() for p in content)
    return bool((content or "").strip())


def _tool_fields(message: Mapping[str, Any]) -> dict[str, Any] | None:
    """The message's tool fields that are set (None: one has the wrong type)."""
    out = {key: message[key] for key in TOOL_FIELDS if message.get(key) is not None}
    if "tool_calls" in out:
        out["tool_calls"] = json_text_field(out["tool_calls"])
    calls = out.get("tool_calls")
    if calls is not None and not (
        isinstance(calls, list) and calls and all(isinstance(c, Mapping) for c in calls)
    ):
        return None
    if not all(isinstance(out[key], str) for key in ("tool_call_id", "name") if key in out):
        return None
    return out


def row_tools(row: Mapping[str, Any]) -> list[Mapping[str, Any]] | None | SkipReason:
    """The row's ``tools`` (function schemas the template renders into the prompt), if any."""
    tools = json_text_field(row.get("tools"))
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
        return SkipReason.BAD_TOOL_CALLS
    return tools or None


def validate_messages(
    messages: object, reasoning: ReasoningPolicy, *, images: bool = False
) -> list[dict[str, Any]] | SkipReason:
    """:func:`clean_messages`, and at least one assistant turn to learn from."""
    clean = clean_messages(messages, reasoning, images=images)
    if not isinstance(clean, SkipReason) and not any(m["role"] == "assistant" for m in clean):
        return SkipReason.MISSING_ASSISTANT
    return clean
