"""The ``sparkforge`` console script: one table of every command, one parser style, one exit rule.

Each row names the command's config dataclass, the function that parses the command line into it
and the job that runs it. Configs and parsers are torch-free; jobs import torch, vLLM or Lightning
only when they run, so ``sparkforge validate`` works without torch and ``sparkforge train`` never
imports vLLM.

Exit codes, for every command: 0 done, 1 the job or its data failed (an invalid cache, a cache that
does not fit the run, a failed capture), 2 a usage or config error (a bad option or value, a path
that names nothing), 128 + N a stop by signal N before the job finished (143: SIGTERM; what the
job saved resumes it). A refusal (``SparkforgeError``; ``ConfigError`` for exit 2) or a storage
failure is one line on stderr; any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from jsonargparse import ArgumentError, ArgumentParser, set_parsing_settings

from sparkforge.app.demo import DemoConfig, run_demo_command
from sparkforge.manifests import cli as manifests_cli
from sparkforge.manifests.cli import FinalizeConfig, ValidateConfig
from sparkforge.manifests.open import open_cache
from sparkforge.producer import cli as producer_cli
from sparkforge.producer.config import ProducerConfig, RegenerateConfig
from sparkforge.shared.config_yaml import use_bounded_yaml
from sparkforge.shared.errors import ConfigError, Interrupted, SparkforgeError
from sparkforge.shared.fields import shorten
from sparkforge.shared.io_errors import describe
from sparkforge.trainer import cli as trainer_cli
from sparkforge.trainer.anchor_budget import (
    AnchorSetting,
    anchor_budget,
    budget_table,
    chat_like_index,
    setting_from_train_config,
)
from sparkforge.trainer.data_plan import SplitIndex
from sparkforge.trainer.job_config import EvalConfig, ExportConfig
from sparkforge.trainer.train_yaml import (
    TrainConfigError,
    contract_from_train_config,
    load_train_yaml,
)

# Attribute docstrings of the config dataclasses become the --help text.
set_parsing_settings(docstring_parse_attribute_docstrings=True)
# Every YAML the parsers read (--config files, train's included, and YAML values) is bounded.
use_bounded_yaml()

USAGE: Final = 2
# Raised by a job when its command line or config names nothing usable (exit 2, not 1).
CONFIG_ERRORS: Final = (ConfigError, FileNotFoundError)


def parse_dataclass(prog: str, description: str, config: type, argv: Sequence[str]) -> Any:
    """``[--config FILE] [--field value ...]`` over a config dataclass (dotted nested fields)."""
    parser = ArgumentParser(prog=prog, description=description, exit_on_error=False)
    parser.add_argument("--config", action="config", help="YAML config file")
    parser.add_class_arguments(config, None, as_group=False)
    namespace = parser.parse_args(list(argv))
    namespace.pop("config", None)
    init = parser.instantiate(namespace)  # builds nested dataclasses (engine), not the top level
    return config(**{key: init[key] for key in init.keys()})


@dataclass(frozen=True)
class Command:
    """One row of the table: what ``sparkforge <name>`` parses and runs."""

    help: str
    """One line, shown by ``sparkforge --help`` and as the command's own description."""
    config: type | None
    """The config dataclass; None for ``train``, whose LightningCLI builds its own classes."""
    job: Callable[[Any], int]
    """Runs the parsed config; returns 0 or 1."""
    parse: Callable[[str, str, Sequence[str]], Any] | None = None
    """(prog, help, argv) -> config; default: :func:`parse_dataclass` over ``config``."""

    def parse_args(self, name: str, argv: Sequence[str]) -> Any:
        """The parsed config of ``sparkforge <name> argv``."""
        prog = f"sparkforge {name}"
        if self.parse is not None:
            return self.parse(prog, self.help, argv)
        assert self.config is not None, f"{name} has neither a parser nor a config dataclass"
        return parse_dataclass(prog, self.help, self.config, argv)


def _manifests_parser(command: str) -> Callable[[str, str, Sequence[str]], Any]:
    return lambda _prog, help_, argv: manifests_cli.parse(command, help_, argv)


def _validate(cfg: ValidateConfig) -> int:
    """``validate``; with ``--against``, the trainer builds the contract the cache must meet
    (from the cache's target config, as ``train`` does) and estimates the config's anchor use
    on the cache's train split."""
    if not cfg.against:
        return manifests_cli.run_validate(cfg)
    against = cfg.against

    def budget() -> tuple[dict[str, Any], str]:
        from sparkforge.trainer.data import load_split_index  # torch, only when asked

        reader = open_cache(cfg.cache, storage_options=json.loads(cfg.storage_options))
        return _budget(against, load_split_index(reader, "train", loss_tokens=True))

    return manifests_cli.run_validate(cfg, lambda target: contract_from_train_config(
        against, target_config=target), budget)


def _plan(cfg: manifests_cli.PlanConfig) -> int:
    """``plan``; with ``--against``, the anchor use of that train config on chat-like samples
    of ``--mean_seq_len`` mean length."""
    against = cfg.against
    if not against:
        return manifests_cli.run_plan(cfg)

    def budget() -> tuple[dict[str, Any], str]:
        row = setting_of(against).loader.max_seq_len
        return _budget(against, chat_like_index(4000, mean_len=cfg.mean_seq_len, max_len=row))

    return manifests_cli.run_plan(cfg, budget)


def setting_of(config: str) -> AnchorSetting:
    """The anchor setting of a train config file (a bad field is a config error)."""
    try:
        return setting_from_train_config(load_train_yaml(config))
    except ValueError as exc:
        raise TrainConfigError(f"{config}: {exc}") from exc


def _budget(config: str, index: SplitIndex) -> tuple[dict[str, Any], str]:
    result = anchor_budget(index, setting_of(config))
    return result, budget_table(result)


# A literal table, not a registry: every command, its config, its job and its one-line help.
COMMANDS: Final[dict[str, Command]] = {
    "validate": Command("check a cache and its manifest (or a train config)", ValidateConfig,
                        _validate, _manifests_parser("validate")),
    "inspect": Command("summarise a cache", manifests_cli.InspectConfig,
                       manifests_cli.run_inspect, _manifests_parser("inspect")),
    "plan": Command("estimate cache size before spending GPU hours", manifests_cli.PlanConfig,
                    _plan, _manifests_parser("plan")),
    "finalize": Command("build the manifest once every unit is committed", FinalizeConfig,
                        manifests_cli.run_finalize),
    "status": Command("progress of a cache being produced (or finished)",
                      manifests_cli.StatusConfig, manifests_cli.run_status,
                      _manifests_parser("status")),
    "produce": Command("capture target hidden states into a cache (vLLM)", ProducerConfig,
                       producer_cli.run_produce),
    "regenerate": Command("sample on-policy assistant turns with the target into Parquet",
                          RegenerateConfig, producer_cli.run_regenerate),
    "parity": Command("compare the backend's capture with one-row transformers forwards on "
                      "--parity_samples rows",
                      ProducerConfig, producer_cli.run_parity),
    "train": Command("train a DSpark draft from a cache (Lightning)", None,
                     trainer_cli.run_train,
                     lambda prog, help_, argv: trainer_cli.train_cli(argv, prog=prog,
                                                                     description=help_)),
    "export": Command("export a checkpoint as a vLLM/SGLang-servable draft", ExportConfig,
                      trainer_cli.run_export, trainer_cli.parse_export),
    "eval": Command("measure acceptance with speculative decoding", EvalConfig,
                    trainer_cli.run_evaluation),
    "demo": Command("run the whole pipeline on an embedded tiny target", DemoConfig,
                    run_demo_command),
}


def _usage() -> str:
    lines = ["usage: sparkforge <command> [options]", "", "commands:"]
    lines += [f"  {name:<11} {command.help}" for name, command in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``sparkforge <command> ...``; returns the exit code (see the module docstring)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help"}:
        print(_usage())
        return 0 if args else USAGE
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"sparkforge: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return USAGE
    command = COMMANDS[name]
    try:
        cfg = command.parse_args(name, rest)
    except SystemExit as exc:  # the parser's own exit: 0 on --help / --print_config, 2 on error
        return int(exc.code or 0)
    except (ValueError, ArgumentError) as exc:  # a value the config dataclass refuses
        print(f"sparkforge {name}: error: {parser_message(exc)}", file=sys.stderr)
        return USAGE
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return command.job(cfg)
    except CONFIG_ERRORS as exc:
        print(f"sparkforge {name}: error: {error_message(exc)}", file=sys.stderr)
        return USAGE
    except Interrupted as exc:  # a signal stopped the job; what it saved resumes it
        print(f"sparkforge {name}: {exc}", file=sys.stderr)
        return 128 + exc.signum
    except SparkforgeError as exc:  # data and job failures
        print(f"sparkforge {name}: error: {error_message(exc)}", file=sys.stderr)
        return 1
    except OSError as exc:  # a storage failure outside the boundaries that name their location
        print(f"sparkforge {name}: error: {describe('path', exc.filename, exc)}",
              file=sys.stderr)
        return 1


_UNION_FAILED: Final = "Does not validate against any of the Union subtypes"


def parser_message(exc: BaseException) -> str:
    """A parser error as the value's own complaint, on one line: for a field typed ``X | None``,
    jsonargparse reports each member's error, the value and its type on many lines; only ``X``'s
    error is kept (after the field's key). A config's own list of problems stays one per line."""
    text = str(exc)
    if _UNION_FAILED not in text or "Errors:" not in text:
        # jsonargparse puts the field's key and its complaint on two lines, and echoes the value
        return shorten(" ".join(text.split()), 400) if isinstance(exc, ArgumentError) else text
    head, _, rest = text.partition("Errors:")
    items: list[list[str]] = []
    for line in rest.split("Given value type:", 1)[0].splitlines():
        if line.strip().startswith("- "):
            items.append([line.strip()[2:]])
        elif line.strip() and items:
            items[-1].append(line.strip())
    errors = [" ".join(item) for item in items if item != ["Expected a <class 'NoneType'>"]]
    key = [line.strip().rstrip(":") for line in head.splitlines()[:1]
           if line.startswith("Parser key")]
    return shorten(": ".join([*key, "; ".join(errors)]), 400) if errors else text


def error_message(exc: BaseException) -> str:
    """The error's own message, on one line.

    An error raised in a DataLoader worker is re-raised in the main process with the worker's
    whole traceback as its message; only the original exception's own line is kept.
    """
    text = str(exc)
    if "Original Traceback" in text:
        last = text.rstrip().splitlines()[-1]  # "package.module.ErrorType: message"
        text = last.split(": ", 1)[1] if ": " in last else last
    return text


def console_main() -> None:
    """The ``sparkforge`` console script: run :func:`main`, then leave without interpreter teardown.

    By then the job has finished, its engines are shut down and its files are closed; what is
    left is the destruction of native thread pools (vLLM CPU, torch), which sometimes aborts the
    process (``terminate called without an active exception``, exit -6) after a finished run.
    """
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    console_main()
