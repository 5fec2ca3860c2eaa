"""What the run header promised at creation: the units and input rows a finished cache holds.

A unit dropped consistently from manifest, index and commit records passes every other check;
only the header, written once when the cache was created, still knows it existed. ``validate``
reports these problems and ``train`` refuses the cache on them before its first step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sparkforge.manifests.contract import CacheContractError
from sparkforge.manifests.finalize import read_run_header
from sparkforge.manifests.schema import CacheManifest
from sparkforge.shared import storage
from sparkforge.shared.fields import ManifestError
from sparkforge.shared.header import RunHeader


def promise_problems(header: RunHeader, m: CacheManifest) -> list[str]:
    """The run header's unit and input-row counts against what the manifest lists."""
    try:
        promised = [("num_units", "units", header.num_units, m.storage.num_units),
                    ("num_rows", "input rows", header.num_rows, m.accounting.input_rows)]
    except ManifestError:
        return []  # a header without the producer's resolved counts promises nothing
    return [f"_meta/header.json promises producer_config.resolved.{key} = {want} {what}, but "
            f"the manifest has {have} (units lost after the run?)"
            for key, what, want, have in promised if want != have]


def check_promises(uri: str, manifest: CacheManifest,
                   storage_options: Mapping[str, Any] | None = None) -> None:
    """Raise ``CacheContractError`` when the cache holds fewer units or rows than it promised."""
    _, header = read_run_header(storage.open_location(uri, storage_options))
    problems = promise_problems(header, manifest)
    if problems:
        raise CacheContractError(f"{uri}: " + "; ".join(problems)
                                 + "; training on it would silently use part of the data "
                                 "(run sparkforge validate)")
