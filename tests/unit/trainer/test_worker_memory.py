"""Workers started by spawn or forkserver map the rank's large arrays instead of copying them."""

from __future__ import annotations

import multiprocessing
from contextlib import nullcontext
from typing import Any

import numpy as np
import pytest
from process_helpers import mapping_of

from sparkforge.trainer.worker_memory import MIN_SHARED_BYTES, arrays_in_shared_memory


def _report(arrays: dict[str, np.ndarray], results: Any) -> None:
    results.put({name: (mapping_of(a), a.flags.writeable, a.dtype.str, a.shape, a.tobytes())
                 for name, a in arrays.items()})


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_processes_started_inside_map_one_shared_copy(method: str) -> None:
    """Inside the block, two processes receive the large arrays as read-only views of one
    /dev/shm block, equal in dtype, shape and bytes; small arrays, and everything sent
    outside the block, arrive as private copies."""
    context = multiprocessing.get_context(method)
    big = MIN_SHARED_BYTES // 8
    arrays = {"ids": np.arange(big, dtype=np.int64) * 3,
              "strided": np.arange(2 * MIN_SHARED_BYTES, dtype=np.uint16).reshape(2, -1)[:, ::2],
              "hashes": np.array([b"%015d" % i for i in range(big)], dtype="S15"),
              "small": np.arange(10, dtype=np.int32)}
    for shared in (True, False):
        results = context.Queue()
        with arrays_in_shared_memory() if shared else nullcontext():
            workers = [context.Process(target=_report, args=(arrays, results)) for _ in range(2)]
            for w in workers:
                w.start()
        got = [results.get(timeout=120) for _ in workers]
        for w in workers:
            w.join(timeout=60)
        for name, a in arrays.items():
            for where, writeable, dtype, shape, raw in (g[name] for g in got):
                assert (dtype, shape, raw) == (a.dtype.str, a.shape, a.tobytes()), name
                in_shm = where.startswith("/dev/shm/")
                assert in_shm == (shared and name != "small"), (name, shared, where)
                assert writeable == (not in_shm), name
            if shared and name != "small":
                assert got[0][name][0] == got[1][name][0], f"{name}: two copies"

