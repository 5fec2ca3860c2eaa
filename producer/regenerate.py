"""On-policy data: replace each row's last assistant turn with one sampled from the target.

Output is a folder of Parquet parts, one per ``rows_per_part`` input rows, each written to a hidden
temporary name and renamed into place, so a re-run skips finished parts and repeats none. Input
row ``i`` samples with seed ``seed + i``, so a resumed part is the same as it would have been. The
sampling parameters travel in every part's Parquet metadata (``sparkforge.regenerate``); the
producer copies them into the header of a cache made from these parts. ``generate_responses``
starts an engine per call, so parts should be large (the default is 1024 rows).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from sparkforge.producer.chat import unreadable_reason
from sparkforge.producer.chat_rows import SkipReason, clean_messages, row_tools
from sparkforge.producer.chat_template import (
    resolve_chat_template,
    template_sha256,
    tokenizer_hash,
)
from sparkforge.producer.config import RegenerateConfig
from sparkforge.producer.header import REGENERATION_KEY, engine_version
from sparkforge.producer.summary import format_table
from sparkforge.producer.target_files import resolve_model_dir
from sparkforge.producer.units import num_units, rows_by_unit
from sparkforge.shared.dataset import RawRow, describe_sources, iter_rows

logger = logging.getLogger(__name__)

_MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string()),
                      ("reasoning_content", pa.string()), ("tool_calls", pa.string()),
                      ("tool_call_id", pa.string()), ("name", pa.string())])
SCHEMA = pa.schema([
    ("messages", pa.list_(_MESSAGE)), ("tools", pa.string()), ("source_row", pa.int64()),
    ("source_hash", pa.string()), ("finish_reason", pa.string()),
    ("num_generated_tokens", pa.int32()),
])
"""A part's rows; ``tool_calls`` and ``tools`` are JSON text (their schemas vary by row), which
``produce`` parses back (``sparkforge.shared.dataset.json_text_field``)."""
ACCOUNTING_KEY = "sparkforge.regenerate_accounting"


def part_name(part: int) -> str:
    """File name of output part ``part``."""
    return f"part-{part:06d}.parquet"


@dataclass
class RegenerateSummary:
    """What one regeneration run did."""

    output: str
    parts_total: int
    parts_done: int = 0
    input_rows: int = 0
    written: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    generated_tokens: int = 0
    seconds: float = 0.0

    def table(self) -> str:
        """A plain-text summary table."""
        rate = self.generated_tokens / self.seconds if self.seconds > 0 else 0.0
        rows = [("output", self.output),
                ("parts", f"{self.parts_done} written now of {self.parts_total}"),
                ("input rows", f"{self.input_rows:,}"), ("written", f"{self.written:,}"),
                *((f"skipped: {k}", f"{v:,}") for k, v in sorted(self.skipped.items())),
                ("generated", f"{self.generated_tokens:,} tokens, {rate:,.0f} tokens/s")]
        return format_table(rows)


@dataclass(frozen=True)
class Prompt:
    """A row's turns before its last assistant turn, and the tool schemas it renders with."""

    messages: list[dict[str, Any]]
    tools: list[Any] | None = None


def prompt_of(row: Any, cfg: RegenerateConfig) -> Prompt | SkipReason:
    """The row's turns up to (not including) its last assistant turn, with its ``tools``.

    Tool calls, tool results and tool schemas are kept, so the prompt renders as serving renders
    it and the part stores what the response was sampled for.
    """
    messages = clean_messages(None if row is None else row.get("messages"), cfg.reasoning)
    if isinstance(messages, SkipReason):
        return SkipReason.MALFORMED_JSON if row is None else messages
    tools = row_tools(row)
    if isinstance(tools, SkipReason):
        return tools
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    return Prompt(messages, tools) if messages else SkipReason.MISSING_MESSAGES


def _stored(message: dict[str, Any]) -> dict[str, Any]:
    """A message as a part stores it: its tool calls as JSON text."""
    calls = message.get("tool_calls")
    return message if calls is None else {**message, "tool_calls": json.dumps(calls)}


def sampling_parameters(cfg: RegenerateConfig, *, template: str, tokenizer: Any) -> dict[str, Any]:
    """What a cache made from this output records about how its responses were made."""
    return {
        "model": cfg.engine.model, "revision": cfg.engine.revision,
        "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k,
        "max_tokens": cfg.max_tokens,
        "seed": cfg.seed, "rows_per_part": cfg.rows_per_part, "source": cfg.data,
        "chat_template_sha256": template_sha256(template),
        "chat_template_kwargs": dict(cfg.chat_template_kwargs), "reasoning": cfg.reasoning,
        "tokenizer_hash": tokenizer_hash(tokenizer), "engine_version": engine_version("vllm"),
    }


def _write_part(fs: Any, root: str, part: int, table: pa.Table) -> None:
    temporary = f"{root}/.{part_name(part)}.{uuid.uuid4().hex}.tmp"
    with fs.open(temporary, "wb") as f:
        pq.write_table(table, f)
    fs.mv(temporary, f"{root}/{part_name(part)}")


def _regenerate_part(
    cfg: RegenerateConfig, rows: Sequence[RawRow], encode: Any, params: dict[str, Any]
) -> tuple[pa.Table, Counter[str], int]:
    from sparkforge.producer.vllm_source import generate_responses

    skipped: Counter[str] = Counter()
    kept: list[tuple[RawRow, Prompt]] = []
    prompts: list[np.ndarray] = []
    for raw in rows:
        prompt = unreadable_reason(raw.error) if raw.row is None else prompt_of(raw.row, cfg)
        if isinstance(prompt, SkipReason):
            skipped[prompt.value] += 1
            continue
        ids = encode(prompt)
        if len(ids) >= cfg.engine.max_model_len:
            skipped[SkipReason.TOO_LONG.value] += 1
            continue
        kept.append((raw, prompt))
        prompts.append(np.asarray(ids, dtype=np.int32))
    responses = generate_responses(
        cfg.engine, prompts, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
        max_tokens=cfg.max_tokens, seed=cfg.seed, seeds=[cfg.seed + raw.index for raw, _ in kept],
    ) if prompts else []
    accounting = {"input_rows": len(rows), "written": len(kept), "skipped": dict(skipped)}
    table = part_table(kept, responses, {REGENERATION_KEY: json.dumps(params),
                                         ACCOUNTING_KEY: json.dumps(accounting)})
    return table, skipped, sum(len(response.token_ids) for response in responses)


def part_table(kept: Sequence[tuple[RawRow, Prompt]], responses: Sequence[Any],
               metadata: dict[str, str]) -> pa.Table:
    """One part: each kept row's prompt (tool calls and schemas as JSON text) and its sampled
    reply (``text``, ``finish_reason``, ``token_ids``) as the last assistant turn."""
    records = [
        {"messages": [*map(_stored, prompt.messages),
                      {"role": "assistant", "content": response.text}],
         "tools": None if prompt.tools is None else json.dumps(prompt.tools),
         "source_row": raw.index, "source_hash": raw.content_hash,
         "finish_reason": response.finish_reason, "num_generated_tokens": len(response.token_ids)}
        for (raw, prompt), response in zip(kept, responses, strict=True)
    ]
    return pa.Table.from_pylist(records, schema=SCHEMA.with_metadata(metadata))


def prompt_ids(tokenizer: Any, template: str, prompt: Prompt,
               chat_template_kwargs: dict[str, Any]) -> list[int]:
    """The prompt rendered with the generation prompt, its tools and the template variables:
    the tokens the engine samples a reply after."""
    out = tokenizer.apply_chat_template(prompt.messages, tools=prompt.tools,
                                        chat_template=template, tokenize=True,
                                        add_generation_prompt=True, return_dict=True,
                                        **chat_template_kwargs)
    return [int(i) for i in out["input_ids"]]


def regenerate(cfg: RegenerateConfig) -> RegenerateSummary:
    """Write the regenerated dataset part by part, skipping parts already present."""
    from transformers import AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(str(resolve_model_dir(cfg.engine)))
    template = resolve_chat_template(cfg.chat_template, tokenizer)
    params = sampling_parameters(cfg, template=template, tokenizer=tokenizer)

    def encode(prompt: Prompt) -> list[int]:
        return prompt_ids(tokenizer, template, prompt, cfg.chat_template_kwargs)

    sources = describe_sources(cfg.data, data_format=cfg.data_format,
                               storage_options=cfg.storage_options, column=cfg.data_column,
                               max_line_bytes=cfg.max_line_bytes)
    total = num_units(sum(s.num_rows for s in sources), cfg.rows_per_part)
    fs, root = fsspec.core.url_to_fs(cfg.output, **cfg.storage_options)
    fs.makedirs(root, exist_ok=True)
    todo = {p for p in range(total) if not fs.exists(f"{root}/{part_name(p)}")}
    summary = RegenerateSummary(output=cfg.output, parts_total=total)
    rows = iter_rows(sources, wanted=lambda i: i // cfg.rows_per_part in todo,
                     batch_rows=cfg.read_batch_rows, storage_options=cfg.storage_options)
    start = time.monotonic()
    with tqdm(total=len(todo), unit="part", disable=not cfg.progress) as bar:
        for part, part_rows in rows_by_unit(rows, cfg.rows_per_part):
            table, skipped, tokens = _regenerate_part(cfg, part_rows, encode, params)
            _write_part(fs, root, part, table)
            summary.parts_done += 1
            summary.input_rows += len(part_rows)
            summary.written += table.num_rows
            summary.skipped.update(skipped)
            summary.generated_tokens += tokens
            summary.seconds = time.monotonic() - start
            bar.update(1)
            rate = summary.generated_tokens / max(summary.seconds, 1e-9)
            bar.set_postfix_str(f"rows={summary.written} tok/s={rate:,.0f}", refresh=False)
    logger.info("regenerated %d parts into %s", summary.parts_done, cfg.output)
    return summary
