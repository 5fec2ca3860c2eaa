"""Boundary checks on connector files and the alignment of vLLM's top-k logprobs."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from sparkforge.producer.payload import PayloadError, check_payload, split_payload, topk_rows

AUX = (1, 3, 4)


def _file(tmp_path, hidden, token_ids):
    path = tmp_path / "r.safetensors"
    save_file({"hidden_states": hidden, "token_ids": token_ids}, str(path))
    return load_file(str(path))


def _check(data, sent):
    check_payload(data, sample_id=7, sent_ids=sent, aux_ids=AUX, hidden_size=8)


def test_good_file_passes_and_splits_by_id(tmp_path) -> None:
    """A matching file passes; slots map to ascending aux ids, the last is the final residual."""
    hidden = torch.arange(5 * 3 * 8, dtype=torch.float32).reshape(5, 3, 8)
    sent = np.arange(5, dtype=np.int64)
    data = _file(tmp_path, hidden, torch.from_numpy(sent))
    _check(data, sent)
    parts = split_payload(data["hidden_states"], aux_ids=AUX, layer_ids=(1, 3), final_id=4)
    assert torch.equal(parts.aux_TFH, hidden[:, :2])
    assert torch.equal(parts.final_TH, hidden[:, 2])


def test_token_mismatch_is_rejected(tmp_path) -> None:
    """A file whose token ids differ from the request names the sample and first position."""
    sent = np.arange(5, dtype=np.int64)
    data = _file(tmp_path, torch.zeros(5, 3, 8), torch.tensor([0, 1, 9, 3, 4]))
    with pytest.raises(PayloadError, match="sample 7.*first difference at position 2"):
        _check(data, sent)


def test_short_file_is_rejected(tmp_path) -> None:
    """A file with fewer tokens than sent is rejected."""
    data = _file(tmp_path, torch.zeros(4, 3, 8), torch.arange(4))
    with pytest.raises(PayloadError, match="4 vs 5 tokens"):
        _check(data, np.arange(5, dtype=np.int64))


def test_wrong_slot_count_is_rejected(tmp_path) -> None:
    """A file with a different number of layer slots than requested is rejected."""
    data = _file(tmp_path, torch.zeros(5, 2, 8), torch.arange(5))
    with pytest.raises(PayloadError, match=r"shape \(5, 2, 8\) != expected \(5, 3, 8\)"):
        _check(data, np.arange(5, dtype=np.int64))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_values_pass_the_boundary(tmp_path, bad) -> None:
    """NaN/inf are no request failure here (a retry repeats them): the capturer's policy decides."""
    hidden = torch.zeros(5, 3, 8)
    hidden[3, 1, 5] = bad
    _check(_file(tmp_path, hidden, torch.arange(5)), np.arange(5, dtype=np.int64))


def _flat(entries):
    """A FlatLogprobs-shaped object from per-position lists of (token, logprob)."""
    flat = SimpleNamespace(start_indices=[], end_indices=[], token_ids=[], logprobs=[])
    for entry in entries:
        flat.start_indices.append(len(flat.token_ids))
        flat.token_ids += [t for t, _ in entry]
        flat.logprobs += [lp for _, lp in entry]
        flat.end_indices.append(len(flat.token_ids))
    return flat


def test_topk_rows_shift_prompt_entries_and_append_the_sampled_step() -> None:
    """Row t holds prompt entry t+1 (scored token dropped); the last row is the sampled step."""
    prompt = _flat([[], [(5, -1.0), (6, -0.1), (5, -1.0)], [(9, -3.0), (1, -0.2), (2, -0.3)]])
    sampled = _flat([[(4, -0.5), (4, -0.5), (8, -0.9)]])
    ids, lps = topk_rows(prompt, sampled, num_tokens=3, k=2)
    assert ids.tolist() == [[6, 5], [1, 2], [4, 8]]
    expected = torch.tensor([[-0.1, -1.0], [-0.2, -0.3], [-0.5, -0.9]])
    torch.testing.assert_close(lps, expected)
