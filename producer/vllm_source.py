"""The vLLM capture backend (with its connector, plugin and CPU memory sizing, the only modules
importing vllm): teacher-forced prefill with the built-in ``extract_hidden_states`` method,
consumed file by file, a long prompt in chunks as chunked prefill computes it.

Requests go in as token ids through ``LLMEngine`` with at most ``window`` in flight. The connector
saves each step's completed blocks of a request as a chunk file and the rest when the request
finishes (``sparkforge.producer.hs_connector``); without top-k or a logprob check, a chunk is read
and handed on while its request still runs, so the scratch folder holds chunks, not samples (the
engine returns prompt logprobs only when a prompt's prefill is done, so with them a request's chunks
wait in the folder until it finishes). Each file is checked against its rows of the request, split
into the captured layers and the final state, optionally checked against the engine's own prompt
logprobs, and deleted. The final state is the pre-norm residual (aux id L) finished with the
target's RMSNorm, or, for families whose lm_head input is not that norm, the lm_head input itself,
which the ``sparkforge.producer.lm_head_capture`` plugin stores in one more aux slot.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import vllm
from safetensors import SafetensorError
from safetensors.torch import load_file
from vllm import LLM, SamplingParams
from vllm.exceptions import VLLMClientError, VLLMError
from vllm.inputs import TokensPrompt
from vllm.platforms import current_platform
from vllm.v1.engine.core_client import InprocClient

from sparkforge.producer.engine_options import EngineOptions
from sparkforge.producer.hs_connector import STREAM_KEY, chunk_path
from sparkforge.producer.lm_head_capture import LM_HEAD_INPUT_KEY, lm_head_input_id
from sparkforge.producer.payload import (
    PayloadError,
    check_payload,
    scored_token_logprobs,
    split_payload,
    topk_rows,
)
from sparkforge.producer.source import CaptureRequest, CaptureResult
from sparkforge.producer.target_head import load_target_head
from sparkforge.producer.vllm_memory import cpu_engine_kwargs
from sparkforge.shared.errors import SparkforgeError
from sparkforge.shared.layer_ids import check_hf_ids, vllm_aux_ids
from sparkforge.shared.target_config import read_target_config
from sparkforge.shared.target_families import family_of

logger = logging.getLogger(__name__)

CONNECTOR = "HostHiddenStatesConnector"
CONNECTOR_MODULE = "sparkforge.producer.hs_connector"
PLUGIN = "sparkforge-lm-head-input"
"""Name of the ``vllm.general_plugins`` entry point (pyproject.toml) that captures the lm_head
input; an allow-list in ``VLLM_PLUGINS`` must name it."""


def engine_kwargs(engine: EngineOptions) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments for a token-id-only engine without prefix caching (on the
    CPU platform with its host memory sized and checked: ``sparkforge.producer.vllm_memory``)."""
    kwargs: dict[str, Any] = {
        "model": engine.model,
        "revision": engine.revision,
        "dtype": engine.dtype,
        "quantization": engine.quantization,
        "kv_cache_dtype": engine.kv_cache_dtype,
        "tensor_parallel_size": engine.tensor_parallel_size,
        "data_parallel_size": engine.data_parallel_size,
        "enable_expert_parallel": engine.enable_expert_parallel,
        "max_model_len": engine.max_model_len,
        "gpu_memory_utilization": engine.gpu_memory_utilization,
        "max_num_seqs": engine.max_num_seqs,
        "max_num_batched_tokens": engine.max_num_batched_tokens,
        "enable_chunked_prefill": engine.enable_chunked_prefill,
        "enforce_eager": engine.enforce_eager,
        "seed": engine.seed,
        "enable_prefix_caching": False,
    }
    return cpu_engine_kwargs(kwargs | engine.extra)


class EngineStopped(SparkforgeError, RuntimeError):
    """The vLLM engine died mid-capture (a kernel or worker error): the run stops with exit 1."""


@dataclass
class _Job:
    request: CaptureRequest
    attempt: int
    verify: bool
    output: Any = None
    engine_id: str = ""
    """The engine's id of the request (the connector names its files by it)."""
    done: int = 0
    """Rows of the sample already handed on."""
    error: str | None = None
    """Why a chunk read while the request ran failed (the request's files are then dropped)."""


class VllmSource:
    """HiddenStateSource backed by a vLLM engine and the hidden-states KV connector.

    Args:
        engine: Engine options; the model folder must hold ``config.json`` and safetensors.
        layer_ids: Captured layers as HF ``hidden_states`` indices, strictly increasing.
        topk: Top-k prompt logprobs per row (0 = none).
        scratch_dir: Folder for the connector's files (default: a fresh folder in /dev/shm).
        window: Most requests in flight (default ``engine.max_num_seqs``, so the engine can fill
            its batches); bounds the scratch space to ``window`` files of ``T x (F + 1) x H``
            elements each.
        max_retries: Resubmissions of a request whose capture failed before it is reported.
        verify_every: Check one request in this many against vLLM's logprobs (0 = never).
        lm_head_input: Take the final state from the captured lm_head input instead of the
            offline norm of the pre-norm residual; None: when the target family needs it.
        chunked: Save and return a request's rows step by step as the engine computes them
            (results with ``row_start``/``last``); False: one file and one result per sample.
    """

    def __init__(
        self,
        engine: EngineOptions,
        *,
        layer_ids: Sequence[int],
        topk: int = 0,
        scratch_dir: str | Path | None = None,
        window: int | None = None,
        max_retries: int = 2,
        verify_every: int = 100,
        lm_head_input: bool | None = None,
        chunked: bool = True,
    ) -> None:
        config = read_target_config(engine.model)
        self.family = family_of(config.model_type)
        self.scaling = self.family.scaling(config.text)
        self.num_hidden_layers = config.positive_int("num_hidden_layers")
        self.hidden_size = config.positive_int("hidden_size")
        self.layer_ids = check_hf_ids(layer_ids, self.num_hidden_layers)
        self.lm_head_input = (
            not self.family.final_from_residual if lm_head_input is None else lm_head_input)
        self.aux_ids: tuple[int, ...] = vllm_aux_ids(self.layer_ids, self.num_hidden_layers)
        if self.lm_head_input:
            _check_plugin_allowed()
            self.aux_ids = (*self.aux_ids, lm_head_input_id(self.num_hidden_layers))
        self.topk, self.max_retries = topk, max_retries
        self.window = window or engine.max_num_seqs
        self.verify_every = verify_every
        self.chunked = chunked
        self._engine_options = engine
        self._head = load_target_head(engine.model, with_lm_head=verify_every > 0,
                                      with_norm=not self.lm_head_input)
        self._own_scratch = scratch_dir is None
        shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
        self.scratch_dir = Path(scratch_dir or tempfile.mkdtemp(prefix="sparkforge-hs-", dir=shm))
        _keep_cpu_reservation(engine)
        self._llm = LLM(**self._build_kwargs(engine))
        self._engine = self._llm.llm_engine
        self._in_process = isinstance(self._engine.engine_core, InprocClient)
        if current_platform.is_cpu() and not self._in_process:
            # The CPU workers own the cores; a multi-threaded norm/check here oversubscribes them
            # (measured: 1.7 s with 2 threads vs 0.1 s with 1 for 64 x 512 tokens, H=512).
            logger.info("CPU engine in worker processes: torch threads here set to 1")
            torch.set_num_threads(1)
        dtype = self._engine.model_config.dtype
        assert isinstance(dtype, torch.dtype), "vLLM resolves the model dtype at start-up"
        self.dtype = dtype
        self._num_submitted = 0
        self.timings = {"engine_s": 0.0, "file_load_s": 0.0, "check_s": 0.0, "norm_s": 0.0}

    def _build_kwargs(self, engine: EngineOptions) -> dict[str, Any]:
        draft_config: dict[str, Any] = {"eagle_aux_hidden_state_layer_ids": list(self.aux_ids)}
        if self.lm_head_input:
            draft_config[LM_HEAD_INPUT_KEY] = lm_head_input_id(self.num_hidden_layers)
        kwargs = engine_kwargs(engine) | {
            "skip_tokenizer_init": True,
            "speculative_config": {
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": draft_config},
            },
            "kv_transfer_config": {
                "kv_connector": CONNECTOR,
                "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(self.scratch_dir),
                                              STREAM_KEY: self.chunked},
            },
        }
        kwargs.setdefault("max_logprobs", max(20, self.topk))
        return kwargs

    def engine_info(self) -> dict[str, Any]:
        """Engine name, version, parallel sizes, aux ids and dtype for the manifest."""
        e = self._engine_options
        return {
            "engine": "vllm",
            "engine_version": vllm.__version__,
            "tensor_parallel_size": e.tensor_parallel_size,
            "expert_parallel": e.enable_expert_parallel,
            "data_parallel_size": e.data_parallel_size,
            "layer_ids": list(self.layer_ids),
            "layer_id_convention": "hf_hidden_states_index",
            "vllm_aux_ids": list(self.aux_ids),
            "features": self.family.features,
            "final_hidden": "lm_head_input" if self.lm_head_input else "post_norm",
            "final_norm": (f"captured: aux id {lm_head_input_id(self.num_hidden_layers)} is the "
                           "lm_head input" if self.lm_head_input
                           else "offline RMSNorm(aux id L) in fp32"),
            "embedding_scale": self.scaling.embedding_scale,
            "final_logit_softcapping": self.scaling.final_logit_softcapping,
            "dtype": str(self.dtype).removeprefix("torch."),
            "quantization": e.quantization,
            "kv_cache_dtype": e.kv_cache_dtype,
        }

    def capture(
        self, requests: Sequence[CaptureRequest], *, topk: int | None = None
    ) -> Iterator[CaptureResult]:
        """Run ``requests`` in a sliding window; yield each one's results (its chunks in row
        order, the last one ``last``), requests in completion order.

        Args:
            requests: Token-id sequences.
            topk: Overrides the source's ``topk`` for this call (parity asks for logprobs).
        """
        k = self.topk if topk is None else topk
        todo = deque(_Job(r, 0, False) for r in requests)
        running: dict[str, _Job] = {}
        written: deque[_Job] = deque()
        try:
            while todo or running or written:
                while todo and len(running) + len(written) < self.window:
                    rejected = self._submit(todo.popleft(), running, k)
                    if rejected is not None:
                        yield rejected
                for running_job in list(running.values()):
                    yield from self._chunks_so_far(running_job, k)
                job = self._pop_readable(written)
                if job is None:
                    self._advance(running, written)
                    continue
                for result in self._rest(job, k):
                    if (result.error is not None and job.done == 0
                            and job.attempt < self.max_retries):
                        logger.warning("retrying sample %d: %s", job.request.sample_id,
                                       result.error)
                        todo.append(_Job(job.request, job.attempt + 1, job.verify))
                        break
                    yield result
        except GeneratorExit:
            # The caller stopped early. Aborting is not enough: the connector still saves an
            # aborted request's file, at a time of its choosing. Finishing the (at most
            # ``window``) requests in flight and deleting their files leaves nothing behind.
            self._drain(running, written)
            raise

    def _drain(self, running: dict[str, _Job], written: deque[_Job]) -> None:
        while running or written:
            job = self._pop_readable(written)
            if job is None:
                self._advance(running, written)
            else:
                self._remove_files(job)

    def _submit(self, job: _Job, running: dict[str, _Job], k: int) -> CaptureResult | None:
        """Add one request; a request the engine refuses (e.g. too long) fails without retry."""
        job.verify = job.verify or (
            self.verify_every > 0 and self._num_submitted % self.verify_every == 0
        )
        self._num_submitted += 1
        request_id = f"s{job.request.sample_id}-{self._num_submitted}"  # unique per submission
        num_logprobs = max(k, 1) if job.verify else k
        params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            detokenize=False,
            prompt_logprobs=num_logprobs or None,
            logprobs=num_logprobs or None,
            flat_logprobs=True,
        )
        prompt = TokensPrompt(prompt_token_ids=job.request.input_ids.tolist())
        try:
            job.engine_id = self._engine.add_request(request_id, prompt, params)
        except (VLLMClientError, ValueError) as exc:
            return CaptureResult(sample_id=job.request.sample_id, error=f"engine refused: {exc}")
        running[request_id] = job  # outputs carry this external id, not the engine's suffixed one
        return None

    def _advance(self, running: dict[str, _Job], written: deque[_Job]) -> None:
        """Step the engine; finished requests move to ``written`` (their files may still be open).

        In-process engines only make progress (including the connector's writes) when stepped; a
        multiprocess engine runs on its own, and stepping it with nothing running would block.
        """
        if not running and not self._in_process:
            time.sleep(0.001)
            return
        start = time.perf_counter()
        try:
            outputs = self._engine.step()
        except VLLMError as exc:  # EngineDeadError: the engine core died; no request can finish
            raise EngineStopped(
                f"the vLLM engine stopped while capturing ({type(exc).__name__}); its own error "
                "is logged above (look for 'Worker failed with error'). Committed units are kept "
                "and a rerun resumes after them") from exc
        self.timings["engine_s"] += time.perf_counter() - start
        for out in outputs:
            job = running.pop(out.request_id, None) if out.finished else None
            if job is not None:
                job.output = out
                written.append(job)

    def _pop_readable(self, written: deque[_Job]) -> _Job | None:
        for job in written:
            path = _file_of(job.output)
            if path is None or _write_finished(path):
                written.remove(job)
                return job
        return None

    def _chunks_so_far(self, job: _Job, k: int) -> Iterator[CaptureResult]:
        """The running request's chunks that are written, from its next row on. Nothing while
        it runs when its rows need prompt logprobs (top-k or a check): vLLM returns those only
        with the request's end."""
        if k or job.verify or job.error is not None:
            return
        while (data := self._read(job, wait=False)) is not None:
            try:
                result = self._convert(job, data, k, last=False)
            except PayloadError as exc:
                job.error = str(exc)
                return
            yield result

    def _rest(self, job: _Job, k: int) -> Iterator[CaptureResult]:
        """A finished request's results from its next row: its chunks, then the final file (or
        one error result); deletes every file of the request, also when closed early."""
        out, request = job.output, job.request
        path = _file_of(out)
        try:
            if job.error is not None:
                raise PayloadError(job.error)
            if path is None:
                raise PayloadError(
                    f"sample {request.sample_id}: engine finished the request without a capture "
                    f"file (finish_reason {out.outputs[0].finish_reason if out.outputs else None})"
                )
            final_start = int(out.kv_transfer_params.get("row_start", 0))
            while job.done < final_start:
                data = self._read(job, wait=True)
                if data is None:
                    raise PayloadError(f"sample {request.sample_id}: no capture file for its rows "
                                       f"from {job.done} (the final file starts at {final_start})")
                yield self._convert(job, data, k, last=False)
            if job.done != final_start:
                raise PayloadError(f"sample {request.sample_id}: its chunks end at row "
                                   f"{job.done}, its final file starts at {final_start}")
            start = time.perf_counter()
            data = load_file(path)
            self.timings["file_load_s"] += time.perf_counter() - start
            yield self._convert(job, data, k, last=True)
        except (PayloadError, OSError, SafetensorError) as exc:
            yield CaptureResult(sample_id=request.sample_id, error=str(exc))
        finally:
            self._remove_files(job)

    def _read(self, job: _Job, *, wait: bool) -> dict[str, torch.Tensor] | None:
        """The chunk file of the job's next rows once written (None: not there, or still being
        written and ``wait`` is false)."""
        start = time.perf_counter()
        data = _read_written(chunk_path(self.scratch_dir, job.engine_id, job.done), wait=wait)
        self.timings["file_load_s"] += time.perf_counter() - start
        return data

    def _remove_files(self, job: _Job) -> None:
        """Delete the request's final file and its chunk files, each once its write is done."""
        if (path := _file_of(job.output)) is not None:
            _remove(path)
        for lock in self.scratch_dir.glob(f"{job.engine_id}.rows*.safetensors.lock"):
            _read_written(str(lock)[: -len(".lock")], wait=True, load=False)
            _remove(str(lock)[: -len(".lock")])

    def _convert(
        self, job: _Job, data: dict[str, torch.Tensor], k: int, *, last: bool
    ) -> CaptureResult:
        """One file's rows (from ``job.done``; ``last``: through the end) as a result; advances
        ``job.done``."""
        ids = job.request.input_ids.astype(np.int64)
        done, total = job.done, ids.shape[0]
        got = data.get("token_ids")
        n = total - done if last or got is None else int(got.shape[0])
        start = time.perf_counter()
        check_payload(
            data,
            sample_id=job.request.sample_id,
            sent_ids=ids[done:done + n],
            aux_ids=self.aux_ids,
            hidden_size=self.hidden_size,
            row_start=done,
        )
        if not last and not 0 < n < total - done:
            raise PayloadError(f"sample {job.request.sample_id}: a chunk of rows [{done}, "
                               f"{done + n}) of its {total}, before the final file")
        parts = split_payload(
            data["hidden_states"],
            aux_ids=self.aux_ids,
            layer_ids=self.layer_ids,
            final_id=(lm_head_input_id(self.num_hidden_layers) if self.lm_head_input
                      else self.num_hidden_layers),
        )
        self.timings["check_s"] += time.perf_counter() - start
        start = time.perf_counter()
        final = (parts.final_TH.to(self.dtype) if self.lm_head_input
                 else self._head.final_norm(parts.final_TH, self.dtype))
        self.timings["norm_s"] += time.perf_counter() - start
        out = job.output
        if job.verify and done == 0:
            err = self._head.check_against_engine(
                ids[:n + 1], final, scored_token_logprobs(out.prompt_logprobs, total)
            )
            logger.debug("sample %d: final-state logprob check %.3g", job.request.sample_id, err)
        topk_ids = topk_lps = None
        if k:
            topk_ids, topk_lps = topk_rows(
                out.prompt_logprobs, out.outputs[0].logprobs, num_tokens=total, k=k,
                rows=slice(done, done + n),
            )
        job.done = done + n
        return CaptureResult(
            sample_id=job.request.sample_id,
            aux_hidden=parts.aux_TFH.to(self.dtype),
            final_hidden=final,
            topk_ids=topk_ids,
            topk_logprobs=topk_lps,
            row_start=done,
            last=last,
        )

    def close(self) -> None:
        """Shut the engine down and remove the scratch folder if this source made it."""
        self._engine.engine_core.shutdown()
        if self._own_scratch:
            shutil.rmtree(self.scratch_dir, ignore_errors=True)


def _check_plugin_allowed() -> None:
    """Refuse to start when ``VLLM_PLUGINS`` is an allow-list without the lm_head plugin (vLLM
    would not load it, and the extractor would find one aux state fewer than it has slots)."""
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN not in allowed.split(","):
        raise SparkforgeError(
            f"this target's final state is captured by the vLLM plugin {PLUGIN!r}, which "
            f"VLLM_PLUGINS={allowed!r} does not allow; add it to the list or unset VLLM_PLUGINS")


def _keep_cpu_reservation(engine: EngineOptions) -> None:
    """On the CPU platform, reserve for the scheduler only the cores a plain engine reserves.

    vLLM's CPU worker reserves one more core per rank whenever a kv_transfer_config is set (meant
    for NIXL transfers, vllm/utils/ompmultiprocessing.py); the hidden-states connector moves no
    data over the network, and on small hosts the extra reservation makes the worker share the
    scheduler's core: capture ran 2.4x slower than plain prefill on 2 cores because of it.
    """
    if not current_platform.is_cpu() or "VLLM_CPU_NUM_OF_RESERVED_CPU" in os.environ:
        return
    reserved = str(engine.tensor_parallel_size)
    logger.info(
        "VLLM_CPU_NUM_OF_RESERVED_CPU=%s (the plain-engine value; see vllm_source)", reserved
    )
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = reserved


def _file_of(output: Any) -> str | None:
    params = output.kv_transfer_params or {}
    return params.get("hidden_states_path")


def _write_finished(path: str) -> bool:
    """True once the connector's writer has released its exclusive lock on ``path``.lock."""
    try:
        fd = os.open(path + ".lock", os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _read_written(path: str, *, wait: bool, load: bool = True) -> dict[str, torch.Tensor] | None:
    """A connector file read under a shared lock on its ``.lock`` (the writer holds the lock
    exclusively from before the lock file has its name until the file is written); None when
    there is no lock file, or the write is still going and ``wait`` is false."""
    try:
        fd = os.open(path + ".lock", os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            return None
        return load_file(path) if load else None
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    for p in (path, path + ".lock"):
        Path(p).unlink(missing_ok=True)


@dataclass(frozen=True)
class GeneratedResponse:
    """One sampled assistant turn."""

    text: str
    token_ids: np.ndarray
    """[n] int32 generated token ids (the stop token included when the model emitted it)."""
    finish_reason: str
    """"stop" (end of turn) or "length" (hit ``max_tokens``)."""


def generate_responses(
    engine: EngineOptions,
    prompts: Sequence[np.ndarray],
    *,
    temperature: float,
    top_p: float,
    max_tokens: int,
    seed: int,
    top_k: int = -1,
    seeds: Sequence[int] | None = None,
) -> list[GeneratedResponse]:
    """Sample one response per token-id prompt with a plain vLLM engine (for regeneration).

    Args:
        engine: Engine options; the model folder must hold the tokenizer (responses are decoded).
        prompts: Token ids ending with the generation prompt.
        temperature: Sampling temperature.
        top_p: Nucleus sampling mass.
        top_k: Sample from the k most likely tokens only (-1: all).
        max_tokens: Most generated tokens per response.
        seed: Base seed; prompt i uses ``seed + i`` unless ``seeds`` is given.
        seeds: One seed per prompt (e.g. derived from sample ids, so a resumed run draws the same).

    Returns:
        One response per prompt, in prompt order.
    """
    per_prompt = list(seeds) if seeds is not None else [seed + i for i in range(len(prompts))]
    if len(per_prompt) != len(prompts):
        raise SparkforgeError(f"seeds has {len(per_prompt)} entries for {len(prompts)} prompts")
    llm = LLM(**engine_kwargs(engine))
    try:
        params = [
            SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                           max_tokens=max_tokens, seed=s)
            for s in per_prompt
        ]
        token_prompts = [TokensPrompt(prompt_token_ids=p.tolist()) for p in prompts]
        outputs = llm.generate(token_prompts, params, use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return [
        GeneratedResponse(
            text=o.outputs[0].text,
            token_ids=np.asarray(o.outputs[0].token_ids, dtype=np.int32),
            finish_reason=str(o.outputs[0].finish_reason),
        )
        for o in outputs
    ]
