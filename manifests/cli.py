"""``sparkforge validate | inspect | plan``: judge, summarise or size a cache (no torch needed).

Exit codes: 0 valid (or success), 1 invalid cache, 2 usage error. A cache path that does not
exist, an unreadable ``--against`` config or bad ``--storage_options`` JSON is a usage error (2):
the command was pointed at nothing to judge. A path that exists but holds no complete, consistent
cache is invalid (1).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any, cast

from sparkforge.manifests.contract import TrainConfigError, run_contract_from_train_config
from sparkforge.manifests.fields import shorten
from sparkforge.manifests.objects import CacheNotFoundError
from sparkforge.manifests.plan import plan_cache, plan_table, target_shape_from_config
from sparkforge.manifests.summary import summarize_cache, summary_table
from sparkforge.manifests.validate import MAX_PROBLEM_CHARS, validate_cache
from sparkforge.shared.dtypes import HiddenDtype
from sparkforge.shared.layout import CacheSpec

USAGE_ERROR = 2


class UsageError(ValueError):
    """A bad command line (exit code 2)."""


def _parser(command: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"sparkforge {command}")
    if command in ("validate", "inspect"):
        p.add_argument("cache", help="cache URI: local path, file://, s3://, gs://, memory://")
        p.add_argument("--json", action="store_true", help="print one JSON object")
        p.add_argument("--storage_options", default="{}",
                       help='fsspec options as JSON, e.g. \'{"endpoint_url": "http://..."}\'')
    if command == "validate":
        p.add_argument("--deep", action="store_true",
                       help="also recompute every crc32c and check all hidden values are finite")
        p.add_argument("--against", metavar="TRAIN_CONFIG",
                       help="a `sparkforge train` YAML config whose draft/data must fit the cache")
    if command == "plan":
        src = p.add_mutually_exclusive_group(required=True)
        src.add_argument("--target_config", help="the target's HF config.json")
        src.add_argument("--hidden_size", type=int, help="target hidden size (no config.json)")
        p.add_argument("--num_tokens", type=int, required=True, help="tokens to capture")
        layers = p.add_mutually_exclusive_group(required=True)
        layers.add_argument("--layer_ids", help="HF hidden_states indices to capture, e.g. 2,10,18")
        layers.add_argument("--num_aux_layers", type=int, help="how many layers to capture")
        p.add_argument("--aux_codec", choices=["lossless", "fp8"], default="lossless")
        p.add_argument("--hidden_dtype", choices=["bfloat16", "float16", "float32"],
                       help="default: the config's dtype, else bfloat16")
        p.add_argument("--mean_seq_len", type=float, default=1024.0,
                       help="mean sample length in tokens (default 1024)")
        p.add_argument("--topk", type=int, default=0, help="top-k logprobs stored per token")
        p.add_argument("--shard_rows", type=int, default=8192)
        p.add_argument("--rows_per_unit", type=int, default=64,
                       help="input rows per unit (default 64, as sparkforge produce)")
        p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``validate``, ``inspect`` or ``plan``; ``argv[0]`` is the subcommand."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in ("validate", "inspect", "plan"):
        print("usage: sparkforge {validate,inspect,plan} ...", file=sys.stderr)
        return USAGE_ERROR
    command = args[0]
    try:
        ns = _parser(command).parse_args(args[1:])
    except SystemExit as exc:  # argparse exits 2 on bad arguments and 0 on --help
        return int(exc.code or 0)
    try:
        return {"validate": _validate, "inspect": _inspect, "plan": _plan}[command](ns)
    except (UsageError, CacheNotFoundError, TrainConfigError, FileNotFoundError) as exc:
        print(f"sparkforge {command}: {exc}", file=sys.stderr)
        return USAGE_ERROR


def _storage_options(text: str) -> dict[str, Any]:
    try:
        options = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"--storage_options is not valid JSON: {exc}") from exc
    if not isinstance(options, dict):
        raise UsageError("--storage_options must be a JSON object")
    return options


def _validate(ns: argparse.Namespace) -> int:
    run = run_contract_from_train_config(ns.against) if ns.against else None
    report = validate_cache(ns.cache, deep=ns.deep, against=run,
                            storage_options=_storage_options(ns.storage_options), progress=True)
    report.against = ns.against
    if ns.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        for problem in report.problems:
            print(problem)
        checked = ", ".join(f"{v:,} {k}" for k, v in sorted(report.checked.items()))
        verdict = "valid" if report.valid else f"INVALID ({len(report.problems)} problems)"
        print(f"{ns.cache}: {verdict}; checked {checked or 'nothing'}"
              + (" (deep)" if ns.deep else "") + (f", against {ns.against}" if ns.against else ""))
    return 0 if report.valid else 1


def _inspect(ns: argparse.Namespace) -> int:
    options = _storage_options(ns.storage_options)
    try:
        summary = summarize_cache(ns.cache, storage_options=options)
    except CacheNotFoundError:
        raise
    except ValueError as exc:  # the cache itself is bad (manifest, index, arrays): exit 1
        print(f"sparkforge inspect: {shorten(str(exc), MAX_PROBLEM_CHARS)} (run `sparkforge "
              "validate` for details)", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=1) if ns.json else summary_table(summary))
    return 0


def _plan(ns: argparse.Namespace) -> int:
    if ns.target_config:
        try:
            shape = target_shape_from_config(ns.target_config)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
        hidden, num_layers, dtype = shape.hidden_size, shape.num_hidden_layers, shape.dtype
    else:
        hidden, num_layers, dtype = ns.hidden_size, None, "bfloat16"
    dtype = ns.hidden_dtype or dtype
    ids = _layer_ids(ns.layer_ids, num_layers) if ns.layer_ids else None
    try:
        spec = CacheSpec(hidden_size=hidden, num_aux_layers=len(ids) if ids else ns.num_aux_layers,
                         hidden_dtype=cast(HiddenDtype, dtype), max_seq_len=ns.shard_rows,
                         aux_codec=ns.aux_codec, topk=ns.topk, shard_rows=ns.shard_rows,
                         rows_per_unit=ns.rows_per_unit)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    bad = [f"--num_tokens must be >= 0, got {ns.num_tokens}"] if ns.num_tokens < 0 else []
    bad += [f"--mean_seq_len must be >= 1, got {ns.mean_seq_len}"] if ns.mean_seq_len < 1 else []
    if bad:
        raise UsageError("; ".join(bad))
    plan = plan_cache(spec, num_tokens=ns.num_tokens, mean_seq_len=ns.mean_seq_len)
    print(json.dumps(plan, indent=1) if ns.json else plan_table(plan))
    return 0


def _layer_ids(text: str, num_layers: int | None) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",")]
    except ValueError as exc:
        raise UsageError(f"--layer_ids must be comma-separated integers, got {text!r}") from exc
    if num_layers is not None and any(not 0 <= i <= num_layers for i in ids):
        raise UsageError(f"--layer_ids {ids}: HF hidden_states indices must be in "
                         f"[0, num_hidden_layers={num_layers}]")
    return ids
