"""Export a training checkpoint as the HF-style DSpark draft that vLLM (and SGLang) load as-is.

The draft config's (architecture, layout) pair picks the format
(``sparkforge.trainer.architectures``): the Qwen3-shaped DSpark draft both engines load (qwen3),
the DFlash draft (qwen3 with layout dflash), the Gemma4 and Kimi K3 drafts vLLM loads (gemma4,
kimi_k3); a deepseek_v4 draft is refused with its reasons, and a pair no engine serves (e.g.
gemma4 with layout dflash) in one line naming it and the pairs that serve. A written draft is
a ``config.json``, bare tensor keys in bf16 ``model.safetensors`` and a provenance file beside
them. The exporter refuses drafts an engine would load wrongly or
silently half-initialise, and checks its own key set and shapes before writing anything.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from sparkforge.shared.errors import SparkforgeError
from sparkforge.shared.provenance import package_version
from sparkforge.trainer.architectures import (
    ARCHITECTURES,
    Engine,
    architecture_of,
    build_draft,
    serving_format,
)
from sparkforge.trainer.architectures.config import DraftConfig
from sparkforge.trainer.checkpoint import load_checkpoint
from sparkforge.trainer.draft.rope import served_rope_problems
from sparkforge.trainer.eval.head_calibration import calibration_contents
from sparkforge.trainer.eval.sts import CALIBRATION_FILE
from sparkforge.trainer.job_config import ExportConfig
from sparkforge.trainer.model_card import CARD_FILE, model_card, num_speculative_tokens

logger = logging.getLogger(__name__)

OPTIONAL_KEYS = ("embed_tokens.weight", "lm_head.weight")
# Never written: a non-persistent buffer (rotary inv_freq) and tensors vLLM skips or drops.
TRAINING_ONLY = ("rotary_emb.", "t2d", "mask_embedding")


class ExportError(SparkforgeError):
    """Raised when a checkpoint cannot be exported as a servable draft; lists every reason."""


def key_problems(cfg: DraftConfig, tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Exact key-set and shape check: vLLM never reports a missing tensor, so we must."""
    required = architecture_of(cfg).expected_shapes(cfg)
    want = {k: (cfg.vocab_size, cfg.hidden_size) for k in OPTIONAL_KEYS} | required
    problems = [f"missing tensor {k} {list(s)}" for k, s in required.items()
                if k not in tensors]
    problems += [f"unexpected tensor {k}" for k in tensors if k not in want]
    problems += [f"{k}: shape {list(tensors[k].shape)}, expected {list(s)}"
                 for k, s in want.items() if k in tensors and tuple(tensors[k].shape) != s]
    return problems


def draft_tensors(state_dict: Mapping[str, torch.Tensor], *,
                  prefix: str = "model.") -> dict[str, torch.Tensor]:
    """Bare draft keys from a Lightning state dict: strip the holder prefix and ``_orig_mod.``."""
    out = {}
    for key, value in state_dict.items():
        if not key.startswith(prefix):
            continue
        bare = key[len(prefix):].replace("_orig_mod.", "")
        if not any(bare.startswith(t) or t in bare for t in TRAINING_ONLY):
            out[bare] = value
    return out


def _versions() -> dict[str, str]:
    return {name: package_version(name) or "not installed"
            for name in ("sparkforge", "torch", "transformers", "lightning", "safetensors")}


def export_draft(
    cfg: DraftConfig,
    tensors: Mapping[str, torch.Tensor],
    out_dir: str | Path,
    *,
    engine: Engine = "any",
    include_embeddings: bool = True,
    provenance: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    eval_report: Mapping[str, Any] | None = None,
) -> Path:
    """Check and write the servable draft directory, with its model card (``README.md``, the
    eval table from ``eval_report`` when given); nothing is written if a check fails.

    Raises:
        SparkforgeError: no engine serves the config's (architecture, layout) pair.
        ExportError: listing every serving and key-set problem.
    """
    out = Path(out_dir)
    tensors = {k: v for k, v in tensors.items() if include_embeddings or k not in OPTIONAL_KEYS}
    fmt = serving_format(cfg)
    problems = served_rope_problems(cfg.rope_parameters) + fmt.serving_problems(cfg, engine)
    problems += key_problems(cfg, tensors)
    calibration = _calibration(cfg, eval_report, problems)
    problems += _out_dir_problems(out, overwrite=overwrite)
    if problems:
        raise ExportError("cannot export a servable DSpark draft:\n  " + "\n  ".join(problems))
    bf16 = {k: (v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach()).contiguous()
            for k, v in sorted(tensors.items())}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write_draft(tmp, bf16, cfg, fmt, engine, provenance, out=out, eval_report=eval_report,
                     calibration=calibration)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    tmp.replace(out)
    logger.info("exported %d tensors (%s) to %s", len(bf16), engine, out)
    if fmt.serving_note:
        logger.warning("%s: %s", out, fmt.serving_note)
    return out


def _out_dir_problems(out: Path, *, overwrite: bool) -> list[str]:
    """Why ``out`` cannot take the export: a symbolic link (replacing it would write through it
    or drop it), something other than a folder, or a folder with files and no ``overwrite``."""
    if out.is_symlink():
        return [f"{out} is a symbolic link (to {out.readlink()}); export neither replaces nor "
                "writes through one: give the folder itself"]
    if out.exists() and not out.is_dir():
        return [f"{out} exists and is not a folder"]
    if out.exists() and any(out.iterdir()) and not overwrite:
        return [f"{out} exists and is not empty (pass --overwrite to replace it)"]
    return []


def _write_draft(tmp: Path, bf16: dict[str, torch.Tensor], cfg: DraftConfig, fmt: Any,
                 engine: Engine, provenance: Mapping[str, Any] | None, *, out: Path,
                 eval_report: Mapping[str, Any] | None,
                 calibration: Mapping[str, Any] | None) -> None:
    """The export's files, in the temporary folder that then replaces ``out``."""
    save_file(bf16, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = json.dumps(fmt.hf_config(cfg), indent=2, sort_keys=True)
    (tmp / "config.json").write_text(config + "\n")
    info = {"draft_config": cfg.to_dict(), "engine_checked": engine, "versions": _versions(),
            **dict(provenance or {})}
    (tmp / "sparkforge_export.json").write_text(json.dumps(info, indent=2, default=str) + "\n")
    sizes = {"draft_parameters": sum(v.numel() for k, v in bf16.items() if k not in OPTIONAL_KEYS),
             "shared_embedding_parameters": sum(v.numel() for k, v in bf16.items()
                                                if k in OPTIONAL_KEYS)}
    (tmp / CARD_FILE).write_text(model_card(cfg, info, draft_dir=str(out), sizes=sizes,
                                            eval_report=eval_report))
    if calibration is not None:
        (tmp / CALIBRATION_FILE).write_text(json.dumps(calibration, indent=2) + "\n")


def _calibration(cfg: DraftConfig, eval_report: Mapping[str, Any] | None,
                 problems: list[str]) -> dict[str, Any] | None:
    """The calibration file of an eval report's STS fit (a problem when it does not fit)."""
    fit = (eval_report or {}).get("confidence_calibration")
    if not fit:
        return None
    temperatures = fit["temperatures"]["head"]
    if len(temperatures) != num_speculative_tokens(cfg):
        problems.append(f"the eval report's calibration has {len(temperatures)} temperatures, "
                        f"the draft drafts {num_speculative_tokens(cfg)} slots: another draft's")
    return calibration_contents(fit)


def read_checkpoint(
    ckpt_path: str | Path,
) -> tuple[DraftConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """The draft config, bare draft tensors and provenance of a ``sparkforge train`` checkpoint."""
    ckpt = load_checkpoint(ckpt_path)
    provenance = {"checkpoint": str(ckpt_path), "global_step": ckpt.get("global_step"),
                  "epoch": ckpt.get("epoch"), **ckpt.get("sparkforge_provenance", {})}
    hparams = ckpt.get("hyper_parameters", {})
    loss = hparams.get("loss")
    if loss is not None:  # the run's loss settings: eval measures with them
        provenance["loss"] = dict(loss)
    provenance["training"] = {k: hparams[k] for k in ("recipe", "optimizer", "scheduler", "seed")
                              if k in hparams}
    cfg = DraftConfig.from_dict(ckpt["draft_config"])
    return cfg, draft_tensors(ckpt["state_dict"]), provenance


def export_checkpoint(ckpt_path: str | Path, out_dir: str | Path, **kwargs: Any) -> Path:
    """Export a ``sparkforge train`` Lightning checkpoint (see ``export_draft`` for options)."""
    cfg, tensors, provenance = read_checkpoint(ckpt_path)
    return export_draft(cfg, tensors, out_dir, provenance=provenance, **kwargs)


def export_from_config(cfg: ExportConfig) -> Path:
    """``sparkforge export``: the checkpoint's draft and model card, with ``cfg.eval_report``'s
    table when given."""
    report = None if cfg.eval_report is None else json.loads(Path(cfg.eval_report).read_text())
    return export_checkpoint(cfg.ckpt, cfg.out_dir, engine=cfg.engine,
                             include_embeddings=cfg.include_embeddings, overwrite=cfg.overwrite,
                             eval_report=report)


def config_from_hf(config: Mapping[str, Any]) -> DraftConfig:
    """Read an exported ``config.json`` (ours, DeepSpec's or NeMo's) with its format's reader.

    The format is the one whose served class names match ``architectures`` (``DFlashDraftModel``
    reads as qwen3 with layout dflash); a config without a known class name is read as
    Qwen3-shaped DSpark.
    """
    served = tuple(config.get("architectures") or ())
    for arch in ARCHITECTURES.values():
        for fmt in arch.formats.values():
            if served and served[0] in fmt.served_as:
                return fmt.config_from_hf(config)
    return ARCHITECTURES["qwen3"].formats["dspark"].config_from_hf(config)


def training_loss_settings(path: str | Path) -> dict[str, Any] | None:
    """The ``model.loss`` settings of the run that trained a draft, or None if not recorded.

    Read from a ``sparkforge train`` checkpoint, or from ``sparkforge_export.json`` beside an
    exported draft.
    """
    root = Path(path)
    if root.is_dir():
        info = root / "sparkforge_export.json"
        loss = json.loads(info.read_text()).get("loss") if info.is_file() else None
    else:
        loss = read_checkpoint(root)[2].get("loss")
    return dict(loss) if isinstance(loss, dict) else None


def load_draft(path: str | Path) -> Any:
    """A draft model from an exported directory or a ``sparkforge train`` checkpoint.

    Every required tensor must be present with its shape (the export self-check).
    """
    from safetensors.torch import load_file

    root = Path(path)
    if root.is_dir():
        cfg = config_from_hf(json.loads((root / "config.json").read_text()))
        tensors = load_file(str(root / "model.safetensors"))
    else:
        cfg, tensors, _ = read_checkpoint(root)
    problems = key_problems(cfg, tensors)
    if problems:
        raise ExportError(f"{root} is not a complete DSpark draft:\n  " + "\n  ".join(problems))
    model = build_draft(cfg)
    model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    return model.eval()
