"""How many entries a local cache's array folders hold, computed from the layout functions."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import numpy as np
import zarr
from cache_helpers import SMALL_SPEC, build_cache, unit_slots

from sparkforge.shared.layout import (
    MAX_ATTEMPTS,
    UNITS_PER_GROUP,
    CacheSpec,
    array_layouts,
    first_slot,
    slot_coords,
    slot_key,
    slots_per_attempt,
    slots_per_group,
)


def _array_folders(spec: CacheSpec, slots: np.ndarray) -> Counter[str]:
    """Entries per folder under ``<array>/c/`` for these committed slots (every array alike):
    ``c/`` holds a folder per slot group, each group folder one per slot in it (format 3)."""
    groups, per_group = np.unique(np.unique(slots) // slots_per_group(spec), return_counts=True)
    return Counter({"c": groups.size} | {f"c/{g}": int(n) for g, n in zip(
        groups.tolist(), per_group.tolist(), strict=True)})


def test_no_array_folder_passes_100k_entries_at_400k_units() -> None:
    """400k units of 64 slots each (256 samples of ~1K tokens in 4K-row slots): every slot of a
    unit, whatever its attempt, lies in its unit's group folder, so ``c/`` holds 400 group
    folders and each group folder 1,000 units x 64 slots, never one folder per slot of the
    cache (25.6M)."""
    spec = CacheSpec(hidden_size=4096, num_aux_layers=3, hidden_dtype="bfloat16",
                     max_seq_len=4096, shard_rows=4096, rows_per_unit=256)
    units, per_unit = 400_000, 64
    first = np.array([slot_coords(spec, first_slot(spec, u, 0))[0] for u in range(units)])
    last = np.array([slot_coords(spec, first_slot(spec, u, MAX_ATTEMPTS - 1)
                                 + slots_per_attempt(spec) - 1)[0] for u in range(units)])
    assert (first == last).all()
    groups = np.bincount(first)
    assert groups.size == units // UNITS_PER_GROUP == 400  # entries of c/
    assert groups.max() * per_unit == 64_000  # of the largest group folder
    assert _array_folders(spec, np.array([first_slot(spec, u, 0) + k for u in range(1000)
                                          for k in range(per_unit)]))["c/0"] == 64_000


def test_a_real_caches_folders_hold_what_the_layout_says(tmp_path: Path) -> None:
    """A written cache's folders under every array hold the entries :func:`_array_folders`
    computes from its committed slots, and each slot's key lies in its group's folder."""
    cache = build_cache(tmp_path / "c", units=3)
    slots = np.array([s for u in range(3) for s in unit_slots(cache, u)], dtype=np.int64)
    want = _array_folders(SMALL_SPEC, slots)
    group = zarr.open_group(str(cache), mode="r")
    for name in array_layouts(SMALL_SPEC):
        have = {os.path.relpath(here, cache / name): len(dirs) + len(files)
                for here, dirs, files in os.walk(cache / name / "c")}
        assert {k: have[k] for k in want} == dict(want)
        for s in slots.tolist():
            g, k = slot_coords(SMALL_SPEC, s)
            key = slot_key(name, group[name], s, SMALL_SPEC)
            assert f"{key}/".startswith(f"{name}/c/{g}/{k}/")
