"""Fuzzed manifests, commit records and run headers are parsed or clearly refused, never crash."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from cache_helpers import SMALL_SPEC, build_cache
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkforge.manifests.schema import parse_manifest
from sparkforge.manifests.validate import MAX_PROBLEM_CHARS, validate_cache
from sparkforge.shared.commit_columns import parse_commit_bytes
from sparkforge.shared.fields import ManifestError, load_json
from sparkforge.shared.header import parse_header

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20)


@pytest.fixture(scope="module")
def documents(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The manifest, commit record 1 and run header of one valid cache."""
    cache = build_cache(tmp_path_factory.mktemp("fuzz") / "c")
    return {"manifest": json.loads((cache / "manifest.json").read_text()),
            "commit": json.loads((cache / "_commits/0/unit_00000001.json").read_text()),
            "header": json.loads((cache / "_meta/header.json").read_text())["header"]}


def _paths(data: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside ``data`` (object keys and list indices)."""
    out = [prefix]
    if isinstance(data, dict):
        for k, v in data.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(data, list):
        for i, v in enumerate(data[:3]):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def mutated(draw: st.DrawFn, doc: Any) -> Any:
    """``doc`` with one to three values replaced by random JSON, or a key deleted or added."""
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_paths(doc)[1:]))
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        if action == "delete" and isinstance(parent, dict):
            del parent[path[-1]]
        elif action == "add" and isinstance(parent, dict):
            parent[draw(st.text(min_size=1, max_size=8))] = draw(JSON_VALUES)
        else:
            parent[path[-1]] = draw(JSON_VALUES)
    return doc


def _refused_or_parsed(parse: Any, data: Any) -> None:
    """``parse(data)`` returns, or raises a one-line ManifestError; any other error fails."""
    message = ""
    try:
        parse(data)
    except ManifestError as exc:
        message = str(exc)
    assert "\n" not in message
    assert len(message) < 2_000


FUZZ = settings(max_examples=300, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@FUZZ
@given(data=st.data())
def test_fuzzed_manifest_is_parsed_or_refused(documents: dict[str, Any], data: Any) -> None:
    """parse_manifest on a mutated manifest returns or raises ManifestError, nothing else."""
    _refused_or_parsed(parse_manifest, data.draw(mutated(documents["manifest"])))


@FUZZ
@given(data=st.data())
def test_fuzzed_commit_record_is_parsed_or_refused(documents: dict[str, Any], data: Any) -> None:
    """A mutated commit record (as bytes, as the store holds it) is parsed or refused."""
    raw = json.dumps(data.draw(mutated(documents["commit"]))).encode()
    _refused_or_parsed(lambda b: parse_commit_bytes(b, unit=1, spec=SMALL_SPEC), raw)


@FUZZ
@given(data=st.data())
def test_fuzzed_header_is_parsed_or_refused(documents: dict[str, Any], data: Any) -> None:
    """parse_header on a mutated run header returns or raises ManifestError, nothing else."""
    _refused_or_parsed(parse_header, data.draw(mutated(documents["header"])))


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=64) | st.text(alphabet="[]{}\":,0123456789.eE+-ntrufalse ",
                                            max_size=400).map(str.encode))
def test_arbitrary_bytes_are_decoded_or_refused(raw: bytes) -> None:
    """load_json on any bytes returns JSON or raises ManifestError (never RecursionError)."""
    _refused_or_parsed(lambda b: load_json(b, "doc"), raw)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_manifest_on_disk_gives_a_report(tmp_path_factory: pytest.TempPathFactory,
                                                documents: dict[str, Any], data: Any) -> None:
    """validate on a cache whose manifest was fuzzed returns short problem lines, no traceback."""
    cache: Path = build_cache(tmp_path_factory.mktemp("disk") / "c")
    manifest = data.draw(mutated(documents["manifest"]))
    (cache / "manifest.json").write_text(json.dumps(manifest))
    report = validate_cache(str(cache))
    assert all(len(p) <= MAX_PROBLEM_CHARS for p in report.problems)
