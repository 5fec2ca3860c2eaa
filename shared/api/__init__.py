"""The Python API: every ``sparkforge`` job as a function over the configs its command parses.

``from sparkforge.api import produce, train, evaluate, export``. ``sparkforge`` itself stays a
namespace package, so the functions live here rather than on ``sparkforge``. Each function is
what its command runs, minus the printing: the command line is a thin layer that parses into the
same config, calls the same job and prints what it returns. Torch, vLLM and Lightning load only
when a job runs.

Configs: :class:`ProducerConfig` (``produce``), :class:`RegenerateConfig` (``regenerate``),
:class:`EvalConfig` (``evaluate``), :class:`ExportConfig` (``export``); ``train`` takes the
sections of a ``sparkforge train --config`` YAML (``model``, ``data``, ``trainer``), whose values
may be the trainer's own dataclasses (:class:`DraftSpec`, :class:`LossSpec`, ...).
:func:`load_config` reads any of the dataclass configs from a YAML file, as ``--config`` does.

Every function refuses as the command line does: a :class:`SparkforgeError` (a
:class:`ConfigError` for a usage error: a wrong type, a path that names nothing, a value the
config refuses) whose message is the line the command would print.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from argparse import ArgumentError
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

from sparkforge.manifests.summary import summarize_cache
from sparkforge.manifests.validate import ValidationReport, validate_cache
from sparkforge.producer.config import ProducerConfig, RegenerateConfig
from sparkforge.producer.engine_options import EngineOptions
from sparkforge.shared.errors import ConfigError, SparkforgeError
from sparkforge.shared.io_errors import describe
from sparkforge.shared.mix import MixSource
from sparkforge.trainer.job_config import EvalConfig, ExportConfig
from sparkforge.trainer.run_config import DraftSpec, LossSpec

if TYPE_CHECKING:
    from sparkforge.producer.regenerate import RegenerateSummary
    from sparkforge.producer.summary import RunSummary

__all__ = ["ConfigError", "DraftSpec", "EngineOptions", "EvalConfig", "ExportConfig", "LossSpec",
           "MixSource", "ProducerConfig", "RegenerateConfig", "SparkforgeError", "eval",
           "evaluate", "export", "inspect", "load_config", "produce", "regenerate", "train",
           "validate"]

ConfigT = TypeVar("ConfigT")


@contextmanager
def _refusals(call: str) -> Iterator[None]:
    """The command line's exit rule for Python callers: what the command prints as one line is
    raised as a SparkforgeError (ConfigError: a usage error) with that line as its message.
    Any other exception is a bug and propagates unchanged."""
    from sparkforge.app.cli import parser_message

    try:
        yield
    except SparkforgeError:
        raise
    except ArgumentError as exc:
        raise ConfigError(f"{call}: {parser_message(exc)}") from exc
    except FileNotFoundError as exc:
        raise ConfigError(f"{call}: {describe('path', exc.filename, exc)}") from exc
    except OSError as exc:
        raise SparkforgeError(f"{call}: {describe('path', exc.filename, exc)}") from exc


def _expect(call: str, name: str, value: Any, kind: type | tuple[type, ...]) -> None:
    """Refuse an argument of another type (a ConfigError naming it)."""
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        raise ConfigError(f"{call}: {name} must be {' or '.join(k.__name__ for k in kinds)}, "
                          f"got {type(value).__name__} {value!r:.80}")


def load_config(config: type[ConfigT], path: str | Path, *overrides: str) -> ConfigT:
    """A config dataclass from a YAML file and ``--field value`` overrides, as the CLI parses it.

    Raises:
        ValueError: a value the config refuses (every problem listed).
    """
    from sparkforge.app.cli import parse_dataclass

    call = "load_config"
    if not (isinstance(config, type) and dataclasses.is_dataclass(config)):
        raise ConfigError(f"{call}: config must be a config class (ProducerConfig, ...), got "
                          f"{config!r:.80}")
    _expect(call, "path", path, (str, os.PathLike))
    for item in overrides:
        _expect(call, "an override", item, str)
    with _refusals(f"{call} {config.__name__} from {path}"):
        try:
            parsed: ConfigT = parse_dataclass(config.__name__, "", config,
                                              ["--config", str(path), *overrides])
        except SystemExit as exc:  # the parser's own exit on a bad option
            raise ConfigError(f"cannot parse {path} into {config.__name__}") from exc
    return parsed


def produce(cfg: ProducerConfig) -> RunSummary:
    """``sparkforge produce``: capture this worker's share of the cache; the run's accounting
    (``.table()`` is what the command prints)."""
    from sparkforge.producer.run import run

    _expect("produce", "cfg", cfg, ProducerConfig)
    with _refusals("produce"):
        return run(cfg)


def regenerate(cfg: RegenerateConfig) -> RegenerateSummary:
    """``sparkforge regenerate``: sample on-policy assistant turns into Parquet parts."""
    from sparkforge.producer.regenerate import regenerate as run_regenerate

    _expect("regenerate", "cfg", cfg, RegenerateConfig)
    with _refusals("regenerate"):
        return run_regenerate(cfg)


def _plain(value: Any) -> Any:
    """Dataclasses (DraftSpec, LossSpec, ...) and tuples as the plain YAML the CLI reads."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def train(config: Mapping[str, Any] | str | Path, *overrides: str) -> dict[str, Any]:
    """``sparkforge train``: check the cache against the run, fit, return the summary
    (``global_step``, ``last_checkpoint``, ``log_dir``, ``metrics``).

    Args:
        config: A ``sparkforge train --config`` YAML file, or its sections as a mapping.
        overrides: Dotted command-line overrides, e.g. ``"--trainer.max_steps", "100"``.

    Raises:
        ValueError: a config value the model, data module or trainer refuses, or a cache that
            does not fit the run (CacheContractError).
    """
    from sparkforge.trainer.cli import train_cli
    from sparkforge.trainer.run import train as fit

    _expect("train", "config", config, (Mapping, str, os.PathLike))
    for item in overrides:
        _expect("train", "an override", item, str)
    with _refusals("train"), tempfile.TemporaryDirectory(prefix="sparkforge-train-") as tmp:
        path = Path(tmp) / "config.yaml"
        if isinstance(config, Mapping):
            path.write_text(yaml.safe_dump(_plain(config), sort_keys=False))
        else:
            path = Path(config)
        try:
            cli = train_cli(["--config", str(path), *overrides], exit_on_error=False)
        except SystemExit as exc:  # --help or --print_config among the overrides
            raise ConfigError(f"train: the parser exited ({exc.code}) on {overrides!r}") from exc
    with _refusals("train"):
        return fit(cli.model, cli.datamodule, cli.trainer, ckpt_path=cli.config["ckpt_path"],
                   run_folder=cli.run_folder)


def evaluate(cfg: EvalConfig) -> dict[str, Any]:
    """``sparkforge eval``: speculative decoding against the target (tau with its 95% interval,
    acceptance by position, calibration) and the teacher-forced table; the report written to
    ``cfg.out_dir/eval_report.json``."""
    from sparkforge.trainer.eval.run import run_eval

    _expect("evaluate", "cfg", cfg, EvalConfig)
    with _refusals("evaluate"):
        return run_eval(cfg)


eval = evaluate  # the command's own name
"""``sparkforge eval`` under its command name (shadows the builtin only inside this module)."""


def export(cfg: ExportConfig) -> Path:
    """``sparkforge export``: the servable draft folder with its model card (``README.md``)."""
    from sparkforge.trainer.export import export_from_config

    _expect("export", "cfg", cfg, ExportConfig)
    with _refusals("export"):
        return export_from_config(cfg)


def validate(cache: str, *, deep: bool = False,
             storage_options: Mapping[str, Any] | None = None) -> ValidationReport:
    """``sparkforge validate``: every problem of a cache (``.valid``, ``.problems``)."""
    _cache_arguments("validate", cache, storage_options)
    _expect("validate", "deep", deep, bool)
    with _refusals("validate"):
        return validate_cache(str(cache), deep=deep, storage_options=storage_options)


def inspect(cache: str, *, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``sparkforge inspect --json``: the cache's summary (mix accounting included)."""
    _cache_arguments("inspect", cache, storage_options)
    with _refusals("inspect"):
        return summarize_cache(str(cache), storage_options=storage_options)


def _cache_arguments(call: str, cache: object, storage_options: object) -> None:
    _expect(call, "cache", cache, (str, os.PathLike))
    if storage_options is not None:
        _expect(call, "storage_options", storage_options, Mapping)
