"""Fuzzed input rows: every line is written or counted under a skip reason, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from sparkforge.producer.capture import FailureRun, UnitCapturer
from sparkforge.producer.chat import ChatEncoder
from sparkforge.producer.chat_rows import ROLES, SkipReason
from sparkforge.producer.splits import SplitRule
from sparkforge.shared.dataset import RawRow, _parse_line

SCALARS = (st.none() | st.booleans() | st.integers(-(2**80), 2**80) | st.integers(-3, 1100)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=12)


def mostly(valid: st.SearchStrategy, hostile: st.SearchStrategy = JSON) -> st.SearchStrategy:
    """``valid`` three times in four, so most rows get as far as the template."""
    return st.one_of(valid, valid, valid, hostile)


TEXT = st.text(max_size=30)
TOOL_CALL = st.fixed_dictionaries({"id": mostly(TEXT), "type": st.just("function"),
                                   "function": st.fixed_dictionaries(
                                       {"name": mostly(TEXT), "arguments": mostly(TEXT)})})
MESSAGE = st.fixed_dictionaries(
    {"role": mostly(st.sampled_from(sorted(ROLES))), "content": mostly(TEXT)},
    optional={"reasoning_content": mostly(TEXT),
              "tool_calls": mostly(st.lists(TOOL_CALL, min_size=1, max_size=2)),
              "tool_call_id": mostly(TEXT), "name": mostly(TEXT)},
)
ANSWER = st.fixed_dictionaries({"role": st.just("assistant"), "content": TEXT})
CHAT_ROW = st.fixed_dictionaries(
    {"messages": mostly(st.tuples(st.lists(MESSAGE, max_size=3), ANSWER).map(
        lambda turns: [*turns[0], turns[1]]))},
    optional={"tools": mostly(st.lists(st.dictionaries(TEXT, JSON, max_size=2), max_size=2))},
)


def _one_replaced(values: st.SearchStrategy) -> st.SearchStrategy:
    """A list of ``values`` with one element replaced by any scalar."""
    return st.tuples(st.lists(values, min_size=1, max_size=8), st.integers(0, 7), SCALARS).map(
        lambda t: [*t[0][: t[1]], t[2], *t[0][t[1] + 1:]])


PRETOKENIZED_ROW = st.integers(1, 8).flatmap(lambda n: st.fixed_dictionaries({
    "input_ids": mostly(st.lists(st.integers(0, 1023), min_size=n, max_size=n),
                        _one_replaced(st.integers(0, 1023)) | JSON),
    "loss_mask": mostly(st.lists(st.integers(0, 1), min_size=n, max_size=n),
                        _one_replaced(st.integers(0, 1)) | JSON),
}))
ROW = mostly(st.one_of(CHAT_ROW, CHAT_ROW, PRETOKENIZED_ROW),
             st.dictionaries(st.text(max_size=10), JSON, max_size=3))
LINE = mostly(ROW.map(lambda row: json.dumps(row).encode()),
              st.binary(max_size=60) | JSON.map(lambda value: json.dumps(value).encode())
              | st.integers(4000, 5000).map(lambda n: b'{"input_ids": [' + b"7" * n + b"]}"))


@pytest.fixture(scope="module")
def capturer(tiny_target_plain_template: Path) -> UnitCapturer:
    encoder = ChatEncoder(AutoTokenizer.from_pretrained(tiny_target_plain_template),
                          max_seq_len=64)
    return UnitCapturer(encoder, SplitRule(0.0, None, 0), 3, "float32", 0, FailureRun(1))


@settings(max_examples=400, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(lines=st.lists(LINE, min_size=1, max_size=4))
def test_every_line_is_encoded_or_counted(capturer: UnitCapturer, lines: list[bytes]) -> None:
    """Any bytes on a line become a tokenized row or one counted skip reason; nothing raises."""
    rows = [_parse_line(i, line) for i, line in enumerate(lines)]
    assert all(isinstance(r, RawRow) for r in rows)
    pending, skipped = capturer.encode(rows)
    assert len(pending) + sum(skipped.values()) == len(rows)
    assert set(skipped) <= {reason.value for reason in SkipReason}
    for p in pending:
        assert p.input_ids.shape == p.loss_mask.shape
        assert 0 < p.input_ids.shape[0] <= 64
        assert p.loss_mask.any()
        assert 0 <= p.input_ids.min()
        assert p.input_ids.max() < capturer.encoder.vocab_size


def test_an_over_long_line_is_counted_as_line_too_long(capturer: UnitCapturer,
                                                       tmp_path: Path) -> None:
    """A line past ``max_line_bytes`` reaches the unit's accounting as its own skip reason."""
    from sparkforge.shared.dataset import describe_sources, iter_rows

    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    long_line = json.dumps({"messages": [{"role": "user", "content": "x" * 5000}]})
    (tmp_path / "d.jsonl").write_text(f"{json.dumps(good)}\n{long_line}\n")
    rows = list(iter_rows(describe_sources(str(tmp_path / "d.jsonl"), max_line_bytes=4096)))
    pending, skipped = capturer.encode(rows)
    assert len(pending) == 1
    assert dict(skipped) == {"line_too_long": 1}
