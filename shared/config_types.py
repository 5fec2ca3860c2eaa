"""The field types of a config dataclass, checked when it is built in Python (the API) as the
command line's parser checks them.

A config built from the command line has the right types already; one built by a caller may
hold anything (``ProducerConfig(window="8")`` used to fail with a ``TypeError`` deep in a range
check, ``validate(deep="yes")`` to run a deep check). :func:`type_problems` names each field whose
value does not fit its annotation: plain types (``bool`` is no ``int``, an ``int`` is a
``float``), ``X | None``, ``Literal``, ``list``/``tuple``/``dict`` of them and nested configs.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union

from sparkforge.shared.fields import shorten


def type_problems(config: Any, *, prefix: str = "--") -> list[str]:
    """One line per field of the dataclass ``config`` whose value its annotation refuses."""
    hints = _hints(config.__class__)
    problems = []
    for f in dataclasses.fields(config):
        value, hint = getattr(config, f.name), hints[f.name]
        if not fits(value, hint):
            problems.append(f"{prefix}{f.name}: expected {describe(hint)}, got "
                            f"{shorten(repr(value))}")
    return problems


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def fits(value: Any, hint: Any) -> bool:
    """Whether ``value`` is of type ``hint`` (unknown kinds of annotation accept anything)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if origin in (Union, types.UnionType):
        return any(fits(value, a) for a in args)
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin in (list, tuple):
        item = args[0] if args else Any
        return isinstance(value, list | tuple) and all(fits(v, item) for v in value)
    if origin is dict:
        key, item = args or (Any, Any)
        return isinstance(value, Mapping) and all(
            fits(k, key) and fits(v, item) for k, v in value.items())
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return isinstance(value, hint)
    return True


def describe(hint: Any) -> str:
    """An annotation in words (``int``, ``'skip' or 'fail'``, ``a list of int``, ...)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return "None"
    if origin in (Union, types.UnionType):
        return " or ".join(describe(a) for a in args)
    if origin is Literal:
        return " or ".join(repr(a) for a in args)
    if origin in (list, tuple):
        return f"a list of {describe(args[0]) if args else 'values'}"
    if origin is dict:
        return "a mapping"
    return getattr(hint, "__name__", str(hint))
