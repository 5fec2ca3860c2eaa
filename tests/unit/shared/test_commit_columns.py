"""Commit records parse column by column: the same rows back, and each bad entry named."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from cache_helpers import SMALL_SPEC, make_run_header, make_unit

from sparkforge.shared.commit import UnitInfo
from sparkforge.shared.commit_columns import parse_commit_bytes, parse_commit_columns
from sparkforge.shared.fields import ManifestError
from sparkforge.shared.layout import commit_key
from sparkforge.shared.writer import CacheWriter


@pytest.fixture(scope="module")
def record(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, UnitInfo]:
    """Unit 1's commit record as the writer stored it, and what it committed."""
    path = tmp_path_factory.mktemp("commit") / "c"
    writer = CacheWriter.open(str(path), spec=SMALL_SPEC, header=make_run_header(SMALL_SPEC))
    writer.write_unit(1, *make_unit(SMALL_SPEC, 1))
    raw = (path / commit_key(SMALL_SPEC, 1)).read_bytes()
    return raw, parse_commit_bytes(raw, unit=1, spec=SMALL_SPEC)


def test_columns_hold_what_the_writer_committed(record: tuple[bytes, UnitInfo]) -> None:
    """Columns and rows agree with the record's JSON, sample by sample and slot by slot."""
    raw, info = record
    cols = parse_commit_columns(raw, unit=1, spec=SMALL_SPEC)
    data = json.loads(raw)
    assert info.to_json(SMALL_SPEC.format_version) == data
    assert cols.samples["length"].tolist() == data["samples"]["length"]
    assert cols.samples["split"].tolist() == [int(s == "eval") for s in data["samples"]["split"]]
    assert cols.slot.tolist() == [s["slot"] for s in data["slots"]]
    assert cols.crc32c[:, cols.arrays.index("final_hidden")].tolist() == [
        s["crc32c"]["final_hidden"] for s in data["slots"]]
    assert cols.num_tokens == sum(data["samples"]["length"]) == info.num_tokens


def _set(column: str, i: int, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda r: r["samples"][column].__setitem__(i, value)


@pytest.mark.parametrize(("edit", "match"), [
    (_set("sample_id", 1, True), r"'samples.sample_id\[1\]': expected an integer, got True"),
    (_set("length", 2, 3.0), r"'samples.length\[2\]': expected an integer, got 3.0"),
    (_set("row_offset", 0, 1 << 70), r"'samples.row_offset\[0\]': expected an integer in"),
    (_set("num_loss_tokens", 3, 99), r"'samples.num_loss_tokens\[3\]': expected an integer in "
                                     r"\[0, \d+\]"),
    (_set("source_hash", 2, "ABCD"), r"'samples.source_hash\[2\]': expected a lowercase hex"),
    (_set("source_hash", 0, "\u00e9"), r"'samples.source_hash\[0\]': expected a lowercase hex"),
    (_set("split", 1, "test"), r"'samples.split\[1\]': expected one of \['train', 'eval'\]"),
    (_set("split", 0, ["train"]), r"'samples.split\[0\]': expected one of"),
    (lambda r: _set("sample_id", 1, r["samples"]["sample_id"][0])(r),
     r"'samples.sample_id': expected unique ids"),
    (lambda r: r["slots"].append(dict(r["slots"][0])), r"'slots\[\d\].slot': expected a slot not "
                                                       r"listed before it"),
])
def test_a_bad_entry_is_named(record: tuple[bytes, UnitInfo],
                              edit: Callable[[dict[str, Any]], None], match: str) -> None:
    """Each column check names the column, the entry and the value, as the per-field parsers."""
    data = json.loads(record[0])
    edit(data)
    with pytest.raises(ManifestError, match=f"commit record of unit 1: .*{match}"):
        parse_commit_columns(json.dumps(data).encode(), unit=1, spec=SMALL_SPEC)


def test_row_offsets_follow_the_packing_of_each_slot(record: tuple[bytes, UnitInfo]) -> None:
    """A sample whose row offset overlaps its slot's previous sample is refused."""
    data = json.loads(record[0])
    slots = np.asarray(data["samples"]["slot"])
    second = int(np.flatnonzero(slots == slots[0])[1])
    data["samples"]["row_offset"][second] -= 1
    with pytest.raises(ManifestError, match=rf"'samples.row_offset\[{second}\]': expected \d+ "
                                            r"\(packed after the previous sample of its slot\)"):
        parse_commit_columns(json.dumps(data).encode(), unit=1, spec=SMALL_SPEC)
