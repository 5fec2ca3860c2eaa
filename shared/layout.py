"""The cache layout: CacheSpec, array names, chunking (~1 MiB inner chunks), codecs, slots."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeVar, get_args

import numpy as np
import numpy.typing as npt
import zarr
from zarr.codecs import BloscCodec, ZstdCodec

from sparkforge.shared import fields as f
from sparkforge.shared.dtypes import STORAGE_DTYPES, HiddenDtype
from sparkforge.shared.errors import SparkforgeError

FORMAT_VERSION: Final = 4
"""The layout new caches get. 1: ``aux_hidden`` (and fp8 ``aux_scale``) hold every captured layer
of a row in one array, so any read decodes all layers. 2: one array per captured layer
(``aux_hidden.0``, ``aux_hidden.1``, ...), so a run reads only the layers it trains on. 3: as 2,
with a leading slot-group axis on every array (the slots of :data:`UNITS_PER_GROUP` units per
group), so slot objects nest as ``c/{group}/{slot in group}`` instead of one folder holding
every slot, and the manifest keeps its unit and slot rows in Parquet tables beside it. 4: as 3,
with commit records and attempt claims nested under their unit's group too
(``_commits/{group}/unit_U.json``, ``_attempts/{group}/unit_U/A``), and groups of
:func:`units_per_group` units, so no folder holds one entry per unit or more slots than
:data:`GROUP_SLOTS`."""
READABLE_VERSIONS: Final = (1, 2, 3, 4)
"""Formats 1 (``_layered``), 2 (flat slot keys: ``_flat``) and 3 (flat ``_commits/`` and
``_attempts/``: ``_flat_bookkeeping``) are still read; format 1's reader is dropped in sparkforge
0.3.0, format 2's in 0.4.0, format 3's in 0.5.0."""
UNITS_PER_GROUP: Final = 1000
"""The most units of a group (format 3: every group's); ``c/`` holds one group folder per group
(400 at 400k units of 1,000)."""
GROUP_SLOTS: Final = 100_000
"""Format 4: a group holds as many units as keep its slot folder within this many entries when
every attempt uses all of :func:`slots_per_attempt` (a slot folder of 1,000 units passed it at
more than 100 slots per unit); each abandoned attempt's slots come on top."""
_IntOrArray = TypeVar("_IntOrArray", int, "npt.NDArray[np.int64]")
AuxCodec = Literal["lossless", "fp8"]
"""How aux hidden states are stored: as ``hidden_dtype``, or fp8 with a per-row scale."""
AUX_CODECS: Final = get_args(AuxCodec)
TARGET_INNER_CHUNK_BYTES: Final = 1 << 20
"""Inner chunks near 1 MiB: smaller ones lower the Blosc-zstd ratio (1.454 -> 1.432 at 256 KiB)."""
MAX_UNITS: Final = 10**7
MAX_ATTEMPTS: Final = 1000
MAX_ROWS: Final = 1 << 62
SPEC_LIMITS: Final = {"hidden_size": 1 << 17, "num_aux_layers": 256, "max_seq_len": 1 << 22,
                      "shard_rows": 1 << 22, "rows_per_unit": 1 << 20}
"""The largest value of each size field a manifest may record: a producer refuses more before
its run, so a cache never ends with a manifest its own parser refuses."""

HEADER_KEY: Final = "_meta/header.json"
INDEX_KEY: Final = "index.parquet"
MANIFEST_KEY: Final = "manifest.json"
TARGET_PREFIX: Final = "target"
PARITY_FILE: Final = "parity.json"
"""The producer's parity report under target/; finalize copies it into the manifest."""


COMMITS_PREFIX: Final = "_commits"
ATTEMPTS_PREFIX: Final = "_attempts"
_COMMIT_NAME: Final = re.compile(r"unit_(\d{8})\.json")


def _flat_bookkeeping(spec: CacheSpec) -> bool:
    """Whether ``_commits/`` and ``_attempts/`` hold one entry per unit (formats 1-3; read until
    sparkforge 0.5.0)."""
    return spec.format_version < 4


def bookkeeping_folder(spec: CacheSpec, prefix: str, unit: int) -> str:
    """The folder under ``prefix`` (``_commits`` or ``_attempts``) holding ``unit``'s objects:
    its group's from format 4, else ``prefix`` itself."""
    return prefix if _flat_bookkeeping(spec) else f"{prefix}/{unit_group(spec, unit)}"


def commit_key(spec: CacheSpec, unit: int) -> str:
    """Key of a unit's commit record."""
    return f"{bookkeeping_folder(spec, COMMITS_PREFIX, unit)}/unit_{unit:08d}.json"


def parse_commit_name(name: str) -> int | None:
    """The unit whose commit record is ``name`` under ``_commits/``; None for any other object."""
    match = _COMMIT_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def attempt_key(spec: CacheSpec, unit: int, attempt: int) -> str:
    """Key claimed (exclusive create) by one write attempt of a unit."""
    return f"{bookkeeping_folder(spec, ATTEMPTS_PREFIX, unit)}/unit_{unit:08d}/{attempt:04d}"


@dataclass(frozen=True, kw_only=True)
class CacheSpec:
    """The storage shape of a cache, fixed at creation and recorded in the store and manifest."""

    hidden_size: int
    """H: the target's hidden size."""
    num_aux_layers: int
    """F: captured intermediate layers stored in ``aux_hidden``."""
    hidden_dtype: HiddenDtype
    """Storage dtype of ``aux_hidden`` (lossless codec) and ``final_hidden``."""
    max_seq_len: int
    """Longest sample in rows (tokens); one longer than ``shard_rows`` spans consecutive slots.

    A cache whose ``max_seq_len`` exceeds ``shard_rows`` may hold such samples: sparkforge
    before they could (which refused this spec as "samples never straddle a slot") never
    opens it, so no reader misreads one."""
    aux_codec: AuxCodec = "lossless"
    """``fp8``: ``aux_hidden`` as float8_e4m3fn bytes with a per-row, per-layer ``aux_scale``."""
    topk: int = 0
    """Top-k target log-probabilities stored per row (``topk_ids``/``topk_logprobs``); 0: none."""
    shard_rows: int = 8192
    """Rows per slot (one shard object per array), the writer's buffer per array: any size,
    independent of ``max_seq_len``."""
    rows_per_unit: int = 256
    """Input rows per commit unit."""
    format_version: int = dataclasses.field(default=FORMAT_VERSION, metadata={"in_json": False})
    """The layout the arrays follow (:data:`FORMAT_VERSION`); the header and the manifest record
    it beside the spec, not in it."""

    def __post_init__(self) -> None:
        problems = [f"{name} must be a positive integer, got {getattr(self, name)!r}"
                    for name in ("hidden_size", "num_aux_layers", "max_seq_len", "shard_rows",
                                 "rows_per_unit")
                    if not isinstance(getattr(self, name), int) or getattr(self, name) < 1]
        problems += [f"{name} must be <= {high:,}, got {getattr(self, name):,}"
                     for name, high in SPEC_LIMITS.items()
                     if isinstance(getattr(self, name), int) and getattr(self, name) > high]
        if not isinstance(self.topk, int) or self.topk < 0:
            problems.append(f"topk must be a non-negative integer, got {self.topk!r}")
        if self.hidden_dtype not in STORAGE_DTYPES:
            problems.append(f"hidden_dtype must be one of {sorted(STORAGE_DTYPES)}, "
                            f"got {self.hidden_dtype!r}")
        if self.format_version not in READABLE_VERSIONS:
            problems.append(f"format_version must be one of {list(READABLE_VERSIONS)}, "
                            f"got {self.format_version!r}")
        if self.aux_codec not in AUX_CODECS:
            problems.append(f"aux_codec must be one of {list(AUX_CODECS)}, got {self.aux_codec!r}")
        if not problems and capacity_rows(self) > MAX_ROWS:
            problems.append(f"rows_per_unit * ceil(max_seq_len / shard_rows) * shard_rows = "
                            f"{slots_per_attempt(self) * self.shard_rows} is too large for the "
                            "slot address space")
        if problems:
            raise SparkforgeError("invalid CacheSpec: " + "; ".join(problems))

    def to_json(self) -> dict[str, Any]:
        """The spec as a JSON object (without ``format_version``, stored beside it)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.metadata.get("in_json", True)}


SPEC_KEYS: Final = frozenset({"hidden_size", "num_aux_layers", "hidden_dtype", "max_seq_len",
                             "aux_codec", "topk", "shard_rows", "rows_per_unit"})


def parse_spec(data: object, field: str = "storage.spec", *,
               format_version: int = FORMAT_VERSION) -> CacheSpec:
    """The inverse of :meth:`CacheSpec.to_json`, with absurd sizes rejected; ``format_version``
    is the one recorded beside the spec."""
    d = f.obj(data, field, required=SPEC_KEYS)
    try:
        return dataclasses.replace(_spec(d, field), format_version=format_version)
    except ValueError as exc:
        if isinstance(exc, f.ManifestError):
            raise
        raise f.ManifestError(f"manifest field {field!r}: {exc}") from exc


def _spec(d: Mapping[str, Any], field: str) -> CacheSpec:
    return CacheSpec(
        hidden_size=f.integer(d["hidden_size"], f"{field}.hidden_size", lo=1,
                              hi=SPEC_LIMITS["hidden_size"]),
        num_aux_layers=f.integer(d["num_aux_layers"], f"{field}.num_aux_layers", lo=1,
                                 hi=SPEC_LIMITS["num_aux_layers"]),
        hidden_dtype=f.choice(d["hidden_dtype"], f"{field}.hidden_dtype", get_args(HiddenDtype)),
        max_seq_len=f.integer(d["max_seq_len"], f"{field}.max_seq_len", lo=1,
                              hi=SPEC_LIMITS["max_seq_len"]),
        aux_codec=f.choice(d["aux_codec"], f"{field}.aux_codec", AUX_CODECS),
        topk=f.integer(d["topk"], f"{field}.topk", hi=1024),
        shard_rows=f.integer(d["shard_rows"], f"{field}.shard_rows", lo=1,
                             hi=SPEC_LIMITS["shard_rows"]),
        rows_per_unit=f.integer(d["rows_per_unit"], f"{field}.rows_per_unit", lo=1,
                                hi=SPEC_LIMITS["rows_per_unit"]),
    )


def slots_per_sample(spec: CacheSpec) -> int:
    """The most slots one sample spans: 1 unless ``max_seq_len`` exceeds ``shard_rows``."""
    return -(-spec.max_seq_len // spec.shard_rows)


def slots_per_attempt(spec: CacheSpec) -> int:
    """Upper bound on the slots one attempt needs: every sample starts a slot of its own and
    spans :func:`slots_per_sample` slots (one per input row for any cache whose samples fit
    one slot, so their slot numbers are the ones they always had)."""
    return spec.rows_per_unit * slots_per_sample(spec)


def sample_slots(spec: CacheSpec, row_offset: _IntOrArray, length: _IntOrArray
                 ) -> tuple[_IntOrArray, _IntOrArray]:
    """The first and last slot holding rows ``[row_offset, row_offset + length)``.

    A sample of more than ``shard_rows`` rows runs over consecutive slots of its unit; the
    index records its first slot (``slot``), and every reader derives the rest from here.
    """
    return row_offset // spec.shard_rows, (row_offset + length - 1) // spec.shard_rows


def first_slot(spec: CacheSpec, unit: int, attempt: int) -> int:
    """The first slot of (unit, attempt); attempts of all units own disjoint slot ranges."""
    return (unit * MAX_ATTEMPTS + attempt) * slots_per_attempt(spec)


def capacity_rows(spec: CacheSpec) -> int:
    """Row capacity of every array: all slots of all possible (unit, attempt) pairs."""
    return MAX_UNITS * MAX_ATTEMPTS * slots_per_attempt(spec) * spec.shard_rows


def _flat(spec: CacheSpec) -> bool:
    """Whether slots lie on one row axis (formats 1 and 2; read until sparkforge 0.4.0)."""
    return spec.format_version < 3


def units_per_group(spec: CacheSpec) -> int:
    """Units of one group (formats 3-4): :data:`UNITS_PER_GROUP`, fewer from format 4 where
    their slots could pass :data:`GROUP_SLOTS` (390 at 256 slots per attempt), at least 1."""
    if spec.format_version < 4:
        return UNITS_PER_GROUP
    return max(1, min(UNITS_PER_GROUP, GROUP_SLOTS // slots_per_attempt(spec)))


def unit_group(spec: CacheSpec, unit: int) -> int:
    """The group whose folders hold a unit's slots (formats 3-4) and bookkeeping (format 4)."""
    return unit // units_per_group(spec)


def slots_per_group(spec: CacheSpec) -> int:
    """Formats 3-4: slot ids in one group (every attempt of :func:`units_per_group` units)."""
    return units_per_group(spec) * MAX_ATTEMPTS * slots_per_attempt(spec)


def row_selection(spec: CacheSpec, start: int, stop: int) -> tuple[int | slice, ...]:
    """The zarr selection of rows ``[start, stop)`` inside one slot group (the slots of one
    unit always are), in the absolute row numbers of ``row_offset`` (slot ``s`` holds rows
    ``[s * shard_rows, (s + 1) * shard_rows)``).

    Every array of a cache is indexed through this: the writer, the readers and validate.
    """
    if _flat(spec):
        return (slice(start, stop),)
    group_rows = slots_per_group(spec) * spec.shard_rows
    group = start // group_rows
    return (group, slice(start - group * group_rows, stop - group * group_rows))


def slot_coords(spec: CacheSpec, slot: int) -> tuple[int, ...]:
    """The slot's position on the leading axes of the chunk grid."""
    return (slot,) if _flat(spec) else divmod(slot, slots_per_group(spec))


def array_shape(spec: CacheSpec, a: ArrayLayout) -> tuple[int, ...]:
    """The full shape of one array (unwritten slots cost nothing)."""
    if _flat(spec):
        return (capacity_rows(spec), *a.row_shape)
    groups = -(-MAX_UNITS // units_per_group(spec))
    return (groups, slots_per_group(spec) * spec.shard_rows, *a.row_shape)


def slot_block(spec: CacheSpec, a: ArrayLayout, rows: int | None = None) -> tuple[int, ...]:
    """The block of ``rows`` rows (default: a slot's, i.e. the shard of a sharded array and the
    chunk of the others) in this array's grid."""
    lead = () if _flat(spec) else (1,)
    return (*lead, spec.shard_rows if rows is None else rows, *a.row_shape)


def inner_chunk_rows(row_bytes: int, shard_rows: int) -> int:
    """c: the smallest power of two with c * row_bytes >= 1 MiB, capped to divide shard_rows."""
    rows = 1
    while rows * row_bytes < TARGET_INNER_CHUNK_BYTES:
        rows *= 2
    rows = min(rows, shard_rows)
    while shard_rows % rows:
        rows //= 2
    return rows


LAYERED: Final = ("aux_hidden", "aux_scale")
"""Sample fields whose second axis is the captured layer."""


@dataclass(frozen=True)
class ArrayLayout:
    """One array: trailing shape, stored dtype, logical dtype and whether it is sharded+Blosc.

    ``layer`` is set on the per-layer arrays of format 2: the array holds that position of its
    field's layer axis (``aux_hidden.1`` holds ``aux_hidden[:, 1]``).
    """

    name: str
    row_shape: tuple[int, ...]
    dtype: np.dtype[Any]
    dtype_logical: str
    blosc: bool
    layer: int | None = None

    @property
    def field(self) -> str:
        """The sample field the array stores (all of it, or one layer of it)."""
        return self.name if self.layer is None else self.name.rpartition(".")[0]


def _layered(name: str, row_shape: tuple[int, ...], dtype: np.dtype[Any], logical: str,
             blosc: bool, spec: CacheSpec) -> list[ArrayLayout]:
    """A ``[rows, F, *row_shape]`` field: one array (format 1) or one array per layer."""
    if spec.format_version == 1:  # format-1 reading: dropped in sparkforge 0.3.0
        return [ArrayLayout(name, (spec.num_aux_layers, *row_shape), dtype, logical, blosc)]
    return [ArrayLayout(f"{name}.{k}", row_shape, dtype, logical, blosc, k)
            for k in range(spec.num_aux_layers)]


def array_layouts(spec: CacheSpec) -> dict[str, ArrayLayout]:
    """Every array of a cache with this spec, keyed by name."""
    hidden = STORAGE_DTYPES[spec.hidden_dtype]
    h = spec.hidden_size
    out = [ArrayLayout("input_ids", (), np.dtype(np.int32), "int32", False),
           ArrayLayout("loss_mask", (), np.dtype(np.uint8), "uint8", False)]
    if spec.aux_codec == "fp8":
        out += _layered("aux_hidden", (h,), np.dtype(np.uint8), "float8_e4m3fn", True, spec)
        out += _layered("aux_scale", (), np.dtype(np.float32), "float32", False, spec)
    else:
        out += _layered("aux_hidden", (h,), hidden, spec.hidden_dtype, True, spec)
    out.append(ArrayLayout("final_hidden", (h,), hidden, spec.hidden_dtype, True))
    if spec.topk:
        out += [ArrayLayout("topk_ids", (spec.topk,), np.dtype(np.int32), "int32", False),
                ArrayLayout("topk_logprobs", (spec.topk,), np.dtype(np.float32), "float32", False)]
    return {a.name: a for a in out}


Compressor = BloscCodec | ZstdCodec


def compressor(a: ArrayLayout, spec: CacheSpec) -> Compressor:
    """The codec of one array: Blosc-zstd inside shards for hidden states, zstd-3 otherwise."""
    if not a.blosc:
        return ZstdCodec(level=3)
    row_bytes = a.dtype.itemsize * int(np.prod(a.row_shape, dtype=np.int64))
    chunk = inner_chunk_rows(row_bytes, spec.shard_rows)
    return BloscCodec(cname="zstd", clevel=1,
                      shuffle="noshuffle" if a.dtype.itemsize == 1 else "shuffle",
                      typesize=a.dtype.itemsize,
                      blocksize=min(chunk * row_bytes, TARGET_INNER_CHUNK_BYTES))


def describe_codecs(compressors: Iterable[object], *, sharded: bool) -> str:
    """The codec chain as the manifest records it, e.g. ``sharded blosc zstd-1 shuffle``.

    Finalize describes the codecs the spec implies; validate describes the stored arrays' and
    compares the two strings.
    """
    parts = ["sharded"] if sharded else []
    for c in compressors:
        if isinstance(c, BloscCodec):
            parts.append(f"blosc {c.cname.value}-{c.clevel} {c.shuffle.value}")
        elif isinstance(c, ZstdCodec):
            parts.append(f"zstd-{c.level}")
        else:
            parts.append(type(c).__name__)
    return " ".join(parts)


def create_arrays(group: zarr.Group, spec: CacheSpec) -> None:
    """Create each missing array's metadata (huge capacity; unwritten slots cost nothing).

    Arrays that already exist are kept, so a creation interrupted by a crash can be finished.
    """
    existing = set(group.array_keys())
    for a in array_layouts(spec).values():
        if a.name in existing:
            continue
        attrs: dict[str, Any] = {"dtype_logical": a.dtype_logical}
        common: dict[str, Any] = {"shape": array_shape(spec, a), "dtype": a.dtype,
                                  "compressors": compressor(a, spec), "fill_value": 0,
                                  "attributes": attrs, "config": {"write_empty_chunks": False}}
        if a.blosc:
            row_bytes = a.dtype.itemsize * int(np.prod(a.row_shape, dtype=np.int64))
            chunk = inner_chunk_rows(row_bytes, spec.shard_rows)
            group.create_array(a.name, chunks=slot_block(spec, a, chunk),
                               shards=slot_block(spec, a), **common)
        else:
            group.create_array(a.name, chunks=slot_block(spec, a), **common)


def open_arrays(group: zarr.Group, spec: CacheSpec,
                names: Iterable[str] | None = None) -> dict[str, zarr.Array[Any]]:
    """The spec's arrays in an existing group (only ``names`` when given).

    Raises:
        ValueError: if an array is missing (the store was not created with this spec).
    """
    out = {}
    for name in array_layouts(spec) if names is None else names:
        arr = group.get(name)
        if not isinstance(arr, zarr.Array):
            raise SparkforgeError(
                f"cache store has no array {name!r}; was it created with this spec?")
        out[name] = arr
    return out


def slot_key(name: str, arr: zarr.Array[Any], slot: int, spec: CacheSpec) -> str:
    """The store key of one slot's object (a shard, or the one chunk of an unsharded array)."""
    coords = slot_coords(spec, slot)
    return f"{name}/{arr.metadata.encode_chunk_key((*coords, *[0] * (arr.ndim - len(coords))))}"
