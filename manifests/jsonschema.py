"""Derive the JSON Schema of manifest.json from the CacheManifest dataclasses."""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path
from typing import Any, Final, Literal, NewType, Union, get_args, get_origin, get_type_hints

from sparkforge.manifests.schema import FORMAT_VERSION, OPTIONAL_MANIFEST_KEYS, CacheManifest
from sparkforge.shared.layout import READABLE_VERSIONS

SCHEMA_PATH: Final = Path(__file__).resolve().with_name("manifest.schema.json")


def _schema(tp: Any) -> dict[str, Any]:
    if isinstance(tp, NewType):  # e.g. HfIndices: its JSON is its base type's
        return _schema(tp.__supertype__)
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        return {"anyOf": [_schema(a) for a in args]}
    if origin is Literal:
        return {"enum": list(args)}
    if origin is tuple:
        return {"type": "array", "items": _schema(args[0])}
    if origin is dict:
        value = args[1]
        return {"type": "object"} if value is Any else {
            "type": "object", "additionalProperties": _schema(value)}
    if dataclasses.is_dataclass(tp):
        hints = get_type_hints(tp)
        fields = [f for f in dataclasses.fields(tp) if f.metadata.get("in_json", True)]
        # Fields added after format version 1 may be absent from older manifests.
        required = [f.name for f in fields if not f.metadata.get("optional_in_json")]
        return {"type": "object", "properties": {f.name: _schema(hints[f.name]) for f in fields},
                "required": required, "additionalProperties": False}
    simple = {int: "integer", str: "string", bool: "boolean", float: "number",
              type(None): "null"}
    return {"type": simple[tp]}


def manifest_json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of ``manifest.json`` for this format version."""
    schema = _schema(CacheManifest)
    schema["properties"]["format_version"] = {"enum": list(READABLE_VERSIONS)}
    schema["required"] = [k for k in schema["required"] if k not in OPTIONAL_MANIFEST_KEYS]
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": f"sparkforge cache manifest, format_version {FORMAT_VERSION}", **schema}


def render() -> str:
    """The schema as committed in ``manifests/manifest.schema.json``."""
    return json.dumps(manifest_json_schema(), indent=1, sort_keys=True) + "\n"


if __name__ == "__main__":
    SCHEMA_PATH.write_text(render())
