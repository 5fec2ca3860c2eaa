"""Turn one chat row into token ids and an assistant-only loss mask, or a typed skip reason.

Two masking methods, chosen once per template: templates with ``{% generation %}`` markers use
transformers' ``return_assistant_tokens_mask``; templates without them are rendered prefix by prefix
and the character span each assistant turn adds is mapped onto the tokens of the full rendering.
Both are probed on a known conversation at start-up, so a template that would give an all-zeros or
all-ones mask (a common silent bug of training pipelines) is refused before any row is read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

import fsspec
import numpy as np

from sparkforge.producer.template_bounds import (
    TEMPLATE_ROW_SECONDS,
    RowTimeLimit,
    TemplateTimeout,
    check_bounded,
)
from sparkforge.shared.dataset import LINE_TOO_LONG, json_text_field
from sparkforge.shared.errors import SparkforgeError
from sparkforge.shared.image_inputs import TargetImages
from sparkforge.shared.images import ImageProblem, is_image_part, template_parts

logger = logging.getLogger(__name__)

ReasoningPolicy = Literal["keep", "drop"]
OverlongPolicy = Literal["truncate", "skip"]
ROLES = frozenset({"system", "user", "assistant", "tool"})
TOOL_FIELDS = ("tool_calls", "tool_call_id", "name")
"""Message fields passed to the template as given (OpenAI tool calling)."""
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_EMPTY_THINK = re.compile(r"\s*<think>\s*</think>\s*")
_PROBE = (
    {"role": "system", "content": "Answer in one line."},
    {"role": "user", "content": "Name the model layer."},
    {"role": "assistant", "content": "The draft block."},
    {"role": "user", "content": "And the cache?"},
    {"role": "assistant", "content": "One shard per slot."},
)


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


def unreadable_reason(error: str | None) -> SkipReason:
    """The skip reason of a row the reader could not parse (its ``error`` names it first)."""
    return SkipReason(error.split(":", 1)[0]) if error else SkipReason.MALFORMED_JSON


@dataclass(frozen=True)
class Encoded:
    """A tokenized row: unshifted ids and a mask that is 1 on assistant tokens."""

    input_ids: np.ndarray
    """[T] int32."""
    loss_mask: np.ndarray
    """[T] uint8."""
    model_inputs: Mapping[str, Any] | None = None
    """An image row's extra forward inputs (pixel values, ...); None for a text row."""
    images_sha256: str | None = None
    """An image row's hash of its image bytes."""


def resolve_chat_template(override: str | None, tokenizer: Any) -> str:
    """The template to use: ``override`` (a Jinja string or a file URI) or the tokenizer's own.

    Raises:
        ValueError: Neither exists.
    """
    if override is not None:
        if "{%" in override or "{{" in override:
            return override
        with fsspec.open(override, "r") as f:
            text: str = f.read()
        return text
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("default")
    if not template:
        raise SparkforgeError(
            "chat_template: the tokenizer ships no chat template; pass --chat_template "
            "(a Jinja string or a file)"
        )
    return str(template)


def template_sha256(template: str) -> str:
    """The chat template's identity as recorded in the manifest."""
    return hashlib.sha256(template.encode()).hexdigest()


def tokenizer_hash(tokenizer: Any) -> str:
    """sha256 of the tokenizer's serialised vocabulary, merges, normaliser and special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(text.encode()).hexdigest()


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


RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})
"""``apply_chat_template``'s own arguments, which ``chat_template_kwargs`` may not set."""


def template_kwargs_problems(kwargs: Mapping[str, Any], flag: str) -> list[str]:
    """Why ``kwargs`` cannot be passed to every rendering (empty when they can): string keys,
    none of ``RESERVED_TEMPLATE_KWARGS``, JSON values (they are recorded in the manifest)."""
    problems = [f"{flag}: {key!r} is apply_chat_template's own argument, not a template "
                "variable" for key in sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)]
    try:
        json.dumps(dict(kwargs), sort_keys=True)
    except (TypeError, ValueError) as exc:
        problems.append(f"{flag}: expected a JSON object of template variables ({exc})")
    return problems


class ChatEncoder:
    """Tokenize rows with one tokenizer and template, under a length and reasoning policy.

    ``chat_template_kwargs`` are template variables given to every rendering (the probe's too),
    e.g. ``{"enable_thinking": false}`` for a Qwen3 template.
    """

    images: TargetImages | None = None
    """The target's image processing (``ImageChatEncoder``); None: image parts are skipped."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        chat_template: str | None = None,
        reasoning: ReasoningPolicy = "keep",
        max_seq_len: int,
        overlong: OverlongPolicy = "skip",
        template_row_seconds: float = TEMPLATE_ROW_SECONDS,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.template_row_seconds = template_row_seconds
        self.template = resolve_chat_template(chat_template, tokenizer)
        self.template_sha256 = template_sha256(self.template)
        self.tokenizer_hash = tokenizer_hash(tokenizer)
        self.uses_generation_tags = bool(_GENERATION_TAG.search(self.template))
        self.reasoning: ReasoningPolicy = reasoning
        self.max_seq_len = max_seq_len
        self.overlong: OverlongPolicy = overlong
        self.vocab_size = len(tokenizer)
        self._reasoning_ignored = reasoning == "keep" and "reasoning_content" not in self.template
        self._probe()

    def encode(self, row: Mapping[str, Any], *, folder: str | None = None) -> Encoded | SkipReason:
        """Tokenize one row (``messages`` or pre-tokenized ``input_ids`` + ``loss_mask``) of the
        data file in ``folder`` (where its relative image paths resolve)."""
        if "messages" not in row and "input_ids" in row:
            encoded = self._pretokenized(row)
        else:
            messages = validate_messages(row.get("messages"), self.reasoning,
                                         images=self.images is not None)
            if isinstance(messages, SkipReason):
                return messages
            tools = row_tools(row)
            if isinstance(tools, SkipReason):
                return tools
            if self._reasoning_ignored and any("reasoning_content" in m for m in messages):
                self._reasoning_ignored = False  # warn once
                logger.warning(
                    "reasoning='keep' but the chat template never reads reasoning_content: "
                    "reasoning text will not reach the cache"
                )
            encoded = self.encode_messages(messages, tools=tools)
            if not isinstance(encoded, SkipReason):
                encoded = self.attach_images(row, encoded, folder=folder)
        if isinstance(encoded, SkipReason):
            return encoded
        return self._fit(encoded)

    def attach_images(self, row: Mapping[str, Any], encoded: Encoded, *,
                      folder: str | None) -> Encoded | SkipReason:
        """An image row's pixel values and expanded image spans (text-only encoder: as is)."""
        del row, folder
        return encoded

    def encode_messages(
        self, messages: Sequence[Mapping[str, Any]], *,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> Encoded | SkipReason:
        """Token ids and the assistant mask of validated messages, before length policy;
        ``template_timeout`` past ``template_row_seconds`` (``RowTimeLimit``)."""
        try:
            with RowTimeLimit(self.template_row_seconds):
                if self.uses_generation_tags:
                    return self._tagged(messages, tools)
                return self._prefix_diff(messages, tools)
        except TemplateTimeout:
            return SkipReason.TEMPLATE_TIMEOUT
        except Exception as exc:  # noqa: BLE001 - Jinja raises anything (e.g. raise_exception)
            logger.debug("template failed on a row: %s", exc)
            return SkipReason.TEMPLATE_ERROR

    def _render(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None, *,
        generation_prompt: bool,
    ) -> str:
        text: str = self.tokenizer.apply_chat_template(
            list(messages), tools=tools, chat_template=self.template, tokenize=False,
            add_generation_prompt=generation_prompt, **self.chat_template_kwargs,
        )
        return text

    def _tagged(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
    ) -> Encoded:
        out = self.tokenizer.apply_chat_template(
            list(messages), tools=tools, chat_template=self.template, tokenize=True,
            return_dict=True, return_assistant_tokens_mask=True, **self.chat_template_kwargs,
        )
        return Encoded(np.asarray(out["input_ids"], dtype=np.int32),
                       np.asarray(out["assistant_masks"], dtype=np.uint8))

    def _prefix_diff(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
    ) -> Encoded | SkipReason:
        full = self._render(messages, tools, generation_prompt=False)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._render(messages[:i], tools, generation_prompt=True) if i else ""
            upto = self._render(messages[: i + 1], tools, generation_prompt=False)
            if not (full.startswith(before) and full.startswith(upto) and len(upto) > len(before)):
                return SkipReason.UNSTABLE_TEMPLATE
            # Whitespace after the end-of-turn marker is never generated, and an empty think block
            # that the template inserts is prompt at inference: neither is supervised.
            start = len(before)
            empty_think = _EMPTY_THINK.match(full, start)
            spans.append((empty_think.end() if empty_think else start, len(upto.rstrip())))
        enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        starts = np.asarray([s for s, _ in enc["offset_mapping"]], dtype=np.int64)
        mask = np.zeros(len(starts), dtype=np.uint8)
        for lo, hi in spans:
            mask[(starts >= lo) & (starts < hi)] = 1
        return Encoded(np.asarray(enc["input_ids"], dtype=np.int32), mask)

    def _pretokenized(self, row: Mapping[str, Any]) -> Encoded | SkipReason:
        """Ids and mask exactly as given: a float, string, bool or out-of-range id, or a mask
        value other than 0/1 (bools allowed), is refused, never coerced."""
        ids, mask = row.get("input_ids"), row.get("loss_mask")
        if not (isinstance(ids, list | tuple) and isinstance(mask, list | tuple)
                and 0 < len(ids) == len(mask)):
            return SkipReason.BAD_PRETOKENIZED
        vocab_size = self.vocab_size
        if not all(type(i) is int and 0 <= i < vocab_size for i in ids) or not all(
            type(m) in (int, bool) and m in (0, 1) for m in mask
        ):
            return SkipReason.BAD_PRETOKENIZED
        return Encoded(np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8))

    def _fit(self, encoded: Encoded) -> Encoded | SkipReason:
        if encoded.input_ids.shape[0] > self.max_seq_len:
            if self.overlong == "skip":
                return SkipReason.TOO_LONG
            encoded = dataclasses.replace(encoded, input_ids=encoded.input_ids[: self.max_seq_len],
                                          loss_mask=encoded.loss_mask[: self.max_seq_len])
        if not encoded.loss_mask.any():
            return SkipReason.NO_LOSS_TOKENS
        return encoded

    def _render_probe(self) -> None:
        """Every rendering the probe's masking asks for, as text (failures are the probe's to
        name: each rendering runs even if another fails)."""
        for end in range(1, len(_PROBE) + 1):
            for generation_prompt in (False, True):
                try:
                    self._render(_PROBE[:end], None, generation_prompt=generation_prompt)
                except MemoryError:
                    raise
                except Exception:  # noqa: BLE001, S112 - Jinja raises anything
                    continue

    def _probe(self) -> None:
        """Refuse a template that outlasts or outgrows ``check_bounded`` on the probe, or whose
        mask misses assistant text or covers user text."""
        check_bounded(self._render_probe)
        encoded = self.encode_messages(_PROBE)
        method = "{% generation %} markers" if self.uses_generation_tags else "prefix rendering"
        if isinstance(encoded, SkipReason):
            raise SparkforgeError(
                f"chat_template: masking by {method} failed on a probe ({encoded})")
        decode = self.tokenizer.decode
        masked = decode(encoded.input_ids[encoded.loss_mask == 1].tolist())
        unmasked = decode(encoded.input_ids[encoded.loss_mask == 0].tolist())
        replies = [m["content"] for m in _PROBE if m["role"] == "assistant"]
        others = [m["content"] for m in _PROBE if m["role"] != "assistant"]
        if not all(r in masked for r in replies) or any(o in masked for o in others) or any(
            r in unmasked for r in replies
        ):
            raise SparkforgeError(
                f"chat_template: masking by {method} does not isolate assistant turns on a probe "
                f"conversation (masked text: {masked!r}); fix the template or pass --chat_template"
            )
