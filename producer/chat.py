"""Turn one chat row into token ids and an assistant-only loss mask, or a typed skip reason.

Two masking methods, chosen once per template: templates with ``{% generation %}`` markers use
transformers' ``return_assistant_tokens_mask``; templates without them are rendered prefix by prefix
and the character span each assistant turn adds is mapped onto the tokens of the full rendering.
Both are probed on a known conversation at start-up, so a template that would give an all-zeros or
all-ones mask (a common silent bug of training pipelines) is refused before any row is read.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from sparkforge.producer.chat_rows import (
    ReasoningPolicy,
    SkipReason,
    row_tools,
    validate_messages,
)
from sparkforge.producer.chat_template import (
    resolve_chat_template,
    template_sha256,
    tokenizer_hash,
)
from sparkforge.producer.template_bounds import (
    TEMPLATE_ROW_SECONDS,
    RowTimeLimit,
    TemplateTimeout,
    check_bounded,
)
from sparkforge.shared.errors import SparkforgeError
from sparkforge.shared.image_inputs import TargetImages

logger = logging.getLogger(__name__)

OverlongPolicy = Literal["truncate", "skip"]
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_EMPTY_THINK = re.compile(r"\s*<think>\s*</think>\s*")
_PROBE = (
    {"role": "system", "content": "Answer in one line."},
    {"role": "user", "content": "Name the model layer."},
    {"role": "assistant", "content": "The draft block."},
    {"role": "user", "content": "And the cache?"},
    {"role": "assistant", "content": "One shard per slot."},
)


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
