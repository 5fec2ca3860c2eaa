"""``sparkforge train | export | eval``: the trainer's parsers and job functions.

``train`` is a LightningCLI: a YAML ``--config`` with ``model``, ``data`` and every ``trainer``
option, dotted overrides (``--trainer.max_steps 100``), ``--print_config``, and ``--ckpt_path``
to resume; parsing it builds the model, data module and trainer. ``export`` takes the checkpoint
and output folder as positionals. Torch, Lightning and the models load only inside the functions.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from typing import Any

from jsonargparse import ArgumentParser

from sparkforge.shared.config_yaml import use_bounded_yaml
from sparkforge.trainer.architectures import Engine
from sparkforge.trainer.job_config import EvalConfig, ExportConfig
from sparkforge.trainer.run_folder import RUN_NAME, RUNS_DIR


def train_cli(argv: Sequence[str], *, prog: str = "sparkforge train",
              description: str | None = None, exit_on_error: bool = True) -> Any:
    """Parse ``sparkforge train`` arguments and build the model, data module and trainer.

    Raises:
        SystemExit: the parser's own exit, 0 on --help / --print_config and 2 on a bad option
            (with ``exit_on_error``; else the bad option raises ArgumentError).
        ValueError: a config value the model, data module or trainer refuses.
    """
    import torch
    from jsonargparse import lazy_instance  # type: ignore[attr-defined]
    from lightning.pytorch.loggers import CSVLogger

    from sparkforge.trainer.datamodule import CacheDataModule
    from sparkforge.trainer.lightning_cli import TrainCLI
    from sparkforge.trainer.lit_module import DraftLitModule

    use_bounded_yaml()  # also when called from the Python API, not the console script
    cuda = torch.cuda.is_available()
    # main(argv) is the entry point, so argv legitimately differs from sys.argv (tests, dispatch).
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
    return TrainCLI(
        DraftLitModule, CacheDataModule, run=False, args=list(argv), seed_everything_default=0,
        auto_configure_optimizers=False,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"prog": prog, "description": description, "exit_on_error": exit_on_error},
        trainer_defaults={
            "logger": lazy_instance(CSVLogger, save_dir=RUNS_DIR, name=RUN_NAME),
            "gradient_clip_val": 1.0,
            "precision": "bf16-mixed" if cuda else "32-true",
            "log_every_n_steps": 10,
        },
    )


def run_train(cli: Any) -> int:
    """Check the cache against the run, fit, and print the summary (rank 0)."""
    from sparkforge.trainer.run import train

    summary = train(cli.model, cli.datamodule, cli.trainer, ckpt_path=cli.config["ckpt_path"],
                    run_folder=cli.run_folder)
    if cli.trainer.is_global_zero:
        print(json.dumps(summary, indent=2, default=str))
    return 0


def parse_export(prog: str, description: str, argv: Sequence[str]) -> ExportConfig:
    """``export CKPT OUT_DIR [--engine E] ...`` into its config."""
    parser = ArgumentParser(prog=prog, description=description, default_env=False)
    parser.add_argument("ckpt", type=str, help="checkpoint written by sparkforge train")
    parser.add_argument("out_dir", type=str, help="output directory")
    parser.add_argument("--engine", type=Engine, default="any",
                        help="engine whose loading rules the draft must satisfy (any = both)")
    parser.add_argument("--include_embeddings", type=bool, default=True,
                        help="ship exact copies of the target's embed_tokens / lm_head")
    parser.add_argument("--overwrite", type=bool, default=False,
                        help="replace a non-empty OUT_DIR")
    parser.add_argument("--eval_report", type=str | None, default=None,
                        help="eval_report.json of sparkforge eval, tabled in the model card")
    return ExportConfig(**vars(parser.parse_args(list(argv))))


def run_export(cfg: ExportConfig) -> int:
    """Write the servable draft and its model card."""
    from sparkforge.trainer.export import export_from_config

    out = export_from_config(cfg)
    print(f"exported {cfg.ckpt} -> {out}")
    return 0


def run_evaluation(cfg: EvalConfig) -> int:
    """Measure acceptance and print tau per position and where the report is."""
    from sparkforge.trainer.eval.run import run_eval
    from sparkforge.trainer.eval.summary import summary_lines

    report = run_eval(cfg)
    print(summary_lines(report))
    auc = report["speculative"].get("calibration", {}).get("auroc")
    if auc is not None:
        print(f"  confidence vs accept events: AUROC {auc:.3f}")
    policies = report["teacher_forced"].get("policies", [])
    if policies:
        print("teacher-forced policy        tokens/round  verified slots  accepted/verified")
        for p in policies:
            print(f"  {p['policy']:<26} {p['tokens_per_round']:12.3f} {p['verified_slots']:15.2f}"
                  f" {p['accepted_per_verified']:18.3f}")
    print(f"report: {report['config']['out_dir']}")
    return 0
