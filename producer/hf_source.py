"""The transformers capture backend: same outputs as the vLLM backend, from a plain HF forward.

It serves targets vLLM cannot run and is the reference for the parity check. ``hidden_states[k]``
is the output of the first k decoder layers and HF's ``hidden_states[L]`` is the lm_head input,
which the cache stores as ``final_hidden``: post-final-norm for Llama/Qwen-style targets, and
``norm(hc_head(streams))`` for DeepSeek-V4. Feature index ``L`` is instead the last layer's raw
output, read by a hook as vLLM serves it. A V4 layer output is ``[B, S, hc_mult, H]``; its
feature is the mean over the hc streams, what vLLM's aux capture feeds a V4 draft.

Every captured row equals that row's own one-row forward: rows are right-padded into batches only
for families whose transformers model gives a padded row the same states
(``TargetFamily.padding_sensitive`` is false); the others are forwarded one row at a time.
Multimodal top levels (no causal-LM class) are loaded as image-text models; text rows run on their
ids, and an image row (a request with ``model_inputs``) is forwarded alone with its pixel values,
so its states are those of the VL forward a serving engine runs on the same prompt.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from sparkforge.producer.source import CaptureRequest, CaptureResult
from sparkforge.producer.target_head import TargetHead
from sparkforge.shared.hidden_features import layer_feature, served_hidden_states
from sparkforge.shared.images import ImageProblem
from sparkforge.shared.layer_ids import check_hf_ids
from sparkforge.shared.target_config import read_target_config
from sparkforge.shared.target_families import family_of, loads_as_image_text

logger = logging.getLogger(__name__)


class HfSource:
    """HiddenStateSource backed by ``AutoModelForCausalLM`` with ``output_hidden_states``.

    Args:
        model_path: Local checkpoint folder.
        layer_ids: Captured layers as HF ``hidden_states`` indices, strictly increasing.
        dtype: Model dtype.
        topk: Top-k logprobs per row (0 = none).
        device: Torch device for the forward.
        max_batch_tokens: Padded tokens per forward; requests are batched up to this budget,
            and a longer text row is forwarded in chunks of this many tokens.
        one_row: Forward every request alone (the parity reference), whatever the family.
        chunked: Forward a text row longer than ``max_batch_tokens`` in chunks, a KV cache
            carried between them, and yield each chunk's states as a result of its own
            (``row_start``, ``last``); False: every row whole (the parity reference).
    """

    def __init__(
        self,
        model_path: str,
        *,
        layer_ids: Sequence[int],
        dtype: str = "float32",
        topk: int = 0,
        device: str = "cpu",
        max_batch_tokens: int = 8192,
        one_row: bool = False,
        chunked: bool = True,
    ) -> None:
        model = _auto_class(model_path).from_pretrained(model_path, dtype=getattr(torch, dtype))
        self.model = model.to(device).eval()
        config = self.model.config.get_text_config()
        self.family = family_of(self.model.config.model_type)
        self.scaling = self.family.scaling(config.to_dict())
        self.one_row = one_row or self.family.padding_sensitive
        self.num_hidden_layers = int(config.num_hidden_layers)
        self.layer_ids = check_hf_ids(layer_ids, self.num_hidden_layers)
        self.dtype = getattr(torch, dtype)
        self.topk, self.device, self.max_batch_tokens = topk, device, max_batch_tokens
        self.chunked = chunked

    def engine_info(self) -> dict[str, Any]:
        """Engine name and version, captured ids and dtype for the manifest."""
        return {
            "engine": "hf",
            "engine_version": transformers.__version__,
            "tensor_parallel_size": 1,
            "expert_parallel": False,
            "data_parallel_size": 1,
            "layer_ids": list(self.layer_ids),
            "layer_id_convention": "hf_hidden_states_index",
            "features": self.family.features,
            "final_hidden": self.family.final_state,
            "embedding_scale": self.scaling.embedding_scale,
            "final_logit_softcapping": self.scaling.final_logit_softcapping,
            "dtype": str(self.dtype).removeprefix("torch."),
        }

    def capture(
        self, requests: Sequence[CaptureRequest], *, topk: int | None = None
    ) -> Iterator[CaptureResult]:
        """Run ``requests`` in right-padded batches; yield one result each, in request order (a
        long text row: one per chunk, see ``chunked``).

        An image row whose forward raises is answered with the skip reason
        ``image_processing_failed`` (its images, not the engine, are at fault).
        """
        k = self.topk if topk is None else topk
        for batch in self._batches(requests):
            if self._chunked(batch):
                yield from self._forward_chunks(batch[0], k)
                continue
            if batch[0].model_inputs is None:
                yield from self._forward(batch, k)
                continue
            try:
                results = list(self._forward(batch, k))
            except (IndexError, ValueError, RuntimeError) as exc:
                logger.warning("the vision forward failed on sample %d: %s: %s",
                               batch[0].sample_id, type(exc).__name__, str(exc)[:200])
                results = [CaptureResult(sample_id=batch[0].sample_id,
                                         skipped=ImageProblem.PROCESSING_FAILED.value)]
            yield from results

    def _batches(self, requests: Sequence[CaptureRequest]) -> Iterator[list[CaptureRequest]]:
        batch: list[CaptureRequest] = []
        longest = 0
        if self.one_row:
            yield from ([r] for r in requests)
            return
        for request in requests:
            if request.model_inputs is not None:
                yield [request]
                continue
            longest_if_added = max(longest, request.input_ids.shape[0])
            if batch and longest_if_added * (len(batch) + 1) > self.max_batch_tokens:
                yield batch
                batch, longest_if_added = [], request.input_ids.shape[0]
            batch.append(request)
            longest = longest_if_added
        if batch:
            yield batch

    def _chunked(self, batch: list[CaptureRequest]) -> bool:
        """Whether ``batch`` is one text row longer than a forward's token budget, which goes
        through the target in chunks (families whose chunked forward differs: whole)."""
        return (self.chunked and len(batch) == 1 and batch[0].model_inputs is None
                and batch[0].input_ids.shape[0] > self.max_batch_tokens
                and not self.family.chunk_sensitive)

    @torch.no_grad()
    def _forward(self, batch: list[CaptureRequest], k: int) -> Iterator[CaptureResult]:
        lengths = [r.input_ids.shape[0] for r in batch]
        ids_BT = torch.zeros(len(batch), max(lengths), dtype=torch.long)
        mask_BT = torch.zeros_like(ids_BT)
        for i, r in enumerate(batch):
            ids_BT[i, : lengths[i]] = torch.from_numpy(r.input_ids.astype("int64"))
            mask_BT[i, : lengths[i]] = 1
        extra = {name: value.to(self.device) for name, value in
                 (batch[0].model_inputs or {}).items()} if len(batch) == 1 else {}
        states, _ = self._states(ids_BT.to(self.device), k, attention_mask=mask_BT.to(self.device),
                                 **extra)
        for i, r in enumerate(batch):
            yield _row(r.sample_id, states, i, lengths[i], k)

    @torch.no_grad()
    def _forward_chunks(self, request: CaptureRequest, k: int) -> Iterator[CaptureResult]:
        """One long text row in chunks of ``max_batch_tokens`` tokens, the KV cache carried from
        chunk to chunk; each chunk's states are yielded as soon as they are computed, so what
        reaches the host is one chunk at a time (the device holds the cache and one chunk)."""
        ids_T = torch.from_numpy(request.input_ids.astype("int64")).to(self.device)
        total, step, cache = ids_T.shape[0], self.max_batch_tokens, None
        for start in range(0, total, step):
            states, cache = self._states(ids_T[None, start:start + step], k,
                                         past_key_values=cache, use_cache=True)
            n = min(step, total - start)
            yield replace(_row(request.sample_id, states, 0, n, k), row_start=start,
                          last=start + n == total)

    def _states(self, ids_BT: torch.Tensor, k: int, **inputs: Any) -> tuple[_States, Any]:
        """One forward: the captured features, the final state and the top-k of each row, left
        on the device (the capturer converts, and quantises, there and copies to the host once);
        and the model's KV cache (None unless ``use_cache``)."""
        with served_hidden_states(self.model) as served:
            out = self.model(
                input_ids=ids_BT, output_hidden_states=True,
                # Without top-k no logit is read: [B, T, V] fp32 logits would be the forward's
                # largest tensor on long rows (32K x 152K vocab: 20 GB).
                **({} if k else {"logits_to_keep": 1}), **inputs)
            states = served(out.hidden_states)
        aux_BTFH = torch.stack(
            [layer_feature(states[k_], self.family) for k_ in self.layer_ids], dim=2)
        topk = (torch.log_softmax(out.logits.float(), dim=-1).topk(k, dim=-1) if k else None)
        return (_States(aux_BTFH, out.hidden_states[self.num_hidden_layers],
                        None if topk is None else topk.indices,
                        None if topk is None else topk.values),
                out.past_key_values if inputs.get("use_cache") else None)

    def target_head(self) -> TargetHead:
        """The model's lm_head (fp32, CPU) and logit softcap, to recompute logits from the final
        state, which this backend takes as it is (no norm)."""
        config = self.model.config.get_text_config().to_dict()
        lm_head = self.model.get_output_embeddings()
        assert lm_head is not None, "a causal LM has an output projection"
        return TargetHead(
            norm_weight=None,
            eps=float(config.get("rms_norm_eps", 1e-6)),
            lm_head_weight=lm_head.weight.detach().float().cpu(),
            final_logit_softcapping=self.scaling.final_logit_softcapping,
        )

    def close(self) -> None:
        """Drop the model."""
        del self.model


def _auto_class(model_path: str) -> type[Any]:
    """``AutoModelForCausalLM``, or the image-text class for a multimodal top level without one."""
    if loads_as_image_text(read_target_config(model_path).model_type):
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


@dataclass(frozen=True)
class _States:
    """What one forward captured, ``[B, T, ...]`` on the capture device."""

    aux_BTFH: torch.Tensor
    final_BTH: torch.Tensor
    topk_ids_BTK: torch.Tensor | None
    topk_logprobs_BTK: torch.Tensor | None


def _row(sample_id: int, states: _States, i: int, length: int, k: int) -> CaptureResult:
    """Row ``i`` of a forward's states, its first ``length`` positions, as a capture result."""
    ids, lps = states.topk_ids_BTK, states.topk_logprobs_BTK
    return CaptureResult(
        sample_id=sample_id,
        aux_hidden=states.aux_BTFH[i, :length],
        final_hidden=states.final_BTH[i, :length],
        topk_ids=ids[i, :length].int().cpu() if k and ids is not None else None,
        topk_logprobs=lps[i, :length].cpu() if k and lps is not None else None,
    )
