"""Summarise a finalized cache (``sparkforge inspect``): target, sizes, codecs, splits, skips."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Mapping
from typing import Any

import numpy as np

from sparkforge.manifests.objects import (
    escaping_links,
    existing_location,
    group_folder,
    irregular_objects,
    object_totals,
    slot_folders,
    stored_objects,
)
from sparkforge.manifests.open import read_manifest, read_samples
from sparkforge.manifests.plan import human_bytes
from sparkforge.manifests.schema import CacheManifest
from sparkforge.manifests.tables import read_slot_table
from sparkforge.shared import storage
from sparkforge.shared.cache_tables import SPLITS, SampleColumns
from sparkforge.shared.layer_ids import default_feature_ids, hf_to_feature
from sparkforge.shared.layout import array_layouts, slot_key
from sparkforge.shared.reader import read_arrays


def summarize_cache(uri: str, *,
                    storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The numbers ``sparkforge inspect`` shows, as a JSON-ready dict.

    ``accounting.image_rows`` counts the written samples that are image rows (None: a cache whose
    commit records predate the count).

    ``compression_ratio`` is the logical bytes of the committed rows (stored dtypes) over the bytes
    of the shard objects holding them; ``bytes_on_disk`` counts every object under the root,
    including slots of abandoned attempts (``unreferenced_bytes``).

    Raises:
        CacheNotFoundError: if nothing exists at ``uri``.
        CacheIncompleteError, ManifestError: as ``open_cache``.
        UnsafeKeyError, IrregularObjectError: a link out of the root or a special file under it.
    """
    loc = existing_location(uri, storage_options)
    _refuse_foreign_objects(loc)
    m = read_manifest(loc)
    index = read_samples(loc, m)
    splits = _split_counts(index)
    spec = m.storage.spec
    arrays, unreferenced = _array_bytes(loc, m)
    num_objects, on_disk = object_totals(loc, spec)
    tokens, data_bytes = m.storage.totals.tokens, sum(a["stored_bytes"] for a in arrays.values())
    logical = sum(a["logical_bytes"] for a in arrays.values())
    t, c = m.target, m.capture
    return {
        "uri": uri, "complete": m.complete, "created_at": m.created_at,
        "target": {"name_or_path": t.name_or_path, "model_type": t.model_type,
                   "architecture": t.architecture, "hidden_size": t.hidden_size,
                   "num_hidden_layers": t.num_hidden_layers, "vocab_size": t.vocab_size,
                   "dtype": t.dtype},
        "layers": {"layer_ids": list(c.layer_ids),
                   "dspark_feature_ids": list(hf_to_feature(c.layer_ids)),
                   "features": c.features, "final_hidden": c.final_hidden},
        "engine": f"{c.engine} {c.engine_version}", "max_seq_len": c.max_seq_len,
        "hidden_dtype": spec.hidden_dtype, "aux_codec": spec.aux_codec, "topk": spec.topk,
        "units": m.storage.num_units,
        "shards": m.storage.num_slots,
        "samples": m.storage.totals.samples, "tokens": tokens,
        "splits": {k: dict(v) for k, v in sorted(splits.items())},
        "accounting": {"input_rows": m.accounting.input_rows, "written": m.accounting.written,
                       "image_rows": m.accounting.image_rows,
                       "skipped": dict(sorted(m.accounting.skipped.items())),
                       "failed": m.accounting.failed},
        "objects": num_objects, "bytes_on_disk": on_disk,
        "bytes_per_token": on_disk / tokens if tokens else None,
        "logical_bytes": logical, "data_bytes": data_bytes, "unreferenced_bytes": unreferenced,
        "compression_ratio": logical / data_bytes if data_bytes else None,
        "arrays": arrays, "warnings": _warnings(arrays),
        "feeds": drafts_fed(m),
        "mix": mix_accounting(m, index),
        "datasets": [{"uri": src.uri, **dataclasses.asdict(src.hf_dataset)}
                     for src in m.data.sources if src.hf_dataset is not None],
    }


def _refuse_foreign_objects(loc: storage.Location) -> None:
    """Links out of a local root and special files make every number below wrong (they are left
    out of the listing): refuse, naming the first, as the readers do."""
    links, irregular = escaping_links(loc), irregular_objects(loc)
    if links:
        key, target = next(iter(links.items()))
        raise storage.UnsafeKeyError(f"{key}: a link to {target}, outside the cache root, and "
                                     f"{len(links) - 1} more; refusing to summarise the cache")
    if irregular:
        key, kind = next(iter(irregular.items()))
        raise storage.IrregularObjectError(f"{key}: {kind}, not a regular file, and "
                                           f"{len(irregular) - 1} more; refusing to summarise "
                                           "the cache")


def mix_accounting(m: CacheManifest, index: SampleColumns) -> list[dict[str, Any]] | None:
    """Per mix entry: its weight, rows held and drawn, samples written (and the share of the
    cache's samples and tokens), rows skipped. None when the cache was not made from a mix."""
    if m.data.mix is None:
        return None
    ids, lengths = index.sample_id, index.length.astype(np.int64)
    total_samples, total_tokens = max(len(ids), 1), max(int(lengths.sum()), 1)
    out = []
    for entry in m.data.mix:
        mine = (ids >= entry.first_sample) & (ids < entry.first_sample + entry.rows)
        written, tokens = int(mine.sum()), int(lengths[mine].sum())
        out.append({"name": entry.name, "data": entry.data, "weight": entry.weight,
                    "source_rows": entry.source_rows, "rows": entry.rows, "written": written,
                    "skipped_or_failed": entry.rows - written, "tokens": tokens,
                    "sample_share": written / total_samples, "token_share": tokens / total_tokens})
    return out


def _mix_lines(mix: list[Mapping[str, Any]] | None) -> list[str]:
    if not mix:
        return []
    total_weight = sum(e["weight"] for e in mix)
    lines = ["", f"{'mix source':<24} {'weight':>7} {'held':>9} {'drawn':>9} {'written':>9} "
             f"{'skipped':>8} {'samples':>8} {'tokens':>8}"]
    lines += [f"{e['name'][-24:]:<24} {e['weight'] / total_weight:>7.3f} {e['source_rows']:>9,} "
              f"{e['rows']:>9,} {e['written']:>9,} {e['skipped_or_failed']:>8,} "
              f"{e['sample_share']:>8.3f} {e['token_share']:>8.3f}" for e in mix]
    return lines


def drafts_fed(m: CacheManifest) -> dict[str, Any]:
    """Which drafts this cache can train: any subset of its features, with these target fields.

    ``default_feature_counts`` lists the n for which the n default draft ids (the rule both the
    producer and the trainer use when no ids are given) are all held.
    """
    t, c = m.target, m.capture
    held = set(hf_to_feature(c.layer_ids))
    defaults = {n: set(default_feature_ids(t.num_hidden_layers, n))
                for n in range(1, len(held) + 1)}
    return {
        "target_layer_ids_subset_of": sorted(held),
        "default_feature_counts": [n for n, ids in defaults.items()
                                   if len(ids) == n and ids <= held],
        "hidden_size": t.hidden_size, "num_target_layers": t.num_hidden_layers,
        "vocab_size": t.vocab_size, "final_hidden": c.final_hidden,
        "topk": m.storage.spec.topk,
    }


def _array_bytes(loc: storage.Location,
                 m: CacheManifest) -> tuple[dict[str, dict[str, Any]], int]:
    """Per array: codec, logical and stored bytes of committed slots; plus unreferenced bytes
    (slot objects no committed slot names). Listed one slot group folder at a time."""
    spec = m.storage.spec
    zarrays = read_arrays(loc, spec)
    slots = read_slot_table(loc, m)
    ids = slots.slot.tolist()
    arrays: dict[str, dict[str, Any]] = {}
    unreferenced = 0
    for name, layout in array_layouts(spec).items():
        stored = missing = 0
        for rows in slot_folders(slots, spec):
            keys = [slot_key(name, zarrays[name], ids[i], spec) for i in range(rows.start,
                                                                              rows.stop)]
            objects = stored_objects(loc, group_folder(name, keys[0], spec))
            stored += sum(objects.get(k, 0) for k in keys)
            missing += sum(k not in objects for k in keys)
        unreferenced += object_totals(loc, m.storage.spec, f"{name}/c")[1] - stored
        logical = m.storage.totals.tokens * layout.dtype.itemsize * math.prod(layout.row_shape)
        arrays[name] = {"codec": m.storage.codecs[name], "logical_bytes": logical,
                        "stored_bytes": stored, "ratio": logical / stored if stored else None,
                        "missing_objects": missing, "objects": len(slots)}
    return arrays, unreferenced


def _warnings(arrays: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Missing slot objects: the ratios above count only the objects present, so they inflate."""
    return [f"{name}: {a['missing_objects']} of {a['objects']} committed slot objects are "
            "missing, so its ratio (and the total) is inflated; run `sparkforge validate`"
            for name, a in arrays.items() if a["missing_objects"]]


def _split_counts(index: SampleColumns) -> dict[str, Counter[str]]:
    """Samples, tokens and loss tokens per split, from the index columns."""
    splits: dict[str, Counter[str]] = {}
    for code, name in enumerate(SPLITS):
        mine = index.split == code
        if mine.any():
            splits[name] = Counter(samples=int(mine.sum()),
                                   tokens=int(index.length[mine].sum(dtype=np.int64)),
                                   loss_tokens=int(index.num_loss_tokens[mine].sum(dtype=np.int64)))
    return splits


def _feeds_line(f: Mapping[str, Any]) -> str:
    counts = ", ".join(map(str, f["default_feature_counts"])) or "none"
    topk = f"top-{f['topk']} logprobs" if f["topk"] else "no top-k"
    return (f"feeds drafts    target_layer_ids any subset of {f['target_layer_ids_subset_of']} "
            f"(default ids held for n = {counts}), hidden_size {f['hidden_size']}, "
            f"num_target_layers {f['num_target_layers']}, vocab {f['vocab_size']:,}; final "
            f"{f['final_hidden']}, {topk}")


def summary_table(s: Mapping[str, Any]) -> str:
    """A readable rendering of :func:`summarize_cache`."""
    t, layers = s["target"], s["layers"]
    ratio = f"{s['compression_ratio']:.3f}" if s["compression_ratio"] else "-"
    per_token = f"{s['bytes_per_token']:,.0f}" if s["bytes_per_token"] else "-"
    skipped = ", ".join(f"{k} {v:,}" for k, v in s["accounting"]["skipped"].items()) or "none"
    image_rows = s["accounting"]["image_rows"]
    lines = [
        f"cache           {s['uri']} ({'complete' if s['complete'] else 'INCOMPLETE'}, "
        f"{s['created_at']})",
        f"target          {t['name_or_path']} ({t['model_type']}, {t['architecture']}, "
        f"H={t['hidden_size']}, {t['num_hidden_layers']} layers, vocab {t['vocab_size']:,})",
        f"layers          hidden_states {layers['layer_ids']} (DSpark ids "
        f"{layers['dspark_feature_ids']}, {layers['features']}) + final "
        f"{layers['final_hidden']}",
        _feeds_line(s["feeds"]),
        f"engine          {s['engine']}, max_seq_len {s['max_seq_len']:,}",
        f"samples         {s['samples']:,} in {s['units']:,} units / {s['shards']:,} shards",
        f"tokens          {s['tokens']:,}",
        f"bytes on disk   {human_bytes(s['bytes_on_disk'])} in {s['objects']:,} objects "
        f"({human_bytes(s['unreferenced_bytes'])} unreferenced)",
        f"bytes/token     {per_token}",
        f"compression     {ratio} ({human_bytes(s['logical_bytes'])} logical -> "
        f"{human_bytes(s['data_bytes'])} stored), {s['hidden_dtype']}, aux {s['aux_codec']}",
        f"accounting      {s['accounting']['input_rows']:,} input rows: "
        f"{s['accounting']['written']:,} written"
        f"{f' ({image_rows:,} image rows)' if image_rows else ''}, skipped {skipped}, "
        f"failed {s['accounting']['failed']:,}",
        "",
        f"{'split':<8} {'samples':>10} {'tokens':>14} {'loss tokens':>14}",
    ]
    for name, v in s["splits"].items():
        lines.append(f"{name:<8} {v['samples']:>10,} {v['tokens']:>14,} {v['loss_tokens']:>14,}")
    lines += ["", f"{'array':<14} {'codec':<30} {'logical':>10} {'stored':>10} {'ratio':>6}"]
    for name, a in s["arrays"].items():
        r = f"{a['ratio']:.3f}" if a["ratio"] else "-"
        lines.append(f"{name:<14} {a['codec']:<30} {human_bytes(a['logical_bytes']):>10} "
                     f"{human_bytes(a['stored_bytes']):>10} {r:>6}")
    lines += _mix_lines(s["mix"])
    lines += [f"dataset         {d['name']} split {d['split']}, revision {d['revision'] or '-'}, "
              f"fingerprint {d['fingerprint']}" for d in s["datasets"]]
    lines += [f"WARNING: {w}" for w in s["warnings"]]
    return "\n".join(lines)
