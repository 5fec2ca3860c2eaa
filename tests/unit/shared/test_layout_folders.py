"""How many entries every folder of a local cache holds, computed from the layout functions."""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pytest
import zarr
from cache_helpers import SMALL_SPEC, build_cache, unit_slots

from sparkforge.manifests.tables import SLOT_TABLE_KEY, UNIT_TABLE_KEY
from sparkforge.shared.layout import (
    GROUP_SLOTS,
    HEADER_KEY,
    INDEX_KEY,
    MANIFEST_KEY,
    MAX_ATTEMPTS,
    CacheSpec,
    array_layouts,
    attempt_key,
    commit_key,
    first_slot,
    slot_coords,
    slot_key,
    slots_per_attempt,
    units_per_group,
)

FIXED_KEYS = ("zarr.json", HEADER_KEY, MANIFEST_KEY, INDEX_KEY, UNIT_TABLE_KEY, SLOT_TABLE_KEY)
"""The objects every finalized cache has once, whatever its size."""


def folder_entries(keys: Iterable[str]) -> Counter[str]:
    """Entries of each folder (the root is '') holding one of ``keys``' objects or folders."""
    entries: Counter[str] = Counter()
    level, seen = set(keys), set()
    while level:  # each key, then each folder, is one entry of its parent
        seen |= level
        parents = [key.rpartition("/")[0] for key in level]
        entries.update(parents)
        level = {p for p in parents if p} - seen
    return entries


def _bookkeeping(spec: CacheSpec, units: int) -> Iterator[str]:
    """The commit record and first attempt claim of every unit, and the fixed objects."""
    yield from FIXED_KEYS
    yield from (f"{name}/zarr.json" for name in array_layouts(spec))
    for u in range(units):
        yield commit_key(spec, u)
        yield attempt_key(spec, u, 0)


@pytest.mark.parametrize("version", [3, 4])
def test_no_folder_passes_100k_entries_at_400k_units(version: int) -> None:
    """400k units of 64 slots each (256 samples of ~1K tokens in 4K-row slots): every slot of a
    unit, whatever its attempt, lies in its unit's group folder, and from format 4 its commit
    record and claims lie in its group's ``_commits/`` and ``_attempts/`` folders, so no folder
    of the cache passes 100k entries (format 3's ``_commits/`` and ``_attempts/`` hold 400k).
    A group folder stays within GROUP_SLOTS even if every attempt used all 256 of its slots."""
    spec = CacheSpec(hidden_size=4096, num_aux_layers=3, hidden_dtype="bfloat16",
                     max_seq_len=4096, shard_rows=4096, rows_per_unit=256,
                     format_version=version)
    units, per_unit = 400_000, 64
    unit = np.arange(units, dtype=np.int64)
    first = slot_coords(spec, first_slot(spec, unit, 0))[0]  # type: ignore[arg-type]
    last = slot_coords(spec, first_slot(spec, unit, MAX_ATTEMPTS - 1)  # type: ignore[arg-type]
                       + slots_per_attempt(spec) - 1)[0]
    assert (first == last).all()
    groups = np.bincount(first)
    entries = folder_entries(_bookkeeping(spec, units))
    for name in array_layouts(spec):
        entries[f"{name}/c"] = groups.size  # the slot objects' folders, computed
        entries.update({f"{name}/c/{g}": n * per_unit for g, n in enumerate(groups.tolist())})
    largest = max(entries.values())
    if version == 3:
        assert entries["_commits"] == entries["_attempts"] == units == largest
        return
    assert (units_per_group(spec), groups.size) == (390, 1026)
    assert entries["_commits"] == entries["_attempts"] == 1026
    assert entries["_commits/0"] == entries["_attempts/0"] == 390
    assert entries["_attempts/0/unit_00000000"] == 1
    assert entries["aux_hidden.0/c/0"] == 390 * 64
    assert largest == 390 * 64 < 100_000
    assert units_per_group(spec) * slots_per_attempt(spec) == 99_840 <= GROUP_SLOTS


@pytest.mark.parametrize("version", [3, 4])
def test_a_real_caches_folders_hold_what_the_layout_says(tmp_path: Path, version: int) -> None:
    """Every folder of a written cache holds the entries the layout functions name for it:
    the fixed objects, each unit's commit record and attempt claim, and each committed slot's
    object in every array, in its group's folder."""
    spec = dataclasses.replace(SMALL_SPEC, format_version=version)
    cache = build_cache(tmp_path / "c", spec, units=3)
    slots = [s for u in range(3) for s in unit_slots(cache, u)]
    group = zarr.open_group(str(cache), mode="r")
    keys = [*_bookkeeping(spec, 3),
            *(slot_key(name, group[name], s, spec) for name in array_layouts(spec) for s in slots)]
    have = {os.path.relpath(here, cache).removeprefix("."): len(dirs) + len(files)
            for here, dirs, files in os.walk(cache)}
    assert have == dict(folder_entries(keys))
    assert have["_commits"] == (3 if version == 3 else 1)
