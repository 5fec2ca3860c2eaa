"""Parity check: a capture backend against the transformers reference on a few samples.

The backend under test is vLLM, or the HF backend itself (its batched capture against one-row
forwards, which catches a family whose rows change when padded into a batch). Per layer it reports
the max abs and relative (Frobenius) error of the captured states, and for the final state it
recomputes ``log_softmax(lm_head(final))`` and compares it with the backend's own top-k logprobs:
top-1 agreement and KL over the backend's top-k support. Silently wrong hidden states (off-by-one
layer ids, a missing norm, padding leaking into a row) show up here as errors of order one.

A reduced-precision engine (bf16, fp16) is also held against the reference's own rounding noise:
the reference run in the engine's dtype, compared with the fp32 one. Some architectures amplify
rounding far past one ulp (a tiny Qwen3-Next in bf16: 4-10% relative in transformers itself), and
an engine that is as close to fp32 as transformers in the same dtype is right.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch

from sparkforge.producer.source import CaptureRequest, CaptureResult, whole_results
from sparkforge.producer.target_head import TargetHead
from sparkforge.shared.errors import SparkforgeError

PARITY_TOPK = 20
"""Top-k logprobs requested from the backend under test for the logit comparison."""
# Relative error limits for ``passed``: fp32 engines agree to ~1e-6 (measured on CPU); bf16
# differs from an fp32 reference by about one bf16 ulp.
REL_TOL = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}
MIN_TOP1 = 0.9
NOISE_FACTOR = 3.0
"""A layer passes within this multiple of the reference's own error in the engine's dtype: two
kernels round differently (vLLM's CPU Gated DeltaNet vs transformers' on a tiny Qwen3-Next in
bf16: 1.5-2.2x), while a wrong layer or norm is off by order one."""
MAX_NOISE_TOL = 0.3
"""Beyond this the rounding noise would hide order-one errors; such a layer fails regardless."""


class ParitySource(Protocol):
    """A capture backend that can be asked for top-k logprobs on one call."""

    layer_ids: tuple[int, ...]

    def capture(
        self, requests: Sequence[CaptureRequest], *, topk: int | None = None
    ) -> Iterator[CaptureResult]: ...

    def engine_info(self) -> dict[str, Any]: ...


class ParityReference(ParitySource, Protocol):
    """The reference side: a capture backend that also knows the target's lm_head."""

    def target_head(self) -> TargetHead: ...


@dataclass(frozen=True)
class LayerParity:
    """Error of one captured layer (``name`` = "hidden_states[k]" or "final")."""

    name: str
    max_abs: float
    rel: float
    dtype_noise: float | None = None
    """Relative error of the reference itself run in the engine's dtype (None: not measured)."""

    def tolerance(self, dtype: str) -> float:
        """The relative error this layer may show: the dtype's own limit, or the measured noise."""
        tol = REL_TOL.get(dtype, 3e-2)
        if self.dtype_noise is None:
            return tol
        return max(tol, min(NOISE_FACTOR * self.dtype_noise, MAX_NOISE_TOL))


@dataclass(frozen=True)
class ParityReport:
    """The parity result; ``to_dict()`` goes into the manifest, ``table()`` to the console."""

    num_samples: int
    num_tokens: int
    dtype: str
    layers: tuple[LayerParity, ...]
    top1_agreement: float
    kl_topk: float
    max_abs_logprob: float
    passed: bool
    num_image_samples: int = 0
    """Image rows among the samples (forwarded with their pixel values by both sides)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form."""
        return asdict(self)

    def table(self) -> str:
        """A printable table, one line per layer then the logit comparison."""
        noise = any(p.dtype_noise is not None for p in self.layers)
        lines = [
            f"parity on {self.num_samples} samples ({self.num_image_samples} with images) / "
            f"{self.num_tokens} tokens ({self.dtype})",
            f"{'layer':<20}{'max abs':>12}{'rel':>12}"
            + (f"{self.dtype + ' noise':>18}{'limit':>12}" if noise else ""),
        ]
        lines += [f"{p.name:<20}{p.max_abs:>12.3e}{p.rel:>12.3e}"
                  + (f"{p.dtype_noise or 0.0:>18.3e}{p.tolerance(self.dtype):>12.3e}"
                     if noise else "") for p in self.layers]
        lines.append(
            f"logits vs engine: top-1 agreement {self.top1_agreement:.4f}, KL(top-k) "
            f"{self.kl_topk:.3e}, max |dlogprob| {self.max_abs_logprob:.3e}"
        )
        lines.append("PASSED" if self.passed else "FAILED")
        return "\n".join(lines)


def run_parity(
    source: ParitySource,
    reference: ParityReference,
    requests: Sequence[CaptureRequest],
    *,
    dtype_reference: ParitySource | None = None,
) -> ParityReport:
    """Capture ``requests`` with both backends and compare them.

    Args:
        source: The backend under test (asked for ``PARITY_TOPK`` top-k logprobs).
        reference: ``HfSource`` forwarding one row at a time, ideally in fp32; it also supplies
            lm_head.
        requests: A few samples (token ids).
        dtype_reference: The same reference in the engine's reduced dtype; its distance to
            ``reference`` is each layer's rounding noise, which widens that layer's limit.

    Raises:
        ValueError: If the two sources capture different layers or a capture failed.
    """
    if tuple(source.layer_ids) != tuple(reference.layer_ids):
        raise SparkforgeError(f"parity: layer_ids differ, {source.engine_info()['engine']} "
                              f"{source.layer_ids} vs reference {reference.layer_ids}")
    head = reference.target_head()
    ours = _by_sample(whole_results(source.capture(requests, topk=PARITY_TOPK)))
    ref = _by_sample(reference.capture(requests, topk=0))
    names = [f"hidden_states[{k}]" for k in source.layer_ids] + ["final"]
    diffs = _pairs(names, requests, ours, ref)
    noise = (None if dtype_reference is None else
             _pairs(names, requests, _by_sample(dtype_reference.capture(requests, topk=0)), ref))
    logit_rows = [_logit_parity(ours[r.sample_id], head) for r in requests]
    layers = tuple(
        _layer_error(name, pairs, None if noise is None else _layer_error(name, noise[name]).rel)
        for name, pairs in diffs.items())
    top1 = float(torch.cat([row[0] for row in logit_rows]).mean())
    # KL is >= 0; float32 rounding of two nearly equal distributions can leave a few 1e-10
    # below it, which the manifest's parity section (a non-negative number) would refuse.
    kl = max(0.0, float(torch.cat([row[1] for row in logit_rows]).mean()))
    max_lp = float(torch.cat([row[2] for row in logit_rows]).max())
    dtype = str(source.engine_info()["dtype"])
    return ParityReport(
        num_samples=len(requests),
        num_tokens=sum(r.input_ids.shape[0] for r in requests),
        dtype=dtype,
        layers=layers,
        top1_agreement=top1,
        kl_topk=kl,
        max_abs_logprob=max_lp,
        passed=all(p.rel <= p.tolerance(dtype) for p in layers) and top1 >= MIN_TOP1,
        num_image_samples=sum(r.model_inputs is not None for r in requests),
    )


def _by_sample(results: Iterator[CaptureResult]) -> dict[int, CaptureResult]:
    out = {}
    for r in results:
        if r.error is not None:
            raise SparkforgeError(f"parity: capture of sample {r.sample_id} failed: {r.error}")
        out[r.sample_id] = r
    return out


def _pairs(names: Sequence[str], requests: Sequence[CaptureRequest],
           ours: dict[int, CaptureResult], ref: dict[int, CaptureResult]
           ) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per layer name: (captured, reference) fp32 CPU tensors of every request."""
    pairs: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {n: [] for n in names}
    for r in requests:
        a, b = ours[r.sample_id], ref[r.sample_id]
        assert a.aux_hidden is not None
        assert b.aux_hidden is not None
        assert a.final_hidden is not None
        assert b.final_hidden is not None
        for f, name in enumerate(names[:-1]):
            pairs[name].append((a.aux_hidden[:, f].float().cpu(), b.aux_hidden[:, f].float().cpu()))
        pairs[names[-1]].append((a.final_hidden.float().cpu(), b.final_hidden.float().cpu()))
    return pairs


def _layer_error(name: str, pairs: list[tuple[torch.Tensor, torch.Tensor]],
                 dtype_noise: float | None = None) -> LayerParity:
    delta = torch.cat([(a - b).flatten() for a, b in pairs])
    ref = torch.cat([b.flatten() for _, b in pairs])
    return LayerParity(name=name, max_abs=float(delta.abs().max()),
                       rel=float(delta.norm() / ref.norm()), dtype_noise=dtype_noise)


def _logit_parity(
    result: CaptureResult, head: TargetHead
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: top-1 match, KL(vLLM || recomputed) over vLLM's top-k, max |dlogprob| on top-k."""
    assert result.topk_ids is not None
    assert result.topk_logprobs is not None
    assert result.final_hidden is not None
    recomputed_TV = head.log_probs(result.final_hidden.cpu())
    ids_TK = result.topk_ids.long()
    engine_TK = result.topk_logprobs.float()
    ours_TK = recomputed_TV.gather(1, ids_TK)
    top1 = (recomputed_TV.argmax(-1) == ids_TK[:, 0]).float()
    p_TK = torch.softmax(engine_TK, -1)
    kl = (p_TK * (torch.log_softmax(engine_TK, -1) - torch.log_softmax(ours_TK, -1))).sum(-1)
    return top1, kl, (ours_TK - engine_TK).abs().amax(-1)
