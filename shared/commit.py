"""Commit records: what one committed unit holds (slots, checksums, sample rows, accounting).

:meth:`UnitInfo.to_bytes` writes a record; ``sparkforge.shared.commit_columns`` reads one back,
checking every row against the unit and the spec (the record is untrusted once it is in the
store).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import crc32c
import numpy as np
import numpy.typing as npt

from sparkforge.shared import fields as f
from sparkforge.shared import storage
from sparkforge.shared.fields import ManifestError
from sparkforge.shared.layout import (
    COMMITS_PREFIX,
    FORMAT_VERSION,
    CacheSpec,
    array_layouts,
    commit_key,
    first_slot,
    parse_commit_name,
    slots_per_attempt,
)
from sparkforge.shared.records import Split, UnitAccounting

SAMPLE_COLUMNS = ("sample_id", "slot", "row_offset", "length", "num_loss_tokens", "source_row",
                  "source_hash", "split")


def bookkeeping_folders(loc: storage.Location, spec: CacheSpec, prefix: str) -> list[str]:
    """The folders holding ``prefix``'s (``_commits``, ``_attempts``) objects: one per group from
    format 4 (listed fresh from the store), else ``prefix`` itself (formats 1-3 keep it flat)."""
    if spec.format_version < 4:
        return [prefix]
    return [f"{prefix}/{g}" for g in storage.list_names(loc, prefix) if g.isdigit()]


def committed_units(loc: storage.Location, spec: CacheSpec) -> set[int]:
    """Units whose commit record exists at its key (listed fresh from the store, one group
    folder at a time from format 4; a record in another unit's group is not counted)."""
    folders = bookkeeping_folders(loc, spec, COMMITS_PREFIX)
    return {unit for folder in folders for name in storage.list_names(loc, folder)
            if (unit := parse_commit_name(name)) is not None
            and commit_key(spec, unit) == f"{folder}/{name}"}


def checksum(values: npt.NDArray[Any]) -> int:
    """crc32c of an array's C-order little-endian bytes (the decoded rows a slot holds)."""
    # A byte view, not tobytes(): no copy of a slot that may hold hundreds of MB.
    return int(crc32c.crc32c(np.ascontiguousarray(values).data.cast("B")))


@dataclass(frozen=True, kw_only=True)
class SlotRecord:
    """One slot of a unit: its id, used rows and the crc32c of each array over those rows."""

    slot: int
    num_rows: int
    crc32c: dict[str, int]


@dataclass(frozen=True, kw_only=True)
class SampleRow:
    """Where one sample lives: ``row_offset`` is the absolute first row in every array."""

    sample_id: int
    slot: int
    row_offset: int
    length: int
    num_loss_tokens: int
    source_row: int
    source_hash: str
    split: Split


@dataclass(frozen=True, kw_only=True)
class UnitInfo:
    """A committed unit: the attempt that won, its slots, its samples and its accounting."""

    unit: int
    attempt: int
    slots: tuple[SlotRecord, ...]
    samples: tuple[SampleRow, ...]
    accounting: UnitAccounting

    @property
    def sample_ids(self) -> list[int]:
        """Sample ids in storage order."""
        return [s.sample_id for s in self.samples]

    @property
    def splits(self) -> list[str]:
        """Split of each sample, aligned with :attr:`sample_ids`."""
        return [s.split for s in self.samples]

    @property
    def num_tokens(self) -> int:
        """Tokens stored by this unit."""
        return sum(s.length for s in self.samples)

    def to_json(self, format_version: int = FORMAT_VERSION) -> dict[str, Any]:
        """The commit record as JSON (sample rows stored column-wise to stay compact)."""
        return {
            "format_version": format_version,
            "unit": self.unit,
            "attempt": self.attempt,
            "slots": [{"slot": s.slot, "num_rows": s.num_rows, "crc32c": dict(s.crc32c)}
                      for s in self.slots],
            "samples": {c: [getattr(s, c) for s in self.samples] for c in SAMPLE_COLUMNS},
            "accounting": accounting_json(self.accounting),
        }

    def to_bytes(self, format_version: int = FORMAT_VERSION) -> bytes:
        """Serialised commit record of a cache with this format version."""
        return json.dumps(self.to_json(format_version), sort_keys=True).encode()


def accounting_json(acc: UnitAccounting) -> dict[str, Any]:
    """An accounting as commit records and the manifest store it (``image_rows`` only when
    counted, so records written before it read back unchanged)."""
    out: dict[str, Any] = {"input_rows": acc.input_rows, "written": acc.written,
                           "skipped": dict(acc.skipped), "failed": acc.failed}
    if acc.image_rows is not None:
        out["image_rows"] = acc.image_rows
    return out


def parse_accounting(data: object, field: str = "accounting") -> UnitAccounting:
    """Input rows, written, skipped by reason, failed; the four must add up. ``image_rows``
    (optional) is at most ``written``."""
    d = f.obj(data, field, required=frozenset({"input_rows", "written", "skipped", "failed"}),
              optional=frozenset({"image_rows"}))
    skipped_raw = f.mapping(d["skipped"], f"{field}.skipped")
    skipped = {f.string(k, f"{field}.skipped", max_len=64): f.integer(v, f"{field}.skipped.{k}")
               for k, v in skipped_raw.items()}
    input_rows = f.integer(d["input_rows"], f"{field}.input_rows")
    written, failed = f.integer(d["written"], f"{field}.written"), f.integer(d["failed"],
                                                                             f"{field}.failed")
    if written + sum(skipped.values()) + failed != input_rows:
        raise ManifestError(
            f"manifest field {field!r}: written {written} + skipped {sum(skipped.values())} "
            f"+ failed {failed} != input_rows {input_rows}")
    image_rows = f.optional(d.get("image_rows"), f.integer, f"{field}.image_rows", hi=written)
    return UnitAccounting(input_rows=input_rows, written=written, skipped=skipped, failed=failed,
                          image_rows=image_rows)


def parse_slots(data: object, field: str, *, spec: CacheSpec, unit: int,
                attempt: int) -> tuple[SlotRecord, ...]:
    """Slots of one (unit, attempt): distinct, inside its slot range, one crc32c per array."""
    lo = first_slot(spec, unit, attempt)
    names = frozenset(array_layouts(spec))
    out = []
    for i, item in enumerate(f.array(data, field, max_len=slots_per_attempt(spec))):
        d = f.obj(item, f"{field}[{i}]", required=frozenset({"slot", "num_rows", "crc32c"}))
        crc = f.obj(d["crc32c"], f"{field}[{i}].crc32c", required=names)
        out.append(SlotRecord(
            slot=f.integer(d["slot"], f"{field}[{i}].slot", lo=lo,
                           hi=lo + slots_per_attempt(spec) - 1),
            num_rows=f.integer(d["num_rows"], f"{field}[{i}].num_rows", lo=1, hi=spec.shard_rows),
            crc32c={k: f.integer(v, f"{field}[{i}].crc32c.{k}", hi=0xFFFFFFFF)
                    for k, v in crc.items()}))
        if out[-1].slot in {s.slot for s in out[:-1]}:
            raise f.fail(f"{field}[{i}].slot", "a slot not listed before it", out[-1].slot)
    return tuple(out)
