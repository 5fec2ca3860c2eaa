"""Requests sent to S3 (counted at a proxy in front of moto) stay flat as a cache grows, and the
trainer's reads are GETs only, with DataLoader workers that reuse their rank's index."""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import parse_qs, urlsplit

import boto3
import numpy as np
import pytest
from cache_helpers import SMALL_SPEC, make_run_header, make_unit
from s3_proxy import S3Proxy, request_kind

from sparkforge.manifests.finalize import finalize_cache
from sparkforge.manifests.objects import group_listings, object_times, stored_objects
from sparkforge.manifests.open import open_cache
from sparkforge.manifests.status import StatusReader
from sparkforge.manifests.summary import summarize_cache
from sparkforge.manifests.validate import validate_cache
from sparkforge.shared import storage
from sparkforge.shared.layout import array_layouts, attempt_key, commit_key
from sparkforge.shared.writer import CacheWriter
from sparkforge.trainer.datamodule import CacheDataModule

SPEC = dataclasses.replace(SMALL_SPEC, shard_rows=128)
"""Every unit fits one slot, so every commit writes the same objects."""
READ_SPEC = dataclasses.replace(SMALL_SPEC, rows_per_unit=8)
NUM_UNITS = 4


@pytest.fixture
def proxy(moto_server: dict[str, Any]) -> Iterator[S3Proxy]:
    """A counting proxy in front of the session's moto server."""
    p = S3Proxy(moto_server["endpoint"])
    yield p
    p.close()


def _options(moto_server: dict[str, Any], proxy: S3Proxy) -> dict[str, Any]:
    return {**moto_server["storage_options"], "endpoint_url": proxy.endpoint,
            "skip_instance_cache": True}


def _put_directly(moto_server: dict[str, Any], keys: list[str]) -> None:
    """Create empty objects on moto itself, past the proxy (other workers' earlier units)."""
    client = _moto_client(moto_server)
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: client.put_object(Bucket=moto_server["bucket"], Key=k, Body=b""),
                      keys))


def _moto_client(moto_server: dict[str, Any], through: S3Proxy | None = None) -> Any:
    """A boto3 client of moto itself, past the proxy, or ``through`` one."""
    return boto3.client("s3", endpoint_url=through.endpoint if through else moto_server["endpoint"],
                        region_name="us-east-1", aws_access_key_id="testing",
                        aws_secret_access_key="testing")


def _count_calls(monkeypatch: pytest.MonkeyPatch, calls: Counter[str], label: str, owner: Any,
                 name: str) -> None:
    """``calls[label]``: how many times ``owner.name`` is called from now on."""
    original = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[label] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)


def _count_dateutil(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """``calls["dateutil"]``: how many times dateutil parses a time from now on."""
    import dateutil.parser

    calls = Counter[str]()
    _count_calls(monkeypatch, calls, "dateutil", dateutil.parser, "parse")
    return calls


def _count_200_error_checks(monkeypatch: pytest.MonkeyPatch, calls: Counter[str]) -> None:
    """``calls["200 error check"]``: how many bodies botocore parses looking for an error
    inside a 200 answer from now on."""
    import botocore.handlers

    _count_calls(monkeypatch, calls, "200 error check", botocore.handlers,
                 "_looks_like_special_case_error")


def _key(path: str) -> str:
    """The cache key a request path names (``/bucket/root/key``; '' for the root itself)."""
    parts = path.split("?")[0].split("/", 3)
    return parts[3] if len(parts) > 3 else ""


def _commit(writer: CacheWriter, unit: int,
            proxy: S3Proxy) -> tuple[Counter[str], list[tuple[str, str]]]:
    """The requests one ``write_unit`` sends: counts by kind, and (kind, path) of each."""
    proxy.reset()
    writer.write_unit(unit, *make_unit(SPEC, unit))
    log = list(proxy.log)
    return proxy.reset(), log


@pytest.mark.slow
def test_a_commit_sends_the_same_requests_after_a_thousand_earlier_units(
        moto_server: dict[str, Any], proxy: S3Proxy) -> None:
    """Claiming an attempt lists nothing, so 1,001 earlier units' claims (more than one LIST
    page; a full group folder and part of the unit's own) and commit records do not change
    what a commit sends: one GET asking whether the unit is committed, the claim, one PUT per
    slot object and the record; no HEAD, no LIST (zarr's read of a shard before writing it, a
    HEAD and a LIST for an object not there yet, is not sent)."""
    root = uuid.uuid4().hex
    uri = f"s3://{moto_server['bucket']}/{root}"
    writer = CacheWriter.open(uri, spec=SPEC, header=make_run_header(SPEC, num_units=2000),
                              storage_options=_options(moto_server, proxy))
    first, _ = _commit(writer, 1500, proxy)
    _put_directly(moto_server, [f"{root}/{key}" for u in range(1001)
                                for key in (attempt_key(SPEC, u, 0), commit_key(SPEC, u))])
    later, log = _commit(writer, 1501, proxy)
    assert later == first
    assert later == {"GET": 1, "PUT": 2 + 5}  # the claim, the record, one object per array
    assert ("GET", f"/{moto_server['bucket']}/{root}/{commit_key(SPEC, 1501)}") in log
    assert ("PUT", f"/{moto_server['bucket']}/{root}/{attempt_key(SPEC, 1501, 0)}") in log


def test_a_commits_slot_objects_are_sent_a_few_at_a_time_before_its_record(
        moto_server: dict[str, Any], proxy: S3Proxy) -> None:
    """A unit's ten slot objects (two slots of five arrays) go out at most ``max_concurrency``
    at once, its claim beside its commit check, and its record only once every slot object
    is answered: sent one after another, or the record sent with them, this fails."""
    uri = f"s3://{moto_server['bucket']}/{uuid.uuid4().hex}"
    options = _options(moto_server, proxy)
    writer = CacheWriter.open(uri, spec=SMALL_SPEC, header=make_run_header(SMALL_SPEC, num_units=1),
                              storage_options=options, max_concurrency=4)
    samples, accounting = make_unit(SMALL_SPEC, 0, lengths=[16] * 4)
    latency = proxy.latency_s = 0.2  # requests overlap only if sent before others come back
    proxy.reset()
    writer.write_unit(0, samples, accounting)
    spans, top = list(proxy.spans), proxy.max_in_flight
    proxy.latency_s = 0.0
    slots = [start for path, start, _ in spans if "/c/" in path]
    check, record = sorted(start for path, start, _ in spans if "/_commits/" in path)
    claim = next(start for path, start, _ in spans if "/_attempts/" in path)
    assert len(slots) == 2 * len(array_layouts(SMALL_SPEC))
    assert top == 4, top  # ten objects are encoded well within one latency
    # The proxy answers no request before ``latency`` has passed since it came in: the claim
    # was sent before the check was answered, the record after every slot object was.
    assert abs(claim - check) < latency, (claim, check)
    assert record >= max(slots) + latency, (record, slots)
    finalize_cache(uri, expected_units=1, storage_options=options)
    got = open_cache(uri, storage_options=options, verify=True).read_unit(0)
    for have, want in zip(got, samples, strict=True):
        np.testing.assert_array_equal(have.aux_hidden, want.aux_hidden)


@pytest.fixture(scope="module")
def s3_cache(moto_server: dict[str, Any]) -> str:
    """A finalized four-unit cache, written to moto directly."""
    uri = f"s3://{moto_server['bucket']}/{uuid.uuid4().hex}"
    options = moto_server["storage_options"]
    header = make_run_header(READ_SPEC, num_units=NUM_UNITS)
    writer = CacheWriter.open(uri, spec=READ_SPEC, header=header, storage_options=options)
    for unit in range(NUM_UNITS):
        writer.write_unit(unit, *make_unit(READ_SPEC, unit))
    finalize_cache(uri, expected_units=NUM_UNITS, storage_options=options)
    return uri


def test_reading_units_sends_no_existence_request(s3_cache: str, moto_server: dict[str, Any],
                                                  proxy: S3Proxy) -> None:
    """Every unit read is GETs only, one per object: its commit record and each slot object
    whole (no shard index read first, nothing read twice); a missing object is told by the GET
    itself, not by a HEAD before it."""
    reader = open_cache(s3_cache, storage_options=_options(moto_server, proxy))
    proxy.reset()
    samples = sum(len(reader.read_unit(u)) for u in reader.unit_ids().tolist())
    counts = proxy.reset()
    assert samples == len(reader.samples)
    assert counts["HEAD"] == 0
    assert set(counts) == {"GET"}
    assert counts["GET"] == NUM_UNITS + len(reader.slots) * len(array_layouts(READ_SPEC))


def test_a_units_commit_record_is_read_while_its_slots_are(
        s3_cache: str, moto_server: dict[str, Any], proxy: S3Proxy) -> None:
    """A unit's first read sends its commit record's GET beside its slots' GETs, not before
    them: one request latency per unit, so read-ahead hides twice the latency it did."""
    reader = open_cache(s3_cache, storage_options=_options(moto_server, proxy))
    proxy.latency_s = 0.2  # requests overlap only if they are sent before others come back
    proxy.reset()
    reader.read_unit(2)
    spans = list(proxy.spans)
    record = [(start, end) for path, start, end in spans if "/_commits/" in path]
    slots = [(start, end) for path, start, end in spans if "/c/" in path]
    assert len(record) == 1, spans
    assert slots, spans
    # Read one after the other, the record's GET ends before any slot's GET starts.
    (record_start, record_end), = record
    assert any(start < record_end and record_start < end for start, end in slots), spans


def test_loader_workers_reuse_the_ranks_index(s3_cache: str, moto_server: dict[str, Any],
                                              proxy: S3Proxy) -> None:
    """Two forked workers stream the whole train split without reading the manifest or the
    index again: they share the columns their rank loaded and open only their own store (whose
    metadata zarr probes once); no slot object is asked for before it is read."""
    data = CacheDataModule(s3_cache, storage_options=_options(moto_server, proxy),
                           batch_size=2, num_workers=2, shuffle_buffer=4)
    loader = data.train_dataloader()
    proxy.reset()
    ids = [i for batch in loader for i in batch["sample_ids"].tolist()]
    log = list(proxy.log)
    assert len(ids) == len(data.split_index("train")) - len(data.split_index("train")) % 2
    assert not [path for _, path in log if path.endswith(("index.parquet", "manifest.json"))]
    assert not [path for kind, path in log if kind == "HEAD" and "/c/" in path]
    assert [path for kind, path in log if kind == "GET" and "/c/" in path]


@pytest.mark.slow
def test_finalize_and_validate_read_each_object_once_a_few_at_a_time(
        moto_server: dict[str, Any], proxy: S3Proxy) -> None:
    """Each commit record is read with one GET (no HEAD first) by finalize and validate (two by
    --deep: its scan reads them again as it goes instead of holding every sample), and each slot
    object with one GET by --deep, at most ``max_concurrency`` requests at once; validate reads
    index.parquet once (one HEAD and one GET)."""
    uri = f"s3://{moto_server['bucket']}/{uuid.uuid4().hex}"
    options = _options(moto_server, proxy)
    writer = CacheWriter.open(uri, spec=SPEC, header=make_run_header(SPEC, num_units=12),
                              storage_options=options)
    for unit in range(12):
        writer.write_unit(unit, *make_unit(SPEC, unit))
    proxy.latency_s = 0.05  # requests overlap only if they are sent before others come back
    jobs = {"finalize": lambda: finalize_cache(uri, expected_units=12, storage_options=options,
                                               max_concurrency=4),
            "validate": lambda: validate_cache(uri, storage_options=options, max_concurrency=4),
            "deep": lambda: validate_cache(uri, deep=True, storage_options=options,
                                           max_concurrency=4)}
    for name, job in jobs.items():
        proxy.reset()
        result = job()
        reads = Counter((kind, _key(path).split("/")[0]) for kind, path in proxy.log
                        if kind in ("GET", "HEAD"))
        assert reads[("GET", "_commits")] == (24 if name == "deep" else 12), (name, reads)
        assert reads[("HEAD", "_commits")] == 0, (name, reads)
        assert 2 <= proxy.max_in_flight <= 4, name
        if name != "finalize":
            assert result.problems == [], result.problems
            # index.parquet is read once: hashed as it is copied, its rows read from the copy
            assert (reads[("HEAD", "index.parquet")], reads[("GET", "index.parquet")]) == (1, 1)
    data = Counter(_key(path) for kind, path in proxy.log
                   if kind == "GET" and "/c/" in path and "zarr.json" not in path)
    assert len(data) == 12 * 5
    assert set(data.values()) == {1}


def _recursive_lists(log: list[tuple[str, str]]) -> list[str]:
    """The prefix of each LIST without a delimiter (all objects below it), relative to the root."""
    queries = [parse_qs(urlsplit(path).query) for kind, path in log if kind == "LIST"]
    return [q["prefix"][0].split("/", 1)[1] for q in queries if "delimiter" not in q]


def test_finalize_and_inspect_count_objects_a_group_folder_at_a_time(
        s3_cache: str, moto_server: dict[str, Any], proxy: S3Proxy) -> None:
    """finalize's and inspect's object counts list no folder above a group's whole: the top
    folders one level at a time, each group folder (``_commits/0``, ``<array>/c/0``) in one
    listing, and they count every object."""
    options = _options(moto_server, proxy)
    loc = storage.open_location(s3_cache, options)
    loc.fs.rm(loc.path("manifest.json"))  # finalize returns a complete cache's manifest as is
    proxy.reset()
    manifest = finalize_cache(s3_cache, expected_units=NUM_UNITS, storage_options=options)
    finalize_lists = _recursive_lists(list(proxy.log))
    proxy.reset()
    summary = summarize_cache(s3_cache, storage_options=options)
    inspect_lists = _recursive_lists(list(proxy.log))
    for lists in (finalize_lists, inspect_lists):
        assert lists
        assert all(len(p.rstrip("/").split("/")) >= 2 and not p.rstrip("/").endswith("/c")
                   for p in lists), lists
    assert {"_commits/0/", "_attempts/0/", "input_ids/c/0/"} <= set(inspect_lists)
    everything = loc.fs.find(loc.root, detail=True)
    assert summary["objects"] == len(everything)
    assert summary["bytes_on_disk"] == sum(int(i["size"]) for i in everything.values())
    assert 0 < manifest.storage.totals.stored_bytes <= summary["bytes_on_disk"]



def test_status_lists_a_group_folder_at_a_time(s3_cache: str, moto_server: dict[str, Any],
                                               proxy: S3Proxy) -> None:
    """``sparkforge status`` lists the commit records and attempt claims one group folder at a
    time (``_commits/0``, ``_attempts/0``), never ``_commits/`` or ``_attempts/`` whole, and still
    finds every unit and its claim."""
    reader = StatusReader.open(s3_cache, storage_options=_options(moto_server, proxy))
    proxy.reset()
    status = reader.read()
    lists = _recursive_lists(list(proxy.log))
    assert sorted(lists) == ["_attempts/0/", "_commits/0/"], lists
    assert status["units"] == {"total": NUM_UNITS, "committed": NUM_UNITS, "missing": 0,
                               "in_flight": 0}
    assert status["state"] == "finalized"
    assert status["abandoned"] == []


def test_validate_lists_each_arrays_objects_as_one_stream_arrays_side_by_side(
        s3_cache: str, moto_server: dict[str, Any], proxy: S3Proxy) -> None:
    """validate lists each array's ``<array>/c/`` once, as one stream of pages (not a listing
    per group folder), arrays side by side (an array's LIST pages follow one another, the
    arrays need not), as many at once as ``max_concurrency`` allows: with 2, two arrays' LISTs
    are in flight together and never three."""
    proxy.latency_s = 0.05  # requests overlap only if they are sent before others come back
    proxy.reset()
    report = validate_cache(s3_cache, storage_options=_options(moto_server, proxy),
                            max_concurrency=2)
    log, spans = list(proxy.log), list(proxy.spans)
    assert report.problems == [], report.problems
    arrays = sorted(f"{name}/c/" for name in array_layouts(READ_SPEC))
    assert len(arrays) > 2
    assert sorted(_recursive_lists(log)) == arrays
    listings = [(start, end) for path, start, end in spans
                if request_kind("GET", path) == "LIST" and _recursive_lists([("LIST", path)])]
    assert len(listings) == len(arrays)
    assert _most_at_once(listings) == 2, listings


@pytest.mark.slow
def test_one_listing_stream_splits_into_the_group_folders_asked_for(
        moto_server: dict[str, Any], proxy: S3Proxy) -> None:
    """One stream over ``<array>/c/`` of two LIST pages, split into the folders asked for in
    listing order (``1/`` < ``10/`` < ``2/``), holds what listing each folder alone finds:
    across the page boundary, with objects of a folder not asked for and of none between
    them, and an asked folder that is empty."""
    root = uuid.uuid4().hex
    counts = {"1": 500, "10": 100, "2": 450, "5": 50}
    keys = [f"{root}/x/c/{g}/{i}/0" for g, n in counts.items() for i in range(n)]
    _put_directly(moto_server, [*keys, f"{root}/x/c/stray"])
    loc = storage.open_location(f"s3://{moto_server['bucket']}/{root}",
                                _options(moto_server, proxy))
    folders = ["x/c/1", "x/c/10", "x/c/2", "x/c/3"]
    expected = [stored_objects(loc, folder) for folder in folders]
    assert [len(e) for e in expected] == [500, 100, 450, 0]
    proxy.reset()
    assert list(group_listings(loc, "x/c", folders)) == expected
    assert proxy.reset()["LIST"] == 2


def _most_at_once(spans: list[tuple[float, float]]) -> int:
    """Most of the (start, end) spans that overlap at one moment."""
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    running = most = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    return most


@pytest.mark.slow
def test_listed_objects_match_boto3s_listing_and_skip_dateutil(
        moto_server: dict[str, Any], proxy: S3Proxy, monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder of more than one LIST page lists as boto3 lists it (every key, size and
    time), no object's time goes through dateutil, which boto3's own listing calls once per
    object, and no page is parsed a second time by botocore's check for an error inside a 200,
    which boto3's listing runs on every page."""
    root = uuid.uuid4().hex
    keys = [f"{root}/_commits/0/{i:05d}.json" for i in range(1_001)]
    _put_directly(moto_server, keys)
    client = _moto_client(moto_server)
    calls = _count_dateutil(monkeypatch)
    _count_200_error_checks(monkeypatch, calls)
    expected = {obj["Key"].split("/", 1)[1]: (obj["Size"], obj["LastModified"].timestamp())
                for page in client.get_paginator("list_objects_v2").paginate(
                    Bucket=moto_server["bucket"], Prefix=f"{root}/_commits/0/")
                for obj in page["Contents"]}
    assert calls["dateutil"] == len(keys)  # the reference parsed every time through dateutil
    assert calls["200 error check"] == 2  # and checked both pages
    loc = storage.open_location(f"s3://{moto_server['bucket']}/{root}",
                                _options(moto_server, proxy))
    calls.clear()
    proxy.reset()
    sizes, times = stored_objects(loc, "_commits/0"), object_times(loc, "_commits/0")
    assert calls["dateutil"] == calls["200 error check"] == 0
    assert proxy.reset()["LIST"] == 4  # two pages each
    assert {key: (sizes[key], times[key]) for key in sizes} == expected


def test_a_filesystem_connected_before_it_is_opened_checks_pages_once(
        moto_server: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """An s3fs filesystem whose botocore client exists before ``open_location`` meets it (the
    client copied the session's handlers) also lists without botocore's second parse of each
    page."""
    import fsspec

    root = uuid.uuid4().hex
    _put_directly(moto_server, [f"{root}/c/{i}" for i in range(3)])
    fs = fsspec.filesystem("s3", **moto_server["storage_options"], skip_instance_cache=True)
    fs.ls(moto_server["bucket"])  # makes the client
    calls: Counter[str] = Counter()
    _count_200_error_checks(monkeypatch, calls)
    storage._cheaper_responses(fs)
    loc = storage.Location(uri=f"s3://{moto_server['bucket']}/{root}", fs=fs,
                           root=f"{moto_server['bucket']}/{root}", storage_options={})
    assert [key for key, _ in storage.s3_objects(loc, "c")] == ["c/0", "c/1", "c/2"]
    assert calls["200 error check"] == 0


def test_read_many_on_s3_reads_on_the_loop_in_order_a_few_at_a_time(
        moto_server: dict[str, Any], proxy: S3Proxy) -> None:
    """``storage.read_many`` on S3 hands back each key's bytes or error in key order (a missing
    object's FileNotFoundError, an oversized one refused, an empty one as b""), at most
    ``max_concurrency`` requests in flight, no thread per read, and a consumer that stops
    early leaves no more than two batches sent."""
    root = uuid.uuid4().hex
    client = _moto_client(moto_server)
    bodies = {f"o/{i:02d}": f"object {i}".encode() for i in range(30)}
    bodies |= {"o/empty": b"", "o/large": b"x" * 101}
    for key, body in bodies.items():
        client.put_object(Bucket=moto_server["bucket"], Key=f"{root}/{key}", Body=body)
    loc = storage.open_location(f"s3://{moto_server['bucket']}/{root}",
                                _options(moto_server, proxy))
    keys = [*sorted(bodies)[:15], "o/missing", *sorted(bodies)[15:]]
    proxy.latency_s = 0.02  # requests overlap only if they are sent before others come back
    proxy.reset()
    got, threads = [], set()
    for key, result in storage.read_many(loc, keys, max_bytes=100, max_concurrency=4):
        got.append((key, result))
        threads |= {t.name for t in threading.enumerate()}
    assert [key for key, _ in got] == keys
    for key, result in got:
        if key == "o/missing":
            assert isinstance(result, FileNotFoundError), result
        elif key == "o/large":
            assert isinstance(result, storage.ObjectTooLargeError), result
        else:
            assert result == bodies[key], (key, result)
    assert 2 <= proxy.max_in_flight <= 4
    assert not [name for name in threads if name.startswith("read_many")], threads
    proxy.reset()
    reads = storage.read_many(loc, keys, max_concurrency=4)
    assert next(reads)[1] == bodies[keys[0]]
    reads.close()
    time.sleep(0.2)
    assert proxy.reset()["GET"] <= 8


def test_object_reads_skip_dateutil(s3_cache: str, moto_server: dict[str, Any], proxy: S3Proxy,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A GET on S3, ours (:func:`storage.read_bytes`) or the zarr store's (an array's
    objects), parses the response's ``Last-Modified`` header without dateutil, which boto3's
    own GET calls once."""
    import zarr

    calls = _count_dateutil(monkeypatch)
    loc = storage.open_location(s3_cache, _options(moto_server, proxy))
    client = _moto_client(moto_server)
    bucket, key = loc.path("manifest.json").split("/", 1)
    client.get_object(Bucket=bucket, Key=key)["Body"].read()
    assert calls["dateutil"] == 1  # the reference parsed its header through dateutil
    calls.clear()
    proxy.reset()
    assert storage.read_bytes(loc, "manifest.json")
    group = zarr.open_group(storage.zarr_store(loc, read_only=True), mode="r", zarr_format=3)
    ids = group["input_ids"]
    assert isinstance(ids, zarr.Array)
    assert np.asarray(ids[(0,) * ids.ndim]).size == 1
    assert proxy.reset()["GET"] >= 3  # manifest.json, zarr metadata, an input_ids object
    assert calls["dateutil"] == 0


@pytest.mark.parametrize("opener", ["writer", "reader", "deep validate"])
def test_opening_a_cache_probes_no_zarr_v2_metadata(opener: str, s3_cache: str,
                                                   moto_server: dict[str, Any],
                                                   proxy: S3Proxy) -> None:
    """A writer reopening a cache, a reader and ``validate --deep`` ask for zarr v3 metadata
    only: no .zgroup, .zattrs or .zmetadata, and no LIST of a missing one (s3fs asking whether
    it is a folder)."""
    options = _options(moto_server, proxy)
    proxy.reset()
    if opener == "writer":
        CacheWriter.open(s3_cache, spec=READ_SPEC, storage_options=options,
                         header=make_run_header(READ_SPEC, num_units=NUM_UNITS))
    elif opener == "reader":
        open_cache(s3_cache, storage_options=options).read_unit(0)
    else:
        assert validate_cache(s3_cache, storage_options=options, deep=True).valid
    log = list(proxy.log)
    v2 = (".zgroup", ".zattrs", ".zmetadata")
    assert not [path for _, path in log if _key(path).rsplit("/", 1)[-1].startswith(v2)], log
    if opener != "deep validate":  # validate lists the cache's folders on purpose
        assert not [path for kind, path in log if kind == "LIST"], log


def test_the_proxy_replays_a_validate_without_asking_upstream(
        s3_cache: str, moto_server: dict[str, Any], proxy: S3Proxy) -> None:
    """bench_scale's ``--replay`` measures a read job against kept answers: validate once with
    the answers recorded, then a slot object deleted on moto itself; validate replayed gets
    the answers from before (valid, nothing asked upstream), validate forwarded finds the
    object missing."""
    options = _options(moto_server, proxy)
    proxy.record()
    assert validate_cache(s3_cache, storage_options=options).valid
    root = s3_cache.removeprefix(f"s3://{moto_server['bucket']}/")
    client = _moto_client(moto_server)
    victim = next(o["Key"] for o in client.list_objects_v2(
        Bucket=moto_server["bucket"], Prefix=f"{root}/final_hidden/c/")["Contents"])
    client.delete_object(Bucket=moto_server["bucket"], Key=victim)
    proxy.replay()
    proxy.reset()
    replayed = validate_cache(s3_cache, storage_options=options)
    assert replayed.valid, replayed.problems
    assert proxy.replay_misses == 0
    assert proxy.reset()["LIST"] > 0  # the same requests came, answered from memory
    proxy.forward()
    forwarded = validate_cache(s3_cache, storage_options=options)
    assert any(victim.removeprefix(f"{root}/") in p and "is missing" in p
               for p in forwarded.problems), forwarded.problems


def test_the_proxy_keeps_each_byte_range_of_an_object_apart(
        moto_server: dict[str, Any], proxy: S3Proxy) -> None:
    """Two ranged GETs of one object, recorded, then replayed: each gets its own bytes back,
    not the first range's, and nothing is asked upstream."""
    key, bucket = f"ranges-{uuid.uuid4().hex}", moto_server["bucket"]
    _moto_client(moto_server).put_object(Bucket=bucket, Key=key, Body=bytes(range(16)))
    client = _moto_client(moto_server, through=proxy)

    def ranges() -> list[bytes]:
        return [client.get_object(Bucket=bucket, Key=key, Range=r)["Body"].read()
                for r in ("bytes=0-3", "bytes=8-15")]

    proxy.record()
    assert ranges() == [bytes(range(4)), bytes(range(8, 16))]
    proxy.replay()
    proxy.reset()
    assert ranges() == [bytes(range(4)), bytes(range(8, 16))]
    assert proxy.replay_misses == 0
