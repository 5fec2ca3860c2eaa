"""The transformers backend: right layers (the last one raw), post-norm final, exact batching."""

from __future__ import annotations

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from sparkforge.producer.hf_source import HfSource
from sparkforge.producer.source import CaptureRequest


def _requests():
    rng = np.random.default_rng(2)
    return [
        CaptureRequest(sample_id=i, input_ids=rng.integers(4, 1000, n).astype(np.int32))
        for i, n in enumerate((30, 5, 17))
    ]


def test_hf_source_returns_layers_and_lm_head_input(tiny_target) -> None:
    """aux = hidden_states[k]; lm_head(final) = the model's logits; top-k from row t's logits."""
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    source = HfSource(str(tiny_target), layer_ids=(1, 2), topk=3)
    for request, result in zip(_requests(), source.capture(_requests()), strict=True):
        with torch.no_grad():
            out = model(
                torch.from_numpy(request.input_ids.astype(np.int64))[None],
                output_hidden_states=True,
            )
        torch.testing.assert_close(result.aux_hidden[:, 1], out.hidden_states[2][0])
        logits = model.lm_head(result.final_hidden)
        torch.testing.assert_close(logits, out.logits[0], atol=1e-4, rtol=1e-5)
        assert torch.equal(result.topk_ids.long(), out.logits[0].topk(3, dim=-1).indices)


def test_padded_batches_equal_single_forwards(tiny_target) -> None:
    """Right-padded batches give the same states as one request per forward."""
    batched = list(
        HfSource(str(tiny_target), layer_ids=(1, 3), max_batch_tokens=4096).capture(_requests())
    )
    single = list(HfSource(str(tiny_target), layer_ids=(1, 3), one_row=True).capture(_requests()))
    for a, b in zip(batched, single, strict=True):
        assert a.sample_id == b.sample_id
        torch.testing.assert_close(a.aux_hidden, b.aux_hidden, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.final_hidden, b.final_hidden, atol=1e-5, rtol=1e-5)


def test_a_long_row_is_captured_chunk_by_chunk_as_one_forward_computes_it(tiny_target) -> None:
    """A row longer than the forward budget goes through in chunks of that many tokens (a KV
    cache carried between them), each chunk its own result as soon as it is computed; joined,
    they equal one plain transformers forward of the whole row within fp32 noise (layers, the
    raw last layer, the lm_head input, the top-k). Shorter rows are still one result each."""
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    long = CaptureRequest(sample_id=7, input_ids=np.random.default_rng(5).integers(
        4, 1000, 100).astype(np.int32))
    source = HfSource(str(tiny_target), layer_ids=(1, 4), topk=3, max_batch_tokens=16)
    results = list(source.capture([_requests()[1], long]))
    assert [(r.sample_id, r.row_start, r.last) for r in results] == [
        (1, 0, True), *((7, start, start == 96) for start in range(0, 100, 16))]
    chunks = results[1:]
    ids = torch.from_numpy(long.input_ids.astype(np.int64))[None]
    raw, out = _last_layer_output(model, ids)
    joined = {name: torch.cat([getattr(r, name) for r in chunks])
              for name in ("aux_hidden", "final_hidden", "topk_ids")}
    torch.testing.assert_close(joined["aux_hidden"][:, 0], out.hidden_states[1][0],
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(joined["aux_hidden"][:, 1], raw[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(joined["final_hidden"], out.hidden_states[4][0],
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(joined["topk_ids"].long(), out.logits[0].topk(3, dim=-1).indices)


def _last_layer_output(model, ids: torch.Tensor) -> tuple[torch.Tensor, object]:
    """The last decoder layer's raw output (a hook in this test) and the forward's output."""
    seen: list[torch.Tensor] = []
    handle = model.model.layers[-1].register_forward_hook(
        lambda module, args, output: seen.append(output))
    try:
        with torch.no_grad():
            out = model(ids, output_hidden_states=True, use_cache=False)
    finally:
        handle.remove()
    return seen[0], out


def test_last_layer_feature_is_the_raw_pre_norm_output(tiny_target) -> None:
    """Feature id L-1 (HF index L) = the last layer's output before the final norm, as vLLM serves
    it: RMSNorm of it is HF's post-norm hidden_states[L], which it is not itself."""
    source = HfSource(str(tiny_target), layer_ids=(1, 4))
    model = source.model
    for request, result in zip(_requests(), source.capture(_requests()), strict=True):
        ids = torch.from_numpy(request.input_ids.astype(np.int64))[None]
        raw, out = _last_layer_output(model, ids)
        torch.testing.assert_close(result.aux_hidden[:, 1], raw[0])
        post_norm = out.hidden_states[4][0]
        torch.testing.assert_close(model.model.norm(result.aux_hidden[:, 1]), post_norm)
        assert (result.aux_hidden[:, 1] - post_norm).abs().max() > 0.1
        torch.testing.assert_close(result.final_hidden, post_norm)


def test_no_logits_are_computed_without_top_k(tiny_target) -> None:
    """Without top-k the lm_head runs on each row's last position only (a long row's [T, V]
    logits would dwarf its features); the captured states are those of the top-k capture."""
    with_topk = list(HfSource(str(tiny_target), layer_ids=(1, 3), topk=2).capture(_requests()))
    source = HfSource(str(tiny_target), layer_ids=(1, 3))
    rows_seen: list[int] = []
    handle = source.model.lm_head.register_forward_hook(
        lambda module, args, output: rows_seen.append(args[0].shape[1]))
    try:
        plain = list(source.capture(_requests()))
    finally:
        handle.remove()
    assert rows_seen
    assert set(rows_seen) == {1}
    for a, b in zip(plain, with_topk, strict=True):
        assert a.topk_ids is None
        torch.testing.assert_close(a.aux_hidden, b.aux_hidden)
        torch.testing.assert_close(a.final_hidden, b.final_hidden)
