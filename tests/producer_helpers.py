"""Test helpers for producer tests: a plain transformers-forward source and dataset/config builders.

``ForwardSource`` is the independent reference the producer is checked against before the vLLM
backend is used: it runs ``AutoModelForCausalLM`` with ``output_hidden_states`` (real numbers, not
random), and can be told to fail given sample ids, or to return NaN for them, to exercise failure
and skip accounting.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sparkforge.manifests.open import open_cache
from sparkforge.producer.config import ProducerConfig
from sparkforge.producer.engine_options import EngineOptions
from sparkforge.producer.source import CaptureRequest, CaptureResult

WORDS = "the draft block reads a cache shard and the target layer writes a token".split()


class ForwardSource:
    """HiddenStateSource over a plain transformers forward of each request, in order."""

    def __init__(self, model_path: Path, *, layer_ids: Sequence[int], topk: int = 0,
                 fail_ids: frozenset[int] = frozenset(),
                 nan_ids: frozenset[int] = frozenset()) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
        self.model.eval()
        self.layer_ids = tuple(layer_ids)
        self.topk = topk
        self.fail_ids = fail_ids
        self.nan_ids = nan_ids
        self.calls = 0

    def capture(self, requests: Sequence[CaptureRequest]) -> Iterator[CaptureResult]:
        for request in requests:
            self.calls += 1
            if request.sample_id in self.fail_ids:
                yield CaptureResult(sample_id=request.sample_id, error="injected failure")
                continue
            ids = torch.as_tensor(request.input_ids, dtype=torch.long)[None]
            with torch.no_grad():
                out = self.model(ids, output_hidden_states=True)
            hidden = out.hidden_states
            topk = {}
            if self.topk:
                values, indices = torch.log_softmax(out.logits[0].float(), -1).topk(self.topk)
                topk = {"topk_ids": indices.to(torch.int32), "topk_logprobs": values}
            aux = torch.stack([hidden[k][0] for k in self.layer_ids], dim=1)
            if request.sample_id in self.nan_ids:
                aux[-1, -1, 0] = float("nan")
            yield CaptureResult(
                sample_id=request.sample_id,
                aux_hidden=aux,
                final_hidden=hidden[-1][0],
                **topk,
            )

    def engine_info(self) -> dict[str, Any]:
        return {"engine": "hf"}

    def close(self) -> None:
        pass


def chat_rows(num_rows: int, *, seed: int = 0) -> list[dict[str, Any]]:
    """Deterministic short conversations of varied length."""
    rows = []
    for i in range(num_rows):
        n = 2 + (i * 7 + seed) % 9
        question = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(n))
        answer = " ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(n + 3))
        rows.append({"messages": [{"role": "user", "content": question.capitalize() + "?"},
                                  {"role": "assistant", "content": answer.capitalize() + "."}]})
    return rows


def write_jsonl(path: Path, rows: Sequence[Any]) -> Path:
    """Rows as JSONL (a str row is written as-is, to plant malformed lines)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def producer_config(model: Path, data: Path | str, output: str, **overrides: Any) -> ProducerConfig:
    """A tiny-target producer config: 3 feature layers, fp32 storage, small units and shards."""
    fields: dict[str, Any] = {
        "data": str(data), "output": output, "backend": "hf", "layer_ids": [0, 1, 2],
        "hidden_dtype": "float32", "rows_per_unit": 4, "shard_rows": 256, "progress": False,
        "engine": EngineOptions(model=str(model), max_model_len=128, dtype="float32"),
    }
    return ProducerConfig(**{**fields, **overrides})


def cache_samples(uri: str, storage_options: dict | None = None) -> dict[int, dict]:
    """Every sample of a finalized cache as plain arrays, keyed by sample id."""
    reader = open_cache(uri, storage_options=storage_options, verify=True)
    out = {}
    for sample_id in reader.samples.sample_id.tolist():
        s = reader.read_sample(sample_id)
        out[sample_id] = {"split": s.split, "input_ids": s.input_ids, "loss_mask": s.loss_mask,
                          "aux_hidden": s.aux_hidden, "final_hidden": s.final_hidden,
                          "topk_ids": s.topk_ids, "topk_logprobs": s.topk_logprobs}
    return out


def assert_same_samples(a: dict[int, dict], b: dict[int, dict]) -> None:
    """Same sample ids, and every array byte-identical."""
    assert sorted(a) == sorted(b)
    for sample_id in a:
        for key, value in a[sample_id].items():
            other = b[sample_id][key]
            if isinstance(value, np.ndarray):
                assert value.dtype == other.dtype, (sample_id, key)
                assert value.tobytes() == other.tobytes(), (sample_id, key)
            else:
                assert value == other, (sample_id, key)


def poisoned_target(target: Path, out: Path, token_id: int) -> Path:
    """A copy of ``target`` whose embedding of ``token_id`` is inf: every row holding that token
    gets non-finite activations from the real model, the other rows stay finite."""
    import shutil

    from transformers import AutoModelForCausalLM

    shutil.copytree(target, out)
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight[token_id] = float("inf")
    model.save_pretrained(str(out))
    return out


def poison_rows(num_rows: int, token_id: int, poisoned: frozenset[int]) -> list[dict[str, Any]]:
    """Pre-tokenized rows; those in ``poisoned`` carry ``token_id`` in the middle."""
    rows = []
    for i in range(num_rows):
        ids = [5 + i, 6, 7, 8, 9, 10]
        if i in poisoned:
            ids[3] = token_id
        rows.append({"input_ids": ids, "loss_mask": [0, 0, 1, 1, 1, 1]})
    return rows


class HookSource:
    """An independent capture through module hooks, for parity against ``HfSource``.

    Feature HF index k is the output of decoder layer k - 1, read by a forward hook on that layer
    (a hyper-connection target's ``[B, S, hc, H]`` streams reduced by ``reduce``); the final state
    is the tensor ``lm_head`` received, read by a pre-hook. ``final="before_hc_head"`` instead
    takes ``norm(mean over streams of the last layer)``, the state a capture that skips
    ``hc_head`` would store. One request per forward, no padding.
    """

    def __init__(self, model_path: Path, *, layer_ids: Sequence[int], reduce: str = "mean",
                 final: str = "lm_head_input") -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
        self.model.eval()
        self.layer_ids = tuple(layer_ids)
        self.reduce, self.final = reduce, final

    def engine_info(self) -> dict[str, Any]:
        """Only the dtype, which parity reads."""
        return {"dtype": "float32"}

    def _streams(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.dim() == 3:
            return hidden
        return hidden.sum(2) if self.reduce == "sum" else hidden.mean(2)

    @torch.no_grad()
    def capture(self, requests: Sequence[CaptureRequest], *,
                topk: int | None = None) -> Iterator[CaptureResult]:
        """One forward per request; features and final from hooks, top-k from the logits."""
        layers = self.model.model.layers
        seen: dict[str, torch.Tensor] = {}

        def keep(name: str):  # type: ignore[no-untyped-def]
            def hook(module, args, output):  # type: ignore[no-untyped-def]
                seen[name] = output[0] if isinstance(output, tuple) else output
            return hook

        handles = [layers[k - 1].register_forward_hook(keep(f"layer{k}")) for k in self.layer_ids]
        handles.append(layers[-1].register_forward_hook(keep("last")))
        handles.append(self.model.lm_head.register_forward_pre_hook(
            lambda module, args: seen.__setitem__("lm_head_input", args[0])))
        try:
            for r in requests:
                ids = torch.from_numpy(r.input_ids.astype(np.int64))[None]
                logits = self.model(input_ids=ids, use_cache=False).logits[0]
                aux = torch.stack([self._streams(seen[f"layer{k}"])[0] for k in self.layer_ids], 1)
                if self.final == "before_hc_head":
                    final = self.model.model.norm(self._streams(seen["last"]))[0]
                else:
                    final = seen["lm_head_input"][0]
                lps = torch.log_softmax(logits.float(), -1).topk(topk, -1) if topk else None
                yield CaptureResult(sample_id=r.sample_id, aux_hidden=aux, final_hidden=final,
                                    topk_ids=lps.indices.int() if lps else None,
                                    topk_logprobs=lps.values if lps else None)
        finally:
            for handle in handles:
                handle.remove()
