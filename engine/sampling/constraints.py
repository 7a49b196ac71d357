"""Structured outputs: a request's `Constraint`, compiled into a grammar, a `GrammarMatcher` per sequence, and the
step's token masks applied to the logits.

The grammar engine is llguidance, chosen over xgrammar by measurement with SmolLM2's tokenizer (49,152 tokens) on a
2-core CPU: it has no dependencies (xgrammar's wheel requires transformers, which lmgate never runs, and takes 1.8 s
to import); it compiles a first-seen JSON schema in ~1.2 ms (xgrammar ~30 ms); and it refuses a JSON Schema keyword
it does not implement (`not`, `if`/`then`/`else`, `uniqueItems`, `contains`, `propertyNames`, `dependentRequired`,
`unevaluatedProperties`), where xgrammar ignores `not`, `if`/`then`/`else`, `allOf`, `uniqueItems` and
`dependentRequired`: a constraint that compiles here is one that holds. Its price is the mask: ~2.5-4 ms per step
for 64 rows of a realistic schema (xgrammar ~0.2 ms), filled on the host while the device computes. Where a
grammar forces text, llguidance allows only that text's canonical tokens (the split the model was trained on),
not every token that would keep the output valid.

Who calls what, on which thread:
- `GrammarCompiler.compile` validates and compiles (InvalidRequest naming what is wrong); it is thread-safe and
  caches compiled grammars by (kind, text), so the loop submits it to a thread pool (llguidance lets the GIL go
  while it builds) and a request with a schema seen before costs a dictionary lookup (`cached`).
- `CompiledGrammar.matcher()` gives a sequence its own matcher, a copy of the compiled one (microseconds).
- Each step, on the loop's thread: `TokenMasks.fill` writes the masks of the constrained rows only, one bitmask row
  each (llguidance's layout: int32 words, bit i of word w allows token 32 w + i), computed in parallel by
  llguidance's threads; `apply_token_mask` sets the disallowed logits of those rows to -inf on the logits' device,
  before penalties, temperature and the filters. `GrammarMatcher.accept` advances a matcher when the step's draws
  are read. A row's next mask needs its previous token: with overlap scheduling, a constrained row waits for it.
"""

from __future__ import annotations

import enum
import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.numpy as llguidance_np  # not llguidance.torch: it imports torch.compile (1.5 s per process)
import torch

from ..errors import InvalidRequest
from ..machine.transfers import to_device

if TYPE_CHECKING:
    import llguidance._lib as llguidance_lib  # JsonCompileOptions: a TypedDict of its stubs alone

MAX_CONSTRAINT_CHARS = 1 << 20  # a schema, regex or grammar's text
MAX_CHOICES = 4096
CACHED_GRAMMARS = 256  # compiled grammars kept (least recently used goes first), failures included
# JSON between two tokens: a space, or a line break and an indent (a pretty-printed value nested 8 deep, indent 4),
# never more: a small model sampled at temperature 1 otherwise spends its tokens on blank lines (vLLM #38696).
JSON_WHITESPACE = r"(?:\x20?|\n\x20{0,32})"
_MESSAGE_CHARS = 600  # of a library's error message, in ours


class ConstraintKind(enum.Enum):
    JSON_SCHEMA = "json_schema"  # a JSON Schema, as text
    JSON_OBJECT = "json_object"  # any JSON object; no text
    REGEX = "regex"  # the whole output matches (Rust `regex` syntax, as llguidance reads it)
    GRAMMAR = "grammar"  # EBNF as xgrammar and llama.cpp's GBNF write it (`root ::= ...`), or Lark (`start: ...`)
    CHOICE = "choice"  # one of a few strings: a JSON list of them (`Constraint.choice`)
    STRUCTURAL_TAG = "structural_tag"  # tool calls in free text, as vLLM takes it: {"structures", "triggers"}


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a request's output must match. Hashable: (kind, text) is its grammar's cache key."""

    kind: ConstraintKind
    text: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ConstraintKind):  # its value ("json_schema") will do
            try:
                object.__setattr__(self, "kind", ConstraintKind(self.kind))
            except ValueError:
                kinds = ", ".join(k.value for k in ConstraintKind)
                raise InvalidRequest(f"unknown constraint kind {self.kind!r} (one of {kinds})") from None
        if not isinstance(self.text, str):
            raise InvalidRequest(f"a {self.kind.value} constraint's text must be a string")
        if len(self.text) > MAX_CONSTRAINT_CHARS:
            raise InvalidRequest(f"a {self.kind.value} constraint is limited to {MAX_CONSTRAINT_CHARS} characters")
        if self.kind is ConstraintKind.JSON_OBJECT:
            if self.text:
                raise InvalidRequest("a json_object constraint takes no text (a schema is a json_schema constraint)")
        elif not self.text:
            raise InvalidRequest(f"a {self.kind.value} constraint must not be empty")

    @classmethod
    def choice(cls, options: Sequence[str]) -> Constraint:
        """The output is one of `options`, exactly."""
        return cls(ConstraintKind.CHOICE, json.dumps(list(options)))


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe. `tokenizer_json` is the model's tokenizer as a
    Hugging Face tokenizer.json (`Tokenizer.hf_files()`), `eos_token_ids` the ids that end a sequence (allowed
    where the grammar is complete), `vocab_size` the width of the logits the masks apply to (the tokenizer's, or
    the model's where its embedding is padded past it)."""

    def __init__(
        self, tokenizer_json: str, eos_token_ids: Iterable[int], vocab_size: int, cache_size: int = CACHED_GRAMMARS
    ) -> None:
        eos = sorted(set(eos_token_ids))
        if not eos:
            raise ValueError("structured outputs need an end-of-sequence token")
        # Parsing tokenizer.json and building the token trie takes a few hundred ms: once per engine.
        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = self._tokenizer.vocab_size
        self.eos_token_ids = frozenset(eos)
        self._cache: OrderedDict[Constraint, CompiledGrammar | InvalidRequest] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()  # a leaf: guards the cache only, never held while compiling

    def cached(self, constraint: Constraint) -> CompiledGrammar | None:
        """The compiled grammar if it is at hand: the loop's question before it queues a compile."""
        with self._lock:
            found = self._cache.get(constraint)
            if isinstance(found, CompiledGrammar):
                self._cache.move_to_end(constraint)
                return found
        return None

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The constraint's grammar, from the cache or compiled now (about a millisecond for a JSON schema;
        llguidance lets the GIL go meanwhile). Raises InvalidRequest where it does not compile."""
        with self._lock:
            found = self._cache.get(constraint)
            if found is not None:
                self._cache.move_to_end(constraint)
        if found is None:
            found = self._compile(constraint)
            with self._lock:
                found = self._cache.setdefault(constraint, found)  # a compile that raced with this one won
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if isinstance(found, InvalidRequest):
            raise InvalidRequest(str(found))
        return found

    def _compile(self, constraint: Constraint) -> CompiledGrammar | InvalidRequest:
        try:
            source = _grammar_source(constraint)
        except (ValueError, TypeError, KeyError, AssertionError) as exc:
            return _invalid(constraint, str(exc))
        matcher = llguidance.LLMatcher(self._tokenizer, source, log_level=0)
        if matcher.is_error():
            return _invalid(constraint, matcher.get_error())
        return CompiledGrammar(constraint, matcher, self.eos_token_ids)


def _invalid(constraint: Constraint, message: str) -> InvalidRequest:
    message = message.strip()
    if len(message) > _MESSAGE_CHARS:
        message = message[:_MESSAGE_CHARS] + " ..."
    return InvalidRequest(f"invalid {constraint.kind.value} constraint: {message}")


def _grammar_source(constraint: Constraint) -> str:
    """llguidance's grammar (a JSON text) for a constraint; ValueError (and kin) for text that is not what its
    kind says. Grammar errors proper show when the matcher is built."""
    kind, text = constraint.kind, constraint.text
    if kind is ConstraintKind.JSON_SCHEMA:
        return _json_grammar(_json_value(text, "a JSON Schema", dict))
    if kind is ConstraintKind.JSON_OBJECT:
        return _json_grammar({"type": "object"})
    if kind is ConstraintKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind is ConstraintKind.GRAMMAR:
        return llguidance.grammar_from("grammar", text)  # GBNF / EBNF turned into Lark; Lark as it is
    if kind is ConstraintKind.CHOICE:
        options = _json_value(text, "a JSON list of strings", list)
        if not options or len(options) > MAX_CHOICES or not all(isinstance(o, str) and o for o in options):
            raise ValueError(f"expected 1 to {MAX_CHOICES} non-empty strings")
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))
    return _structural_tag_grammar(_json_value(text, "a JSON object", dict))


def _json_value(text: str, expected: str, kind: type) -> Any:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(value, kind):
        raise ValueError(f"expected {expected}, got {type(value).__name__}")
    return value


def _json_grammar(schema: object) -> str:
    # No `x-guidance` key of the client's may loosen the options: `overrides` are applied after the schema's.
    options: llguidance_lib.JsonCompileOptions = {"whitespace_pattern": JSON_WHITESPACE, "lenient": False}
    return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=options)


def _structural_tag_grammar(spec: dict) -> str:
    """vLLM's `structural_tag`: free text in which each trigger starts a structure, `begin`, then JSON of its
    `schema`, then `end` (`{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`)."""
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list) or not triggers:
        raise ValueError('expected {"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}')
    if not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("triggers must be non-empty strings")
    tags = []
    for s in structures:
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str):
            raise ValueError('each structure needs a "begin" and an "end" string')
        if not isinstance(s.get("schema"), dict):
            raise ValueError(f'the structure {s["begin"]!r} needs a "schema" object')
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"the structure {s['begin']!r} starts with none of the triggers {triggers}")
        tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"], grammar=s["schema"], end=s["end"]))
    return llguidance.StructTag.to_grammar(tags)


class CompiledGrammar:
    """A constraint compiled for the tokenizer: a matcher at the start, which every sequence's matcher copies."""

    def __init__(self, constraint: Constraint, start: llguidance.LLMatcher, eos_token_ids: frozenset[int]) -> None:
        self.constraint = constraint
        self._start = start
        self._eos = eos_token_ids
        self._lock = threading.Lock()  # a leaf: copies of the start come one at a time

    def matcher(self) -> GrammarMatcher:
        with self._lock:
            return GrammarMatcher(self._start.deep_copy(), self._eos)


class GrammarMatcher:
    """One sequence's place in its grammar; used by one thread at a time (its loop's).

    `accept` each token as the step's draws are read; `fill_mask` writes the tokens allowed next into one row of a
    batch bitmask (only end-of-sequence once the grammar is complete or the matcher has failed); `is_terminated`
    once nothing but end-of-sequence may follow (the loop may end the sequence without drawing it); `rollback` or
    `reset` / `replay` where tokens are taken back. A token the grammar does not allow is refused and changes
    nothing; a matcher that fails inside llguidance (a limit reached) is in `error` for good, and its mask then allows
    only end-of-sequence."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: frozenset[int]) -> None:
        self._matcher = matcher
        self._eos = eos_token_ids
        self.num_tokens = 0  # tokens accepted, an end-of-sequence included
        self._ended = False  # an end-of-sequence accepted: nothing more is
        self._eos_unrecorded = False  # it came after the grammar had stopped, where llguidance takes it unrecorded

    def accept(self, token_id: int) -> bool:
        """Advance by one drawn token; False, and no change, where the grammar does not allow it."""
        if self._ended:
            return False
        if token_id in self._eos and self._matcher.is_stopped() and not self._matcher.is_error():
            self._ended = self._eos_unrecorded = True
        elif self._matcher.validate_tokens([token_id]) == 1 and self._matcher.consume_token(token_id):
            self._ended = token_id in self._eos
        else:
            return False
        self.num_tokens += 1
        return True

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """The tokens allowed next, into `bitmask[row]` (host int32, [rows, ceil(vocab / 32)])."""
        llguidance_np.fill_next_token_bitmask(self._matcher, bitmask.numpy(), row)

    @property
    def eos_allowed(self) -> bool:
        """Whether the output so far is a whole match: end-of-sequence may come next."""
        return self._matcher.is_accepting() and not self._ended

    @property
    def is_terminated(self) -> bool:
        """Nothing but end-of-sequence may follow (or it came, or the matcher failed)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error()

    def rollback(self, num_tokens: int) -> None:
        """Take back the last `num_tokens` accepted."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_tokens} tokens")
        if num_tokens == 0:
            return
        inner = num_tokens - self._eos_unrecorded
        self._ended = self._eos_unrecorded = False
        if inner and not self._matcher.rollback(inner):
            raise RuntimeError(f"llguidance could not roll back {inner} tokens: {self._matcher.get_error()}")
        self.num_tokens -= num_tokens

    def reset(self) -> None:
        """Back to the start of the grammar."""
        self._matcher.reset()
        self.num_tokens, self._ended, self._eos_unrecorded = 0, False, False

    def replay(self, token_ids: Iterable[int]) -> bool:
        """Reset, then accept each token: a sequence's matcher rebuilt from its output. False at the first token
        the grammar refuses."""
        self.reset()
        return all(self.accept(t) for t in token_ids)


class TokenMasks:
    """The host's bitmask of a step's constrained rows, kept across steps (grown when a batch needs more rows):
    row j of `fill`'s result is the mask of the j-th matcher it was given. Used by its loop's thread alone."""

    def __init__(self, vocab_size: int, rows: int = 64, threads: int | None = None) -> None:
        self.vocab_size = vocab_size
        self._bitmask = torch.full(llguidance_np.get_bitmask_shape(rows, vocab_size), -1, dtype=torch.int32)
        self._executor = llguidance.LLExecutor(threads)

    def fill(self, matchers: Sequence[GrammarMatcher]) -> torch.Tensor:
        """The masks of `matchers`, computed in parallel: a [len(matchers), words] view of the kept bitmask,
        valid until the next `fill` (`apply_token_mask` copies it where it goes to a device)."""
        n = len(matchers)
        if n > self._bitmask.shape[0]:
            self._bitmask = torch.full(llguidance_np.get_bitmask_shape(n, self.vocab_size), -1, dtype=torch.int32)
        bitmask = self._bitmask[:n]
        if n == 1:  # no thread hand-off for one row
            matchers[0].fill_mask(bitmask, 0)
        elif n:
            inner = [(m._matcher, j) for j, m in enumerate(matchers)]
            llguidance_np.fill_next_token_bitmask_par(self._executor, inner, bitmask.numpy())
        return bitmask


@functools.lru_cache(maxsize=8)
def _bit_shifts(device: torch.device) -> torch.Tensor:
    return to_device(torch.arange(32, dtype=torch.int32), device)


def apply_token_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None) -> torch.Tensor:
    """Sets the logits of the tokens a mask disallows to -inf, in place, and returns `logits`: bitmask row j masks
    logits row `rows[j]` (all rows in order where `rows` is None); other rows and allowed entries are untouched,
    as are NaNs. Columns past the mask's width (an embedding padded past the tokenizer) are disallowed. The bitmask
    is on the host (as `TokenMasks.fill` gives it) or on the logits' device already; logits are [rows, vocab]
    float on any device (inference tensors included). Torch ops, the same on CPU and CUDA: each bit becomes a
    bound of +inf or -inf and the logits their minimum with it (on the CPU, 8x faster than a masked_fill)."""
    n, words = bitmask.shape
    if n == 0:
        return logits
    device, vocab = logits.device, logits.shape[-1]
    with torch.inference_mode():
        bits = to_device(bitmask, device) if bitmask.device != device else bitmask
        allowed = ((bits.unsqueeze(-1) >> _bit_shifts(device)) & 1).view(n, words * 32)
        bound = allowed.to(logits.dtype).mul_(2).sub_(1).mul_(float("inf"))  # 1 -> +inf, 0 -> -inf
        if vocab <= words * 32:
            bound = bound[:, :vocab]
        else:
            bound = torch.nn.functional.pad(bound, (0, vocab - words * 32), value=float("-inf"))
        if rows is None:
            if n != logits.shape[0]:
                raise ValueError(f"a bitmask of {n} rows for logits of {logits.shape[0]}")
            torch.minimum(logits, bound, out=logits)
            return logits
        if len(rows) != n:
            raise ValueError(f"a bitmask of {n} rows for {len(rows)} logits rows")
        at = to_device(torch.tensor(list(rows), dtype=torch.long), device)
        logits.index_copy_(0, at, torch.minimum(logits.index_select(0, at), bound))
    return logits
