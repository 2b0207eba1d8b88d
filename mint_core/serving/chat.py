"""How a conversation becomes one prompt, the same on every backend (no torch here: the supervisor reads it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mint_core.serving.protocol import ChatCompletionMessageParam

# A conversation as one prompt when the base's tokenizer has no chat template: `role: content` lines, then the
# assistant's turn. mint serve renders it in Python (routes/completions.py); vLLM is started with this template.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}assistant:"
)


def chat_prompt(tok: Any, messages: list[ChatCompletionMessageParam]) -> str:
    """The conversation as one prompt: the tokenizer's chat template, or `role: content` lines without one (what
    FALLBACK_CHAT_TEMPLATE renders, the template mint starts vLLM with)."""
    msgs = [{"role": m.role, "content": m.text()} for m in messages]
    if getattr(tok, "chat_template", None):
        return str(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
    return "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant:"
