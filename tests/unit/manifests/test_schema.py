"""Manifest parsing: golden examples round-trip; every invalid manifest names its field."""

from __future__ import annotations

import copy
import json
from importlib.resources import files
from typing import Any

import jsonschema
import pytest

from sparkforge.manifests import jsonschema as manifest_schema
from sparkforge.manifests.schema import (
    MANIFEST_KEYS,
    OPTIONAL_MANIFEST_KEYS,
    CacheManifest,
    ManifestError,
    UnknownFormatVersionError,
)
from sparkforge.shared.header import parse_header

EXAMPLES = sorted(p for p in files("sparkforge.manifests").joinpath("examples").iterdir()
                  if p.name.endswith(".json"))


def _example() -> dict[str, Any]:
    return json.loads(EXAMPLES[0].read_text())


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_golden_examples_round_trip(path: Any) -> None:
    """Each golden manifest parses and serialises back to the identical JSON."""
    data = json.loads(path.read_text())
    manifest = CacheManifest.from_json(data)
    assert manifest.to_json() == data
    assert set(data) == MANIFEST_KEYS | OPTIONAL_MANIFEST_KEYS


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_golden_examples_satisfy_json_schema(path: Any) -> None:
    """The exported JSON Schema accepts the golden manifests."""
    jsonschema.validate(json.loads(path.read_text()), manifest_schema.manifest_json_schema())


def test_committed_json_schema_is_up_to_date() -> None:
    """manifests/manifest.schema.json equals the schema derived from the dataclasses.

    Regenerate with: .venv/bin/python -P -m sparkforge.manifests.jsonschema
    """
    assert manifest_schema.SCHEMA_PATH.read_text() == manifest_schema.render()


def _set(path: str, value: Any) -> Any:
    def mutate(d: dict[str, Any]) -> None:
        new = value(d) if callable(value) else value
        *parents, last = path.split(".")
        for p in parents:
            d = d[int(p)] if isinstance(d, list) else d[p]
        if value is _DELETE:
            del d[last]
        elif isinstance(d, list):
            d[int(last)] = new
        else:
            d[last] = new
    return mutate


_DELETE = object()

INVALID = [
    ("format_version", 5, UnknownFormatVersionError, r"reads versions \[1, 2, 3, 4\], got 5"),
    ("format_version", "1", ManifestError, "'format_version': expected an integer"),
    ("complete", "yes", ManifestError, "'complete': expected true or false"),
    ("created_at", "yesterday", ManifestError, "'created_at': expected an ISO 8601"),
    ("created_at", "2026-01-01T00:00:00", ManifestError, "with a timezone"),
    ("git_sha", "not-hex", ManifestError, "'git_sha': expected a lowercase hex"),
    ("parity", [1, 2], ManifestError, "'parity': expected a JSON object"),
    ("target.vocab_size", -5, ManifestError, r"'target.vocab_size': expected an integer in"),
    ("target.hidden_size", 1 << 40, ManifestError, "'target.hidden_size'"),
    ("target.num_hidden_layers", True, ManifestError, "'target.num_hidden_layers'"),
    ("target.content_hash", "XYZ", ManifestError, "'target.content_hash'"),
    ("target.extra", 1, ManifestError, r"'target': expected only keys .* unknown"),
    ("target.dtype", _DELETE, ManifestError, r"'target': expected keys \['dtype'\]"),
    ("capture.layer_ids", [3, 1, 2], ManifestError, "'capture.layer_ids': expected a non-empty"),
    ("capture.layer_ids", [1, 2, 9], ManifestError, "ids <= target.num_hidden_layers"),
    ("capture.layer_ids", [1, 2], ManifestError, r"'capture.layer_ids': expected 3 ids"),
    ("capture.layer_id_convention", "vllm", ManifestError, "'capture.layer_id_convention'"),
    ("capture.final_hidden", "pre_norm", ManifestError, "'capture.final_hidden'"),
    ("capture.features", "hc_sum", ManifestError, r"'capture.features': expected one of "
                                                  r"\['residual', 'hc_mean'\]"),
    ("capture.max_seq_len", 32, ManifestError, "'capture.max_seq_len': expected storage.spec"),
    ("tokenizer.chat_template_sha256", "ab", ManifestError, "of 64 characters"),
    ("data.eval_fraction", 1.5, ManifestError, "'data.eval_fraction'"),
    ("data.sources", "s3://x", ManifestError, "'data.sources': expected a JSON array"),
    ("data.regeneration", {}, ManifestError, "'data.regeneration': expected a JSON array"),
    ("data.regeneration", [{"temperature": 1.0}], ManifestError,
     r"'data.regeneration\[0\]': expected keys"),
    ("data.regeneration", [{"temperature": -1.0, "top_p": 1.0, "top_k": -1, "seed": 0,
                            "max_tokens": 8}], ManifestError,
     r"'data.regeneration\[0\].temperature'"),
    ("data.regeneration", [{"temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": 0,
                            "max_tokens": 8}], ManifestError,
     r"'data.regeneration\[0\].top_k': expected -1 \(off\) or >= 1"),
    ("accounting.failed", 1, ManifestError, r"'accounting': written .* != input_rows"),
    ("accounting.written", -1, ManifestError, "'accounting.written'"),
    ("accounting.image_rows", 10**6, ManifestError, "'accounting.image_rows': expected an int"),
    ("accounting.image_rows", 0, ManifestError,  # the units do not count theirs
     "'accounting': expected the sum of the units' accounting"),
    ("storage.spec.shard_rows", 0, ManifestError, "'storage.spec.shard_rows'"),
    ("storage.spec.hidden_dtype", "int4", ManifestError, "'storage.spec.hidden_dtype'"),
    ("storage.arrays.aux_hidden.dtype", "float64", ManifestError, "'storage.arrays.aux_hidden'"),
    ("storage.index_key", "../../etc/passwd", ManifestError, "'storage.index_key'"),
    ("storage.index_key", "/abs/index.parquet", ManifestError, "inside the cache root"),
    ("storage.units", lambda d: [d["storage"]["units"][0]] * 2, ManifestError,
     "'storage.units': expected unique units"),
    ("storage.units", lambda d: d["storage"]["units"][1:], ManifestError, "without gaps"),
    ("storage.units.1.slots.0.slot", 0, ManifestError, r"'storage.units\[1\].slots\[0\].slot'"),
    ("storage.units.0.slots.0.crc32c.aux_hidden", 1 << 33, ManifestError, "crc32c.aux_hidden"),
    ("storage.units.0.num_tokens", 1, ManifestError, "'storage.units\\[0\\].num_tokens'"),
    ("storage.totals.tokens", 7, ManifestError, "'storage.totals.tokens'"),
    ("storage.totals.samples", 10**20, ManifestError, "'storage.totals.samples'"),
]


FORMAT_3 = [  # from format 3 the manifest names its unit and slot tables instead of listing units
    ("storage.slot_table", _DELETE, ManifestError, r"'storage': expected keys \['slot_table'\]"),
    ("storage.units", [], ManifestError,
     r"'storage': expected only keys .* unknown, got \['units'\]"),
    ("storage.unit_table.key", "../units.parquet", ManifestError,
     "'storage.unit_table.key': expected a relative key inside the cache root"),
    ("storage.slot_table.sha256", "ab", ManifestError, "'storage.slot_table.sha256'"),
    ("storage.slot_table.num_rows", -1, ManifestError, "'storage.slot_table.num_rows'"),
    ("storage.unit_table.num_rows", 10**8, ManifestError, "'storage.unit_table.num_rows'"),
]


def _format_3_example() -> dict[str, Any]:
    (path,) = (p for p in EXAMPLES if p.name == "tiny_vllm_format3.json")
    return json.loads(path.read_text())


def _case_id(path: str, value: Any, match: str) -> str:
    """A test id that is the same in every process (pytest-xdist compares them): a deletion or
    a function is named by its path and the error it expects, not by its address."""
    shown = "deleted" if value is _DELETE else match if callable(value) else repr(value)
    return f"{path}={shown}"[:60]


@pytest.mark.parametrize(("path", "value", "error", "match"), INVALID,
                         ids=[_case_id(p, v, m) for p, v, _, m in INVALID])
def test_invalid_manifest_is_named(path: str, value: Any, error: type, match: str) -> None:
    """A bad field raises ManifestError naming the field and, where useful, the value."""
    data = copy.deepcopy(_example())
    _set(path, value)(data)
    with pytest.raises(error, match=match):
        CacheManifest.from_json(data)


@pytest.mark.parametrize(("path", "value", "error", "match"), FORMAT_3,
                         ids=[_case_id(p, v, m) for p, v, _, m in FORMAT_3])
def test_invalid_format_3_storage_is_named(path: str, value: Any, error: type,
                                           match: str) -> None:
    """A format-3 manifest's table references are parsed field by field like the rest."""
    data = _format_3_example()
    _set(path, value)(data)
    with pytest.raises(error, match=match):
        CacheManifest.from_json(data)


def test_manifest_without_features_reads_as_residual() -> None:
    """A manifest written before capture.features existed parses as plain residual features."""
    data = copy.deepcopy(_example())
    del data["capture"]["features"]
    manifest = CacheManifest.from_json(data)
    assert manifest.capture.features == "residual"
    jsonschema.validate(data, manifest_schema.manifest_json_schema())


def test_manifest_without_regeneration_reads_as_not_regenerated() -> None:
    """A manifest written before data.regeneration existed parses with no sampling records."""
    data = copy.deepcopy(_example())
    del data["data"]["regeneration"]
    assert CacheManifest.from_json(data).data.regeneration == ()
    jsonschema.validate(data, manifest_schema.manifest_json_schema())


def test_image_rows_count_round_trips_and_sums_over_units() -> None:
    """Units that count their image rows give the manifest's count; absent (older caches), it
    reads as None and stays absent."""
    data = copy.deepcopy(_example())
    assert CacheManifest.from_json(data).accounting.image_rows is None
    for i, unit in enumerate(data["storage"]["units"]):
        unit["accounting"]["image_rows"] = min(i + 1, unit["accounting"]["written"])
    data["accounting"]["image_rows"] = sum(u["accounting"]["image_rows"]
                                           for u in data["storage"]["units"])
    manifest = CacheManifest.from_json(data)
    assert manifest.accounting.image_rows == data["accounting"]["image_rows"] > 0
    assert manifest.to_json() == data
    jsonschema.validate(data, manifest_schema.manifest_json_schema())
    data["accounting"]["image_rows"] += 1
    with pytest.raises(ManifestError, match="the sum of the units' accounting"):
        CacheManifest.from_json(data)


def test_regeneration_sampling_is_typed() -> None:
    """A regenerated example's sampling settings parse into their typed record."""
    (path,) = (p for p in EXAMPLES if p.name == "tiny_fp8_topk.json")
    (sampling,) = CacheManifest.from_json(json.loads(path.read_text())).data.regeneration
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed,
            sampling.max_tokens) == (1.0, 0.95, -1, 7, 2048)


@pytest.mark.parametrize("data", [None, [], "manifest", 3])
def test_non_object_manifest_is_rejected(data: Any) -> None:
    """Anything but a JSON object is rejected before field parsing."""
    with pytest.raises(ManifestError, match="expected a JSON object"):
        CacheManifest.from_json(data)


def test_manifest_error_is_a_value_error() -> None:
    """Callers can catch ManifestError as ValueError."""
    assert issubclass(ManifestError, ValueError)


def test_parse_header_accepts_the_example_sections() -> None:
    """The producer-supplied sections of a golden manifest form a valid run header."""
    data = _example()
    header = parse_header({k: data[k] for k in ("producer_config", "target", "capture",
                                                "tokenizer", "data")})
    assert header.capture.layer_ids == (1, 2, 3)
