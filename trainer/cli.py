"""``sparkforge train | export | eval``: parse arguments (LightningCLI / jsonargparse) and run.

``train`` is a LightningCLI: a YAML ``--config`` with ``model``, ``data`` and every ``trainer``
option, dotted overrides (``--trainer.max_steps 100``), ``--print_config``, and ``--ckpt_path``
to resume. ``export`` and ``eval`` take the same YAML/override style over their config dataclass.
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from jsonargparse import (  # type: ignore[attr-defined]
    ActionConfigFile,
    ArgumentParser,
    set_parsing_settings,
)

logger = logging.getLogger(__name__)

# Attribute docstrings of the config dataclasses become the --help text.
set_parsing_settings(docstring_parse_attribute_docstrings=True)


@dataclass(frozen=True, kw_only=True)
class ExportConfig:
    """Export a training checkpoint as a vLLM / SGLang servable DSpark draft."""

    ckpt: str
    """Lightning checkpoint written by ``sparkforge train``."""
    out_dir: str
    """Directory to write (config.json, model.safetensors, sparkforge_export.json)."""
    engine: str = "any"
    """Engine the draft must be servable by: vllm, sglang or any (both)."""
    include_embeddings: bool = True
    """Ship exact copies of the target's embed_tokens / lm_head (engines share them when equal)."""
    overwrite: bool = False
    """Replace an existing export in ``out_dir`` instead of refusing."""


def _train(argv: list[str]) -> int:
    import torch
    from jsonargparse import lazy_instance  # type: ignore[attr-defined]
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.loggers import CSVLogger

    from sparkforge.trainer.datamodule import CacheDataModule
    from sparkforge.trainer.lit_module import DSparkLitModule
    from sparkforge.trainer.run import train

    class _TrainCLI(LightningCLI):
        """Adds ``--ckpt_path`` (resume) and a ``checkpoint`` section to the Lightning CLI."""

        def add_arguments_to_parser(self, parser: Any) -> None:
            parser.add_argument("--ckpt_path", type=str | None, default=None,
                                help="checkpoint to resume from (path, or 'last')")
            # Always checkpoint (``checkpoint.*`` options); save_last makes --ckpt_path last work.
            parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
            parser.set_defaults({"checkpoint.save_last": True})

    cuda = torch.cuda.is_available()
    # main(argv) is the entry point, so argv legitimately differs from sys.argv (tests, dispatch).
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
    cli = _TrainCLI(
        DSparkLitModule, CacheDataModule, run=False, args=argv, seed_everything_default=0,
        auto_configure_optimizers=False,
        save_config_kwargs={"overwrite": True},
        trainer_defaults={
            "logger": lazy_instance(CSVLogger, save_dir="runs", name="dspark"),
            "gradient_clip_val": 1.0,
            "precision": "bf16-mixed" if cuda else "32-true",
            "log_every_n_steps": 10,
        },
    )
    summary = train(cli.model, cli.datamodule, cli.trainer, ckpt_path=cli.config["ckpt_path"])
    if cli.trainer.is_global_zero:
        print(json.dumps(summary, indent=2, default=str))
    return 0


def _config_parser(name: str, config_cls: type) -> ArgumentParser:
    parser = ArgumentParser(prog=f"sparkforge {name}", description=config_cls.__doc__,
                            default_env=False)
    parser.add_argument("--config", action=ActionConfigFile, help="YAML with the options below")
    parser.add_class_arguments(config_cls, nested_key=None, as_group=False)
    return parser


def _export(argv: list[str]) -> int:
    from sparkforge.trainer.export import export_checkpoint

    parser = ArgumentParser(prog="sparkforge export", description=ExportConfig.__doc__,
                            default_env=False)
    parser.add_argument("ckpt", type=str, help="checkpoint written by sparkforge train")
    parser.add_argument("out_dir", type=str, help="output directory")
    parser.add_argument("--engine", type=Literal["vllm", "sglang", "any"], default="any",
                        help="engine whose loading rules the draft must satisfy (any = both)")
    parser.add_argument("--include_embeddings", type=bool, default=True,
                        help="ship exact copies of the target's embed_tokens / lm_head")
    parser.add_argument("--overwrite", type=bool, default=False,
                        help="replace a non-empty OUT_DIR")
    cfg = ExportConfig(**vars(parser.parse_args(argv)))
    out = export_checkpoint(cfg.ckpt, cfg.out_dir, engine=cfg.engine,
                            include_embeddings=cfg.include_embeddings, overwrite=cfg.overwrite)
    print(f"exported {cfg.ckpt} -> {out}")
    return 0


def _eval(argv: list[str]) -> int:
    from sparkforge.trainer.eval import EvalConfig, run_eval

    parser = _config_parser("eval", EvalConfig)
    args = parser.parse_args(argv)
    args.pop("config", None)
    report = run_eval(EvalConfig(**args.as_dict()))
    spec = report["speculative"]
    print(f"tau {spec['tau']:.3f} over {spec['rounds']} rounds; per position "
          + ", ".join(f"{a:.2f}" for a in spec["acceptance_by_position"]))
    print(f"report: {report['config']['out_dir']}")
    return 0


COMMANDS = {"train": _train, "export": _export, "eval": _eval}


def main(argv: Sequence[str] | None = None) -> int:
    """``main(["train", ...])``; returns the exit code (1 on a config/data error, 2 on usage)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in COMMANDS:
        print(f"usage: sparkforge {{{','.join(COMMANDS)}}} [options]", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return COMMANDS[args[0]](args[1:])
    except (ValueError, OSError) as exc:  # config, data, storage: one readable message, exit 1
        print(f"sparkforge {args[0]}: error: {error_message(exc)}", file=sys.stderr)
        return 1


def error_message(exc: BaseException) -> str:
    """The error's own message.

    An error raised in a DataLoader worker is re-raised in the main process with the worker's
    whole traceback as its message; only the original exception's line is kept.
    """
    text = str(exc)
    if "Original Traceback" not in text:
        return text
    last = text.rstrip().splitlines()[-1]  # "package.module.ErrorType: message"
    return last.split(": ", 1)[1] if ": " in last else last


if __name__ == "__main__":
    sys.exit(main())
