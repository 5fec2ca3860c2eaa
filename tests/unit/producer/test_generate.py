"""Response regeneration with a plain vLLM engine: decoded text, finish reasons, seeds."""

from __future__ import annotations

import os

import numpy as np
import pytest
from transformers import AutoTokenizer

from sparkforge.producer.engine_options import EngineOptions

pytestmark = pytest.mark.slow


def test_generate_responses_decode_and_reproduce_per_seed(tiny_target) -> None:
    """Same prompt + same seed gives the same response; text decodes the returned token ids."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from sparkforge.producer.vllm_source import generate_responses

    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    prompt = np.asarray(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "the model and the cache"}],
            add_generation_prompt=True,
            return_dict=False,
        ),
        dtype=np.int32,
    )
    engine = EngineOptions(
        model=str(tiny_target), dtype="float32", max_model_len=256, enforce_eager=True
    )
    out = generate_responses(
        engine,
        [prompt, prompt, prompt],
        temperature=1.0,
        top_p=0.95,
        max_tokens=12,
        seed=0,
        seeds=[5, 5, 6],
    )
    assert len(out) == 3
    assert np.array_equal(out[0].token_ids, out[1].token_ids)
    assert not np.array_equal(out[0].token_ids, out[2].token_ids)
    for response in out:
        assert 1 <= response.token_ids.shape[0] <= 12
        assert response.finish_reason in {"stop", "length"}
        assert response.text == tokenizer.decode(response.token_ids, skip_special_tokens=True)
