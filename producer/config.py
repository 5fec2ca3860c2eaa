"""The producer's one config: what to capture, from which data, into which cache, and how."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from sparkforge.producer.chat_template import template_kwargs_problems
from sparkforge.producer.engine_options import EngineOptions
from sparkforge.producer.template_bounds import TEMPLATE_ROW_SECONDS
from sparkforge.shared.config_types import type_problems
from sparkforge.shared.dataset import MAX_LINE_BYTES
from sparkforge.shared.dtypes import HiddenDtype
from sparkforge.shared.errors import ConfigError, SparkforgeError
from sparkforge.shared.fields import shorten
from sparkforge.shared.image_sources import (
    DEFAULT_IMAGE_READ_TIMEOUT_S,
    DEFAULT_MAX_IMAGE_BYTES,
    parse_image_sources,
)
from sparkforge.shared.images import DEFAULT_MAX_IMAGE_PIXELS
from sparkforge.shared.layout import MAX_UNITS, AuxCodec, CacheSpec
from sparkforge.shared.mix import MixSource
from sparkforge.shared.storage import DEFAULT_MAX_CONCURRENCY
from sparkforge.shared.unit_stream import WRITE_AHEAD_BYTES

# Settings that change how a run goes but not a byte of the cache: left out of the cache header, so
# a resumed run (or another worker) may differ in them. Everything else must match on resume.
RUN_LOCAL_FIELDS = frozenset({
    "storage_options", "output", "worker_index", "num_workers", "window", "max_retries",
    "max_consecutive_failures", "parity_samples", "scratch_dir", "read_batch_rows", "hf_device",
    "hf_batch_tokens",
    "finalize", "progress", "writer_queue_units", "writer_threads", "writer_max_concurrency",
    "writer_max_in_flight_bytes", "non_finite",
    "max_image_pixels",  # an image cache records it in producer_config.resolved.images
    "image_sources", "max_image_bytes", "image_read_timeout_s",  # where images may come from
    "template_row_seconds",  # CPU seconds, like max_retries: the machine's, not the data's
})
RUN_LOCAL_ENGINE_FIELDS = frozenset({
    "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill",
    "enforce_eager", "data_parallel_size", "extra",
})


@dataclass(frozen=True, kw_only=True)
class ProducerConfig:
    """``sparkforge produce``: run the frozen target teacher-forced, write a hidden-state cache."""

    engine: EngineOptions
    """The target and how vLLM runs it (``engine.model`` is the target checkpoint)."""
    output: str
    """Cache URI: a local path, s3://bucket/prefix, gs://..."""
    data: str | None = None
    """Chat dataset: a JSONL/Parquet file, a folder or a glob, local or any fsspec URI; or a
    Hugging Face dataset, ``hf://<org>/<name>[@<revision>][:<split>]`` (from the local cache)
    or a ``save_to_disk`` folder (``<folder>[:<split>]``). Give this or ``mix``."""
    mix: list[MixSource] | None = None
    """A weighted mix instead of ``data``: entries ``{data, weight[, data_format, column,
    name]}``, each drawn to its weight's share of ``mix_rows`` (repeated or subsampled)."""
    mix_rows: int | None = None
    """Rows of the mix; default: the sources' rows together."""
    mix_seed: int = 0
    """Seed of the mix's draws."""
    data_column: str | None = None
    """Hugging Face datasets: the conversation column (None: ``messages``, else
    ``conversations``); ShareGPT ``from``/``value`` turns are mapped to ``role``/``content``."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options for ``output``, ``data`` and ``eval_ids`` (e.g. endpoint_url, key, secret)."""
    backend: Literal["vllm", "hf"] = "vllm"
    """Capture engine: vLLM (default) or a transformers forward (targets vLLM cannot run)."""
    layer_ids: list[int] | None = None
    """DSpark feature ids (output of decoder layer l, 0-based; the cache records HF
    ``hidden_states`` indices l + 1, see ``sparkforge.shared.layer_ids``); default: evenly
    spaced."""
    layer_stride: int | None = None
    """Capture every k-th feature id up to L-2 from ``layer_start`` instead of ``layer_ids``: a
    superset cache from which drafts train on any subset of these features."""
    layer_start: int = 1
    """First feature id of ``layer_stride`` (1, the default rule's first id)."""
    num_feature_layers: int = 5
    """How many default feature layers to pick when neither ``layer_ids`` nor ``layer_stride``."""
    hidden_dtype: HiddenDtype = "bfloat16"
    """Storage dtype of aux and final hidden states."""
    aux_codec: AuxCodec = "lossless"
    """Aux hidden codec; fp8 halves the disk (final_hidden stays lossless)."""
    topk: int = 0
    """Store the top-k target log-probabilities per position (0: none)."""
    max_seq_len: int | None = None
    """Longest sequence written (at most ``engine.max_model_len - 1``: vLLM refuses a prompt
    without room for the one token a capture asks for); default ``engine.max_model_len``."""
    overlong: Literal["truncate", "skip"] = "skip"
    """Rows longer than ``max_seq_len``: cut to length, or skip (counted as too_long)."""
    chat_template: str | None = None
    """Jinja template (string or file URI) replacing the tokenizer's own."""
    reasoning: Literal["keep", "drop"] = "keep"
    """Assistant ``reasoning_content``: pass it to the template, or drop it."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Template variables for every rendering, e.g. ``{"enable_thinking": true}`` (Qwen3);
    recorded in the manifest's ``producer_config``, so ``eval`` renders prompts alike."""
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    """Image rows of a VL target: images with more pixels (width x height) are skipped
    (``image_too_large``), checked before they are decoded."""
    image_sources: list[str] = field(default_factory=list)
    """Where image parts may be read from besides data URIs, inline bytes and the data file's
    own folder: local folders and remote prefixes (``s3://bucket/prefix``, ``gs://bucket``,
    ``https://host[:port]/prefix``). Anything else is skipped as ``image_*_refused``."""
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    """Largest encoded image read; a larger one is skipped (``image_too_many_bytes``)."""
    image_read_timeout_s: float = DEFAULT_IMAGE_READ_TIMEOUT_S
    """Longest read of one image; a slower one is skipped (``image_read_timeout``)."""
    eval_fraction: float = 0.0
    """Fraction of rows put in the eval split (seeded hash of each row's content); 1.0 makes an
    eval-only cache (for ``sparkforge eval``)."""
    eval_ids: str | None = None
    """URI of a file with one input row index per line: those rows form the eval split."""
    split_seed: int = 0
    """Seed of the eval-fraction hash."""
    rows_per_unit: int = 64
    """Input rows per commit unit (the resume and multi-worker granule). A unit's samples stream
    to the writer as they are captured; the unit is committed all at once, when it is whole."""
    shard_rows: int = 8192
    """Token rows per shard, any size: a longer sample spans several. The writer holds one
    shard per array and writer thread: (F + 1) x shard_rows x H x 2 bytes in bf16."""
    writer_queue_units: int = 2
    """Units waiting for a writer thread at most, while the engine captures the next one. Each
    holds at most 2 blocks of rows (a chunk of a long sample, or a sample) waiting, so at most
    (writer_queue_units + writer_threads + 1) x 2 blocks wait to be written."""
    writer_threads: int = 0
    """Writer threads, each writing one unit at a time, and as many codec threads; 0: the CPUs
    left after the engine (available CPUs minus one per engine GPU process, one for vLLM's
    scheduler and one for the capture loop; >= 1)."""
    writer_max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    """Writes the writer has in flight at once, all threads together (slot objects, and a
    unit's claim beside its commit check): on an object store each waits out a round trip."""
    writer_max_in_flight_bytes: int = WRITE_AHEAD_BYTES
    """Encoded slot objects each writer thread holds while they are sent (at least one,
    however large), besides its shard buffers; counted in the writer memory logged at start."""
    data_format: Literal["auto", "jsonl", "parquet"] = "auto"
    """Input format; auto reads it from the file suffix."""
    worker_index: int | None = None
    """This worker's index; default from JOB_COMPLETION_INDEX / SLURM_* (see producer/README.md)."""
    num_workers: int | None = None
    """How many workers share the units; default from the environment, else 1."""
    window: int = 64
    """Requests in flight at once (bounds scratch space)."""
    max_retries: int = 2
    """Retries of a failed request before it is counted as failed."""
    max_consecutive_failures: int = 16
    """Abort after this many failed requests in a row."""
    non_finite: Literal["skip", "fail"] = "skip"
    """A row whose captured activations hold NaN or inf: skip it (counted as
    non_finite_activations) or stop the run with the sample named (its unit is not committed)."""
    parity_samples: int = 0
    """Compare N samples against one-row transformers forwards before capturing (vLLM: the
    engine; hf: the backend's own batching, a self-check)."""
    scratch_dir: str = "/dev/shm/sparkforge"
    """Where the vLLM connector drops per-request files (RAM disk recommended)."""
    hf_device: str = "auto"
    """Device of the hf backend ("auto": cuda if available, else cpu)."""
    hf_batch_tokens: int = 8192
    """Tokens per forward of the hf backend: rows are right-padded into batches up to this many,
    and a longer row goes through in chunks of this many tokens, a KV cache carried between
    them, each chunk's features handed to the writer as it is computed (host memory holds
    chunks of a long sample, never the sample)."""
    read_batch_rows: int = 1024
    """Parquet record-batch size while reading the dataset."""
    max_line_bytes: int = MAX_LINE_BYTES
    """Longest JSONL line; a longer one is skipped unread and counted as line_too_long."""
    template_row_seconds: float = TEMPLATE_ROW_SECONDS
    """Longest rendering of one row by the chat template, in CPU seconds (and at most 10 times
    that in wall clock); a row that takes longer is skipped and counted as template_timeout."""
    finalize: bool = True
    """Build the manifest when this worker sees every unit committed."""
    progress: bool = True
    """Show a progress bar."""

    def __post_init__(self) -> None:
        typed = type_problems(self)
        if typed:
            raise ConfigError("invalid producer config:\n  " + "\n  ".join(typed))
        problems = []
        positive = ("num_feature_layers", "rows_per_unit", "shard_rows", "window",
                    "hf_batch_tokens", "max_consecutive_failures", "read_batch_rows",
                    "max_line_bytes", "writer_queue_units", "writer_max_concurrency",
                    "writer_max_in_flight_bytes",
                    "max_image_pixels", "max_image_bytes")
        for name in positive:
            if getattr(self, name) < 1:
                problems.append(f"--{name} must be >= 1, got {getattr(self, name)}")
        for name in ("template_row_seconds", "image_read_timeout_s"):
            if not getattr(self, name) > 0:
                problems.append(f"--{name} must be > 0, got {getattr(self, name)}")
        try:
            parse_image_sources(self.image_sources)
        except ValueError as exc:
            problems.append(str(exc))
        problems += template_kwargs_problems(self.chat_template_kwargs, "--chat_template_kwargs")
        for name in ("topk", "max_retries", "parity_samples", "writer_threads"):
            if getattr(self, name) < 0:
                problems.append(f"--{name} must be >= 0, got {getattr(self, name)}")
        if not self.output:
            problems.append("--output is required")
        if bool(self.data) == bool(self.mix):
            problems.append("give exactly one of --data and --mix")
        if self.mix_rows is not None and (not self.mix or self.mix_rows < 1):
            problems.append(f"--mix_rows needs --mix and must be >= 1, got {self.mix_rows}")
        elif self.mix_rows is not None and self.mix_rows > MAX_UNITS * self.rows_per_unit:
            problems.append(f"--mix_rows {self.mix_rows} would need more than {MAX_UNITS:,} "
                            f"units of --rows_per_unit {self.rows_per_unit}, the most a cache "
                            "holds; lower it or raise --rows_per_unit")
        if self.mix_seed < 0:
            problems.append(f"--mix_seed must be >= 0, got {self.mix_seed}")
        if not 0.0 <= self.eval_fraction <= 1.0:
            problems.append(f"--eval_fraction must be in [0, 1], got {self.eval_fraction}")
        if self.eval_fraction > 0.0 and self.eval_ids is not None:
            problems.append("Can't provide both --eval_fraction and --eval_ids")
        if self.layer_ids is not None and (
            not self.layer_ids or list(self.layer_ids) != sorted(set(self.layer_ids))
            or self.layer_ids[0] < 0
        ):
            problems.append(f"--layer_ids must be non-empty, >= 0, strictly increasing: "
                            f"{shorten(str(self.layer_ids))}")
        if self.layer_stride is not None and self.layer_ids is not None:
            problems.append("Can't provide both --layer_ids and --layer_stride")
        if self.layer_stride is not None and self.layer_stride < 1:
            problems.append(f"--layer_stride must be >= 1, got {self.layer_stride}")
        if self.max_seq_len is not None and not 1 <= self.max_seq_len <= self.engine.max_model_len:
            problems.append(f"--max_seq_len must be in [1, --engine.max_model_len="
                            f"{self.engine.max_model_len}], got {self.max_seq_len}")
        if (self.worker_index is None) != (self.num_workers is None):
            problems.append("--worker_index and --num_workers must be given together")
        elif self.num_workers is not None and not 0 <= self.worker_index < self.num_workers:  # type: ignore[operator]
            problems.append(f"--worker_index must be in [0, --num_workers={self.num_workers})")
        if not problems:
            problems += self._slot_space_problems()
        if problems:
            raise SparkforgeError("invalid producer config:\n  " + "\n  ".join(problems))

    def _slot_space_problems(self) -> list[str]:
        """What the cache layout refuses in --rows_per_unit / --shard_rows, before any run."""
        try:
            CacheSpec(hidden_size=1, num_aux_layers=1, hidden_dtype=self.hidden_dtype,
                      max_seq_len=self.seq_len,
                      shard_rows=self.shard_rows, rows_per_unit=self.rows_per_unit)
        except SparkforgeError as exc:
            return [f"--rows_per_unit ({self.rows_per_unit}) / --shard_rows ({self.shard_rows}): "
                    f"{exc}"]
        return []

    @property
    def seq_len(self) -> int:
        """The effective maximum sequence length."""
        return self.max_seq_len if self.max_seq_len is not None else self.engine.max_model_len

    @property
    def longest_sample(self) -> int:
        """Most tokens a written sample has: ``seq_len``, and under ``engine.max_model_len``.

        vLLM takes a prompt only with room for one generated token (a capture asks for one), so
        a prompt of ``max_model_len`` tokens is refused; the HF backend keeps the same limit, so
        both backends write the same samples from the same rows.
        """
        return min(self.seq_len, self.engine.max_model_len - 1)

    def identity(self) -> dict[str, Any]:
        """The fields that decide the cache's bytes (recorded in the header, checked on resume)."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in RUN_LOCAL_FIELDS}
        out["engine"] = {k: v for k, v in out["engine"].items() if k not in RUN_LOCAL_ENGINE_FIELDS}
        out["max_seq_len"] = self.seq_len
        if not self.chat_template_kwargs:  # absent: none (headers written before it compare equal)
            del out["chat_template_kwargs"]
        return out


@dataclass(frozen=True, kw_only=True)
class RegenerateConfig:
    """``sparkforge regenerate``: sample new assistant turns with the target (on-policy data)."""

    data: str
    """Chat dataset to regenerate (the last assistant turn, if any, is replaced): files as for
    ``produce``, ``hf://<org>/<name>[@<revision>][:<split>]`` or a ``save_to_disk`` folder."""
    engine: EngineOptions
    """The target and how vLLM runs it."""
    output: str
    """Folder URI for the Parquet parts (``part-000000.parquet``, ...)."""
    data_column: str | None = None
    """Hugging Face datasets: the conversation column (None: ``messages``, else
    ``conversations``)."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options for ``data`` and ``output``."""
    temperature: float = 1.0
    """Sampling temperature; 1.0 samples the target's own distribution (on-policy)."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    top_k: int = -1
    """Sample from the k most likely tokens only; -1 samples from all of them."""
    max_tokens: int = 2048
    """Longest generated response."""
    seed: int = 0
    """Sampling seed; input row i samples with ``seed + i``, so a resumed part repeats exactly."""
    rows_per_part: int = 1024
    """Input rows per output part (the resume granule)."""
    chat_template: str | None = None
    """Jinja template (string or file URI) replacing the tokenizer's own."""
    reasoning: Literal["keep", "drop"] = "keep"
    """Prompt turns' ``reasoning_content``: pass it to the template, or drop it."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Template variables for every prompt rendering, e.g. ``{"enable_thinking": true}``
    (Qwen3); recorded in each part's sampling parameters and, through them, in the cache."""
    data_format: Literal["auto", "jsonl", "parquet"] = "auto"
    """Input format; auto reads it from the file suffix."""
    read_batch_rows: int = 1024
    """Parquet record-batch size while reading the dataset."""
    max_line_bytes: int = MAX_LINE_BYTES
    """Longest JSONL line; a longer one is skipped unread and counted as line_too_long."""
    progress: bool = True
    """Show a progress bar."""

    def __post_init__(self) -> None:
        typed = type_problems(self)
        if typed:
            raise ConfigError("invalid regenerate config:\n  " + "\n  ".join(typed))
        problems = []
        for name in ("max_tokens", "rows_per_part", "read_batch_rows", "max_line_bytes"):
            if getattr(self, name) < 1:
                problems.append(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature < 0:
            problems.append(f"--temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"--top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            problems.append(f"--top_k must be -1 (off) or >= 1, got {self.top_k}")
        for name in ("data", "output"):
            if not getattr(self, name):
                problems.append(f"--{name} is required")
        problems += template_kwargs_problems(self.chat_template_kwargs, "--chat_template_kwargs")
        if problems:
            raise SparkforgeError("invalid regenerate config:\n  " + "\n  ".join(problems))

