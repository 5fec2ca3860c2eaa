"""How the cache's bookkeeping scales: finalize, validate, --deep, inspect and a commit at three
cache sizes, on local disk and on S3 (moto behind a proxy that adds latency to every request).

Each size's cache is synthesized: the real writer commits unit 0, whose commit record and slot
objects are then copied to every other unit with shifted ids, so no hidden-state bytes are
computed (one row holds a tiny hidden size). Every job runs in its own process (CPU time and
peak RSS are that process's own); requests are counted at the proxy. The growth exponent is
the least-squares slope of log(cost) over log(samples) across the sizes (1.0: linear).

    .venv/bin/python -P benchmarks/bench_scale.py            (small sizes, as make bench runs it)
    .venv/bin/python -P benchmarks/bench_scale.py --samples 100000 1000000 10000000 --modes local
    .venv/bin/python -P benchmarks/bench_scale.py --old 7fbae68   (also that revision's code,
        by its own copy of this benchmark, and old / new per row)

``--s3rver PATH`` serves S3 with s3rver (``npm install s3rver@3.7.1``; PATH is
``node_modules/.bin/s3rver``) instead of moto: its listing walks only the folders a page
needs, where moto scans the bucket. validate is what it is for (the same requests as on moto,
and every object found). Two of its differences from S3 spoil the other jobs' figures: it
accepts a second ``If-None-Match: *`` PUT (a commit's claim is not exclusive), and a delimiter
listing returns nothing for a folder whose objects lie two folders down (``<array>/c/``), so
finalize counts too few objects and sends too few requests.

``--replay`` runs each read-only job twice on S3: answered by the server (the proxy keeping every
answer), then by the proxy from those answers, the server not asked. The second run meets the
same latency and answers with no server spending CPU on this machine's 2 cores, as a remote
store's servers spend none there: it measures the client alone (``requests not replayed``: 0).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))  # cache_helpers (the run header), s3_proxy, s3_server
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_scale_read (old_code)

ROWS_PER_UNIT, SAMPLE_TOKENS, SAMPLES_PER_SLOT = 256, 4, 32
"""Every unit: 256 samples of 4 tokens, 8 full slots of 32 samples (4 objects each)."""
BUCKET = "bench-scale"


def spec() -> Any:
    """The synthesized caches' spec: 1 aux layer, H=1, slots of 128 rows."""
    from sparkforge.shared.layout import CacheSpec

    return CacheSpec(hidden_size=1, num_aux_layers=1, hidden_dtype="bfloat16",
                     max_seq_len=SAMPLE_TOKENS, shard_rows=SAMPLE_TOKENS * SAMPLES_PER_SLOT,
                     rows_per_unit=ROWS_PER_UNIT)


def unit_samples(unit: int) -> tuple[list[Any], Any]:
    """One unit's samples, alike in every unit but for their ids (so every slot's bytes are)."""
    from sparkforge.shared.records import SampleRecord, UnitAccounting

    t, rows = SAMPLE_TOKENS, range(unit * ROWS_PER_UNIT, (unit + 1) * ROWS_PER_UNIT)
    samples = [SampleRecord(
        sample_id=r, source_row=r, source_hash=f"{r:064x}",
        split="eval" if r % 4 == 0 else "train",
        input_ids=np.arange(1, t + 1, dtype=np.int32), loss_mask=np.ones(t, np.uint8),
        aux_hidden=np.full((t, 1, 1), 0x3F80, np.uint16),
        final_hidden=np.full((t, 1), 0x3F80, np.uint16)) for r in rows]
    return samples, UnitAccounting(input_rows=ROWS_PER_UNIT, written=ROWS_PER_UNIT, skipped={})


def slot_keys(root: Path) -> Callable[[int], dict[str, str]]:
    """slot -> {array name: store key of the slot's object} for the cache at ``root``."""
    import zarr

    from sparkforge.shared.layout import array_layouts, slot_key

    group = zarr.open_group(str(root), mode="r")
    arrays = {name: group[name] for name in array_layouts(spec())}
    return lambda slot: {name: slot_key(name, arr, slot, spec()) for name, arr in arrays.items()}


def synthesize(root: Path, num_units: int, extra: int) -> dict[str, Any]:
    """Units 0..num_units-1: unit 0 by the real writer, the rest copies of its record and objects
    with shifted ids; the header promises ``extra`` units more (the measured commits write
    them, one per latency on S3)."""
    from cache_helpers import make_run_header

    from sparkforge.shared.layout import attempt_key, commit_key, first_slot
    from sparkforge.shared.writer import CacheWriter

    s = spec()
    writer = CacheWriter.open(str(root), spec=s,
                              header=make_run_header(s, num_units=num_units + extra))
    writer.write_unit(0, *unit_samples(0))
    record = json.loads((root / commit_key(s, 0)).read_text())
    keys = slot_keys(root)
    slots0 = [x["slot"] for x in record["slots"]]
    blobs = [{name: (root / key).read_bytes() for name, key in keys(slot).items()}
             for slot in slots0]
    samples = record["samples"]
    slot_index = np.asarray(samples["slot"]) - slots0[0]
    offsets = np.asarray(samples["row_offset"]) - slots0[0] * s.shard_rows
    for unit in range(1, num_units):
        first = first_slot(s, unit, 0)
        ids = np.arange(unit * ROWS_PER_UNIT, (unit + 1) * ROWS_PER_UNIT)
        record.update(unit=unit, slots=[dict(x, slot=first + k)
                                        for k, x in enumerate(record["slots"])])
        samples.update(sample_id=ids.tolist(), source_row=ids.tolist(),
                       source_hash=[f"{r:064x}" for r in ids],
                       slot=(first + slot_index).tolist(),
                       row_offset=(first * s.shard_rows + offsets).tolist(),
                       split=["eval" if r % 4 == 0 else "train" for r in ids])
        _write(root / commit_key(s, unit), json.dumps(record, sort_keys=True).encode())
        _write(root / attempt_key(s, unit, 0), b"")
        for k, blob in enumerate(blobs):
            for name, key in keys(first + k).items():
                _write(root / key, blob[name])
    return {"units": num_units, "slots": num_units * len(slots0),
            "objects": num_units * len(slots0) * len(blobs[0])}


def _write(path: Path, data: bytes) -> None:
    try:
        path.write_bytes(data)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def largest_folder(root: Path) -> tuple[int, str]:
    """The most entries any folder under ``root`` holds, and which folder."""
    best = (0, "")
    for here, dirs, files in os.walk(root):
        best = max(best, (len(dirs) + len(files), os.path.relpath(here, root)))
    return best


class Phase:
    """What a job process knows: the cache, how to reach it, and when its measured part starts."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.uri, self.units, self.extra = args.uri, args.units, args.extra_units
        self.options = json.loads(args.storage_options)
        self.max_concurrency = args.max_concurrency
        self._t0 = (time.perf_counter(), time.process_time())

    def start(self) -> None:
        """Set-up is done: the parent resets the request counts, then the timers start."""
        print("ready", flush=True)
        sys.stdin.readline()
        self._t0 = (time.perf_counter(), time.process_time())

    def elapsed(self) -> dict[str, float]:
        """Wall and CPU seconds since :meth:`start`."""
        return {"wall_s": time.perf_counter() - self._t0[0],
                "cpu_s": time.process_time() - self._t0[1]}

    def kwargs(self, fn: Callable[..., Any]) -> dict[str, Any]:
        """``storage_options`` and (where the job takes it) ``max_concurrency``."""
        import inspect

        out: dict[str, Any] = {"storage_options": self.options}
        if "max_concurrency" in inspect.signature(fn).parameters:
            out["max_concurrency"] = self.max_concurrency
        return out


def job_commit(p: Phase) -> dict[str, Any]:
    """One more unit through the real writer, after ``units`` earlier ones and the commits
    measured before this one (at other latencies)."""
    from cache_helpers import make_run_header

    from sparkforge.shared.writer import CacheWriter

    s = spec()
    writer = CacheWriter.open(p.uri, spec=s, header=make_run_header(s, num_units=p.units + p.extra),
                              storage_options=p.options, max_concurrency=p.max_concurrency)
    unit = p.units + sum(u >= p.units for u in writer.committed_units())
    samples = unit_samples(unit)
    p.start()
    writer.write_unit(unit, *samples)
    return {}


def job_finalize(p: Phase) -> dict[str, Any]:
    """``sparkforge finalize`` over every unit."""
    from sparkforge.manifests.finalize import finalize_cache

    p.start()
    finalize_cache(p.uri, expected_units=p.units + p.extra, **p.kwargs(finalize_cache))
    return {}


def job_manifest(p: Phase) -> dict[str, Any]:
    """Read and parse manifest.json (what every reader does first)."""
    from sparkforge.manifests.open import read_manifest
    from sparkforge.shared import storage

    loc = storage.open_location(p.uri, p.options)
    p.start()
    read_manifest(loc)
    return {"manifest_bytes": len(storage.read_bytes(loc, "manifest.json"))}


def _validate(p: Phase, *, deep: bool) -> dict[str, Any]:
    from sparkforge.manifests.validate import validate_cache

    p.start()
    report = validate_cache(p.uri, deep=deep, **p.kwargs(validate_cache))
    if report.problems:
        raise SystemExit(f"validate found problems: {report.problems[:3]}")
    return {"checked": dict(report.checked)}


def job_validate(p: Phase) -> dict[str, Any]:
    """``sparkforge validate``."""
    return _validate(p, deep=False)


def job_deep(p: Phase) -> dict[str, Any]:
    """``sparkforge validate --deep``."""
    return _validate(p, deep=True)


def job_inspect(p: Phase) -> dict[str, Any]:
    """``sparkforge inspect``."""
    from sparkforge.manifests.summary import summarize_cache

    p.start()
    summarize_cache(p.uri, storage_options=p.options)
    return {}


def job_copy(p: Phase) -> dict[str, Any]:
    """The baseline of --deep: the objects it reads (every committed slot's object of each
    array ``open_arrays`` opens, slot by slot), through the same client and ``read_bytes``, with
    ``max_concurrency`` threads, and nothing else: no commit record, no decoding."""
    from concurrent.futures import ThreadPoolExecutor

    import zarr

    from sparkforge.manifests.open import read_manifest
    from sparkforge.manifests.tables import read_slot_table
    from sparkforge.shared import storage
    from sparkforge.shared.layout import open_arrays, slot_key

    loc = storage.open_location(p.uri, p.options)
    manifest = read_manifest(loc)
    spec = manifest.storage.spec
    # Opened once: opening an array per key sent a metadata GET per object before the copy.
    arrays = open_arrays(zarr.open_group(storage.zarr_store(loc, read_only=True), mode="r"), spec)
    keys = [slot_key(name, arr, slot, spec) for slot in read_slot_table(loc, manifest).slot.tolist()
            for name, arr in arrays.items()]
    p.start()
    with ThreadPoolExecutor(p.max_concurrency) as pool:
        total = sum(map(len, pool.map(lambda key: storage.read_bytes(loc, key), keys)))
    return {"objects": len(keys), "bytes": total}


JOBS: dict[str, Callable[[Phase], dict[str, Any]]] = {
    "commit": job_commit, "finalize": job_finalize, "manifest": job_manifest,
    "validate": job_validate, "deep": job_deep, "inspect": job_inspect, "copy": job_copy}
"""Job name -> what its process runs, in the order they run (each needs the ones before)."""
LABELS = {"commit": "commit of one more unit", "finalize": "finalize",
          "manifest": "read + parse manifest.json", "validate": "validate",
          "deep": "validate --deep", "inspect": "inspect",
          "copy": "plain copy of the slot objects"}


def run_job(args: argparse.Namespace) -> None:
    """In a job process: run it, then print one JSON line (times, peak RSS, what it returned)."""
    phase = Phase(args)
    out = JOBS[args.job](phase)
    out |= phase.elapsed()
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out), flush=True)


def serve_moto(folder: Path) -> None:
    """In the S3 server process: moto's S3 app (``tests/s3_server.py``) with ``folder``'s files
    under ``s3://bench-scale/cache/`` (loaded straight into its backend), its port on stdout,
    until stdin closes."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends
    from s3_server import start_s3_server

    server = start_s3_server()
    backend = s3_backends[DEFAULT_ACCOUNT_ID]["global"]
    backend.create_bucket(BUCKET, "us-east-1")
    for here, _, files in os.walk(folder):
        for name in files:
            path = Path(here, name)
            backend.put_object(BUCKET, f"cache/{path.relative_to(folder).as_posix()}",
                               path.read_bytes())
    print(server.server_address[1], flush=True)
    sys.stdin.read()
    server.shutdown()


@dataclass
class Served:
    """The S3 side of a job: the counting proxy (in this process) and the server's pid."""

    proxy: Any
    server_pid: int


def lone_requests(spans: list[tuple[str, float, float]]) -> int:
    """How many requests overlapped no other (each waited out a whole latency alone)."""
    ordered = sorted((start, end) for _, start, end in spans)
    lone, reach = 0, float("-inf")  # reach: the latest end of the requests started before
    for i, (start, end) in enumerate(ordered):
        after = ordered[i + 1][0] if i + 1 < len(ordered) else float("inf")
        lone += start >= reach and end <= after
        reach = max(reach, end)
    return lone


def run_in_process(job: str, uri: str, units: int, options: dict[str, Any],
                   args: argparse.Namespace, served: Served | None, extra: int) -> dict[str, Any]:
    """Run one job in its own process; on S3 also the requests it sends after its set-up, by
    kind, the most in flight, how many were alone in flight, and the CPU the server and the
    proxy (this process's threads: its main thread only waits) spent on them."""
    cmd = [sys.executable, "-P", __file__, "--job", job, "--uri", uri, "--units", str(units),
           "--storage_options", json.dumps(options), "--max_concurrency",
           str(args.max_concurrency), "--extra_units", str(extra)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None
    assert proc.stdout is not None
    from bench_scale_read import cpu_seconds

    last, server_cpu, proxy_cpu = "", 0.0, 0.0
    for line in proc.stdout:
        if line.strip() == "ready":
            if served is not None:
                served.proxy.reset()
                server_cpu, proxy_cpu = cpu_seconds(served.server_pid), time.process_time()
            proc.stdin.write("go\n")
            proc.stdin.flush()
        else:
            last = line
    if proc.wait():
        raise SystemExit(f"{job} failed at {units} units (exit {proc.returncode})")
    out: dict[str, Any] = json.loads(last)
    if served is not None:
        out["server_cpu_s"] = cpu_seconds(served.server_pid) - server_cpu
        out["proxy_cpu_s"] = time.process_time() - proxy_cpu
        out["max_in_flight"] = served.proxy.max_in_flight
        out["lone_requests"] = lone_requests(served.proxy.spans)
        if served.proxy.replaying:
            out["replay_misses"] = served.proxy.replay_misses
        counts = served.proxy.reset()
        out["requests"] = sum(counts.values())
        out["requests_by_kind"] = dict(counts)
    return out


@contextmanager
def s3_cache(root: Path, s3rver: str | None) -> Iterator[tuple[str, dict[str, Any], Served]]:
    """The synthesized cache served by moto (or s3rver) behind a latency-adding, counting
    proxy."""
    from s3_proxy import S3Proxy
    from s3_server import S3RVER_KEY

    server, port = start_s3rver(root, s3rver) if s3rver else start_moto(root)
    proxy = S3Proxy(f"http://127.0.0.1:{port}")
    key = S3RVER_KEY if s3rver else "testing"  # s3rver knows only its default account
    options = {"key": key, "secret": key, "endpoint_url": proxy.endpoint,
               "client_kwargs": {"region_name": "us-east-1"}}
    try:
        yield f"s3://{BUCKET}/cache", options, Served(proxy, server.pid)
    finally:
        proxy.close()
        if s3rver:
            server.terminate()
        else:
            assert server.stdin is not None
            server.stdin.close()
        server.wait(timeout=60)
        if s3rver:
            shutil.rmtree(s3rver_folder(root))


def start_moto(root: Path) -> tuple[subprocess.Popen[str], int]:
    """moto's S3 app in its own process, ``root``'s files loaded (then removed here)."""
    moto = subprocess.Popen([sys.executable, "-P", __file__, "--serve", str(root)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert moto.stdout is not None
    port = int(moto.stdout.readline())
    shutil.rmtree(root)
    return moto, port


def s3rver_folder(root: Path) -> Path:
    """Where s3rver keeps the objects of the cache synthesized at ``root``."""
    return root.with_name(f"{root.name}-s3rver")


def start_s3rver(root: Path, executable: str) -> tuple[subprocess.Popen[bytes], int]:
    """s3rver serving ``root``'s files, moved into its folder layout first (each object a
    ``._S3rver_object`` file beside its md5 and metadata)."""
    data = s3rver_folder(root)
    for here, _, files in os.walk(root):
        for name in files:
            path = Path(here, name)
            path.with_name(f"{name}._S3rver_object.md5").write_text(
                hashlib.md5(path.read_bytes()).hexdigest())
            path.with_name(f"{name}._S3rver_metadata.json").write_text(
                '{"content-type": "binary/octet-stream"}')
            path.rename(path.with_name(f"{name}._S3rver_object"))
    (data / BUCKET).mkdir(parents=True)
    root.rename(data / BUCKET / "cache")
    from s3_server import start_s3rver as start

    return start(executable, str(data))


def measure(samples: int, mode: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Synthesize one size, then run every job on it in turn."""
    units = math.ceil(samples / ROWS_PER_UNIT)
    extra = len(args.latency_ms) if mode == "s3" else 1  # one commit per latency on S3
    root = workdir / f"cache-{samples}"
    t0 = time.perf_counter()
    synth = subprocess.run([sys.executable, "-P", __file__, "--synthesize", str(root),
                            "--units", str(units), "--extra_units", str(extra)],
                           check=True, capture_output=True, text=True)
    out: dict[str, Any] = json.loads(synth.stdout.splitlines()[-1])
    out["synthesize_s"] = time.perf_counter() - t0
    jobs = [j for j in args.jobs if mode == "s3" or j != "copy"]
    if mode == "local":
        out["jobs"] = {j: run_in_process(j, str(root), units, {}, args, None, extra)
                       for j in jobs}
        out["largest_folder"] = largest_folder(root)
        shutil.rmtree(root)
    else:
        with s3_cache(root, args.s3rver) as (uri, options, served):
            out["jobs"] = {}
            for j in jobs:  # each latency in turn, job by job (a job may need the one before)
                for latency in args.latency_ms[-1:] if j in WRITES else args.latency_ms:
                    served.proxy.latency_s = latency / 1000
                    replay = args.replay and j in READ_ONLY
                    if replay:
                        served.proxy.record()
                    out["jobs"][at(j, latency)] = run_in_process(j, uri, units, options, args,
                                                                 served, extra)
                    if replay:
                        served.proxy.replay()
                        out["jobs"][at(j, latency, replayed=True)] = run_in_process(
                            j, uri, units, options, args, served, extra)
                        served.proxy.forward()
    return out


def exponent(sizes: list[int], values: list[float]) -> str:
    """Least-squares slope of log(value) over log(size); '-' when a value is not positive."""
    if len(sizes) < 2 or min(values) <= 0:
        return "-"
    return f"{np.polyfit(np.log(sizes), np.log(values), 1)[0]:.2f}"


def at(job: str, latency_ms: float, *, replayed: bool = False) -> str:
    """The key of a job's result at one injected latency (answered by the server, or from its
    answers kept by the proxy: ``--replay``)."""
    return f"{job}@{latency_ms:g}" + (REPLAYED if replayed else "")


REPLAYED = "/replayed"
READ_ONLY = ("manifest", "validate", "deep", "inspect", "copy")
"""Jobs that only read: ``--replay`` runs each a second time from the answers the first got."""


WRITES = ("finalize",)
"""Jobs that change the cache: on S3 they run once, at the last latency given (commit runs at
each, writing one more unit each time)."""


def table(mode: str, sizes: list[int], results: list[dict[str, Any]],
          args: argparse.Namespace) -> str:
    """One mode's rows: sizes across, the growth exponent last, labels as wide as the widest."""
    where = ("local disk" if mode == "local" else
             f"S3 ({'s3rver' if args.s3rver else 'moto'}) behind a proxy adding "
             f"{' / '.join(f'{x:g}' for x in args.latency_ms)} ms per request")
    rows: list[tuple[str, str]] = []

    def row(label: str, values: list[float], fmt: str) -> None:
        rows.append((label, "".join(f"{v:>14{fmt}}" for v in values)
                     + f"{exponent(sizes, values):>10}"))

    row("units", [r["units"] for r in results], ",")
    row("slots", [r["slots"] for r in results], ",")
    row("slot objects", [r["objects"] for r in results], ",")
    manifest = next((k for k in results[0]["jobs"] if k.split("@")[0] == "manifest"), None)
    if manifest:
        row("manifest.json bytes", [r["jobs"][manifest]["manifest_bytes"] for r in results],
            ",")
    if mode == "local":
        row("largest folder (entries)", [r["largest_folder"][0] for r in results], ",")
    for key in results[0]["jobs"]:
        job, _, latency = key.partition("@")
        latency, _, replayed = latency.partition("/")
        label = LABELS[job] + (f" at {latency} ms" if latency else "") + (
            ", answers replayed" if replayed else "")
        got = [r["jobs"][key] for r in results]
        for name, field, fmt in (("wall s", "wall_s", ".3f"), ("CPU s", "cpu_s", ".3f"),
                                 ("peak RSS MB", "peak_rss_mb", ".0f"),
                                 ("server CPU s", "server_cpu_s", ".3f"),
                                 ("proxy CPU s", "proxy_cpu_s", ".3f"),
                                 ("requests", "requests", ","),
                                 ("most in flight", "max_in_flight", ","),
                                 ("requests alone in flight", "lone_requests", ","),
                                 ("requests not replayed", "replay_misses", ",")):
            if field in got[0]:
                row(f"{label}: {name}", [g[field] for g in got], fmt)
            if field == "requests" and field in got[0]:
                for kind in sorted({k for g in got for k in g["requests_by_kind"]}):
                    row(f"{label}: {kind} requests",
                        [g["requests_by_kind"].get(kind, 0) for g in got], ",")
    if mode == "s3":
        s3_ratios(results, args, row)
    elif {"deep", "copy"} <= set(results[0]["jobs"]):
        row("validate --deep / plain copy (wall)",
            [r["jobs"]["deep"]["wall_s"] / r["jobs"]["copy"]["wall_s"] for r in results], ".2f")
    width = max(len(label) for label, _ in rows) + 2
    header = f"{'':<{width}}" + "".join(f"{n:>14,}" for n in sizes) + f"{'exponent':>10}"
    return "\n".join([f"{where}; max_concurrency {args.max_concurrency}", header]
                     + [f"{label:<{width}}{values}" for label, values in rows])


def s3_ratios(results: list[dict[str, Any]], args: argparse.Namespace,
              row: Callable[[str, list[float], str], None]) -> None:
    """Wall at the last latency / at the first for each read job, replayed / served, and --deep /
    plain copy at each latency, served and replayed."""
    jobs = results[0]["jobs"]
    first, last = args.latency_ms[0], args.latency_ms[-1]
    for job in JOBS:
        if first != last and at(job, first) in jobs and at(job, last) in jobs:
            row(f"{LABELS[job]}: wall at {last:g} / {first:g} ms",
                [r["jobs"][at(job, last)]["wall_s"] / r["jobs"][at(job, first)]["wall_s"]
                 for r in results], ".2f")
    for job in JOBS:
        for latency in args.latency_ms:
            if at(job, latency, replayed=True) in jobs:
                row(f"{LABELS[job]} at {latency:g} ms: wall replayed / served",
                    [r["jobs"][at(job, latency, replayed=True)]["wall_s"]
                     / r["jobs"][at(job, latency)]["wall_s"] for r in results], ".2f")
    for latency in args.latency_ms:
        for replayed, how in ((False, ""), (True, ", answers replayed")):
            deep, copy = (at(job, latency, replayed=replayed) for job in ("deep", "copy"))
            if deep in jobs and copy in jobs:
                row(f"validate --deep / plain copy at {latency:g} ms (wall{how})",
                    [r["jobs"][deep]["wall_s"] / r["jobs"][copy]["wall_s"] for r in results], ".2f")


def parse_table(text: str) -> dict[str, dict[str, list[float]]]:
    """The rows of every table :func:`table` printed: first line -> label -> values."""
    tables: dict[str, dict[str, list[float]]] = {}
    rows: dict[str, list[float]] = {}
    for line in text.splitlines():
        if line.startswith(("local disk", "S3 (")):
            rows = tables.setdefault(line.split(";")[0], {})
        elif match := re.fullmatch(r"(\S.*?) {2,}([-\d.,]+(?: +[-\d.,]+)*)", line):
            try:
                rows[match[1]] = [float(v.replace(",", "")) for v in match[2].split()[:-1]]
            except ValueError:
                continue
    return tables


def run_old(rev: str, argv: list[str], where: Path) -> str:
    """This benchmark as revision ``rev`` has it, run on that revision's code; its output."""
    from bench_scale_read import old_code

    path = old_code(rev, where)
    env = dict(os.environ, PYTHONPATH=f"{path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    script = where / "tree" / "benchmarks" / "bench_scale.py"
    out = subprocess.run([sys.executable, "-P", str(script), *argv], env=env, check=True,
                         capture_output=True, text=True).stdout
    return out


def ratios(new: str, old: str, rev: str) -> str:
    """old / new for every row both printed (above 1: this code is cheaper)."""
    lines = [f"{rev} / this code, per size (above 1: this code is cheaper)"]
    olds = parse_table(old)
    for where, rows in parse_table(new).items():
        lines.append(where)
        for label, values in rows.items():
            before = olds.get(where, {}).get(label)
            if before and len(before) == len(values) and label not in ("units", "slots",
                                                                         "slot objects"):
                lines.append(f"  {label:<42}" + "".join(
                    f"{b / v:>14.2f}" if v else f"{'-':>14}" for b, v in zip(before, values,
                                                                              strict=True)))
    return "\n".join(lines)


def main() -> int:
    """Parse the flags; run a job, the S3 server or the synthesizer, or the whole benchmark."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, nargs="+", default=[5_000, 20_000, 80_000])
    p.add_argument("--modes", nargs="+", choices=["local", "s3"], default=["local", "s3"])
    p.add_argument("--latency_ms", type=float, nargs="+", default=[30.0],
                   help="on S3, run each read job at each of these latencies per request, in "
                        "order (the ratio of the last to the first is printed)")
    p.add_argument("--max_concurrency", type=int, default=32)
    p.add_argument("--jobs", nargs="+", choices=list(JOBS), default=list(JOBS),
                   help="run only these jobs (each needs the ones before it in this list)")
    p.add_argument("--workdir", help="where the local caches go (default: a temporary folder)")
    p.add_argument("--old", help="also run this git revision's code (its own copy of this file)")
    p.add_argument("--s3rver", metavar="PATH", help="serve S3 with this s3rver executable, not "
                   "moto (see the module docstring)")
    p.add_argument("--replay", action="store_true",
                   help="on S3, run each read-only job a second time with the server's answers "
                        "replayed by the proxy: the latency and the same answers, no server CPU "
                        "on this machine (as a remote store's)")
    p.add_argument("--job", choices=list(JOBS), help=argparse.SUPPRESS)
    p.add_argument("--serve", help=argparse.SUPPRESS)
    p.add_argument("--synthesize", help=argparse.SUPPRESS)
    p.add_argument("--uri", help=argparse.SUPPRESS)
    p.add_argument("--units", type=int, help=argparse.SUPPRESS)
    p.add_argument("--storage_options", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--extra_units", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.job:
        run_job(args)
        return 0
    if args.serve:
        serve_moto(Path(args.serve))
        return 0
    if args.synthesize:
        print(json.dumps(synthesize(Path(args.synthesize), args.units, args.extra_units)))
        return 0
    flags = (["--samples", *map(str, args.samples), "--modes", *args.modes,
              "--latency_ms", *(f"{x:g}" for x in args.latency_ms), "--max_concurrency",
              str(args.max_concurrency)] + ([] if args.jobs == list(JOBS) else
                                            ["--jobs", *args.jobs])
             + (["--s3rver", args.s3rver] if args.s3rver else [])
             + (["--replay"] if args.replay else []))
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        tables = []
        for mode in args.modes:
            results = []
            for n in args.samples:
                results.append(measure(n, mode, args, Path(tmp)))
                print(f"[{mode} {n:,} samples: {results[-1]['synthesize_s']:.0f} s to "
                      "synthesize]", file=sys.stderr, flush=True)
            tables.append(table(mode, args.samples, results, args))
            print(tables[-1], "\n", flush=True)
        if args.old:
            old = run_old(args.old, [*flags, "--workdir", tmp], Path(tmp) / "old")
            print(f"--- {args.old} (its code, by its own benchmarks/bench_scale.py) ---\n{old}")
            print(ratios("\n".join(tables), old, args.old), "\n")
    print("reproduce: .venv/bin/python -P benchmarks/bench_scale.py " + " ".join(flags)
          + (f" --old {args.old}" if args.old else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
