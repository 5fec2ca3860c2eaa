"""``sparkforge validate | inspect | plan | finalize | status``: judge, summarise, size, finalize
or follow a cache.

No torch needed. Each command parses its arguments into a config and runs one job function;
``sparkforge.app.cli`` maps the outcome to the exit code. A cache path that does not exist, an
unreadable ``--against`` config or bad ``--storage_options`` JSON is a usage error (2): the
command was pointed at nothing to judge. A path that exists but holds no complete, consistent
cache is invalid (1).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from sparkforge.manifests.contract import RunContract
from sparkforge.manifests.finalize import finalize_run
from sparkforge.manifests.no_samples import require_samples
from sparkforge.manifests.objects import CacheNotFoundError
from sparkforge.manifests.open import cache_target_config
from sparkforge.manifests.plan import plan_cache, plan_table, target_shape_from_config
from sparkforge.manifests.plan_layers import capture_ids
from sparkforge.manifests.status import DEFAULT_WINDOW_S, StatusReader, status_table
from sparkforge.manifests.summary import summarize_cache, summary_table
from sparkforge.manifests.validate import MAX_PROBLEM_CHARS, validate_cache
from sparkforge.shared.dtypes import HiddenDtype
from sparkforge.shared.errors import ConfigError
from sparkforge.shared.fields import shorten
from sparkforge.shared.layer_ids import hf_to_feature
from sparkforge.shared.layout import CacheSpec
from sparkforge.shared.storage import DEFAULT_MAX_CONCURRENCY


class UsageError(ConfigError):
    """A bad command line (exit code 2)."""


@dataclass(frozen=True, kw_only=True)
class ValidateConfig:
    """``sparkforge validate`` (options documented by its parser)."""

    cache: str
    json: bool = False
    storage_options: str = "{}"
    deep: bool = False
    against: str | None = None
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY


@dataclass(frozen=True, kw_only=True)
class InspectConfig:
    """``sparkforge inspect`` (options documented by its parser)."""

    cache: str
    json: bool = False
    storage_options: str = "{}"


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """``sparkforge plan`` (options documented by its parser)."""

    num_tokens: int
    target_config: str | None = None
    hidden_size: int | None = None
    layer_ids: str | None = None
    num_aux_layers: int | None = None
    layer_stride: int | None = None
    layer_start: int = 1
    aux_codec: Literal["lossless", "fp8"] = "lossless"
    hidden_dtype: HiddenDtype | None = None
    mean_seq_len: float = 1024.0
    topk: int = 0
    shard_rows: int = 8192
    rows_per_unit: int = 64
    tokens_per_s: float | None = None
    against: str | None = None
    json: bool = False


@dataclass(frozen=True, kw_only=True)
class StatusConfig:
    """``sparkforge status`` (options documented by its parser)."""

    cache: str
    json: bool = False
    storage_options: str = "{}"
    num_workers: int = 1
    window_s: float = DEFAULT_WINDOW_S
    watch: float = 0.0


@dataclass(frozen=True, kw_only=True)
class FinalizeConfig:
    """``sparkforge finalize``: write the manifest once every unit is committed."""

    output: str
    """Cache URI."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options for ``output``."""
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    """Commit records read at once (object stores answer each in tens of milliseconds)."""


def _parser(command: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"sparkforge {command}", description=description)
    if command in ("validate", "inspect", "status"):
        p.add_argument("cache", help="cache URI: local path, file://, s3://, gs://, memory://")
        p.add_argument("--json", action="store_true", help="print one JSON object")
        p.add_argument("--storage_options", default="{}",
                       help='fsspec options as JSON, e.g. \'{"endpoint_url": "http://..."}\'')
    if command == "validate":
        p.add_argument("--deep", action="store_true",
                       help="also recompute every crc32c and check all hidden values are finite")
        p.add_argument("--against", metavar="TRAIN_CONFIG",
                       help="a `sparkforge train` YAML config whose draft/data must fit the cache")
        p.add_argument("--max_concurrency", type=int, default=DEFAULT_MAX_CONCURRENCY,
                       help="reads in flight at once: commit records and, with --deep, slot "
                            f"objects (default {DEFAULT_MAX_CONCURRENCY})")
    if command == "status":
        p.add_argument("--num_workers", type=int, default=1,
                       help="workers of the run: one row per share u %% N == w (default 1)")
        p.add_argument("--window_s", type=float, default=DEFAULT_WINDOW_S,
                       help="throughput and ETA over the commits of this many seconds before "
                            "the newest (default 600)")
        p.add_argument("--watch", type=float, default=0.0, metavar="N",
                       help="refresh every N seconds until the cache is finalized (Ctrl-C stops)")
    if command == "plan":
        src = p.add_mutually_exclusive_group(required=True)
        src.add_argument("--target_config", help="the target's HF config.json")
        src.add_argument("--hidden_size", type=int, help="target hidden size (no config.json)")
        p.add_argument("--num_tokens", type=int, required=True, help="tokens to capture")
        layers = p.add_mutually_exclusive_group(required=True)
        layers.add_argument("--layer_ids",
                            help="feature ids to capture, as `sparkforge produce --layer_ids` "
                                 "(id l: the output of 0-based decoder layer l, HF "
                                 "hidden_states index l + 1), e.g. 1,9,17")
        layers.add_argument("--num_aux_layers", type=int, help="how many layers to capture")
        layers.add_argument("--layer_stride", type=int,
                            help="a superset capture: every k-th feature id up to L-2 from "
                                 "--layer_start, as `sparkforge produce --layer_stride` (needs "
                                 "--target_config)")
        p.add_argument("--layer_start", type=int, default=1,
                       help="first feature id of --layer_stride (default 1)")
        p.add_argument("--aux_codec", choices=["lossless", "fp8"], default="lossless")
        p.add_argument("--hidden_dtype", choices=["bfloat16", "float16", "float32"],
                       help="default: the config's dtype, else bfloat16")
        p.add_argument("--mean_seq_len", type=float, default=1024.0,
                       help="mean sample length in tokens (default 1024)")
        p.add_argument("--topk", type=int, default=0, help="top-k logprobs stored per token")
        p.add_argument("--shard_rows", type=int, default=8192)
        p.add_argument("--rows_per_unit", type=int, default=64,
                       help="input rows per unit (default 64, as sparkforge produce)")
        p.add_argument("--tokens_per_s", type=float,
                       help="capture speed of one producer (e.g. a GPU's prefill tokens/s): "
                            "also print the writer cores needed to keep up")
        p.add_argument("--against", metavar="TRAIN_CONFIG",
                       help="a `sparkforge train` YAML config: also estimate its kept-anchor "
                            "ratio and padding with and without packing (chat-like lengths "
                            "around --mean_seq_len)")
        p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


CONFIGS = {"validate": ValidateConfig, "inspect": InspectConfig, "plan": PlanConfig,
           "status": StatusConfig}


def parse(command: str, description: str, argv: Sequence[str]) -> Any:
    """Parse ``validate``, ``inspect``, ``plan`` or ``status`` arguments into the command's config.

    Raises:
        SystemExit: argparse's own exit, 0 on --help and 2 on a bad command line.
    """
    ns = _parser(command, description).parse_args(list(argv))
    return CONFIGS[command](**vars(ns))


def _storage_options(text: str) -> dict[str, Any]:
    try:
        options = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"--storage_options is not valid JSON: {exc}") from exc
    if not isinstance(options, dict):
        raise UsageError("--storage_options must be a JSON object")
    return options


Extra = Callable[[], tuple[dict[str, Any], str]]
"""More for a command to report, computed by the app layer (the trainer's anchor budget of an
``--against`` config): a JSON object, added under ``anchor_budget``, and its text."""

ContractBuilder = Callable[[Mapping[str, Any] | None], RunContract]
"""Builds the contract of ``--against`` from the cache's target ``config.json`` (None when
unreadable), as ``train`` builds it."""


def run_validate(cfg: ValidateConfig, contract: ContractBuilder | None = None,
                 extra: Extra | None = None) -> int:
    """Validate the cache (against the run ``contract`` builds for ``cfg.against``); 1 if
    invalid. ``extra`` is reported too when the cache is valid."""
    options = _storage_options(cfg.storage_options)
    if cfg.max_concurrency < 1:
        raise UsageError(f"--max_concurrency must be >= 1, got {cfg.max_concurrency}")
    run = None if contract is None else contract(cache_target_config(cfg.cache, options))
    report = validate_cache(cfg.cache, deep=cfg.deep, against=run, storage_options=options,
                            progress=True, max_concurrency=cfg.max_concurrency)
    report.against = cfg.against
    against = f", against {cfg.against}" if cfg.against else ""
    more = extra() if extra is not None and report.valid else None
    if cfg.json:
        print(json.dumps(report.to_json() | ({"anchor_budget": more[0]} if more else {}),
                         indent=1))
    else:
        for problem in report.problems:
            print(problem)
        checked = ", ".join(f"{v:,} {k}" for k, v in sorted(report.checked.items()))
        verdict = "valid" if report.valid else f"INVALID ({len(report.problems)} problems)"
        print(f"{cfg.cache}: {verdict}; checked {checked or 'nothing'}"
              + (" (deep)" if cfg.deep else "") + against)
        if more:
            print(more[1])
    return 0 if report.valid else 1


def run_inspect(cfg: InspectConfig) -> int:
    """Print the cache's summary; 1 if its manifest does not parse."""
    options = _storage_options(cfg.storage_options)
    try:
        summary = summarize_cache(cfg.cache, storage_options=options)
    except CacheNotFoundError:
        raise
    except ValueError as exc:  # the cache itself is bad (manifest, index, arrays): exit 1
        print(f"sparkforge inspect: {shorten(str(exc), MAX_PROBLEM_CHARS)} (run `sparkforge "
              "validate` for details)", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=1) if cfg.json else summary_table(summary))
    return 0


def run_plan(cfg: PlanConfig, extra: Extra | None = None) -> int:
    """Print the estimated cache size (and ``extra``)."""
    hidden: int | None
    if cfg.target_config:
        try:
            shape = target_shape_from_config(cfg.target_config)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
        hidden, num_layers, dtype = shape.hidden_size, shape.num_hidden_layers, shape.dtype
    else:
        hidden, num_layers, dtype = cfg.hidden_size, None, "bfloat16"
    dtype = cfg.hidden_dtype or dtype
    ids = capture_ids(layer_ids=cfg.layer_ids, layer_stride=cfg.layer_stride,
                      layer_start=cfg.layer_start, num_layers=num_layers)
    try:
        # The parser requires --target_config or --hidden_size, and one of the layer flags.
        spec = CacheSpec(hidden_size=cast(int, hidden),
                         num_aux_layers=len(ids) if ids else cast(int, cfg.num_aux_layers),
                         hidden_dtype=cast(HiddenDtype, dtype), max_seq_len=cfg.shard_rows,
                         aux_codec=cfg.aux_codec, topk=cfg.topk, shard_rows=cfg.shard_rows,
                         rows_per_unit=cfg.rows_per_unit)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    bad = [f"--num_tokens must be >= 0, got {cfg.num_tokens}"] if cfg.num_tokens < 0 else []
    bad += [f"--mean_seq_len must be >= 1, got {cfg.mean_seq_len}"] if cfg.mean_seq_len < 1 else []
    if cfg.tokens_per_s is not None and cfg.tokens_per_s <= 0:
        bad.append(f"--tokens_per_s must be > 0, got {cfg.tokens_per_s}")
    if bad:
        raise UsageError("; ".join(bad))
    plan = plan_cache(spec, num_tokens=cfg.num_tokens, mean_seq_len=cfg.mean_seq_len,
                      tokens_per_s=cfg.tokens_per_s)
    if ids:
        plan["layer_ids"], plan["feature_ids"] = ids, list(hf_to_feature(ids))
    more = extra() if extra is not None else None
    if more:
        plan["anchor_budget"] = more[0]
    print(json.dumps(plan, indent=1) if cfg.json else
          plan_table(plan) + (f"\n\n{more[1]}" if more else ""))
    return 0


def run_status(cfg: StatusConfig) -> int:
    """Print the cache's progress (every ``cfg.watch`` seconds until finalized); 1 on problems."""
    bad = [f"--num_workers must be >= 1, got {cfg.num_workers}"] if cfg.num_workers < 1 else []
    bad += [f"--window_s must be > 0, got {cfg.window_s}"] if cfg.window_s <= 0 else []
    bad += [f"--watch must be >= 0, got {cfg.watch}"] if cfg.watch < 0 else []
    if bad:
        raise UsageError("; ".join(bad))
    reader = StatusReader.open(cfg.cache, num_workers=cfg.num_workers, window_s=cfg.window_s,
                               storage_options=_storage_options(cfg.storage_options))
    try:
        while True:
            status = reader.read()
            if cfg.json:  # one object per line, so --watch --json is a JSON Lines stream
                print(json.dumps(status), flush=True)
            else:
                clear = "\x1b[H\x1b[2J" if cfg.watch and sys.stdout.isatty() else ""
                print(clear + status_table(status), flush=True)
            if not cfg.watch or status["state"] == "finalized":
                return 1 if status["problems"] else 0
            time.sleep(cfg.watch)
    except KeyboardInterrupt:
        return 0


def run_finalize(cfg: FinalizeConfig) -> int:
    """Write the manifest and print the accounting in words, as ``inspect`` does."""
    if cfg.max_concurrency < 1:
        raise UsageError(f"--max_concurrency must be >= 1, got {cfg.max_concurrency}")
    manifest = finalize_run(cfg.output, storage_options=cfg.storage_options,
                            max_concurrency=cfg.max_concurrency)
    acc = manifest.accounting
    skipped = ", ".join(f"{k} {v:,}" for k, v in sorted(acc.skipped.items())) or "none"
    print(f"finalized {cfg.output}: {acc.input_rows:,} input rows: {acc.written:,} written, "
          f"skipped {skipped}, failed {acc.failed:,}")
    require_samples(acc, f"the cache {cfg.output}")
    return 0
