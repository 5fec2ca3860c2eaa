"""Test helper: start processes as torchrun starts the ranks of one node (env rendezvous)."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any


def start_ranks(cmd: Sequence[str], *, world_size: int = 2, env: Mapping[str, str] | None = None,
                **popen: Any) -> list[subprocess.Popen[Any]]:
    """``world_size`` processes of ``cmd`` on a free local port, rank i with ``RANK=i``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [subprocess.Popen(list(cmd), env={
        **os.environ, **(env or {}), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world_size), "RANK": str(rank), "LOCAL_RANK": str(rank),
        "NODE_RANK": "0"}, **popen) for rank in range(world_size)]
