"""Regenerated parts keep tool calls and schemas, and template variables shape every rendering."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
from test_chat import TOOL_CHAT, TOOL_TEMPLATE
from transformers import AutoTokenizer

from sparkforge.producer.chat import ChatEncoder
from sparkforge.producer.chat_rows import SkipReason
from sparkforge.producer.config import RegenerateConfig
from sparkforge.producer.engine_options import EngineOptions
from sparkforge.producer.regenerate import part_table, prompt_ids, prompt_of
from sparkforge.shared.dataset import RawRow, describe_sources, iter_rows

CFG = RegenerateConfig(data="d.jsonl", output="out", engine=EngineOptions(model="m"))
# ChatML that opens an empty think block before every reply when thinking is off (as Qwen3's).
_OFF = ("{%- if enable_thinking is defined and not enable_thinking -%}"
        "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}")
THINK_TEMPLATE = (
    "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' -}}"
    "{%- if m['role'] == 'assistant' -%}" + _OFF + "{%- endif -%}"
    "{{- m['content'] + '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}" + _OFF + "{%- endif -%}"
)


def test_a_tool_row_survives_its_part_and_captures_as_the_original(
        tiny_target_plain_template: Path, tmp_path: Path) -> None:
    """A row with tool schemas, a tool call and a tool result, regenerated: its part holds the
    prompt as given, and the capture encodes the part's row exactly as it encodes the original
    row with that reply (same tokens, same supervised tool call)."""
    tok = AutoTokenizer.from_pretrained(tiny_target_plain_template)
    raw = RawRow(index=7, row=TOOL_CHAT, content_hash="0" * 64)
    prompt = prompt_of(TOOL_CHAT, CFG)
    assert not isinstance(prompt, SkipReason)
    assert prompt.tools == TOOL_CHAT["tools"]
    reply = SimpleNamespace(text="It is 4.", finish_reason="stop", token_ids=[1, 2, 3])
    path = tmp_path / "part-000000.parquet"
    pq.write_table(part_table([(raw, prompt)], [reply], {}), path)
    (row,) = [r.row for r in iter_rows(describe_sources(str(path)))]
    assert isinstance(row["tools"], str)  # stored as JSON text
    enc = ChatEncoder(tok, chat_template=TOOL_TEMPLATE, max_seq_len=512)
    got, want = enc.encode(row), enc.encode(TOOL_CHAT)
    assert not isinstance(got, SkipReason)
    assert not isinstance(want, SkipReason)
    assert got.input_ids.tolist() == want.input_ids.tolist()
    assert got.loss_mask.tolist() == want.loss_mask.tolist()
    assert "<tool_call>add(2, 2)</tool_call>" in tok.decode(got.input_ids[got.loss_mask == 1])


@pytest.mark.parametrize("thinking", [True, False])
def test_template_kwargs_reach_regenerate_and_capture_alike(
        tiny_target_plain_template: Path, thinking: bool) -> None:
    """``enable_thinking`` renders the regeneration prompt and the captured row the same way;
    the empty think block thinking-off inserts is prompt, never supervised."""
    tok = AutoTokenizer.from_pretrained(tiny_target_plain_template)
    kwargs = {"enable_thinking": thinking}
    chat = {"messages": [{"role": "user", "content": "q"},
                         {"role": "assistant", "content": "a"}]}
    prompt = prompt_of(chat, CFG)
    assert not isinstance(prompt, SkipReason)
    text = tok.decode(prompt_ids(tok, THINK_TEMPLATE, prompt, kwargs))
    assert text.endswith("assistant\n" if thinking else "<think>\n\n</think>\n\n")
    enc = ChatEncoder(tok, chat_template=THINK_TEMPLATE, max_seq_len=512,
                      chat_template_kwargs=kwargs)
    out = enc.encode(chat)
    assert not isinstance(out, SkipReason)
    assert tok.decode(out.input_ids[out.loss_mask == 1]) == "a<|im_end|>"


def test_template_kwargs_that_shadow_the_renderer_are_refused() -> None:
    """A template variable named like apply_chat_template's own argument is a config error."""
    with pytest.raises(ValueError, match="'tools' is apply_chat_template's own argument"):
        RegenerateConfig(data="d", output="o", engine=EngineOptions(model="m"),
                         chat_template_kwargs={"tools": []})
