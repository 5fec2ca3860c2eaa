"""How the trainer's read side scales: start-up CPU and memory per process and per DataLoader
worker, epoch planning per rank, and read throughput behind request latency; this code against
an older checkout, run by the same command, as ratios.

Phases, each in its own process (CPU time and peak RSS are that process's own):

- ``startup``: ``CacheDataModule.train_dataloader()`` (manifest, index, split, the per-share batch
  count of ``pack``) and the plans of the rank's worker shares, made before they fork
  (``plans``), on synthesized bookkeeping of N samples (units of 256 samples, one slot each;
  index and manifest only, no slot objects). CPU per sample, peak RSS and the RSS left after
  start-up per sample, with the manifest's own parse timed apart (the manifest is another
  change's). Growth exponent: the least-squares slope of log(cost) over log(N).
- ``plan``: one rank's plans (its 2 worker shares, ``pack``) at several share counts.
- ``workers``: private memory (USS) each of 2 DataLoader workers adds, per sample, on a real
  cache written by the real writer: forked, spawned (columns in shared memory), and spawned with
  that hand-over off (each worker unpickles its copy: the baseline).
- ``throughput``: samples/s of the training loader over one real cache on S3 (moto behind the
  counting proxy of ``tests/s3_proxy.py``), at 0 and 30 ms per request, a warm-up pass left
  out, then 3 passes of each, alternating, in one process: their ratio (overall and pass by
  pass), the requests and the most in flight.

    .venv/bin/python -P benchmarks/bench_scale_read.py --samples 100000 1000000 10000000
    .venv/bin/python -P benchmarks/bench_scale_read.py --old dd1fd3e   (also the old code)
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
sys.path.insert(0, str(TESTS))  # cache_helpers (the run header), s3_proxy, conftest's moto
PER_UNIT, TOKENS = 256, 4
"""Synthesized units: 256 samples of 4 tokens, one slot of 1024 rows."""
SHARE_COUNTS = (8, 64, 512)
THROUGHPUT_UNITS, READ_AHEAD, LATENCIES, PAIRS = 128, 16, (0.0, 0.03), 3
"""The S3 cache of the throughput phase: 128 units, 16 read ahead (112 read after the first
batch), at 0 and 30 ms per request, 3 passes of each, alternating."""
WORKER_STARTS = (("fork", "shared"), ("spawn", "shared"), ("spawn", "unshared"))
"""How the workers start: forked; spawned, the columns handed over in shared memory; spawned,
each unpickling its own copy (the baseline)."""
WORKER_UNITS = (256, 4096)
"""Real caches of 65k and 1M samples (the larger takes ~6 min to write here; ``--work`` keeps
it): a worker's private bytes per sample is the slope."""


def spec() -> Any:
    """The synthesized caches' spec (H=1, one aux layer)."""
    from sparkforge.shared.layout import CacheSpec

    return CacheSpec(hidden_size=1, num_aux_layers=1, hidden_dtype="bfloat16",
                     max_seq_len=TOKENS, shard_rows=PER_UNIT * TOKENS, rows_per_unit=PER_UNIT)


def real_cache(root: Path, num_units: int, *, storage_options: dict[str, Any] | None = None,
               uri: str | None = None) -> str:
    """A finalized cache of ``num_units`` units written by the real writer."""
    from cache_helpers import make_run_header

    from sparkforge.manifests.finalize import finalize_cache
    from sparkforge.shared.records import SampleRecord, UnitAccounting
    from sparkforge.shared.writer import CacheWriter

    uri = uri or str(root)
    writer = CacheWriter.open(uri, spec=spec(), header=make_run_header(spec(), num_units=num_units),
                              storage_options=storage_options)
    for unit in range(num_units):
        rows = range(unit * PER_UNIT, (unit + 1) * PER_UNIT)
        samples = [SampleRecord(
            sample_id=r, source_row=r, source_hash=f"{r:064x}",
            split="eval" if r % 4 == 0 else "train",
            input_ids=np.arange(1, TOKENS + 1, dtype=np.int32), loss_mask=np.ones(TOKENS, np.uint8),
            aux_hidden=np.full((TOKENS, 1, 1), 0x3F80, np.uint16),
            final_hidden=np.full((TOKENS, 1), 0x3F80, np.uint16)) for r in rows]
        writer.write_unit(unit, samples, UnitAccounting(input_rows=PER_UNIT, written=PER_UNIT,
                                                        skipped={}))
    finalize_cache(uri, expected_units=num_units, storage_options=storage_options)
    return uri


def synthesize(root: Path, num_samples: int) -> str:
    """Bookkeeping of ``num_samples`` samples: a one-unit real cache whose manifest and index
    are widened to ``num_samples / 256`` units (no slot object but unit 0's)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from sparkforge.manifests.index import INDEX_SCHEMA
    from sparkforge.shared.layout import first_slot

    real_cache(root, 1)
    num_units = num_samples // PER_UNIT
    manifest = json.loads((root / "manifest.json").read_text())
    storage = manifest["storage"]
    s = spec()
    widen_tables(root, manifest, num_units, first_slot(s, 1, 0))
    n = num_units * PER_UNIT
    for key in ("samples", "tokens", "logical_bytes"):
        storage["totals"][key] *= num_units
    for key in ("input_rows", "written", "failed"):
        manifest["accounting"][key] *= num_units
    ids = np.arange(n, dtype=np.int64)
    unit = ids // PER_UNIT
    slot = unit * first_slot(s, 1, 0)  # each unit's first slot (attempt 0)
    digits = np.frombuffer(b"0123456789abcdef", np.uint8)
    hashes = digits[np.random.default_rng(0).integers(16, size=(n, 64))].view("S64")[:, 0]
    table = pa.table({
        "sample_id": ids, "unit": unit, "slot": slot,
        "row_offset": slot * s.shard_rows + (ids % PER_UNIT) * TOKENS,
        "length": np.full(n, TOKENS, np.int32), "num_loss_tokens": np.full(n, TOKENS, np.int32),
        "source_row": ids, "source_hash": pa.array(hashes, pa.binary()).cast(pa.string()),
        "split": np.where(ids % 4 == 0, "eval", "train")}, schema=INDEX_SCHEMA)
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", row_group_size=256 * 1024)
    (root / "index.parquet").write_bytes(buf.getvalue())
    storage["index_sha256"] = hashlib.sha256(buf.getvalue()).hexdigest()
    (root / "manifest.json").write_text(json.dumps(manifest))
    return str(root)


def widen_tables(root: Path, manifest: dict[str, Any], num_units: int, unit_slots: int) -> None:
    """Unit 0's rows of units.parquet and slots.parquet repeated for ``num_units`` units (unit
    ``u``'s slots ``u * unit_slots`` later), the manifest's references re-sealed."""
    import dataclasses

    from sparkforge.manifests.schema import CacheManifest
    from sparkforge.manifests.tables import read_tables, slot_table_bytes, unit_table_bytes
    from sparkforge.shared import storage as st
    from sparkforge.shared.cache_tables import SlotColumns

    units, slots = read_tables(st.open_location(str(root)), CacheManifest.from_json(manifest))
    ids = np.arange(num_units)
    wide_units = dataclasses.replace(
        units, **{f.name: np.repeat(getattr(units, f.name), num_units)
                  for f in dataclasses.fields(units) if f.name not in ("unit", "skipped")},
        unit=ids, skipped={k: np.repeat(v, num_units) for k, v in units.skipped.items()})
    wide_slots = SlotColumns.from_columns(
        unit=np.repeat(ids, len(slots)), slot=(ids[:, None] * unit_slots + slots.slot).ravel(),
        num_rows=np.tile(slots.num_rows, num_units), crc32c=np.tile(slots.crc32c, (num_units, 1)),
        arrays=slots.arrays)
    for field, raw, rows in (("unit_table", unit_table_bytes(wide_units), num_units),
                             ("slot_table", slot_table_bytes(wide_slots), len(wide_slots))):
        ref = manifest["storage"][field]
        (root / ref["key"]).write_bytes(raw)
        ref |= {"sha256": hashlib.sha256(raw).hexdigest(), "num_rows": rows}


def rss_bytes() -> int:
    """This process's resident set now."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM: ``ru_maxrss`` would carry over the peak of the
    benchmark process this one was started from)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def private_bytes(pid: int) -> int:
    """A process's private (unshared) resident bytes."""
    fields = dict(line.split(":", 1) for line in
                  Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:])
    return sum(int(fields[k].split()[0]) * 1024 for k in ("Private_Clean", "Private_Dirty"))


def private_shm_bytes(pid: int) -> int:
    """The part of :func:`private_bytes` in shared-memory files: pages of a /dev/shm block that
    only this process has touched so far (a worker reading its own share), not copies."""
    total, in_shm = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        name, _, rest = line.partition(":")
        if "-" in name and " " in line and not name.isalpha():  # a mapping's header line
            in_shm = "/dev/shm/" in line
        elif in_shm and name in ("Private_Clean", "Private_Dirty"):
            total += int(rest.split()[0]) * 1024
    return total


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def data_module(uri: str, **kw: Any) -> Any:
    """The training data module as ``sparkforge train`` builds it (``pack``, 2 workers)."""
    from sparkforge.trainer.datamodule import CacheDataModule

    return CacheDataModule(uri, **{"batch_size": 8, "batching": "pack", "max_seq_len": 64,
                                   "num_workers": 2, **kw})


def phase_startup(uri: str) -> dict[str, Any]:
    """Train start-up on one rank: the loader and its length, nothing read from slots."""
    import sparkforge.trainer.datamodule  # noqa: F401 (imports are not start-up)
    from sparkforge.manifests.open import read_manifest
    from sparkforge.shared import storage

    base, cpu = rss_bytes(), time.process_time()
    read_manifest(storage.open_location(uri))
    manifest_s = time.process_time() - cpu
    base, cpu = rss_bytes(), time.process_time()
    dm = data_module(uri)
    loader = dm.train_dataloader()
    length = len(loader)
    before_plans = time.process_time()
    # This code plans its workers' shares in the rank before they fork (older code: in each
    # worker, so not here).
    prepare = getattr(loader.stream, "prepare", None)
    if prepare is not None:
        prepare()
    peak = peak_rss_bytes()
    return {"cpu_s": time.process_time() - cpu, "manifest_cpu_s": manifest_s,
            "plans_cpu_s": time.process_time() - before_plans,
            "rss_added": rss_bytes() - base, "batches": length, "peak_rss_added": peak - base}


def phase_plan(uri: str, num_shares: int) -> dict[str, Any]:
    """CPU of one rank's two worker-share plans (and the shared batch count) out of
    ``num_shares``."""
    dm = data_module(uri)
    index = dm.split_index("train")
    stream = dm.train_dataloader().stream
    stream.world_size = num_shares // 2
    stream._packed_batches = None
    cpu = time.process_time()
    len(stream)
    plans = [stream.plan(share) for share in (0, 1)]
    return {"cpu_s": time.process_time() - cpu, "samples": len(index),
            "planned": sum(int(_plan_size(p)) for p in plans)}


def _plan_size(plan: Any) -> int:
    """Samples in a plan, whichever form it has (this code's columns, or a list of batches)."""
    positions = getattr(plan, "positions", None)
    return int(positions.size) if positions is not None else sum(b.size for b in plan.batches)


def phase_workers(uri: str, start_method: str = "fork", shared: str = "shared"
                  ) -> dict[str, Any]:
    """Private bytes each of two DataLoader workers holds once it yielded a batch (outside
    shared-memory blocks, which only the first to touch a page holds alone), started by
    ``start_method``; ``unshared``: spawned workers unpickle private copies of the columns
    (this code with its shared-memory hand-over turned off, the baseline)."""
    if shared == "unshared":
        from sparkforge.trainer import worker_memory

        worker_memory.MIN_SHARED_BYTES = 1 << 62  # type: ignore[misc]
    dm = data_module(uri, **({} if start_method == "fork" else {"start_method": start_method}))
    loader = dm.train_dataloader()
    batches = iter(loader)
    next(batches)
    next(batches)
    children = Path(f"/proc/self/task/{os.getpid()}/children").read_text().split()
    workers = [int(pid) for pid in children if _is_loader_worker(int(pid))]
    return {"worker_private": [private_bytes(pid) - private_shm_bytes(pid) for pid in workers],
            "worker_private_shm": [private_shm_bytes(pid) for pid in workers],
            "samples": len(dm.split_index("train"))}


def _is_loader_worker(pid: int) -> bool:
    """Whether child ``pid`` is a DataLoader worker (not forkserver's server or spawn's
    resource tracker)."""
    command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return not any(b"forkserver" in part or b"resource_tracker" in part for part in command)


def phase_throughput(num_units: int) -> dict[str, Any]:
    """Training-loader samples/s from one S3 cache behind 0 and 30 ms per request: one
    warm-up pass, left out, then each latency read PAIRS times, alternating (each pass timed
    after its first batch, once the read-ahead is full); ``ratios`` pairs each 30 ms pass with
    the 0 ms pass before it."""
    import uuid

    from conftest import moto_server

    server = moto_server.__wrapped__()
    moto = next(server)
    (moto["pid"],) = map(int, Path(f"/proc/self/task/{os.getpid()}/children").read_text().split())
    try:
        uri = f"s3://{moto['bucket']}/{uuid.uuid4().hex}"
        real_cache(Path(), num_units, storage_options=moto["storage_options"], uri=uri)
        runs: dict[str, list[dict[str, Any]]] = {str(lat): [] for lat in LATENCIES}
        _read_through_proxy(uri, moto, LATENCIES[0])
        for lat in LATENCIES * PAIRS:
            runs[str(lat)].append(_read_through_proxy(uri, moto, lat))
        rates = {lat: [r["samples_per_s"] for r in rs] for lat, rs in runs.items()}
        first = rates[str(LATENCIES[0])]
        return {lat: {"ratios": [b / a for a, b in zip(first, rates[lat], strict=True)],
                      "samples_per_s": float(np.mean([r["samples_per_s"] for r in rs])),
                      "cpu_us": float(np.mean([r["cpu_us"] for r in rs])),
                      "server_cpu_us": float(np.mean([r["server_cpu_us"] for r in rs])),
                      "requests": rs[-1]["requests"],
                      "max_in_flight": max(r["max_in_flight"] for r in rs)}
                for lat, rs in runs.items()}
    finally:
        next(server, None)


def _read_through_proxy(uri: str, moto: dict[str, Any], latency_s: float) -> dict[str, Any]:
    """One pass of the training loader over the S3 cache behind a fresh latency proxy."""
    from s3_proxy import S3Proxy

    proxy = S3Proxy(moto["endpoint"], latency_s=latency_s)
    options = {**moto["storage_options"], "endpoint_url": proxy.endpoint,
               "config_kwargs": {"max_pool_connections": 64}}
    dm = data_module(uri, storage_options=options, num_workers=0,
                     read_ahead_units=READ_AHEAD, batching="bucket")
    batches = iter(dm.train_dataloader())
    next(batches)
    proxy.reset()
    start, samples = (time.perf_counter(), time.process_time(), cpu_seconds(moto["pid"])), 0
    for batch in batches:
        samples += batch["sample_ids"].numel()
    wall = time.perf_counter() - start[0]
    cpu, server = time.process_time() - start[1], cpu_seconds(moto["pid"]) - start[2]
    in_flight = proxy.max_in_flight
    counts = proxy.reset()
    proxy.close()
    return {"samples_per_s": samples / wall, "cpu_us": cpu / samples * 1e6,
            "server_cpu_us": server / samples * 1e6, "requests": dict(counts),
            "max_in_flight": in_flight}


def run_phase(argv: list[str], code: Path | None) -> dict[str, Any]:
    """One phase in a fresh interpreter (``code``: an older checkout's packages first)."""
    env = dict(os.environ)
    if code is not None:
        env["PYTHONPATH"] = f"{code}{os.pathsep}{env.get('PYTHONPATH', '')}"
    out = subprocess.run([sys.executable, "-P", __file__, "--phase", *argv], env=env,
                         capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"phase {argv} failed:\n{out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def old_code(rev: str, where: Path) -> Path:
    """A folder whose ``sparkforge`` package is the tree of revision ``rev`` (for PYTHONPATH)."""
    tree = where / "tree"
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    package = where / "path" / "sparkforge"
    package.mkdir(parents=True)
    for name, folder in (("shared", "shared"), ("manifests", "manifests"),
                         ("trainer", "trainer"), ("producer", "producer"),
                         ("app", "shared/app"), ("api", "shared/api")):
        (package / name).symlink_to(tree / folder)
    return where / "path"


def slope(sizes: list[int], costs: list[float]) -> float:
    """Least-squares slope of log(cost) over log(size)."""
    x, y = np.log(sizes), np.log(np.maximum(costs, 1e-12))
    return float(np.polyfit(x, y, 1)[0])


def measure(sizes: list[int], code: Path | None, work: Path) -> dict[str, Any]:
    """Every phase for one code version."""
    out: dict[str, Any] = {"startup": {}, "plan": {}}
    for n in sizes:
        uri = str(work / f"synth-{n}")
        if not Path(uri).exists():
            synthesize(Path(uri), n)
        out["startup"][n] = run_phase(["startup", uri], code)
        out["plan"][n] = {k: run_phase(["plan", uri, str(k)], code) for k in SHARE_COUNTS}
    out["workers"] = {start: {} for start in WORKER_STARTS if code is None or start[0] == "fork"}
    for units in WORKER_UNITS:
        uri = str(work / f"real-{units}")
        if not Path(uri).exists():
            real_cache(Path(uri), units)
        for start in out["workers"]:
            out["workers"][start][units] = run_phase(["workers", uri, *start], code)
    out["throughput"] = run_phase(["throughput", str(THROUGHPUT_UNITS)], code)
    return out


def table(name: str, res: dict[str, Any], sizes: list[int]) -> list[str]:
    """Readable lines of one code version's results."""
    lines = [f"== {name}", f"{'samples':>10} {'start cpu us/s':>15} {'plans us/s':>11} "
             f"{'manifest us/s':>14} "
             f"{'rss B/s':>8} {'peak +B/s':>13} "
             + " ".join(f"{'plan@' + str(k) + ' us/s':>14}" for k in SHARE_COUNTS)]
    for n in sizes:
        s, p = res["startup"][n], res["plan"][n]
        lines.append(f"{n:>10,} {s['cpu_s'] / n * 1e6:>15.2f} "
                     f"{s.get('plans_cpu_s', 0.0) / n * 1e6:>11.2f} "
                     f"{s['manifest_cpu_s'] / n * 1e6:>14.2f} "
                     f"{s['rss_added'] / n:>8.0f} {s['peak_rss_added'] / n:>13.0f} "
                     + " ".join(f"{p[k]['cpu_s'] / n * 1e6:>14.3f}" for k in SHARE_COUNTS))
    if len(sizes) > 1:
        cpu = [res["startup"][n]["cpu_s"] for n in sizes]
        rss = [res["startup"][n]["rss_added"] for n in sizes]
        plan = [res["plan"][n][SHARE_COUNTS[0]]["cpu_s"] for n in sizes]
        lines.append(f"growth exponent: start-up cpu {slope(sizes, cpu):.3f}, rss "
                     f"{slope(sizes, rss):.3f}, plan {slope(sizes, plan):.3f}")
        for a, b in zip(sizes, sizes[1:], strict=False):
            lines.append(f"marginal {a:,} -> {b:,}: start-up cpu "
                         f"{(cpu[sizes.index(b)] - cpu[sizes.index(a)]) / (b - a) * 1e6:.2f} us, "
                         f"rss {(rss[sizes.index(b)] - rss[sizes.index(a)]) / (b - a):.0f} B "
                         "per sample")
    for start, sizes_of in res["workers"].items():
        small, big = (sizes_of[u] for u in WORKER_UNITS)
        extra = [(b - a) / (big["samples"] - small["samples"])
                 for a, b in zip(small["worker_private"], big["worker_private"], strict=True)]
        shm = [(b - a) / (big["samples"] - small["samples"]) for a, b in
               zip(small.get("worker_private_shm", []), big.get("worker_private_shm", []),
                   strict=True)]
        lines.append(f"each DataLoader worker's private bytes ({' '.join(start)}): "
                     f"{small['worker_private']} at {small['samples']:,} train samples, "
                     f"{big['worker_private']} at {big['samples']:,}: "
                     f"{', '.join(f'{e:.0f}' for e in extra)} B per sample (besides "
                     f"{', '.join(f'{e:.0f}' for e in shm) or 'no'} B of shared-memory pages "
                     "only it touched)")
    rate = {lat: t["samples_per_s"] for lat, t in res["throughput"].items()}
    for lat, t in res["throughput"].items():
        lines.append(f"S3 at {float(lat) * 1000:.0f} ms/request: {t['samples_per_s']:,.0f} "
                     f"samples/s ({t['samples_per_s'] / rate[str(LATENCIES[0])]:.2f}x of 0 ms, "
                     f"pass by pass {min(t.get('ratios', [0])):.2f}-"
                     f"{max(t.get('ratios', [0])):.2f}x; "
                     f"CPU per sample: reader and proxy {t.get('cpu_us', 0):.0f} us, moto "
                     f"{t.get('server_cpu_us', 0):.0f} us), "
                     f"requests {t['requests']}, at most {t['max_in_flight']} in flight")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--old", default=None, help="also measure this git revision")
    parser.add_argument("--work", type=Path, default=None,
                        help="keep the synthesized caches here (reused by the next run)")
    parser.add_argument("--phase", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.phase:
        name, *rest = args.phase
        result = {"startup": lambda: phase_startup(rest[0]),
                  "plan": lambda: phase_plan(rest[0], int(rest[1])),
                  "workers": lambda: phase_workers(*rest),
                  "throughput": lambda: phase_throughput(int(rest[0]))}[name]()
        print(json.dumps(result))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        results = {"this code": measure(args.samples, None, work)}
        if args.old:
            results[args.old] = measure(args.samples, old_code(args.old, Path(tmp) / "old"),
                                        work)
    for name, res in results.items():
        print("\n".join(table(name, res, args.samples)))
    if args.old:
        new, old = results["this code"], results[args.old]
        for n in args.samples:
            ratio = {key: old["startup"][n][key] / max(new["startup"][n][key], 1e-9)
                     for key in ("cpu_s", "rss_added", "peak_rss_added")}
            top = SHARE_COUNTS[-1]
            plan = old["plan"][n][top]["cpu_s"] / new["plan"][n][top]["cpu_s"]
            print(f"{n:>10,}: old/new start-up cpu {ratio['cpu_s']:.1f}x, rss added "
                  f"{ratio['rss_added']:.1f}x, peak rss {ratio['peak_rss_added']:.1f}x, plan at "
                  f"{top} shares {plan:.1f}x")
    print(f"reproduce: .venv/bin/python -P benchmarks/bench_scale_read.py --samples "
          f"{' '.join(map(str, args.samples))}" + (f" --old {args.old}" if args.old else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
