"""Refuse a producer run or a finalized cache that holds no sample, naming why its rows were
skipped (the cache would otherwise look complete and train on nothing)."""

from __future__ import annotations

from typing import Final

from sparkforge.shared.errors import SparkforgeError
from sparkforge.shared.records import UnitAccounting

# What a run that wrote nothing most likely got wrong, by the reason that skipped its rows.
_EMPTY_RUN_HINTS: Final = {
    "missing_messages": "the rows have no 'messages' (or 'input_ids' + 'loss_mask') column: "
                        "wrong schema or wrong --data?",
    "malformed_json": "the lines are not JSON objects: wrong --data or --data_format?",
    "line_too_long": "every line is longer than --max_line_bytes: wrong --data, or raise it",
    "bad_pretokenized": "'input_ids' / 'loss_mask' must be equal-length lists of ints "
                        "(ids below the vocabulary size, mask 0/1)",
    "too_long": "every row is longer than --max_seq_len (or use --overlong truncate)",
    "template_error": "the chat template fails on these rows (--chat_template?)",
    "template_timeout": "the chat template runs past --template_row_seconds on every row (an "
                        "endless loop in --chat_template?)",
}


class NoSamplesWritten(SparkforgeError, RuntimeError):
    """Raised when rows were read but none became a sample (the cache would train on nothing)."""


def require_samples(accounting: UnitAccounting, where: str) -> None:
    """Raise NoSamplesWritten, naming the skip reasons, if ``accounting`` wrote no sample."""
    if accounting.written or not accounting.input_rows:
        return
    reasons = sorted(accounting.skipped.items(), key=lambda kv: -kv[1])
    if len(reasons) == 1 and not accounting.failed:
        reason = reasons[0][0]
        what = f"every one of its {accounting.input_rows:,} input rows was skipped as {reason}"
        hint = _EMPTY_RUN_HINTS.get(reason)
    else:
        parts = [f"{k} {v:,}" for k, v in reasons] + (
            [f"failed {accounting.failed:,}"] if accounting.failed else [])
        what = f"none of its {accounting.input_rows:,} input rows was written ({', '.join(parts)})"
        hint = _EMPTY_RUN_HINTS.get(reasons[0][0]) if reasons else None
    raise NoSamplesWritten(f"{where} holds no sample: {what}" + (f"; {hint}" if hint else ""))
