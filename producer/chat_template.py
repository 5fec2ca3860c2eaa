"""Which chat template a capture renders with, its recorded identity, and its variables.

The template is the tokenizer's own or an override (a Jinja string or a file URI); the manifest
records its sha256 and the tokenizer's, so a cache names exactly what rendered its rows.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import fsspec

from sparkforge.shared.errors import SparkforgeError


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
