"""The producer's input rows: one dataset (``--data``) or a weighted mix (``--mix``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from sparkforge.producer.config import ProducerConfig
from sparkforge.shared.dataset import (
    HF_DATASET_KEY,
    DatasetError,
    DataSource,
    RawRow,
    describe_sources,
    iter_rows,
)
from sparkforge.shared.header import HfDatasetInfo, MixInfo, SourceInfo
from sparkforge.shared.mix import MixEntry, iter_mix_rows, plan_mix


@dataclass(frozen=True)
class InputRows:
    """Every input file, the rows they make (a mix's draws included) and how to stream them."""

    sources: list[DataSource]
    """Every file, a mix's entries' files one after the other."""
    num_rows: int
    """Rows of the input: the sample ids are ``0 .. num_rows - 1``."""
    mix: list[MixEntry] | None = None

    def rows(self, *, wanted: Callable[[int], bool] | None = None, batch_rows: int = 1024,
             storage_options: dict[str, object] | None = None) -> Iterator[RawRow]:
        """The rows in sample-id order; ``wanted`` filters sample ids."""
        if self.mix is None:
            return iter_rows(self.sources, wanted=wanted, batch_rows=batch_rows,
                             storage_options=storage_options)
        return iter_mix_rows(self.mix, wanted=wanted, batch_rows=batch_rows,
                             storage_options=storage_options)

    def source_infos(self) -> tuple[SourceInfo, ...]:
        """The manifest's ``data.sources`` (with a Hugging Face dataset's identity)."""
        return tuple(SourceInfo(uri=s.uri, content_hash=s.content_hash,
                                hf_dataset=_hf_info(s)) for s in self.sources)

    def mix_infos(self) -> tuple[MixInfo, ...] | None:
        """The manifest's ``data.mix``: each entry's weight, rows, sample range and files."""
        if self.mix is None:
            return None
        infos, first_sample, first_source = [], 0, 0
        for entry in self.mix:
            infos.append(MixInfo(name=entry.label, data=entry.source.data,
                                 weight=entry.source.weight, source_rows=entry.source_rows,
                                 rows=len(entry.draws), first_sample=first_sample,
                                 first_source=first_source, num_sources=len(entry.files)))
            first_sample += len(entry.draws)
            first_source += len(entry.files)
        return tuple(infos)


def _hf_info(source: DataSource) -> HfDatasetInfo | None:
    identity = source.metadata.get(HF_DATASET_KEY)
    return None if identity is None else HfDatasetInfo(**identity)


def open_inputs(cfg: ProducerConfig) -> InputRows:
    """Describe ``cfg``'s data (and draw its mix).

    Raises:
        DatasetError: the data (or a mix source) holds no rows, or cannot be found.
    """
    if cfg.mix:
        plan = plan_mix(cfg.mix, num_rows=cfg.mix_rows, seed=cfg.mix_seed,
                        storage_options=cfg.storage_options, max_line_bytes=cfg.max_line_bytes)
        return InputRows(sources=[f for entry in plan for f in entry.files],
                         num_rows=sum(len(entry.draws) for entry in plan), mix=plan)
    assert cfg.data is not None, "ProducerConfig checks that data or mix is given"
    sources = describe_sources(cfg.data, data_format=cfg.data_format,
                               storage_options=cfg.storage_options, column=cfg.data_column,
                               max_line_bytes=cfg.max_line_bytes)
    num_rows = sum(s.num_rows for s in sources)
    if not num_rows:
        raise DatasetError(f"data: {cfg.data} holds no rows ({len(sources)} file(s), all empty)")
    return InputRows(sources=sources, num_rows=num_rows)
