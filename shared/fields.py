"""Small typed readers for untrusted JSON values; each error names the field and the value."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any, Final, TypeVar

from sparkforge.shared.errors import SparkforgeError

MAX_COUNT: Final = 1 << 48
"""Upper bound for counts (rows, samples, tokens, bytes): anything larger is corrupt input."""
MAX_DEPTH: Final = 32
"""Deepest nesting of any stored JSON document (sparkforge writes at most 8 levels)."""
MAX_FREE_STRING: Final = 1 << 20
"""Longest string inside a free-form section (e.g. an inline chat template in producer_config)."""
SHOWN_CHARS: Final = 120
"""Characters of a bad value quoted in an error message."""
_HEX = re.compile(r"^[0-9a-f]+$")
T = TypeVar("T")


class ManifestError(SparkforgeError):
    """Raised when a manifest, run header or commit record is malformed or inconsistent."""


def shorten(text: str, limit: int = SHOWN_CHARS) -> str:
    """``text`` cut to ``limit`` characters (marked with '...'), so a huge value stays one line."""
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


def fail(field: str, expected: str, value: object) -> ManifestError:
    """The error for ``field`` holding ``value`` where ``expected`` was required."""
    return ManifestError(f"manifest field {shorten(field)!r}: expected {expected}, "
                         f"got {shorten(repr(value))}")


def load_json(raw: bytes, what: str) -> object:
    """Decode an untrusted JSON document, refusing nesting deeper than :data:`MAX_DEPTH`.

    Raises:
        ManifestError: naming ``what``: not JSON, or nested too deeply.
    """
    try:
        data = json.loads(raw)
    except RecursionError as exc:
        raise ManifestError(f"{what}: JSON nested deeper than {MAX_DEPTH} levels") from exc
    except ValueError as exc:
        raise ManifestError(f"{what} is not valid JSON: {shorten(str(exc))}") from exc
    if json_depth(data) > MAX_DEPTH:
        raise ManifestError(f"{what}: JSON nested deeper than {MAX_DEPTH} levels")
    return data


def json_depth(data: object) -> int:
    """Nesting depth of decoded JSON (a scalar is 0), computed without recursion."""
    deepest, stack = 0, [(data, 0)]
    while stack:
        value, depth = stack.pop()
        if not isinstance(value, dict | list):
            continue
        deepest = max(deepest, depth + 1)
        children = value.values() if isinstance(value, dict) else value
        # A commit record's columns hold thousands of scalars: look at their types all at once.
        if not {dict, list}.isdisjoint(map(type, children)):
            stack += [(v, depth + 1) for v in children if isinstance(v, dict | list)]
    return deepest


def obj(data: object, field: str, *, required: frozenset[str],
        optional: frozenset[str] = frozenset()) -> Mapping[str, Any]:
    """A JSON object with exactly the required keys plus some optional ones."""
    if not isinstance(data, dict):
        raise fail(field, "a JSON object", data)
    missing, unknown = required - data.keys(), data.keys() - required - optional
    if missing:
        raise fail(field, f"keys {sorted(missing)} (missing)", sorted(data))
    if unknown:
        raise fail(field, f"only keys {sorted(required | optional)}; unknown", sorted(unknown))
    return data


def mapping(data: object, field: str) -> dict[str, Any]:
    """A free-form JSON object (e.g. the producer config): string keys, bounded depth and strings.

    The error names the path of the first offending value, e.g. ``producer_config.resolved.x``.
    """
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise fail(field, "a JSON object", data)
    stack: list[tuple[str, object, int]] = [(field, data, 1)]
    while stack:
        path, value, depth = stack.pop()
        if isinstance(value, str) and len(value) > MAX_FREE_STRING:
            raise fail(path, f"a string of at most {MAX_FREE_STRING:,} characters", value)
        if isinstance(value, dict | list) and depth > MAX_DEPTH:
            raise fail(path, f"at most {MAX_DEPTH} levels of nesting", "...")
        if isinstance(value, dict):
            for k, v in value.items():
                if len(k) > MAX_FREE_STRING:
                    raise fail(path, f"keys of at most {MAX_FREE_STRING:,} characters", k)
                stack.append((f"{path}.{k}", v, depth + 1))
        elif isinstance(value, list):
            stack += [(f"{path}[{i}]", v, depth + 1) for i, v in enumerate(value)]
    return data


def integer(data: object, field: str, *, lo: int = 0, hi: int = MAX_COUNT) -> int:
    """An int in [lo, hi] (bools rejected)."""
    if isinstance(data, bool) or not isinstance(data, int):
        raise fail(field, "an integer", data)
    if not lo <= data <= hi:
        raise fail(field, f"an integer in [{lo}, {hi}]", data)
    return data


def number(data: object, field: str, *, lo: float, hi: float) -> float:
    """A finite JSON number in [lo, hi]."""
    if isinstance(data, bool) or not isinstance(data, int | float) or not lo <= data <= hi:
        raise fail(field, f"a number in [{lo}, {hi}]", data)
    return float(data)


def string(data: object, field: str, *, max_len: int = 4096) -> str:
    """A non-empty string of at most ``max_len`` characters."""
    if not isinstance(data, str) or not data or len(data) > max_len:
        raise fail(field, f"a non-empty string of at most {max_len} characters", data)
    return data


def hexdigest(data: object, field: str, *, length: int | None = None) -> str:
    """A lowercase hex digest, optionally of an exact length."""
    text = string(data, field, max_len=256)
    if not _HEX.match(text) or (length is not None and len(text) != length):
        raise fail(field, f"a lowercase hex digest{f' of {length} characters' if length else ''}",
                   data)
    return text


def boolean(data: object, field: str) -> bool:
    """A JSON boolean."""
    if not isinstance(data, bool):
        raise fail(field, "true or false", data)
    return data


def choice(data: object, field: str, options: tuple[T, ...]) -> T:
    """One of a closed set of values."""
    for option in options:
        if data == option and type(data) is type(option):
            return option
    raise fail(field, f"one of {list(options)}", data)


def array(data: object, field: str, *, max_len: int = MAX_COUNT) -> list[Any]:
    """A JSON array of at most ``max_len`` items."""
    if not isinstance(data, list) or len(data) > max_len:
        raise fail(field, f"a JSON array of at most {max_len} items", data)
    return data


def optional(data: object, parse: Callable[..., T], field: str, **kwargs: Any) -> T | None:
    """``None`` stays ``None``; anything else goes through ``parse``."""
    return None if data is None else parse(data, field, **kwargs)
