"""Helper run as a subprocess by the TP=2 test: capture requests from an .npz with TP=2 (mp mode).

Usage: python -P capture_tp2.py MODEL_DIR REQUESTS.npz OUT.pt
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from sparkforge.producer.engine_options import EngineOptions
from sparkforge.producer.source import CaptureRequest, whole_results

if __name__ == "__main__":
    from sparkforge.producer.vllm_source import VllmSource

    model, requests_path, out_path = sys.argv[1:4]
    arrays = np.load(requests_path)
    requests = [CaptureRequest(sample_id=int(k), input_ids=arrays[k]) for k in arrays.files]
    engine = EngineOptions(
        model=model,
        dtype="float32",
        max_model_len=256,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        enforce_eager=True,
        tensor_parallel_size=2,
        extra={"distributed_executor_backend": "mp"},
    )
    source = VllmSource(engine, layer_ids=(1, 3, 4), topk=4, window=2, verify_every=1)
    results = {r.sample_id: r for r in whole_results(source.capture(requests))}
    info = source.engine_info()
    source.close()
    torch.save(
        {
            "info": info,
            "results": {
                k: (r.aux_hidden, r.final_hidden, r.topk_ids, r.error) for k, r in results.items()
            },
        },
        out_path,
    )
