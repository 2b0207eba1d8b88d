"""How a conversation becomes one prompt, the same on every backend (no torch here: the supervisor reads it).

The rendering itself lives in `mint_core.engine.chat` (below both serving/ and rl/, so rollouts render the same
way); this module adds the serving protocol's message type."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mint_core.engine.chat import FALLBACK_CHAT_TEMPLATE, prompt_ids, render_prompt

if TYPE_CHECKING:
    from mint_core.serving.protocol import ChatCompletionMessageParam


def chat_prompt(tok: Any, messages: list[ChatCompletionMessageParam]) -> str:
    """The conversation as one prompt: the tokenizer's chat template, or `role: content` lines without one (what
    FALLBACK_CHAT_TEMPLATE renders, the template mint starts vLLM with)."""
    return render_prompt(tok, [{"role": m.role, "content": m.text()} for m in messages])


def chat_ids(tok: Any, messages: list[ChatCompletionMessageParam]) -> list[int]:
    """The conversation's token ids as vLLM's chat route makes them: the rendered prompt, no special token added
    (a template such as Llama 3's writes its BOS itself)."""
    return prompt_ids(tok, [{"role": m.role, "content": m.text()} for m in messages])


__all__ = ["FALLBACK_CHAT_TEMPLATE", "chat_ids", "chat_prompt", "prompt_ids", "render_prompt"]
