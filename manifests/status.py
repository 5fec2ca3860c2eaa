"""Progress of a cache while it is produced (``sparkforge status``), from its commit records.

Works on a run in progress (no manifest yet) as on a finished one. Units come from the commit
records (``_commits/``), attempts from the attempt claims (``_attempts/``), times from the store's
own object timestamps (the commit record's creation is its unit's commit time), and the unit count
from the run header the producer writes (``producer_config.resolved.num_units``). Worker ``w`` of
``N`` owns the units with ``u % N == w``, the producer's rule.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from typing import Any, Final, Literal

from sparkforge.manifests.finalize import read_run_header
from sparkforge.manifests.objects import MAX_COMMIT_BYTES, existing_location, object_times
from sparkforge.manifests.open import read_manifest
from sparkforge.manifests.schema import ManifestError
from sparkforge.shared import storage
from sparkforge.shared.commit import bookkeeping_folders
from sparkforge.shared.commit_columns import parse_commit_bytes
from sparkforge.shared.errors import SparkforgeError
from sparkforge.shared.header import RunHeader
from sparkforge.shared.layout import (
    ATTEMPTS_PREFIX,
    COMMITS_PREFIX,
    MANIFEST_KEY,
    CacheSpec,
    commit_key,
    parse_commit_name,
)

logger = logging.getLogger(__name__)

DEFAULT_WINDOW_S: Final = 600.0
"""Throughput and ETA use the commits of the last ten minutes before the newest one."""

State = Literal["not_started", "running", "unfinalized", "finalized"]


@dataclass(frozen=True)
class UnitDone:
    """What one commit record says, plus when the store received it."""

    unit: int
    attempt: int
    committed_at: float | None
    samples: int
    tokens: int
    input_rows: int
    skipped: int
    failed: int


@dataclass(frozen=True)
class Attempt:
    """One claimed write attempt of a unit (``_attempts/{group}/unit_U/A``)."""

    unit: int
    attempt: int
    claimed_at: float | None


@dataclass
class StatusReader:
    """Reads a cache's progress; commit records are immutable, so each is parsed only once."""

    loc: storage.Location
    spec: CacheSpec
    num_units: int
    num_workers: int = 1
    window_s: float = DEFAULT_WINDOW_S
    done: dict[int, UnitDone] = field(default_factory=dict)
    max_concurrency: int = storage.DEFAULT_MAX_CONCURRENCY
    """Group folders listed at once."""

    @classmethod
    def open(cls, uri: str, *, num_workers: int = 1, window_s: float = DEFAULT_WINDOW_S,
             storage_options: Mapping[str, Any] | None = None) -> StatusReader:
        """Read the run header (spec and unit count).

        Raises:
            CacheNotFoundError: nothing exists at ``uri``.
            CacheIncompleteError: no run header (not a sparkforge cache, or not started).
            ManifestError: the header is malformed or does not say how many units the run has.
        """
        loc = existing_location(uri, storage_options)
        spec, header = read_run_header(loc)
        return cls(loc, spec, _num_units(loc, header), num_workers, window_s)

    def read(self, *, now: float | None = None) -> dict[str, Any]:
        """The status as a JSON-ready dict (see :func:`status_table` for its fields)."""
        now = datetime.now(UTC).timestamp() if now is None else now
        problems: list[str] = []
        commit_times = {unit: t for k, t in self._times(COMMITS_PREFIX).items()
                        if (unit := _unit_of(k)) is not None}
        self._read_new(commit_times, problems)
        attempts = [a for k, t in self._times(ATTEMPTS_PREFIX).items()
                    if (a := _attempt_of(k, t)) is not None]
        committed = set(commit_times)
        open_attempts = _latest_open(attempts, committed)
        current = {(d.unit, d.attempt) for d in self.done.values()}
        current |= {(a.unit, a.attempt) for a in open_attempts.values()}
        abandoned = sorted((a for a in attempts if (a.unit, a.attempt) not in current),
                           key=lambda a: (a.unit, a.attempt))
        state = self._state(committed, attempts, problems)
        done = [self.done[u] for u in sorted(self.done)]
        missing = self.num_units - len(committed & set(range(self.num_units)))
        return {
            "uri": self.loc.uri, "state": state, "now": _iso(now),
            "units": {"total": self.num_units, "committed": len(committed), "missing": missing,
                      "in_flight": len(open_attempts)},
            "samples": sum(d.samples for d in done), "tokens": sum(d.tokens for d in done),
            "input_rows": sum(d.input_rows for d in done),
            "skipped": sum(d.skipped for d in done), "failed": sum(d.failed for d in done),
            "throughput": _throughput(done, attempts, self.window_s, missing, now),
            "workers": self._workers(committed, open_attempts, now),
            "in_flight": [{"unit": a.unit, "attempt": a.attempt, "claimed_at": _iso(a.claimed_at),
                           "age_s": _age(a.claimed_at, now)} for a in open_attempts.values()],
            "abandoned": [{"unit": a.unit, "attempt": a.attempt, "claimed_at": _iso(a.claimed_at)}
                          for a in abandoned],
            "problems": problems,
        }

    def _times(self, prefix: str) -> dict[str, float | None]:
        """:func:`object_times` of ``prefix``, a group folder at a time (from format 4), up to
        ``max_concurrency`` folders at once: no listing holds more than one group's objects,
        and each is dropped from the filesystem's listing cache once read (one find of
        ``_commits/`` held every unit's details at once)."""
        folders = bookkeeping_folders(self.loc, self.spec, prefix)
        times: dict[str, float | None] = {}
        for folder, found in storage.map_ahead(partial(object_times, self.loc), folders,
                                               max_concurrency=self.max_concurrency,
                                               name="status-listing"):
            times |= found
            self.loc.fs.invalidate_cache(self.loc.path(folder))
        return times

    def _read_new(self, commit_times: Mapping[int, float | None], problems: list[str]) -> None:
        """Parse the commit records not seen before (all in one batched read, each capped)."""
        new = sorted(set(commit_times) - set(self.done))
        paths = {self.loc.path(commit_key(self.spec, u)): u for u in new}
        # Ranged reads: an oversized record costs one byte past the cap, never its whole size.
        raw = (self.loc.fs.cat(list(paths), on_error="return", start=0, end=MAX_COMMIT_BYTES + 1)
               if paths else {})
        for path, data in raw.items():
            unit = paths[path] if path in paths else _unit_of(path.rsplit("/", 1)[-1])
            assert unit is not None, path
            try:
                if isinstance(data, BaseException):
                    raise data
                if len(data) > MAX_COMMIT_BYTES:
                    raise SparkforgeError(f"larger than the {MAX_COMMIT_BYTES:,} bytes allowed")
                info = parse_commit_bytes(data, unit=unit, spec=self.spec)
            except (OSError, ValueError) as exc:
                problems.append(f"unit {unit}: commit record cannot be read: {exc}")
                continue
            acc = info.accounting
            self.done[unit] = UnitDone(unit=unit, attempt=info.attempt,
                                       committed_at=commit_times[unit], samples=len(info.samples),
                                       tokens=info.num_tokens, input_rows=acc.input_rows,
                                       skipped=sum(acc.skipped.values()), failed=acc.failed)

    def _state(self, committed: set[int], attempts: list[Attempt], problems: list[str]) -> State:
        if committed >= set(range(self.num_units)):
            if not storage.exists(self.loc, MANIFEST_KEY):
                return "unfinalized"
            try:
                read_manifest(self.loc)
            except ValueError as exc:
                problems.append(f"manifest: {exc}")
                return "unfinalized"
            return "finalized"
        return "running" if committed or attempts else "not_started"

    def _workers(self, committed: set[int], open_attempts: Mapping[int, Attempt],
                 now: float) -> list[dict[str, Any]]:
        """One row per worker share ``u % N == w``: done, missing, in flight, last commit."""
        rows = []
        for w in range(self.num_workers):
            owned = range(w, self.num_units, self.num_workers)
            mine = [self.done[u] for u in owned if u in self.done]
            missing = [u for u in owned if u not in committed]
            times = [d.committed_at for d in mine if d.committed_at is not None]
            working = [u for u in missing if u in open_attempts]
            rows.append({
                "worker": w, "owned": len(owned), "committed": len(owned) - len(missing),
                "missing": len(missing), "in_flight": working,
                "tokens": sum(d.tokens for d in mine),
                "last_commit_at": _iso(max(times)) if times else None,
                "idle_s": _age(max(times), now) if times else None,
                "state": "done" if not missing else "working" if working else "waiting",
            })
        return rows


def _num_units(loc: storage.Location, header: RunHeader) -> int:
    """The run's unit count: the producer records it in its header; a finalized cache lists it."""
    try:
        return header.num_units
    except ManifestError as exc:
        if storage.exists(loc, MANIFEST_KEY):
            return read_manifest(loc).storage.num_units
        raise ManifestError(f"{loc.uri}: no manifest, so the number of units must come from the "
                            f"run header: {exc}") from exc


def _unit_of(key: str) -> int | None:
    """The unit of a commit record key (``_commits/0/unit_00000012.json``), None for others."""
    return parse_commit_name(key.rsplit("/", 1)[-1])


def _attempt_of(key: str, claimed_at: float | None) -> Attempt | None:
    """The attempt claimed by ``_attempts/{group}/unit_U/A`` (formats 1-3:
    ``_attempts/unit_U/A``), None for any other object."""
    parts = key.split("/")
    unit, attempt = parts[-2:] if len(parts) in (3, 4) else ("", "")
    if not unit.startswith("unit_") or not unit[5:].isdigit() or not attempt.isdigit():
        return None
    return Attempt(int(unit[5:]), int(attempt), claimed_at)


def _latest_open(attempts: list[Attempt], committed: set[int]) -> dict[int, Attempt]:
    """Per uncommitted unit, its newest attempt (being written now, or left by a dead worker)."""
    latest: dict[int, Attempt] = {}
    for a in attempts:
        if a.unit not in committed and (a.unit not in latest or a.attempt > latest[a.unit].attempt):
            latest[a.unit] = a
    return dict(sorted(latest.items()))


def _throughput(done: list[UnitDone], attempts: list[Attempt], window_s: float, missing: int,
                now: float) -> dict[str, Any]:
    """Rates over the whole run and over the window before the newest commit, and the ETA.

    The run starts at the first attempt claim (a unit's commit comes after its capture). The
    ETA divides the missing units by the recent unit rate and counts from the newest commit.
    """
    times = sorted(d.committed_at for d in done if d.committed_at is not None)
    claims = [a.claimed_at for a in attempts if a.claimed_at is not None]
    if not times:
        return {"started_at": _iso(min(claims)) if claims else None, "last_commit_at": None,
                "idle_s": None, "window_s": window_s, "elapsed_s": None, "overall": None,
                "recent": None, "eta_s": None, "eta_at": None}
    start, last = min([*claims, times[0]]), times[-1]
    recent = [d for d in done if d.committed_at is not None and d.committed_at > last - window_s]
    recent_span = min(window_s, last - start)
    rate = _rates(recent, recent_span)
    eta = missing / rate["units_per_s"] if rate and rate["units_per_s"] else None
    return {"started_at": _iso(start), "last_commit_at": _iso(last), "idle_s": _age(last, now),
            "window_s": window_s, "elapsed_s": last - start,
            "overall": _rates(done, last - start), "recent": rate,
            "eta_s": 0.0 if missing == 0 else eta,
            "eta_at": _iso(last + eta) if eta is not None else None}


def _rates(done: list[UnitDone], span_s: float) -> dict[str, float] | None:
    if span_s <= 0:
        return None
    return {"units_per_s": len(done) / span_s,
            "samples_per_s": sum(d.samples for d in done) / span_s,
            "tokens_per_s": sum(d.tokens for d in done) / span_s}


def _iso(t: float | None) -> str | None:
    return None if t is None else datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds")


def _age(t: float | None, now: float) -> float | None:
    return None if t is None else max(0.0, now - t)


def status_table(s: Mapping[str, Any]) -> str:
    """A readable rendering of :meth:`StatusReader.read`."""
    u, tp = s["units"], s["throughput"]
    lines = [
        f"cache        {s['uri']}: {s['state'].upper().replace('_', ' ')} at {s['now']}",
        f"units        {u['committed']:,} / {u['total']:,} committed, {u['missing']:,} missing, "
        f"{u['in_flight']:,} in flight",
        f"samples      {s['samples']:,} of {s['input_rows']:,} input rows (skipped "
        f"{s['skipped']:,}, failed {s['failed']:,})",
        f"tokens       {s['tokens']:,}",
    ]
    if tp["last_commit_at"] is None:
        lines.append("throughput   no unit committed yet")
    else:
        lines += [
            f"throughput   last {_duration(tp['window_s'])}: {_rate_text(tp['recent'])}",
            f"             whole run ({_duration(tp['elapsed_s'])}): {_rate_text(tp['overall'])}",
            f"eta          {_eta_text(tp)}; last commit {_duration(tp['idle_s'])} ago",
        ]
    abandoned = sorted({a["unit"] for a in s["abandoned"]})
    n = len(s["abandoned"])
    lines.append(f"abandoned    {n:,} attempt{'' if n == 1 else 's'}"
                 + (f" (units {_some(abandoned)})" if abandoned else ""))
    ages = {a["unit"]: a["age_s"] for a in s["in_flight"]}
    lines += ["", f"{'worker':>6} {'owned':>8} {'committed':>10} {'missing':>8} "
                  f"{'tokens':>14} {'last commit':>12}  state"]
    for w in s["workers"]:
        idle = f"{_duration(w['idle_s'])} ago" if w["idle_s"] is not None else "-"
        work = "".join(f", unit {u} claimed {_duration(ages[u])} ago" if ages[u] is not None
                       else f", unit {u}" for u in w["in_flight"])
        lines.append(f"{w['worker']:>6} {w['owned']:>8,} {w['committed']:>10,} "
                     f"{w['missing']:>8,} {w['tokens']:>14,} {idle:>12}  {w['state']}{work}")
    lines += [f"problem: {p}" for p in s["problems"]]
    return "\n".join(lines)


def _rate_text(rate: Mapping[str, float] | None) -> str:
    if rate is None:
        return "-"
    return (f"{_num(rate['units_per_s'] * 3600)} units/h, {_num(rate['samples_per_s'])} "
            f"samples/s, {_num(rate['tokens_per_s'])} tokens/s")


def _num(x: float) -> str:
    """Three significant digits or more: ``12,345``, ``12.3``, ``0.123``."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}" if x >= 1 else f"{x:.3f}"


def _eta_text(tp: Mapping[str, Any]) -> str:
    if tp["eta_s"] is None:
        return "unknown (no commit in the window)"
    if tp["eta_s"] == 0:
        return "done"
    return f"{_duration(tp['eta_s'])} after the last commit ({tp['eta_at']})"


def _duration(seconds: float) -> str:
    """``1h 02m``, ``4m 05s`` or ``12s``."""
    total = int(round(seconds))
    h, rest = divmod(total, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}h {m:02d}m" if h else f"{m}m {sec:02d}s" if m else f"{sec}s"


def _some(values: list[int], limit: int = 8) -> str:
    shown = ", ".join(map(str, values[:limit]))
    return shown + (f" and {len(values) - limit} more" if len(values) > limit else "")
