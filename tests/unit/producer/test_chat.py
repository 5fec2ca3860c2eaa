"""Loss masks and skip reasons of the chat encoder, on the tiny target's two templates."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from sparkforge.producer.chat import ChatEncoder
from sparkforge.producer.chat_rows import SkipReason, validate_messages

CONVERSATIONS = [
    [
        {"role": "user", "content": "What is the sum?"},
        {"role": "assistant", "content": "The sum is 42."},
    ],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a layer."},
        {"role": "assistant", "content": "The draft layer."},
        {"role": "user", "content": "And then?"},
        {"role": "assistant", "content": "Then the cache, with 3 shards!"},
    ],
    [
        {"role": "user", "content": "One"},
        {"role": "assistant", "content": " leading space and trailing newline\n"},
    ],
]


def chatml_assistant_mask(tokenizer, ids: np.ndarray) -> np.ndarray:
    """Hand rule for ChatML: after '<|im_start|>assistant\\n', up to and including '<|im_end|>'."""
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    mask = np.zeros(len(ids), dtype=np.uint8)
    i = 0
    while i < len(ids):
        if ids[i] == start:
            j = i + 1
            while tokenizer.decode([ids[j]]) != "\n":
                j += 1
            role = tokenizer.decode(ids[i + 1 : j].tolist())
            k = j + 1
            while ids[k] != end:
                k += 1
            if role == "assistant":
                mask[j + 1 : k + 1] = 1
            i = k + 1
        else:
            i += 1
    return mask


@pytest.fixture(scope="module", params=["tiny_target", "tiny_target_plain_template"])
def encoder(request: pytest.FixtureRequest) -> ChatEncoder:
    path: Path = request.getfixturevalue(request.param)
    return ChatEncoder(AutoTokenizer.from_pretrained(path), max_seq_len=512)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_mask_covers_exactly_the_assistant_turns(encoder: ChatEncoder, messages: list) -> None:
    """Both masking methods mark assistant content plus its end-of-turn token, nothing else."""
    encoded = encoder.encode({"messages": messages})
    assert not isinstance(encoded, SkipReason)
    expected = chatml_assistant_mask(encoder.tokenizer, encoded.input_ids)
    assert expected.sum() > 0
    np.testing.assert_array_equal(encoded.loss_mask, expected)
    assert encoded.input_ids.dtype == np.int32
    assert encoded.loss_mask.dtype == np.uint8


def test_two_methods_agree(tiny_target: Path, tiny_target_plain_template: Path) -> None:
    """Generation markers and prefix rendering give identical ids and masks for the same chat."""
    tagged = ChatEncoder(AutoTokenizer.from_pretrained(tiny_target), max_seq_len=512)
    plain = ChatEncoder(AutoTokenizer.from_pretrained(tiny_target_plain_template), max_seq_len=512)
    assert tagged.uses_generation_tags
    assert not plain.uses_generation_tags
    assert tagged.template_sha256 != plain.template_sha256
    for messages in CONVERSATIONS:
        a, b = tagged.encode({"messages": messages}), plain.encode({"messages": messages})
        np.testing.assert_array_equal(a.input_ids, b.input_ids)
        np.testing.assert_array_equal(a.loss_mask, b.loss_mask)


def test_template_masking_everything_is_refused(tiny_target: Path) -> None:
    """A template whose markers wrap user text too fails the start-up probe, naming the field."""
    tok = AutoTokenizer.from_pretrained(tiny_target)
    bad = "{% generation %}" + tok.chat_template.replace("{% generation %}", "").replace(
        "{% endgeneration %}", "") + "{% endgeneration %}"
    with pytest.raises(ValueError, match="chat_template"):
        ChatEncoder(tok, chat_template=bad, max_seq_len=512)


def test_override_from_file(tiny_target: Path, tiny_target_plain_template: Path, tmp_path: Path):
    """A chat_template file overrides the tokenizer's own template."""
    tok = AutoTokenizer.from_pretrained(tiny_target_plain_template)
    path = tmp_path / "t.jinja"
    path.write_text(AutoTokenizer.from_pretrained(tiny_target).chat_template)
    enc = ChatEncoder(tok, chat_template=str(path), max_seq_len=512)
    assert enc.uses_generation_tags


def test_missing_template_names_the_field(tiny_target: Path) -> None:
    """A tokenizer without a template and no override is refused with the flag name."""
    tok = AutoTokenizer.from_pretrained(tiny_target)
    tok.chat_template = None
    with pytest.raises(ValueError, match="chat_template"):
        ChatEncoder(tok, max_seq_len=512)


OK = {"role": "user", "content": "hi"}
ANSWER = {"role": "assistant", "content": "yes"}


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"text": "no messages"}, SkipReason.MISSING_MESSAGES),
        ({"messages": []}, SkipReason.MISSING_MESSAGES),
        ({"messages": [{"role": "wizard", "content": "x"}, ANSWER]}, SkipReason.UNKNOWN_ROLE),
        ({"messages": ["just text", ANSWER]}, SkipReason.UNKNOWN_ROLE),
        ({"messages": [{"role": "user", "content": ["a"]}, ANSWER]}, SkipReason.NON_STRING_CONTENT),
        ({"messages": [OK, {"role": "assistant", "content": None}]}, SkipReason.NON_STRING_CONTENT),
        ({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}, ANSWER]},
         SkipReason.IMAGE_CONTENT),
        ({"messages": [OK, {"role": "assistant", "content": [{"type": "image", "image": "x"}]}]},
         SkipReason.IMAGE_CONTENT),
        ({"messages": [OK]}, SkipReason.MISSING_ASSISTANT),
        ({"messages": [OK, {"role": "assistant", "content": "  \n"}]}, SkipReason.EMPTY_ASSISTANT),
        ({"input_ids": [1, 2, 3], "loss_mask": [0, 1]}, SkipReason.BAD_PRETOKENIZED),
        ({"input_ids": [1, 99999], "loss_mask": [0, 1]}, SkipReason.BAD_PRETOKENIZED),
        ({"input_ids": [1, 2], "loss_mask": [0, 2]}, SkipReason.BAD_PRETOKENIZED),
        ({"input_ids": [1, 2], "loss_mask": [0, 0]}, SkipReason.NO_LOSS_TOKENS),
        ({"messages": [{"role": "user", "content": "word " * 300}, ANSWER]}, SkipReason.TOO_LONG),
        # unhashable roles once raised TypeError and stopped the run
        ({"messages": [{"role": ["user"], "content": "x"}, ANSWER]}, SkipReason.UNKNOWN_ROLE),
        ({"messages": [{"role": {"user": 1}, "content": "x"}, ANSWER]}, SkipReason.UNKNOWN_ROLE),
        ({"messages": [{"role": None, "content": "x"}, ANSWER]}, SkipReason.UNKNOWN_ROLE),
        # ids beyond int64 once raised OverflowError; every coercion is refused, not applied
        ({"input_ids": [1, 10**30], "loss_mask": [0, 1]}, SkipReason.BAD_PRETOKENIZED),
        ({"input_ids": [1, float("inf")], "loss_mask": [0, 1]}, SkipReason.BAD_PRETOKENIZED),
        ({"input_ids": [1, float("nan")], "loss_mask": [0, 1]}, SkipReason.BAD_PRETOKENIZED),
        ({"input_ids": [1, 5.7], "loss_mask": [0, 1]}, SkipReason.BAD_PRETOKENIZED),
        ({"input_ids": [1, 5.0], "loss_mask": [0, 1]}, SkipReason.BAD_PRETOKENIZED),
        ({"input_ids": [1, "5"], "loss_mask": [0, 1]}, SkipReason.BAD_PRETOKENIZED),
        ({"input_ids": [1, True], "loss_mask": [0, 1]}, SkipReason.BAD_PRETOKENIZED),
        ({"input_ids": [-1, 2], "loss_mask": [0, 1]}, SkipReason.BAD_PRETOKENIZED),
        ({"input_ids": [1, 2], "loss_mask": [0, 0.5]}, SkipReason.BAD_PRETOKENIZED),
        ({"input_ids": [1, 2], "loss_mask": [0, 1.0]}, SkipReason.BAD_PRETOKENIZED),
        ({"input_ids": [1, 2], "loss_mask": [0, "1"]}, SkipReason.BAD_PRETOKENIZED),
        ({"input_ids": [1, 2], "loss_mask": [0, 10**30]}, SkipReason.BAD_PRETOKENIZED),
        ({"input_ids": [], "loss_mask": []}, SkipReason.BAD_PRETOKENIZED),
        ({"input_ids": "1 2", "loss_mask": "0 1"}, SkipReason.BAD_PRETOKENIZED),
        ({"input_ids": [[1, 2]], "loss_mask": [[0, 1]]}, SkipReason.BAD_PRETOKENIZED),
        ({"input_ids": {"a": 1}, "loss_mask": [1]}, SkipReason.BAD_PRETOKENIZED),
        # tool fields are kept, so their types are checked
        ({"messages": [OK, {"role": "assistant", "content": None, "tool_calls": "call f"}]},
         SkipReason.BAD_TOOL_CALLS),
        ({"messages": [OK, {"role": "assistant", "content": "x", "tool_calls": []}]},
         SkipReason.BAD_TOOL_CALLS),
        ({"messages": [OK, {"role": "assistant", "content": "x", "tool_calls": ["f()"]}]},
         SkipReason.BAD_TOOL_CALLS),
        ({"messages": [OK, {"role": "tool", "content": "4", "tool_call_id": 7}, ANSWER]},
         SkipReason.BAD_TOOL_CALLS),
        ({"messages": [OK, {"role": "tool", "content": "4", "name": ["f"]}, ANSWER]},
         SkipReason.BAD_TOOL_CALLS),
        ({"messages": [OK, ANSWER], "tools": "f"}, SkipReason.BAD_TOOL_CALLS),
        ({"messages": [OK, ANSWER], "tools": [1]}, SkipReason.BAD_TOOL_CALLS),
    ],
)
def test_bad_rows_get_their_reason(encoder: ChatEncoder, row: dict, reason: SkipReason) -> None:
    """Each malformed row maps to its typed skip reason instead of raising."""
    assert encoder.encode(row) == reason


def test_truncation_keeps_head_and_skips_rows_left_without_loss(tiny_target: Path) -> None:
    """truncate cuts to max_seq_len; a row whose assistant turn is cut off is no_loss_tokens."""
    tok = AutoTokenizer.from_pretrained(tiny_target)
    enc = ChatEncoder(tok, max_seq_len=24, overlong="truncate")
    long_answer = {"messages": [OK, {"role": "assistant", "content": "word " * 50}]}
    out = enc.encode(long_answer)
    assert out.input_ids.shape == (24,)
    assert out.loss_mask.sum() > 0
    long_prompt = {"messages": [{"role": "user", "content": "word " * 50}, ANSWER]}
    assert enc.encode(long_prompt) == SkipReason.NO_LOSS_TOKENS


def test_pretokenized_rows_pass_through(encoder: ChatEncoder) -> None:
    """input_ids + loss_mask rows are used as given; a boolean mask is read as 0/1."""
    out = encoder.encode({"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]})
    np.testing.assert_array_equal(out.input_ids, [5, 6, 7])
    np.testing.assert_array_equal(out.loss_mask, [0, 1, 1])
    out = encoder.encode({"input_ids": [0, encoder.vocab_size - 1], "loss_mask": [False, True]})
    np.testing.assert_array_equal(out.input_ids, [0, encoder.vocab_size - 1])
    np.testing.assert_array_equal(out.loss_mask, [0, 1])


def test_reasoning_policy() -> None:
    """drop removes reasoning_content; keep passes it on; reasoning alone is not an empty turn."""
    msgs = [OK, {"role": "assistant", "content": "", "reasoning_content": "think"}]
    kept = validate_messages(msgs, "keep")
    assert kept[1]["reasoning_content"] == "think"
    assert validate_messages(msgs, "drop") == SkipReason.EMPTY_ASSISTANT


THINK_TEMPLATE = (  # Qwen3-style: every assistant turn opens with a (possibly empty) think block
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' -}}"
    "{%- if m['role'] == 'assistant' -%}"
    "{{- '<think>\\n' + (m.get('reasoning_content') or '') + '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- m['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def test_empty_think_block_is_not_supervised(tiny_target_plain_template: Path) -> None:
    """A template-inserted empty <think></think> is prompt; real reasoning is supervised."""
    tok = AutoTokenizer.from_pretrained(tiny_target_plain_template)
    enc = ChatEncoder(tok, chat_template=THINK_TEMPLATE, max_seq_len=512)
    plain = enc.encode({"messages": [OK, {"role": "assistant", "content": "The answer."}]})
    masked = tok.decode(plain.input_ids[plain.loss_mask == 1].tolist())
    assert masked == "The answer.<|im_end|>"
    thought = enc.encode({"messages": [OK, {"role": "assistant", "content": "The answer.",
                                            "reasoning_content": "Sum it."}]})
    masked = tok.decode(thought.input_ids[thought.loss_mask == 1].tolist())
    assert masked == "<think>\nSum it.\n</think>\n\nThe answer.<|im_end|>"


TOOL_TEMPLATE = (  # renders tool schemas, assistant tool calls and tool results, like Qwen3/Hermes
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\nTools:' -}}"
    "{%- for t in tools -%}{{- ' ' + t['function']['name'] -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' -}}"
    "{%- if m['role'] == 'tool' -%}{{- '[' + m['tool_call_id'] + '] ' -}}{%- endif -%}"
    "{{- m['content'] or '' -}}"
    "{%- for call in m.get('tool_calls') or [] -%}"
    "{{- '<tool_call>' + call['function']['name'] + '(' + call['function']['arguments'] + ')"
    "</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
TOOL_CHAT = {
    "tools": [{"type": "function", "function": {"name": "add", "parameters": {}}}],
    "messages": [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "2, 2"}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "add", "content": "4"},
        {"role": "assistant", "content": "It is 4."},
    ],
}


def test_tool_calls_reach_the_template_and_are_supervised(tiny_target_plain_template: Path):
    """tools, tool_calls, tool_call_id and name are rendered as serving renders them; the tool
    call is supervised and the tool result is not."""
    tok = AutoTokenizer.from_pretrained(tiny_target_plain_template)
    enc = ChatEncoder(tok, chat_template=TOOL_TEMPLATE, max_seq_len=512)
    out = enc.encode(TOOL_CHAT)
    assert not isinstance(out, SkipReason)
    serving = tok.apply_chat_template(TOOL_CHAT["messages"], tools=TOOL_CHAT["tools"],
                                      chat_template=TOOL_TEMPLATE, tokenize=False)
    assert tok.decode(out.input_ids.tolist()) == serving
    assert "Tools: add" in serving
    assert "[c1] 4" in serving
    masked = tok.decode(out.input_ids[out.loss_mask == 1].tolist())
    assert masked == "<tool_call>add(2, 2)</tool_call><|im_end|>It is 4.<|im_end|>"


def test_unreadable_rows_are_counted_by_the_reason_the_reader_gave() -> None:
    """The reader's error prefix is the skip reason: over-long lines are not malformed JSON."""
    from sparkforge.producer.chat import unreadable_reason

    assert unreadable_reason("line_too_long: the line is longer") == SkipReason.LINE_TOO_LONG
    assert unreadable_reason("malformed_json: Expecting value") == SkipReason.MALFORMED_JSON
    assert unreadable_reason(None) == SkipReason.MALFORMED_JSON


_MESSAGES_LOOP = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


@pytest.mark.parametrize(("hostile", "refusal"), [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
     + _MESSAGES_LOOP, "took over 2 s"),  # 10^10 iterations
    ("{% for i in range(100000) %}{% for j in range(100000) %}{{ 'x' }}{% endfor %}{% endfor %}"
     + _MESSAGES_LOOP, "took over 2 s|needed over 0.25 GiB"),  # prints 10^10 characters
    ("{{ 'x' * 10000000000 }}" + _MESSAGES_LOOP, "needed over 0.25 GiB"),  # one 10 GB string
])
def test_a_hostile_template_is_refused_within_bounds(
    tiny_target: Path, hostile: str, refusal: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A template that would loop or allocate for ever is stopped by the check's bounds and
    refused in one line (exit 2), and the process keeps its memory."""
    from sparkforge.producer import template_bounds
    from sparkforge.shared.errors import ConfigError

    monkeypatch.setattr(template_bounds, "CHECK_SECONDS", 2.0)
    monkeypatch.setattr(template_bounds, "CHECK_MEMORY_BYTES", 1 << 28)
    with pytest.raises(ConfigError, match=refusal) as info:
        ChatEncoder(AutoTokenizer.from_pretrained(tiny_target), chat_template=hostile,
                    max_seq_len=512)
    assert "\n" not in str(info.value)


_LOOP_ON_MARKER = ("{% for m in messages %}{% if 'LOOP' in m['content'] %}"
                   "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                   "{% endfor %}{% endif %}{% endfor %}")


@pytest.mark.parametrize("own_template", [False, True], ids=["prefix", "generation_tags"])
def test_a_template_looping_on_some_rows_skips_them_as_template_timeout(
        tiny_target: Path, own_template: bool) -> None:
    """A template benign on the probe but endless on rows holding a marker passes the start-up
    check; each such row is stopped at template_row_seconds and skipped as template_timeout,
    and the next rows encode as before (the SIGALRM handler and timer are the caller's again)."""
    import signal

    tok = AutoTokenizer.from_pretrained(tiny_target)
    masking = tok.chat_template if own_template else _MESSAGES_LOOP  # the own one has the tags
    enc = ChatEncoder(tok, chat_template=_LOOP_ON_MARKER + masking, max_seq_len=512,
                      template_row_seconds=0.5)
    assert enc.uses_generation_tags == own_template
    plain = {"messages": [{"role": "user", "content": "Hi?"},
                          {"role": "assistant", "content": "Hello."}]}
    marked = {"messages": [{"role": "user", "content": "Hi LOOP?"},
                           {"role": "assistant", "content": "Hello."}]}
    handler, (outer, _) = signal.getsignal(signal.SIGALRM), signal.getitimer(signal.ITIMER_REAL)
    assert enc.encode(marked) == SkipReason.TEMPLATE_TIMEOUT
    assert signal.getsignal(signal.SIGALRM) is handler
    left, _ = signal.getitimer(signal.ITIMER_REAL)  # pytest-timeout's timer, if armed, runs on
    assert (left > 0) == (outer > 0)
    assert left <= outer
    out = enc.encode(plain)
    assert not isinstance(out, SkipReason)
    masked = tok.decode(out.input_ids[out.loss_mask == 1].tolist())
    assert "Hello." in masked
    assert "Hi" not in masked


def test_a_stray_sigalrm_after_a_bounded_row_still_ends_the_process() -> None:
    """Once a row was bounded, the row timer's handler stays installed in place of the default;
    a SIGALRM that is not the row timer's ends the process as the default would."""
    import signal
    import subprocess
    import sys

    code = ("import signal, time\n"
            "from sparkforge.producer.template_bounds import RowTimeLimit\n"
            "with RowTimeLimit(5.0):\n    pass\n"
            "signal.setitimer(signal.ITIMER_REAL, 0.1)\ntime.sleep(30)\n")
    done = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == -signal.SIGALRM, done.stderr[-2000:]
    assert "TemplateTimeout" not in done.stderr


def _spin() -> None:
    """Compute forever."""
    while True:
        pass


def test_the_row_limit_counts_the_rows_cpu_not_a_busy_hosts_wall_clock() -> None:
    """Which extreme rows are kept must not depend on host load: a row that waits (as when the
    host is busy) past its limit in wall clock without using that CPU runs on, up to
    ``WALL_FACTOR`` times the limit; a row that computes past it is stopped."""
    from sparkforge.producer.template_bounds import WALL_FACTOR, RowTimeLimit, TemplateTimeout

    started = time.monotonic()
    with RowTimeLimit(0.2):
        time.sleep(0.6)   # three times the limit in wall clock, next to no CPU
    assert time.monotonic() - started >= 0.6
    spent = time.thread_time()
    with pytest.raises(TemplateTimeout), RowTimeLimit(0.2):
        _spin()
    assert time.thread_time() - spent >= 0.2
    started = time.monotonic()
    with pytest.raises(TemplateTimeout), RowTimeLimit(0.05):
        time.sleep(60)    # waiting forever still ends, at WALL_FACTOR times the limit
    assert time.monotonic() - started < 60 * 0.05 * WALL_FACTOR
