"""A session's conversation kept on the client, so a resumable session can start again on another replica
(its own went away) and replay what was said as the prefix of its next turn."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .wire import Delta


class History:
    """Every turn's input and output, in the one form the session's turns take: prompt text, chat messages
    or token ids. Replayed as one input, it gives the same tokens as a stateless request over the whole
    conversation, which is what the session's next turn would have seen. Prompt turns are replayed as their
    text, which holds less than the server's history did where a turn's tokens went past its text: an
    end-of-sequence or other special token, or what followed a stop string."""

    def __init__(self) -> None:
        self.kind: str | None = None  # "prompt", "messages" or "token_ids", set by the first turn
        self.text = ""
        self.messages: list[dict[str, str]] = []
        self.token_ids: list[int] = []

    def turn_input(
        self, prompt: str | None, messages: Sequence[Mapping[str, str]] | None, token_ids: Sequence[int] | None
    ) -> dict[str, Any]:
        """This turn's input as `generate` keywords, after checking it is of the session's kind."""
        given = {
            k: v for k, v in (("prompt", prompt), ("messages", messages), ("token_ids", token_ids)) if v is not None
        }
        kind = next(iter(given), None)
        if len(given) == 1 and self.kind not in (None, kind):
            raise ValueError(f"a resumable session keeps one kind of input: its turns are {self.kind}, not {kind}")
        return {"prompt": prompt, "messages": messages, "token_ids": token_ids}

    def replay(self, turn: dict[str, Any]) -> dict[str, Any]:
        """The whole conversation followed by this turn, as one turn's `generate` keywords."""
        if turn["prompt"] is not None:
            return {**turn, "prompt": self.text + turn["prompt"]}
        if turn["messages"] is not None:
            return {**turn, "messages": self.messages + [dict(m) for m in turn["messages"]]}
        return {**turn, "token_ids": self.token_ids + list(turn["token_ids"])}

    def record(self, turn: dict[str, Any], deltas: list[Delta]) -> None:
        """A finished (or stopped) turn: its input and what came back, as the server's history now holds it
        (a turn cancelled before its first token, not at all)."""
        if deltas and deltas[-1].finish_reason == "cancelled" and not any(d.token_ids for d in deltas):
            return
        text = "".join(d.text for d in deltas)
        if turn["prompt"] is not None:
            self.kind, self.text = "prompt", self.text + turn["prompt"] + text
        elif turn["messages"] is not None:
            self.kind = "messages"
            self.messages += [dict(m) for m in turn["messages"]] + [{"role": "assistant", "content": text}]
        else:
            self.kind = "token_ids"
            self.token_ids += list(turn["token_ids"]) + [t for d in deltas for t in d.token_ids]
