"""Chat messages to token ids, and how a session's next turn continues the tokens it already holds.

A session whose turns are messages keeps its conversation. Each turn renders the whole conversation with the
model's chat template, exactly as a stateless request on it would, and prefills only the tokens past the
longest prefix the session already holds. Where the template renders earlier turns differently once more
follow (a default system prompt that moves, reasoning stripped from past replies, a reply re-tokenized
differently from how it was sampled), the held tokens past the common prefix and their KV are dropped and
recomputed: the turn's tokens always equal the stateless request's, reuse is a matter of speed only.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..errors import InvalidRequest
from .tokenizer import Tokenizer

Message = dict[str, Any]


def is_chat(prompt: Any) -> bool:
    """Whether a prompt is chat messages (a list of {"role", "content"} dicts)."""
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def render_ids(tokenizer: Tokenizer, messages: list[Message]) -> list[int]:
    """The chat template's rendering of `messages` with the assistant's turn opened, as token ids."""
    if not messages:
        raise InvalidRequest("messages is empty")
    try:
        text = tokenizer.apply_chat_template(messages)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    return tokenizer.encode(text, add_special_tokens=False)


def check_turn(tokenizer: Tokenizer, messages: list[Message]) -> None:
    """A session turn's new messages, checked as far as they can be alone (a template, known roles). Whether the
    template takes them shows only with the conversation before them, which the session's engine loop renders:
    a template's guard may look at the whole (tool results must follow a call, a user message must come
    somewhere), so the turn alone may be refused where the conversation is not."""
    try:
        tokenizer.check_messages(messages)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


def common_prefix(held: Sequence[int], rendered: Sequence[int]) -> int:
    """How many leading tokens the two share."""
    n = min(len(held), len(rendered))
    for i in range(n):
        if held[i] != rendered[i]:
            return i
    return n


def assistant_reply(text: str) -> Message:
    """A finished (or cancelled) turn's text, as its client received it (cut before a stop string), as the
    message the next turn's rendering includes: what a client that sent the whole conversation would send."""
    return {"role": "assistant", "content": text}
