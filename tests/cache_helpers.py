"""Test helpers for cache tests: a valid run header and deterministic synthetic samples."""

from __future__ import annotations

import dataclasses
import hashlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from zarr.storage import WrapperStore

from sparkforge.shared import storage
from sparkforge.shared.header import RunHeader
from sparkforge.shared.layout import CacheSpec, commit_key
from sparkforge.shared.records import SampleRecord, UnitAccounting
from sparkforge.shared.writer import float_to_storage

if TYPE_CHECKING:  # pyarrow comes with it: the writer's benchmarks measure RSS without it
    from sparkforge.shared.cache_tables import SlotColumns

SMALL_SPEC = CacheSpec(hidden_size=16, num_aux_layers=2, hidden_dtype="bfloat16", max_seq_len=16,
                       shard_rows=32, rows_per_unit=5)
"""A tiny lossless bf16 spec: 3 units of 5 rows (4 written, 1 skipped) pack into 6 slots."""
SMALL_FP8_SPEC = dataclasses.replace(SMALL_SPEC, aux_codec="fp8", topk=2)


class CountingStore(WrapperStore):  # type: ignore[type-arg]
    """A zarr store that counts the bytes its reads return (shard indexes and chunk ranges),
    per array (the key's first part)."""

    def __init__(self, store: Any) -> None:
        super().__init__(store)
        self.bytes_by_array: Counter[str] = Counter()

    @property
    def bytes_read(self) -> int:
        """Bytes returned by every get()."""
        return sum(self.bytes_by_array.values())

    async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
        buf = await super().get(key, prototype, byte_range)
        self.bytes_by_array[key.split("/")[0]] += 0 if buf is None else len(buf)
        return buf


@contextmanager
def counting_reads() -> Iterator[list[CountingStore]]:
    """Every zarr store sparkforge opens inside the block, wrapped in a :class:`CountingStore`."""
    real, opened = storage.zarr_store, []

    def counted(loc: storage.Location, *, read_only: bool) -> CountingStore:
        opened.append(CountingStore(real(loc, read_only=read_only)))
        return opened[-1]

    storage.zarr_store = counted  # type: ignore[assignment]
    try:
        yield opened
    finally:
        storage.zarr_store = real  # type: ignore[assignment]


def build_cache(path: Path, spec: CacheSpec = SMALL_SPEC, units: int = 3,
                header: dict[str, Any] | None = None,
                target_files: dict[str, bytes] | None = None) -> Path:
    """A finalized cache of ``make_unit`` samples written by the real writer (``header``: a
    :func:`make_header` result to use instead of the default one; ``target_files``: stored
    under ``target/``, e.g. a ``config.json``)."""
    from sparkforge.manifests.finalize import finalize_cache
    from sparkforge.shared.writer import CacheWriter

    run_header = (make_run_header(spec, num_units=units) if header is None
                  else RunHeader.from_json(header))
    w = CacheWriter.open(str(path), spec=spec, header=run_header)
    if target_files:
        w.write_target_files(target_files)
    for u in range(units):
        w.write_unit(u, *make_unit(spec, u))
    finalize_cache(str(path), expected_units=units)
    return path


def make_header(spec: CacheSpec, *, num_hidden_layers: int = 4,
                num_units: int | None = None) -> dict[str, Any]:
    """A run header consistent with ``spec`` (layer ids 1..F); with ``num_units``, it promises
    that many units and their input rows, as the producer's header does."""
    config: dict[str, Any] = {"model": "tiny", "batch_size": 4}
    if num_units is not None:
        config["resolved"] = {"num_units": num_units,
                              "num_rows": num_units * spec.rows_per_unit}
    return {
        "producer_config": config,
        "target": {"name_or_path": "tiny-qwen3", "revision": None, "content_hash": "ab" * 32,
                   "model_type": "qwen3", "architecture": "Qwen3ForCausalLM", "vocab_size": 1024,
                   "hidden_size": spec.hidden_size, "num_hidden_layers": num_hidden_layers,
                   "dtype": "bfloat16", "quantization": None},
        "capture": {"layer_ids": list(range(1, spec.num_aux_layers + 1)),
                    "layer_id_convention": "hf_hidden_states_index", "features": "residual",
                    "final_hidden": "post_norm", "engine": "hf", "engine_version": "5.19.0",
                    "tensor_parallel_size": 1,
                    "expert_parallel": False, "data_parallel_size": 1,
                    "max_seq_len": spec.max_seq_len, "embedding_scale": 1.0,
                    "final_logit_softcapping": None},
        "tokenizer": {"hash": "cd" * 32, "chat_template_sha256": "ef" * 32},
        "data": {"sources": [{"uri": "memory://chat.jsonl", "content_hash": "01" * 32}],
                 "eval_fraction": 0.25, "seed": 0, "regeneration": []},
    }


def make_run_header(spec: CacheSpec, *, num_units: int | None = None) -> RunHeader:
    """:func:`make_header`, typed as the writer takes it."""
    return RunHeader.from_json(make_header(spec, num_units=num_units))


def make_unit(spec: CacheSpec, unit: int, *, seed: int = 0, skip_every: int = 5,
              lengths: Sequence[int] | None = None) -> tuple[list[SampleRecord], UnitAccounting]:
    """Deterministic samples for every input row of ``unit`` (every ``skip_every``-th skipped),
    of random lengths, or of ``lengths`` in turn."""
    samples = []
    rows = range(unit * spec.rows_per_unit, (unit + 1) * spec.rows_per_unit)
    for row in rows:
        if row % skip_every == skip_every - 1:
            continue
        rng = np.random.default_rng([seed, row])
        t = int(rng.integers(1, spec.max_seq_len + 1))
        if lengths is not None:
            t = lengths[len(samples)]
        scale = rng.uniform(0.5, 8.0, size=(t, 1, 1)).astype(np.float32)
        aux = rng.standard_normal((t, spec.num_aux_layers, spec.hidden_size)).astype(np.float32)
        final = rng.standard_normal((t, spec.hidden_size)).astype(np.float32)
        topk = spec.topk > 0
        samples.append(SampleRecord(
            sample_id=row, source_row=row,
            source_hash=hashlib.sha256(str(row).encode()).hexdigest(),
            split="eval" if row % 4 == 0 else "train",
            input_ids=rng.integers(0, 1024, t).astype(np.int32),
            loss_mask=(rng.random(t) < 0.6).astype(np.uint8),
            aux_hidden=float_to_storage(aux * scale, spec.hidden_dtype),
            final_hidden=float_to_storage(final, spec.hidden_dtype),
            topk_ids=rng.integers(0, 1024, (t, spec.topk)).astype(np.int32) if topk else None,
            topk_logprobs=-rng.random((t, spec.topk)).astype(np.float32) if topk else None))
    skipped = spec.rows_per_unit - len(samples)
    return samples, UnitAccounting(input_rows=spec.rows_per_unit, written=len(samples),
                                   skipped={"too_long": skipped} if skipped else {})


TINY_LAYER_IDS = (1, 3)
"""HF hidden_states indices captured by the tiny caches (DSpark feature ids 0 and 2)."""


def write_tiny_cache(uri: str, target_dir: Path, *, hidden_dtype: str = "bfloat16",
                     num_rows: int = 16, rows_per_unit: int = 4, max_seq_len: int = 96,
                     layer_ids: tuple[int, ...] = TINY_LAYER_IDS,
                     storage_options: dict[str, Any] | None = None, seed: int = 0,
                     shard_rows: int | None = None) -> str:
    """Write and finalize a cache of chat samples whose hidden states come from HF ``forward``
    (``shard_rows`` below ``max_seq_len``: samples span slots; default one slot each).

    Every 4th row is in the eval split. Returns ``uri``.
    """
    import random

    import torch
    from safetensors.torch import save
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from sparkforge.app.tiny_text import synthetic_corpus
    from sparkforge.manifests.finalize import finalize_cache
    from sparkforge.shared.writer import CacheWriter

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    model = Qwen3ForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    cfg = model.config
    spec = CacheSpec(hidden_size=cfg.hidden_size, num_aux_layers=len(layer_ids),
                     hidden_dtype=hidden_dtype, max_seq_len=max_seq_len,  # type: ignore[arg-type]
                     shard_rows=shard_rows or max(256, max_seq_len),
                     rows_per_unit=rows_per_unit)
    header = {
        "producer_config": {"builder": "tests/conftest.py::write_tiny_cache", "seed": seed,
                            # the producer's promise, which validate and train hold a cache to
                            "resolved": {"num_units": num_rows // rows_per_unit,
                                         "num_rows": num_rows}},
        "target": {"name_or_path": str(target_dir), "revision": None, "content_hash": "ab" * 32,
                   "model_type": "qwen3", "architecture": "Qwen3ForCausalLM",
                   "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
                   "num_hidden_layers": cfg.num_hidden_layers, "dtype": "float32",
                   "quantization": None},
        "capture": {"layer_ids": list(layer_ids), "layer_id_convention": "hf_hidden_states_index",
                    "final_hidden": "post_norm", "engine": "hf", "engine_version": "5.19.0",
                    "tensor_parallel_size": 1, "expert_parallel": False, "data_parallel_size": 1,
                    "max_seq_len": max_seq_len},
        "tokenizer": {"hash": "cd" * 32, "chat_template_sha256": "ef" * 32},
        "data": {"sources": [{"uri": "memory://synthetic", "content_hash": "01" * 32}],
                 "eval_fraction": 0.25, "seed": seed},
    }
    writer = CacheWriter.open(uri, spec=spec, header=RunHeader.from_json(header),
                              storage_options=storage_options)
    state = model.state_dict()
    writer.write_target_files({
        "config.json": (target_dir / "config.json").read_bytes(),
        "weights.safetensors": save({"embed_tokens.weight": state["model.embed_tokens.weight"],
                                     "lm_head.weight": state["lm_head.weight"],
                                     "norm.weight": state["model.norm.weight"]}),
    })
    lines, rng = synthetic_corpus(4 * num_rows, seed=seed), random.Random(seed)
    for unit in range(num_rows // rows_per_unit):
        samples = []
        for row in range(unit * rows_per_unit, (unit + 1) * rows_per_unit):
            reply = " ".join(lines[4 * row + 1: 4 * row + 1 + rng.randint(1, 3)])
            enc = tok.apply_chat_template(
                [{"role": "user", "content": lines[4 * row]},
                 {"role": "assistant", "content": reply}],
                tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            ids = torch.tensor(enc["input_ids"][:max_seq_len])
            with torch.no_grad():
                hs = model(ids[None], output_hidden_states=True).hidden_states
            aux = torch.stack([hs[i][0] for i in layer_ids], dim=1).numpy()
            samples.append(SampleRecord(
                sample_id=row, source_row=row,
                source_hash=hashlib.sha256(reply.encode()).hexdigest(),
                split="eval" if row % 4 == 3 else "train", input_ids=ids.numpy().astype(np.int32),
                loss_mask=np.asarray(enc["assistant_masks"][:max_seq_len], dtype=np.uint8),
                aux_hidden=float_to_storage(aux, hidden_dtype),
                final_hidden=float_to_storage(hs[-1][0].numpy(), hidden_dtype)))
        writer.write_unit(unit, samples, UnitAccounting(input_rows=rows_per_unit,
                                                        written=len(samples)))
    finalize_cache(uri, expected_units=num_rows // rows_per_unit, storage_options=storage_options)
    return uri


def cache_spec(cache: Path) -> CacheSpec:
    """The spec of a finalized local cache, from its manifest."""
    from sparkforge.manifests.open import read_manifest

    return read_manifest(storage.open_location(str(cache))).storage.spec


def unit_slots(cache: Path, unit: int) -> list[int]:
    """The slots of one unit, in order, as the cache's slot table lists them."""
    from sparkforge.manifests.open import read_manifest
    from sparkforge.manifests.tables import read_slot_table

    loc = storage.open_location(str(cache))
    slots = read_slot_table(loc, read_manifest(loc))
    return slots.slot[slots.of_unit(unit)].tolist()


def slot_object(cache: Path, name: str, slot: int) -> Path:
    """The file holding one slot of array ``name`` (``c/{group}/{slot in group}/...``)."""
    import zarr

    from sparkforge.shared.layout import slot_key

    arr = zarr.open_array(str(cache / name), mode="r")
    return cache / slot_key(name, arr, slot, cache_spec(cache))


def reseal_slot_table(cache: Path, edit: Callable[[SlotColumns], None]) -> None:
    """Edit the slot rows in place, rewrite the slot table and re-seal the manifest's sha256 of
    it, so only the checks after the digest can object."""
    import json

    from sparkforge.manifests.open import read_manifest
    from sparkforge.manifests.tables import read_slot_table, slot_table_bytes

    loc = storage.open_location(str(cache))
    slots = read_slot_table(loc, read_manifest(loc))
    edit(slots)
    raw = slot_table_bytes(slots)
    manifest = json.loads((cache / "manifest.json").read_text())
    ref = manifest["storage"]["slot_table"]
    (cache / ref["key"]).write_bytes(raw)
    ref["sha256"] = hashlib.sha256(raw).hexdigest()
    (cache / "manifest.json").write_text(json.dumps(manifest))


def forge_rows(cache: Path, name: str, row: int, values: np.ndarray) -> None:
    """Overwrite rows of one array and re-seal the slot's crc32c in its commit record and the
    slot table, as a producer writing bad values would (the checksums then match the bad data)."""
    import json

    import zarr

    from sparkforge.shared.commit import checksum
    from sparkforge.shared.layout import row_selection

    spec = cache_spec(cache)
    arr = zarr.open_group(str(cache), mode="r+")[name]
    arr[row_selection(spec, row, row + len(values))] = values
    slot = row // spec.shard_rows

    def edit(slots: SlotColumns) -> None:
        k = int(np.flatnonzero(slots.slot == slot)[0])
        start = slot * spec.shard_rows
        used = row_selection(spec, start, start + int(slots.num_rows[k]))
        crc = checksum(np.asarray(arr[used]))
        slots.crc32c[k, slots.arrays.index(name)] = crc
        path = cache / commit_key(spec, int(slots.unit[k]))
        record = json.loads(path.read_text())
        next(s for s in record["slots"] if s["slot"] == slot)["crc32c"][name] = crc
        path.write_text(json.dumps(record))

    reseal_slot_table(cache, edit)
