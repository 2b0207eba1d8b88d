"""The tiny chat bases' tokenizers: a byte-level BPE trained here (no hub) on a small generated corpus, with a
family's pre-tokenizer split, special tokens and chat template (Llama 3, Qwen2, Qwen3).

Kept apart from tokenizer.py, whose byte tokenizer the built-in base is pretrained with (a DVC dependency of it).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import PreTrainedTokenizerFast

ChatFamily = Literal["llama", "qwen2", "qwen3"]
CHAT_FAMILIES: tuple[ChatFamily, ...] = ("llama", "qwen2", "qwen3")

# The pre-tokenizer split patterns of the real families: Llama 3 groups digits by up to three, Qwen splits each digit.
_LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

# Qwen2-Instruct's template, verbatim: ChatML with a default system turn.
QWEN2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Qwen3's, without tools: ChatML, no default system turn, earlier thinking dropped from assistant turns, and an
# empty think block when the caller turns thinking off (`enable_thinking=False`).
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' and '</think>' in message['content'] %}"
    "{{- message['content'].split('</think>')[-1].lstrip('\\n') }}{%- else %}{{- message['content'] }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
# Llama 3 Instruct's: the BOS in the template (the tokenizer adds none itself, so a rendered prompt holds one).
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class ChatTokens:
    """A family's special tokens and which of them the tokenizer and generation_config name."""

    specials: tuple[str, ...]
    """Added as special tokens after the BPE vocabulary (as the real families number them)."""
    eos: str
    """The tokenizer's EOS."""
    end_of_turn: str
    """What the chat template closes every turn with; generation stops at it too (generation_config)."""
    pad: str
    bos: str | None
    template: str
    split: str
    plain: tuple[str, ...] = ()
    """Added tokens that are not special (kept when decoding), e.g. Qwen3's think markers."""


CHAT_TOKENS: dict[ChatFamily, ChatTokens] = {
    # Llama 3 base checkpoints: EOS <|end_of_text|>, turns end with <|eot_id|>
    "llama": ChatTokens(
        specials=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ),
        eos="<|end_of_text|>",
        end_of_turn="<|eot_id|>",
        pad="<|end_of_text|>",
        bos="<|begin_of_text|>",
        template=LLAMA3_CHAT_TEMPLATE,
        split=_LLAMA3_SPLIT,
    ),
    # Qwen2 base checkpoints: EOS <|endoftext|>, ChatML turns end with <|im_end|>
    "qwen2": ChatTokens(
        specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        eos="<|endoftext|>",
        end_of_turn="<|im_end|>",
        pad="<|endoftext|>",
        bos=None,
        template=QWEN2_CHAT_TEMPLATE,
        split=_QWEN_SPLIT,
    ),
    # Qwen3 (post-trained) checkpoints: EOS is the end of turn itself, <|endoftext|> still stops
    "qwen3": ChatTokens(
        specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        eos="<|im_end|>",
        end_of_turn="<|im_end|>",
        pad="<|endoftext|>",
        bos=None,
        template=QWEN3_CHAT_TEMPLATE,
        split=_QWEN_SPLIT,
        plain=("<think>", "</think>"),
    ),
}

_WORD_TEXT = (
    "the a an and or but if then so of to in on at by for with from as is are was were be been has have had do does "
    "did not no yes this that these those it its he she they we you i me my your our their his her them us who what "
    "which when where why how many much more less most least each every all some any one two three four five six "
    "seven eight nine ten hundred thousand apples oranges books pens cookies marbles coins stickers cards eggs boxes "
    "bags cups dollars cents hours minutes days weeks years miles pages students friends people children teacher "
    "farmer baker store school class garden market train car bike house room city tom anna sam maria john lisa ben "
    "emma buys sells gives gets takes makes reads eats spends saves earns pays has needs wants left remaining total "
    "altogether together each per twice half double triple times more fewer than after before during every week "
    "question answer solve number sum difference product quotient equals plus minus divided multiplied help please "
    "thank hello assistant user system helpful sure here step first second next finally therefore so result"
)
_WORDS = tuple(_WORD_TEXT.split())
_NAMES = ("Tom", "Anna", "Sam", "Maria", "John", "Lisa", "Ben", "Emma", "Noah", "Mia")
_ITEMS = ("apples", "books", "pens", "cookies", "marbles", "coins", "stickers", "cards", "eggs", "cups")


def tiny_corpus(seed: int = 0, lines: int = 4000) -> list[str]:
    """English-ish sentences, arithmetic, and GSM8K-style items (`Question: ... Answer: ... #### N`), seeded: what
    a tiny chat base's tokenizer is trained on."""
    rng = random.Random(seed)
    out: list[str] = []
    for i in range(lines):
        kind = i % 5
        if kind == 4:  # the role names as a chat template writes them, at the start of a line
            role = rng.choice(("system", "user", "assistant"))
            words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 10))]
            out.append(f"{role}\n" + " ".join(words).capitalize() + ".")
        elif kind == 0:
            words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
            out.append(" ".join(words).capitalize() + rng.choice((".", "?", "!")))
        elif kind == 1:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            op = rng.choice("+-*")
            value = a + b if op == "+" else a - b if op == "-" else a * b
            out.append(f"{a} {op} {b} = {value}")
        else:
            name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            out.append(
                f"Question: {name} has {a} {item} and gets {b} more. How many {item} does {name} have now?\n"
                f"Answer: {name} has {a} + {b} = {a + b} {item}.\n#### {a + b}"
            )
    return out


def chat_bpe_tokenizer(family: ChatFamily, vocab_size: int = 1024, seed: int = 0) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained here on `tiny_corpus(seed)` (about `vocab_size` tokens, then the family's
    special tokens), with the family's pre-tokenizer split and chat template. The same for the same arguments."""
    if family not in CHAT_TOKENS:
        raise ValueError(f"unknown chat family {family!r}; expected one of {', '.join(CHAT_FAMILIES)}")
    spec = CHAT_TOKENS[family]
    tok = Tokenizer(models.BPE())
    if family != "llama":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(spec.split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tiny_corpus(seed), trainer=trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in spec.specials])
    if spec.plain:
        tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in spec.plain])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=spec.bos,
        eos_token=spec.eos,
        pad_token=spec.pad,
        chat_template=spec.template,
        padding_side="left",
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
