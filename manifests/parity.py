"""Parse the producer's vLLM-vs-transformers parity report (manifest ``parity``, parity.json)."""

from __future__ import annotations

from dataclasses import dataclass, field

from sparkforge.shared import fields as f

MAX_PARITY_LAYERS = 1025
"""Captured layers plus the final state: at most one per target layer and the final norm."""


@dataclass(frozen=True, kw_only=True)
class LayerParityInfo:
    """Error of one captured layer against the reference ("hidden_states[k]" or "final")."""

    name: str
    max_abs: float
    rel: float
    dtype_noise: float | None = field(default=None, metadata={"optional_in_json": True})
    """The reference's own relative error in the engine's reduced dtype (absent: not measured)."""


@dataclass(frozen=True, kw_only=True)
class ParityInfo:
    """The parity check the producer ran before capturing."""

    num_samples: int
    num_tokens: int
    dtype: str
    layers: tuple[LayerParityInfo, ...]
    top1_agreement: float
    kl_topk: float
    max_abs_logprob: float
    passed: bool
    num_image_samples: int = field(default=0, metadata={"optional_in_json": True})
    """Samples of ``num_samples`` that are image rows, forwarded with their pixel values
    (reports written before this field: 0)."""


def error_metric(data: object, field: str) -> float:
    """A non-negative error: a number >= 0, infinite, or NaN (an all-zero reference gives NaN)."""
    if isinstance(data, bool) or not isinstance(data, int | float) or data < 0:
        raise f.fail(field, "a non-negative number", data)
    return float(data)


def parse_parity(data: object, field: str = "parity") -> ParityInfo:
    """Every field of a parity report, typed and bounded like the other manifest sections.

    Raises:
        ManifestError: naming the field, e.g. ``parity.layers[2].rel``.
    """
    d = f.obj(data, field, required=frozenset({
        "num_samples", "num_tokens", "dtype", "layers", "top1_agreement", "kl_topk",
        "max_abs_logprob", "passed"}), optional=frozenset({"num_image_samples"}))
    layers = []
    for i, item in enumerate(f.array(d["layers"], f"{field}.layers", max_len=MAX_PARITY_LAYERS)):
        where = f"{field}.layers[{i}]"
        layer = f.obj(item, where, required=frozenset({"name", "max_abs", "rel"}),
                      optional=frozenset({"dtype_noise"}))
        noise = layer.get("dtype_noise")
        layers.append(LayerParityInfo(
            name=f.string(layer["name"], f"{where}.name", max_len=64),
            max_abs=error_metric(layer["max_abs"], f"{where}.max_abs"),
            rel=error_metric(layer["rel"], f"{where}.rel"),
            dtype_noise=None if noise is None else error_metric(noise, f"{where}.dtype_noise")))
    return ParityInfo(
        num_samples=f.integer(d["num_samples"], f"{field}.num_samples", lo=1),
        num_tokens=f.integer(d["num_tokens"], f"{field}.num_tokens"),
        dtype=f.string(d["dtype"], f"{field}.dtype", max_len=32),
        layers=tuple(layers),
        top1_agreement=f.number(d["top1_agreement"], f"{field}.top1_agreement", lo=0.0, hi=1.0),
        kl_topk=error_metric(d["kl_topk"], f"{field}.kl_topk"),
        max_abs_logprob=error_metric(d["max_abs_logprob"], f"{field}.max_abs_logprob"),
        passed=f.boolean(d["passed"], f"{field}.passed"),
        num_image_samples=f.integer(d.get("num_image_samples", 0), f"{field}.num_image_samples"),
    )
