"""Small typed readers for untrusted JSON values; each error names the field and the value."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, Final, TypeVar

MAX_COUNT: Final = 1 << 48
"""Upper bound for counts (rows, samples, tokens, bytes): anything larger is corrupt input."""
_HEX = re.compile(r"^[0-9a-f]+$")
T = TypeVar("T")


class ManifestError(ValueError):
    """Raised when a manifest, run header or commit record is malformed or inconsistent."""


def fail(field: str, expected: str, value: object) -> ManifestError:
    """The error for ``field`` holding ``value`` where ``expected`` was required."""
    shown = repr(value)
    if len(shown) > 120:
        shown = shown[:117] + "..."
    return ManifestError(f"manifest field {field!r}: expected {expected}, got {shown}")


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
    """A free-form JSON object with string keys (e.g. the producer config)."""
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise fail(field, "a JSON object", data)
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
