"""The tiny targets' text, offline: a synthetic corpus, the byte-level BPE tokenizer trained on
it with its ChatML templates, and demo chat rows drawn from it.

Every tiny target (``tiny_target``, ``tiny_minimax_vl``) and the image chats (``tiny_vl``) build
on these; this module imports none of them.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from pathlib import Path

# ChatML with {% generation %} markers around assistant content: HF's
# ``return_assistant_tokens_mask`` reads them to build the loss mask.
CHATML_GENERATION_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{- message['content'] + '<|im_end|>' -}}{% endgeneration %}{{- '\\n' -}}"
    "{%- else -%}"
    "{{- message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# The same rendering without markers: the loss mask must then be found by prefix diffing.
CHATML_PLAIN_TEMPLATE = CHATML_GENERATION_TEMPLATE.replace("{% generation %}", "").replace(
    "{% endgeneration %}", ""
)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")
MASK_TOKEN = "<|mask|>"


def chatml_image_template(image_token: str) -> str:
    """ChatML whose content may be a list of text and image parts: one ``image_token`` per image
    part, which the target's image processing expands into the image's span."""
    return ("{%- macro render(content) -%}"
            "{%- if content is string -%}{{- content -}}{%- else -%}{%- for part in content -%}"
            "{%- if part['type'] == 'image' -%}{{- '" + image_token + "' -}}{%- else -%}"
            "{{- part['text'] -}}{%- endif -%}{%- endfor -%}{%- endif -%}"
            "{%- endmacro -%}"
            + CHATML_GENERATION_TEMPLATE.replace("message['content']",
                                                 "render(message['content'])"))

_WORDS = (
    "the a an of to and in is was for on that with as by at from it be this are or have not but "
    "which one all were when we there can been has more if will no out so up said what its about "
    "into than them only other new some time could these two may first then do any like my now "
    "over such our man me even most made after also did many before must through back years where "
    "much your way well down should because each just those people how too little state good very "
    "make world still own see men work long get here between both life being under never day same "
    "another know while last might us great old year off come since against go came right used "
    "take "
    "three number value sum list graph model token layer draft block anchor cache shard train loss"
).split()


def synthetic_corpus(num_lines: int = 4000, *, seed: int = 0) -> list[str]:
    """Deterministic English-like lines with digits and punctuation, for tokenizer training."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ",", ":"]))
    return lines


def build_tokenizer(
    out_dir: Path, *, vocab_size: int = 1024, generation_markers: bool = True,
    corpus: Iterable[str] | None = None, image_tokens: Sequence[str] = (),
) -> None:
    """Train a byte-level BPE tokenizer of exactly ``vocab_size`` tokens and save it HF-style.

    ``corpus`` defaults to :func:`synthetic_corpus`; ``image_tokens`` (begin-of-image,
    end-of-image, image; ids 4, 5, 6) adds them and the chat template that renders image parts.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*SPECIAL_TOKENS, *image_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus() if corpus is None else corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[MASK_TOKEN, *image_tokens],
    )
    fast.chat_template = (chatml_image_template(image_tokens[2]) if image_tokens else
                          CHATML_GENERATION_TEMPLATE if generation_markers else
                          CHATML_PLAIN_TEMPLATE)
    fast.save_pretrained(str(out_dir))


def demo_conversations(num_rows: int, *, seed: int = 0) -> list[dict[str, object]]:
    """Chat rows in OpenAI ``messages`` form (system, user, assistant) from the synthetic corpus."""
    rng = random.Random(seed)
    lines = synthetic_corpus(num_rows * 3, seed=seed + 1)
    rows: list[dict[str, object]] = []
    for i in range(num_rows):
        messages = [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": lines[3 * i]},
            {"role": "assistant", "content": lines[3 * i + 1] + " " + lines[3 * i + 2]},
        ]
        if rng.random() < 0.3:  # some two-turn conversations
            messages += [
                {"role": "user", "content": rng.choice(lines)},
                {"role": "assistant", "content": rng.choice(lines)},
            ]
        rows.append({"id": i, "messages": messages})
    return rows


def write_chats(path: Path, rows: Iterable[dict[str, object]]) -> None:
    """Write chat rows as JSONL, one object per line."""
    import json

    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
