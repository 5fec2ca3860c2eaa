"""DataLoader workers that are not forked map the rank's columns instead of copying them.

A forked worker shares the rank's memory copy-on-write: the index columns and the epoch plans
cost it nothing. A worker started by ``spawn`` or ``forkserver`` (Python 3.14's default on Linux)
unpickles its dataset instead, so each would hold a private copy of every column. While a
loader starts such workers, :func:`arrays_in_shared_memory` sends each large numpy array through
one block of shared memory (torch's, passed as a file descriptor), which every worker of the
rank maps read-only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler
from typing import Any, Final

import numpy as np
import torch

MIN_SHARED_BYTES: Final = 1 << 16
"""Arrays smaller than this are pickled as usual (a block of shared memory costs a file
descriptor and a page)."""


@contextmanager
def arrays_in_shared_memory() -> Iterator[None]:
    """Within the block, processes the multiprocessing pickler starts receive the numpy arrays
    of at least :data:`MIN_SHARED_BYTES` it sends as read-only views of shared memory; one array
    sent to several processes is copied into shared memory once."""
    blocks: dict[int, tuple[np.ndarray, torch.Tensor]] = {}
    """id(array) -> (the array, kept alive so its id stays its own; its shared copy)."""

    def reduce(array: np.ndarray) -> Any:
        if array.nbytes < MIN_SHARED_BYTES or array.dtype.hasobject or array.ndim == 0:
            return array.__reduce__()
        kept = blocks.get(id(array))
        if kept is None:
            block = torch.empty(array.nbytes, dtype=torch.uint8).share_memory_()
            block.numpy()[:] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
            kept = blocks[id(array)] = (array, block)
        return _from_shared, (kept[1], array.dtype, array.shape)

    reducers: dict[type, Any] = ForkingPickler._extra_reducers  # type: ignore[attr-defined]
    previous = reducers.get(np.ndarray)
    ForkingPickler.register(np.ndarray, reduce)
    try:
        yield
    finally:
        if previous is None:
            reducers.pop(np.ndarray, None)
        else:
            ForkingPickler.register(np.ndarray, previous)


def _from_shared(block: torch.Tensor, dtype: np.dtype[Any], shape: tuple[int, ...]
                 ) -> np.ndarray:
    """The array a worker receives: a read-only view of the shared block (which it keeps
    mapped as long as the view lives)."""
    array = block.numpy().view(dtype).reshape(shape)
    array.flags.writeable = False
    return array
