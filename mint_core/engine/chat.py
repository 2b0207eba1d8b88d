"""How a task row's prompt or a conversation becomes the one string a base is given, the same everywhere.

Rollouts, mint serve's and vLLM's `/v1/chat/completions`, lm-eval (`apply_chat_template`) and the canary's scoring
all render through `render_prompt`: plain text passes through unchanged, a list of `{role, content}` messages goes
through the base's chat template with the assistant's turn opened. No torch here: the supervisor and the serving
front import it (so it sits in engine/, below both rl/ and serving/, which may not import each other).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# A conversation as one prompt when the base's tokenizer has no chat template: `role: content` lines, then the
# assistant's turn. `render_prompt` renders it in Python; vLLM is started with this template (vllm_process.py).
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}assistant:"
)

Messages = Sequence[Mapping[str, Any]]


def _content(content: Any) -> str:
    """A message's text: a string, or OpenAI's content parts (their `text` parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    raise TypeError(f"message content must be text or a list of content parts, not {type(content).__name__}")


def as_messages(prompt: Messages) -> list[dict[str, str]]:
    """`{role, content}` dicts with text content; a message without a role is refused, naming its index."""
    out = []
    for i, m in enumerate(prompt):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not m["role"]:
            raise ValueError(f"message {i} has no role (expected {{'role': ..., 'content': ...}}, got {m!r})")
        out.append({"role": m["role"], "content": _content(m.get("content"))})
    return out


def render_prompt(tokenizer: Any, prompt: str | Messages) -> str:
    """The prompt a base is given: plain text unchanged; chat messages through the tokenizer's chat template
    (`add_generation_prompt=True`), or `role: content` lines (FALLBACK_CHAT_TEMPLATE) where it has none."""
    if isinstance(prompt, str):
        return prompt
    msgs = as_messages(prompt)
    if getattr(tokenizer, "chat_template", None):
        return str(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
    return "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant:"


def prompt_ids(tokenizer: Any, prompt: str | Messages) -> list[int]:
    """A prompt's token ids as the serving routes tokenize it: plain text as `/v1/completions` does (with the
    tokenizer's own special tokens, e.g. an added BOS), chat messages as `/v1/chat/completions` does on vLLM (the
    rendered template, which writes any BOS itself, with nothing added). Rollouts of chat rows use it too, so
    training sees the tokens serving does."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    return list(tokenizer(render_prompt(tokenizer, prompt), add_special_tokens=False)["input_ids"])


def stop_token_ids(tokenizer: Any, generation_eos: int | Sequence[int] | None = None) -> frozenset[int]:
    """Every token that ends a generation: the tokenizer's EOS and each id of generation_config's eos_token_id
    (a chat model's end-of-turn token, e.g. `<|im_end|>`, `<|eot_id|>`), as vLLM stops at both."""
    ids = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    if isinstance(generation_eos, int):
        ids.add(generation_eos)
    elif generation_eos is not None:
        ids.update(int(i) for i in generation_eos)
    return frozenset(ids)


def generation_eos(path: str | Path) -> list[int]:
    """The eos_token_id list of a model directory's generation_config.json ([] without one)."""
    f = Path(path) / "generation_config.json"
    if not f.is_file():
        return []
    got = json.loads(f.read_text()).get("eos_token_id")
    if got is None:
        return []
    return [int(got)] if isinstance(got, int) else [int(i) for i in got]
