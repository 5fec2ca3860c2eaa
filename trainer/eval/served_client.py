"""Send eval's prompts to an OpenAI-compatible server and time the answers.

Prompts travel as token ids (``/v1/completions`` with ``prompt: [ids]``), so the server decodes
exactly what the reference decoder decodes, never a re-tokenised text. Each request pins the
sampling eval measures at (``temperature``, ``top_p`` 1, ``top_k`` -1: a server's own default
top-k would make sampled acceptance incomparable) and a seed per prompt. Standard library only:
this module runs in the trainer's environment, which has no vLLM.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from sparkforge.shared.errors import SparkforgeError


@dataclass(frozen=True)
class Completion:
    """One answered prompt."""

    tokens: list[int]
    """Generated ids (empty when the server does not return them)."""
    num_tokens: int
    """Generated tokens, as the server counts them (``usage.completion_tokens``)."""
    spec: dict[str, Any] | None
    """The response's ``metrics.speculative_decoding`` (vLLM), when it has one."""


@dataclass(frozen=True)
class RequestRun:
    """Every prompt answered once at one concurrency."""

    completions: list[Completion]
    wall_s: float
    concurrency: int

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens over the run's wall time."""
        return sum(c.num_tokens for c in self.completions) / self.wall_s if self.wall_s else 0.0


def _call(url: str, payload: dict[str, Any] | None, timeout_s: float) -> Any:
    """GET (no payload) or POST JSON to ``url``; the decoded JSON, or the text of a non-JSON
    page. Any failure is one line naming the URL."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = response.read().decode()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace").strip().splitlines()
        raise SparkforgeError(f"{url}: HTTP {exc.code}: {detail[0][:300] if detail else ''}"
                              ) from exc
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        reason = getattr(exc, "reason", exc)
        raise SparkforgeError(f"{url}: {reason} (is an OpenAI-compatible server running "
                              "there?)") from exc
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        return body


def served_model(base_url: str, timeout_s: float = 30.0) -> str:
    """The name of the model a server serves (the first of ``/v1/models``)."""
    models = _call(f"{base_url}/v1/models", None, timeout_s)
    try:
        return str(models["data"][0]["id"])
    except (KeyError, IndexError, TypeError) as exc:
        raise SparkforgeError(f"{base_url}/v1/models lists no model: {str(models)[:200]}"
                              ) from exc


def metrics_page(base_url: str, timeout_s: float = 30.0) -> str:
    """The server's Prometheus page (``/metrics``)."""
    return str(_call(f"{base_url}/metrics", None, timeout_s))


def complete(base_url: str, model: str, prompt: Sequence[int], *, max_tokens: int,
             temperature: float, seed: int, timeout_s: float) -> Completion:
    """One completion of a token-id prompt."""
    payload = {"model": model, "prompt": [int(t) for t in prompt], "max_tokens": max_tokens,
               "temperature": temperature, "top_p": 1.0, "top_k": -1, "seed": seed,
               "return_token_ids": True}
    answer = _call(f"{base_url}/v1/completions", payload, timeout_s)
    try:
        choice = answer["choices"][0]
        num_tokens = int(answer["usage"]["completion_tokens"])
    except (KeyError, IndexError, TypeError) as exc:
        raise SparkforgeError(f"{base_url}/v1/completions: no choice or usage in the answer: "
                              f"{str(answer)[:200]}") from exc
    spec = (answer.get("metrics") or {}).get("speculative_decoding")
    return Completion(tokens=[int(t) for t in choice.get("token_ids") or []],
                      num_tokens=num_tokens, spec=spec)


def run_requests(base_url: str, model: str, prompts: Sequence[Sequence[int]], *,
                 concurrency: int, max_tokens: int, temperature: float, seed: int,
                 timeout_s: float) -> RequestRun:
    """Every prompt once, ``concurrency`` in flight; prompt ``i`` samples with seed
    ``seed + i``. Completions come back in prompt order."""
    def one(i: int) -> Completion:
        return complete(base_url, model, prompts[i], max_tokens=max_tokens,
                        temperature=temperature, seed=seed + i, timeout_s=timeout_s)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        completions = list(tqdm(pool.map(one, range(len(prompts))), total=len(prompts),
                                desc=f"served, {concurrency} in flight", unit="prompt"))
    return RequestRun(completions=completions, wall_s=time.perf_counter() - start,
                      concurrency=concurrency)
