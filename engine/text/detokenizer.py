"""Streaming token ids -> text, with stop strings.

Decoding one token at a time is wrong for byte-level vocabularies: an emoji or CJK character is
often split over several tokens, and each piece alone decodes to U+FFFD. So, like vLLM and TGI,
tokenizers' `DecodeStream` (`Tokenizer.decode_stream`) decodes a small window of recent tokens and
gives only what lies beyond the window's previous text, holding back while the window ends in U+FFFD
(an incomplete character): one call into Rust per token, which a step of hundreds of sequences pays
hundreds of times.
"""

from __future__ import annotations

from collections.abc import Sequence

from .tokenizer import Tokenizer

CONTEXT_TOKENS = 64  # a reply's context is looked for in this many ids before it; past that, all of them


def reply_context(tokenizer: Tokenizer, preceding: Sequence[int], skip_special_tokens: bool = True) -> list[int]:
    """The shortest tail of the ids before a reply (at least one) whose text starts on a character boundary
    and ends the text of all of them: a reply decoded after it is `decode(preceding + reply)` past
    `decode(preceding)`. One id is not always enough: a byte-level vocabulary splits a character over ids,
    and the last id of "日本語" alone decodes to U+FFFD, which the reply's text would then carry; a
    byte-fallback decoder turns a whole run of byte ids into U+FFFD while its last character is incomplete.
    Where no such tail is found near the end, all of `preceding` is the context."""
    whole = None
    for k in range(1, min(len(preceding), CONTEXT_TOKENS) + 1):
        tail = preceding[-k:]
        text = tokenizer.decode(tail, skip_special_tokens)
        if text.startswith("\ufffd"):
            continue
        whole = whole if whole is not None else tokenizer.decode(preceding[-CONTEXT_TOKENS - 1 :], skip_special_tokens)
        if whole.endswith(text):
            return list(tail)
    return list(preceding)


class IncrementalDetokenizer:
    """Turns one sequence's generated tokens into text deltas, as they arrive.

    Invariant: without a stop-string hit, the deltas from `step` plus `finish()` concatenate to
    exactly the text the generated ids add after `context` (the tail of the ids before them that
    `reply_context` picks):
    `decode(context + generated)` past `decode(context)`. With a hit, they concatenate to that text
    cut right before the earliest stop string. The context is what makes a SentencePiece reply
    continue its prompt: that decoder strips a leading space at the start of a text, so decoded
    alone, "▁world" after the prompt "hello" would give "helloworld".
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool,
        stop: Sequence[str] = (),
        context: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._stop = [s for s in stop if s]
        # Where a held-back tail may begin: a stop string's first character (`_partial_stop_len`)
        self._stop_starts = "".join(sorted({s[0] for s in self._stop}))
        self._longest_stop = max(map(len, self._stop), default=0)
        self._context = list(context)
        self._ids: list[int] = []  # generated ids
        self._next_text = tokenizer.decode_stream(skip_special_tokens, self._context)
        self._decoded = ""  # generated text confirmed so far (complete characters only)
        self._emitted = 0  # of _decoded, the characters emitted: `text`
        self.stopped = False  # a stop string was hit; everything after it is dropped

    def fresh(self) -> "IncrementalDetokenizer":
        """One with this one's settings and no tokens yet: another sample of the same prompt."""
        return IncrementalDetokenizer(self._tokenizer, self._skip, self._stop, self._context)

    def step(self, new_token_ids: Sequence[int]) -> tuple[str, bool]:
        """Add tokens; return (text safe to emit now, whether a stop string was hit)."""
        if self.stopped:
            return "", True
        self._ids.extend(new_token_ids)
        return self._add("".join(map(self._next_text, new_token_ids)))

    def step_one(self, token_id: int) -> tuple[str, bool]:
        """`step([token_id])`, without the list: the engine's per-token call."""
        if self.stopped:
            return "", True
        self._ids.append(token_id)
        return self._add(self._next_text(token_id))

    @property
    def has_stops(self) -> bool:
        """Whether it looks for stop strings (and holds back text that may begin one)."""
        return bool(self._stop)

    @property
    def text(self) -> str:
        """The text emitted so far: a prefix of the decoded text, without stop strings."""
        return self._decoded[: self._emitted]

    def _add(self, new: str) -> tuple[str, bool]:
        self._decoded += new
        if not self._stop:  # nothing is held back: every token's text goes out (a step's hundreds of rows)
            self._emitted = len(self._decoded)
            return new, False
        return self._release(final=False), self.stopped

    def finish(self) -> str:
        """Generation ended for another reason (length, eos, cancel): release held-back text."""
        if self.stopped:
            return ""
        full = self._decode(self._context + self._ids)[len(self._decode(self._context)) :]
        if full.startswith(self._decoded):  # always so, unless a decoder is context-sensitive
            self._decoded = full
        return self._release(final=True)

    @property
    def num_tokens(self) -> int:
        """The generated ids it has read: where a stop string was hit, those through the one that completed it."""
        return len(self._ids)

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the text (the first of those given that starts where the text ends)."""
        if not self.stopped:
            return None
        return next(s for s in self._stop if self._decoded.startswith(s, self._emitted))

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def _release(self, final: bool) -> str:
        """Emit confirmed text up to the earliest stop string, or up to any tail that could still
        grow into one (unless final)."""
        # No stop string can start in emitted text: it would have been found
        start, decoded = self._emitted, self._decoded
        hit = -1
        for stop in self._stop:
            at = decoded.find(stop, start)
            if at >= 0 and (hit < 0 or at < hit):
                hit = at
        if hit >= 0:
            self.stopped = True
            end = hit
        elif final or not self._stop:
            end = len(decoded)
        else:
            end = len(decoded) - self._partial_stop_len(start)
        self._emitted = end
        return decoded[start:end]

    def _partial_stop_len(self, start: int) -> int:
        """Length of the longest tail of the pending text that is a proper prefix of a stop string. Such a tail
        begins with a stop string's first character, which most tokens' text does not hold: found by `str.find`."""
        decoded, end = self._decoded, len(self._decoded)
        at = self._next_stop_start(max(start, end - self._longest_stop + 1))  # a proper prefix is shorter
        while at < end:  # the earliest start gives the longest tail
            tail = decoded[at:]
            if any(len(s) > len(tail) and s.startswith(tail) for s in self._stop):
                return end - at
            at = self._next_stop_start(at + 1)
        return 0

    def _next_stop_start(self, at: int) -> int:
        """The first index from `at` of a character that begins a stop string; the text's length if none."""
        first = len(self._decoded)
        for c in self._stop_starts:
            found = self._decoded.find(c, at, first)
            if found >= 0:
                first = found
        return first
