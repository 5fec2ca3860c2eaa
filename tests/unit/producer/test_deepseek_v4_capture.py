"""DeepSeek-V4 capture: pieces by V4's own names, stream-mean features, lm_head-input final."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from producer_helpers import HookSource
from safetensors.torch import load as load_safetensors

from sparkforge.producer.hf_source import HfSource
from sparkforge.producer.parity import REL_TOL, run_parity
from sparkforge.producer.source import CaptureRequest
from sparkforge.producer.target_files import target_files
from sparkforge.producer.target_head import load_target_head

LAYER_IDS = (1, 2, 3, 4)   # HF indices of feature ids 0..3, L-1 = 3 included


def _requests() -> list[CaptureRequest]:
    rng = np.random.default_rng(4)
    return [CaptureRequest(sample_id=i, input_ids=rng.integers(4, 1000, n).astype(np.int32))
            for i, n in enumerate((24, 9, 17))]


def test_v4_target_files_hold_head_and_hc_head(tiny_v4_target: Path) -> None:
    """V4's head.weight, final norm and hc_head weights land under the cache names, unchanged."""
    from safetensors import safe_open

    weights = load_safetensors(
        target_files(tiny_v4_target, hidden_dtype="float32")["weights.safetensors"])
    with safe_open(str(tiny_v4_target / "model.safetensors"), framework="pt") as f:
        source = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    pairs = {"lm_head.weight": "head.weight", "embed_tokens.weight": "model.embed_tokens.weight",
             "norm.weight": "model.norm.weight", "hc_head.hc_fn": "model.hc_head.hc_fn",
             "hc_head.hc_base": "model.hc_head.hc_base",
             "hc_head.hc_scale": "model.hc_head.hc_scale"}
    assert set(weights) == set(pairs)
    for ours, theirs in pairs.items():
        assert torch.equal(weights[ours], source[theirs].float()), ours


def test_v4_final_is_not_finished_offline(tiny_v4_target: Path) -> None:
    """A V4 final state cannot be finished from one residual: no offline norm is given."""
    with pytest.raises(ValueError, match="deepseek_v4 family.*capture the lm_head input"):
        load_target_head(tiny_v4_target, with_lm_head=False)


def test_v4_features_are_stream_means_and_final_is_lm_head_input(tiny_v4_target: Path) -> None:
    """aux = mean over hc streams of hidden_states[k]; lm_head(final) = the model's logits."""
    source = HfSource(str(tiny_v4_target), layer_ids=LAYER_IDS, topk=2)
    assert source.engine_info()["features"] == "hc_mean"
    assert source.engine_info()["final_hidden"] == "lm_head_input"
    for request, result in zip(_requests(), source.capture(_requests()), strict=True):
        ids = torch.from_numpy(request.input_ids.astype(np.int64))[None]
        with torch.no_grad():
            out = source.model(ids, output_hidden_states=True, use_cache=False)
        assert out.hidden_states[2].dim() == 4
        torch.testing.assert_close(result.aux_hidden[:, 1], out.hidden_states[2][0].mean(1))
        torch.testing.assert_close(source.model.lm_head(result.final_hidden), out.logits[0],
                                   atol=1e-4, rtol=1e-5)


def test_v4_last_layer_feature_is_the_stream_mean_before_hc_head(tiny_v4_target: Path) -> None:
    """Feature id L-1 = mean over the streams the last layer hands to hc_head: norm(hc_head(those
    streams)) is HF's hidden_states[L], which the feature itself is not."""
    source = HfSource(str(tiny_v4_target), layer_ids=LAYER_IDS)
    model = source.model
    results = list(source.capture(_requests()))
    seen: list[torch.Tensor] = []
    handle = model.model.layers[-1].register_forward_hook(
        lambda module, args, output: seen.append(output))
    for request, result in zip(_requests(), results, strict=True):
        with torch.no_grad():
            out = model(torch.from_numpy(request.input_ids.astype(np.int64))[None],
                        output_hidden_states=True, use_cache=False)
            streams = seen.pop()
            assert streams.dim() == 4
            torch.testing.assert_close(model.model.norm(model.model.hc_head(streams)),
                                       out.hidden_states[4])
        torch.testing.assert_close(result.aux_hidden[:, 3], streams[0].mean(1))
        assert (result.aux_hidden[:, 3] - out.hidden_states[4][0]).abs().max() > 0.1
    handle.remove()


def test_v4_parity_passes_against_module_hooks(tiny_v4_target: Path) -> None:
    """The HF backend agrees with a capture read from layer and lm_head hooks."""
    reference = HfSource(str(tiny_v4_target), layer_ids=LAYER_IDS)
    report = run_parity(HookSource(tiny_v4_target, layer_ids=LAYER_IDS), reference, _requests())
    assert report.passed, report.table()
    assert max(p.rel for p in report.layers) < 1e-5


@pytest.mark.parametrize(("variant", "broken"), [
    ({"reduce": "sum"}, {"hidden_states[1]", "hidden_states[2]", "hidden_states[3]",
                         "hidden_states[4]"}),
    ({"final": "before_hc_head"}, {"final"}),
])
def test_v4_parity_fails_on_wrong_semantics(
    tiny_v4_target: Path, variant: dict[str, str], broken: set[str]
) -> None:
    """Summed streams or a final state taken before hc_head fail parity at that entry."""
    reference = HfSource(str(tiny_v4_target), layer_ids=LAYER_IDS)
    wrong = HookSource(tiny_v4_target, layer_ids=LAYER_IDS, **variant)
    report = run_parity(wrong, reference, _requests())
    assert not report.passed
    errors = {p.name: p.rel for p in report.layers}
    assert {name for name, rel in errors.items() if rel > 100 * REL_TOL["float32"]} == broken, (
        report.table())
    assert all(rel < REL_TOL["float32"] for name, rel in errors.items() if name not in broken)
