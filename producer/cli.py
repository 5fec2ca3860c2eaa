"""``sparkforge produce | finalize | regenerate | parity``: parse a config and call its job."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from jsonargparse import ArgumentError, ArgumentParser, set_parsing_settings

from sparkforge.producer.config import FinalizeConfig, ProducerConfig, RegenerateConfig
from sparkforge.shared.io_errors import describe

# Attribute docstrings of the config dataclasses become the --help text.
set_parsing_settings(docstring_parse_attribute_docstrings=True)

DESCRIPTIONS = {
    "produce": "capture target hidden states into a cache",
    "finalize": "build the manifest once every unit is committed",
    "regenerate": "sample on-policy assistant turns with the target into Parquet",
    "parity": "compare vLLM capture with a transformers forward on --parity_samples rows",
}


def _parse(command: str, config_class: type, argv: Sequence[str]) -> Any:
    parser = ArgumentParser(prog=f"sparkforge {command}", description=DESCRIPTIONS[command],
                            exit_on_error=False)
    parser.add_argument("--config", action="config", help="YAML config file")
    parser.add_class_arguments(config_class, None, as_group=False)
    namespace = parser.parse_args(list(argv))
    namespace.pop("config", None)
    init = parser.instantiate(namespace)  # builds nested dataclasses (engine), not the top level
    return config_class(**{key: init[key] for key in init.keys()})


def _produce(cfg: ProducerConfig) -> int:
    from sparkforge.producer.run import run

    print(run(cfg).table())
    return 0


def _finalize(cfg: FinalizeConfig) -> int:
    from sparkforge.producer.run import finalize

    manifest = finalize(cfg.output, storage_options=cfg.storage_options)
    acc = manifest.accounting
    skipped = ", ".join(f"{k} {v:,}" for k, v in sorted(acc.skipped.items())) or "none"
    print(f"finalized {cfg.output}: {acc.input_rows:,} input rows: {acc.written:,} written, "
          f"skipped {skipped}, failed {acc.failed:,}")
    return 0


def _regenerate(cfg: RegenerateConfig) -> int:
    from sparkforge.producer.regenerate import regenerate

    print(regenerate(cfg).table())
    return 0


def _parity(cfg: ProducerConfig) -> int:
    from sparkforge.producer.run import parity

    report = parity(cfg)
    print(report.table())
    return 0 if report.passed else 1


# command -> (config dataclass, job). A literal table, not a registry.
COMMANDS: dict[str, tuple[type, Callable[[Any], int]]] = {
    "produce": (ProducerConfig, _produce),
    "finalize": (FinalizeConfig, _finalize),
    "regenerate": (RegenerateConfig, _regenerate),
    "parity": (ProducerConfig, _parity),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``<command> [--config FILE] [--field value ...]``; returns the exit code.

    Exit codes: 0 done, 1 the job failed (bad data, mismatched cache, aborted capture),
    2 a usage or config error.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in COMMANDS:
        print(f"usage: sparkforge {{{','.join(COMMANDS)}}} --config FILE [--field value ...]",
              file=sys.stderr)
        return 2
    command, rest = args[0], args[1:]
    config_class, job = COMMANDS[command]
    try:
        cfg = _parse(command, config_class, rest)
    except SystemExit as exc:  # --help and --print_config exit 0
        return int(exc.code or 0)
    except (ValueError, ArgumentError) as exc:
        print(f"sparkforge {command}: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return job(cfg)
    except (ValueError, RuntimeError) as exc:
        print(f"sparkforge {command}: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a storage failure outside the data/output boundaries (e.g. the model)
        print(f"sparkforge {command}: error: {describe('path', exc.filename or '?', exc)}",
              file=sys.stderr)
        return 1
