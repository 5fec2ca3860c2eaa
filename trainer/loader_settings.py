"""The ``data.*`` settings of a run: how it batches, orders and reads its cache (torch-free).

One frozen dataclass, parsed once from the CLI or a train YAML, read by the data module, the
stream, the epoch planner and the anchor budget, so their defaults cannot drift apart.
``sparkforge validate --against`` and ``plan --against`` read it from a YAML without torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, get_args

from sparkforge.shared.errors import ConfigError

Batching = Literal["pad", "bucket", "pack"]
BATCHINGS: Final = get_args(Batching)
StartMethod = Literal["fork", "spawn", "forkserver"]
START_METHODS: Final = get_args(StartMethod)
DEFAULT_MAX_SEQ_LEN: Final = 4096
"""``data.max_seq_len`` when a train config leaves it out."""


@dataclass(frozen=True, kw_only=True)
class LoaderSettings:
    """How a run streams its cache; each field is the ``data.<field>`` flag of ``train``."""

    max_seq_len: int = DEFAULT_MAX_SEQ_LEN
    """Longest sample the run is sized for (a cache captured longer is refused); with ``pack``
    also the tokens of one packed row."""
    batch_size: int = 1
    """Samples (``pack``: rows) per micro-batch, per rank."""
    batching: Batching = "bucket"
    """``bucket`` groups samples of similar length, ``pad`` keeps the shuffled order, ``pack``
    fills training rows with whole samples up to ``max_seq_len`` tokens."""
    shuffle_buffer: int = 256
    """Samples held by the streaming shuffle buffer (and the packing window)."""
    pool_batches: int = 16
    """Batches per length-sorting pool with ``bucket``."""
    num_workers: int = 2
    """DataLoader worker processes per rank; each reads its own disjoint share."""
    prefetch_factor: int = 4
    """Batches each worker prepares ahead of the step."""
    read_ahead_units: int = 2
    """Cache units each worker reads concurrently ahead of consumption (the bound on reads in
    flight; raise it for object stores with high request latency)."""
    seed: int = 0
    """Seed of the data order; the order is a function of (seed, epoch, rank, worker)."""
    min_loss_tokens: int = 2
    """Samples with fewer supervised tokens hold no anchor and are skipped."""
    verify_checksums: bool = True
    """Check each slot's crc32c while reading."""
    val_batch_size: int | None = None
    """Micro-batch size for validation (None: ``batch_size``)."""
    start_method: StartMethod | None = None
    """How DataLoader workers start (None: Python's default, ``forkserver`` on Linux from 3.14).
    Forked workers share the rank's columns copy-on-write; the others map them from shared
    memory, so no worker copies them either way."""

    def __post_init__(self) -> None:
        problems = [f"data.{name}={value} must be >= {low}" for name, value, low in (
            ("max_seq_len", self.max_seq_len, 2), ("batch_size", self.batch_size, 1),
            ("shuffle_buffer", self.shuffle_buffer, 1), ("pool_batches", self.pool_batches, 1),
            ("num_workers", self.num_workers, 0), ("prefetch_factor", self.prefetch_factor, 1),
            ("read_ahead_units", self.read_ahead_units, 1),
            ("min_loss_tokens", self.min_loss_tokens, 0),
            ("val_batch_size", self.val_batch_size or 1, 1)) if value < low]
        if self.batching not in BATCHINGS:
            problems.append(f"data.batching={self.batching!r} must be 'pad', 'bucket' or 'pack'")
        if self.start_method not in (None, *START_METHODS):
            problems.append(f"data.start_method={self.start_method!r} must be one of "
                            f"{list(START_METHODS)} or null (Python's default)")
        if problems:
            raise ConfigError("invalid data config:\n  " + "\n  ".join(problems))

    @property
    def eval_batch_size(self) -> int:
        """The validation micro-batch size."""
        return self.val_batch_size or self.batch_size

    @classmethod
    def from_train_config(cls, data: Mapping[str, Any]) -> LoaderSettings:
        """The ``data`` section of a loaded train config (unset fields: the defaults).

        Raises:
            ConfigError: naming every field that has the wrong type or is out of range.
        """
        section = data.get("data") or {}
        if not isinstance(section, Mapping):
            raise ConfigError(f"train config: data must be a mapping, got {section!r}")
        known = {f.name: f for f in dataclasses.fields(cls)}
        problems = []
        for name, value in section.items():
            field = known.get(name)
            if field is None or value is None:
                continue  # uri, storage_options: the data module's own
            if not _has_kind(value, field.type):
                problems.append(f"data.{name} must be {_kind(field.type)}, got {value!r}")
        if problems:
            raise ConfigError("train config: " + "; ".join(problems))
        return cls(**{k: v for k, v in section.items() if k in known and v is not None})


def _choices(annotation: str) -> tuple[str, ...]:
    """The values of a Literal field (its annotation as text, possibly ``| None``)."""
    return START_METHODS if annotation.startswith("StartMethod") else BATCHINGS


def _kind(annotation: object) -> str:
    """A field's annotation in words: ``an integer``, ``a boolean`` or its choices."""
    text = str(annotation)
    if text.startswith("int"):
        return "an integer"
    if text == "bool":
        return "a boolean"
    return f"one of {list(_choices(text))}"


def _has_kind(value: object, annotation: object) -> bool:
    """Whether a YAML value fits a field's annotation (a bool is no integer)."""
    kind = _kind(annotation)
    if kind == "an integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "a boolean":
        return isinstance(value, bool)
    return value in _choices(str(annotation))
