"""Text <-> token ids, and chat-template rendering.

The tokenizer is always a `tokenizers.Tokenizer` (the HF Rust library); this module only
assembles one from what a model ships: GGUF metadata or a Hugging Face model directory.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, cast

import gguf
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from ..sampling.constraints import GrammarCompiler

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})

# llama.cpp token types (gguf.TokenType).
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4

# llama.cpp "pre" names (the regex a byte-level vocabulary's merges were learned over) of the models lmgate
# runs, as transformers' GGUF loader maps them; the GPT-2 ones take ByteLevel's own, and any other is refused:
# split another way, a prompt's tokens are not the model's.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (  # as Llama 3's, but every digit alone
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (  # Mistral NeMo's
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "tekken": _TEKKEN_SPLIT,
}
_GPT2_PRE = (None, "default", "gpt-2", "gpt2")
# Vocabularies whose merges llama.cpp ignores for a word that is a token whole, and which start text with BOS
# where the GGUF does not say (its llama-bpe group and tekken), as their tokenizer.json files do.
_WHOLE_WORD_PRE = frozenset({"llama3", "llama-v3", "llama-bpe", "tekken"})
# Texts that end a turn whatever the GGUF's eos/eot keys say, as llama.cpp treats them: an older Llama 3
# Instruct GGUF names only <|end_of_text|>, while its model ends each reply with <|eot_id|>.
_END_OF_GENERATION_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "<|end_of_text|>",
        "<end_of_utterance>",
    }
)


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special-token facts and chat template of one model."""

    def __init__(
        self,
        backend: _Backend,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        add_bos_token: bool,
        chat_template: str | None,
    ) -> None:
        self._backend = backend
        # One past the largest id: a count of the tokens would fall short where added tokens leave gaps
        self._id_bound = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self.bos_token_id = bos_token_id
        self.eos_token_ids: frozenset[int] = frozenset(eos_token_ids)
        self._eos_token_id = eos_token_ids[0] if eos_token_ids else None  # the one templates call eos_token
        self.chat_template = chat_template
        self._special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        # A tokenizer.json may already add BOS in its post-processor; only prepend it ourselves if not.
        added_by_backend = bos_token_id in backend.encode("", add_special_tokens=True).ids
        self._prepend_bos = add_bos_token and bos_token_id is not None and not added_by_backend
        self.prefix_ids: tuple[int, ...] = tuple(self.encode(""))  # what every text's encoding starts with (a BOS)
        self._anchor = self._continuation_anchor()
        self._continuation = None if self._anchor else _without_prepended_space(backend)
        # Whether a text's stateless encoding is its continuation's after the prefix (no suffix such as an EOS)
        self._prefix_only = (
            self._anchor is None
            and self._continuation is None
            and self.encode("a") == [*self.prefix_ids, *self.encode("a", False)]
        )
        # `token_text`: each id decoded after a plain one, whose text is cut off again; filled as ids are asked for
        self._plain_id = self.encode("a", add_special_tokens=False)[-1]
        self._plain_len = len(self.decode([self._plain_id], skip_special_tokens=False))
        self._token_texts: dict[int, str] = {}
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()  # a leaf: held while the compiler is first built

    # ----------------------------------------------------------------- loading
    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> Tokenizer:
        """Rebuild the tokenizer llama.cpp would use from a GGUF's `tokenizer.*` metadata."""

        def field(key: str, default: Any = None) -> Any:
            f = reader.fields.get(key)
            return default if f is None else f.contents()

        kind = field("tokenizer.ggml.model")
        tokens: list[str] = field("tokenizer.ggml.tokens") or []
        types: list[int] = field("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = field("tokenizer.ggml.merges")
        vocab = {tok: i for i, tok in enumerate(tokens)}
        if kind == "gpt2":
            pre = field("tokenizer.ggml.pre")
            backend = _byte_level_bpe(vocab, merges or [], pre)
            add_bos_default = pre in _WHOLE_WORD_PRE
        elif kind == "llama":
            unk_id = field("tokenizer.ggml.unknown_token_id")
            unk = None if unk_id is None else tokens[unk_id]
            if merges is None:
                merges = _merges_from_scores(tokens, field("tokenizer.ggml.scores"))
            backend = _sentencepiece_bpe(vocab, merges, unk, field("tokenizer.ggml.add_space_prefix", True))
            add_bos_default = True  # llama.cpp's default for SentencePiece vocabularies
        else:
            raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (supported: 'gpt2', 'llama')")

        # Control / user-defined tokens must be matched whole in text, before the model splits it.
        typed = list(zip(tokens, types))
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, ty in typed if ty in (_CONTROL, _UNKNOWN)]
        )
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in typed if ty == _USER_DEFINED])
        eos_ids = [
            i
            for key in ("eos_token_id", "eot_token_id", "eom_token_id")
            if (i := field(f"tokenizer.ggml.{key}")) is not None
        ]
        eos_ids += [
            i
            for i, (t, ty) in enumerate(typed)
            if ty == _CONTROL and t in _END_OF_GENERATION_TEXTS and i not in eos_ids
        ]
        return cls(
            backend,
            bos_token_id=field("tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos_ids,
            add_bos_token=bool(field("tokenizer.ggml.add_bos_token", add_bos_default)),
            chat_template=field("tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_dir(cls, path: str) -> Tokenizer:
        """Load `tokenizer.json` and the special-token/chat-template facts from a HF model directory."""
        backend = _Backend.from_file(os.path.join(path, "tokenizer.json"))
        # What transformers does unless a call asks: a file's own truncation would cut prompts short unseen
        backend.no_truncation()
        backend.no_padding()
        config = _read_json(os.path.join(path, "tokenizer_config.json"))

        def token_id(entry: Any) -> int | None:
            text = entry.get("content") if isinstance(entry, dict) else entry
            return None if text is None else backend.token_to_id(text)

        bos_id = token_id(config.get("bos_token"))
        eos_ids = [i for i in [token_id(config.get("eos_token"))] if i is not None]
        for name in ("generation_config.json", "config.json"):
            extra = _read_json(os.path.join(path, name)).get("eos_token_id")
            eos_ids += extra if isinstance(extra, list) else [] if extra is None else [extra]

        template = config.get("chat_template")
        if isinstance(template, list):  # [{name, template}, ...]: the "default" one is the chat template
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.exists(jinja_file):  # before tokenizer_config.json's, as transformers reads them
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            add_bos_token=bool(config.get("add_bos_token", False)),
            chat_template=template,
        )

    # ------------------------------------------------------------------- codec
    @property
    def vocab_size(self) -> int:
        """One past the largest id, added tokens included: the ids it knows are below it (with gaps, perhaps)."""
        return self._id_bound

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text`. The GIL is released meanwhile (tokenizers' `encode` holds it, its batch call does
        not), so a long prompt encoded off the server's event loop does not stall it."""
        ids = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self._prepend_bos:
            assert self.bos_token_id is not None  # _prepend_bos is only set with one
            ids.insert(0, self.bos_token_id)
        return ids

    def encode_first_turn(self, text: str, continuation: list[int]) -> list[int]:
        """`text` encoded as a stateless prompt is (`encode`), given its `encode_continuation`: that after the
        special prefix, where that is all the special tokens and the tokenizer puts no space before a text's
        start (no second encoding)."""
        return [*self.prefix_ids, *continuation] if self._prefix_only else self.encode(text)

    def encode_continuation(self, text: str) -> list[int]:
        """`text` as it continues earlier text (a session's later turn): no special tokens, and none of the
        space ("▁") a SentencePiece tokenizer puts before the start of a text, which would make " world" after
        "Hello" two spaces. Encoded after a special token that is then dropped, as transformers' Llama
        tokenizer does with its unk token; where the space comes from a normalizer that prepends it to every
        piece of text (no anchor helps), encoded without that step (`_without_prepended_space`)."""
        if self._continuation is not None:
            return self._continuation.encode_batch([text], add_special_tokens=False)[0].ids
        if self._anchor is None:
            return self.encode(text, add_special_tokens=False)
        return self.encode(self._anchor + text, add_special_tokens=False)[1:]

    def _continuation_anchor(self) -> str | None:
        """A special token's text after which text encodes as a continuation; None where a text's start gets
        no space of its own (byte-level BPE), or where none helps (a normalizer that prepends the space to
        every piece of text)."""
        start = self._backend.encode("a", add_special_tokens=False)
        if not start.tokens or not start.tokens[0].startswith("▁"):
            return None
        for token_id in sorted(self._special_ids):
            anchor = self._backend.id_to_token(token_id)
            assert anchor is not None  # an added token's id is in the vocabulary
            after = self._backend.encode(anchor + "a", add_special_tokens=False).tokens  # no space: none put in
            spaced = self._backend.encode(anchor + " a", add_special_tokens=False).ids  # a space: kept as one
            if len(after) > 1 and not after[1].startswith("▁") and spaced == [token_id, *start.ids]:
                return anchor
        return None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text one id adds after plain text, as OpenAI's logprobs show a token: with the leading space a
        SentencePiece decoder strips from the start of a text, U+FFFD where the id holds part of a character,
        a special token's own text. Cached: a step's logprobs ask for the same alternatives again and again."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.decode([self._plain_id, token_id], skip_special_tokens=False)[self._plain_len :]
            self._token_texts[token_id] = text
        return text

    def decode_stream(self, skip_special_tokens: bool = True, context: Sequence[int] = ()) -> Callable[[int], str]:
        """A function of each next id: the text it adds after `context` and the ids before it, "" while the
        text ends inside a character (tokenizers' `DecodeStream`: one call per id, its window of recent ids
        kept in Rust). The text is `decode(context + ids)` past `decode(context)`, counted in characters as
        transformers' streamers do: where the context ends inside a character, its U+FFFD stands for the
        character the next ids complete, and the stream's first text (which starts at the context) is cut by
        that many characters. Where ids that are not valid UTF-8 make the window's texts stop being prefixes
        of one another (a byte-fallback decoder fusing stray bytes), the window starts afresh at that id
        instead of raising."""
        backend = self._backend
        stream = decoders.DecodeStream(skip_special_tokens=skip_special_tokens)
        owed = 0  # characters of the context's text the stream has still to give
        if context:
            owed = len(self.decode(context, skip_special_tokens)) - len(stream.step(backend, list(context)) or "")

        def step(token_id: int) -> str:
            nonlocal stream, owed
            try:
                text = stream.step(backend, token_id) or ""
            except Exception as exc:  # tokenizers raises a plain Exception
                if "Invalid prefix" not in str(exc):
                    raise
                stream, owed = decoders.DecodeStream(skip_special_tokens=skip_special_tokens), 0
                text = stream.step(backend, token_id) or ""
            if owed and text:
                text, owed = text[owed:], max(0, owed - len(text))
            return text

        return step

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self._backend.id_to_token(i) for i in ids]

    def is_special(self, token_id: int) -> bool:
        """True for tokens that `decode(..., skip_special_tokens=True)` drops."""
        return token_id in self._special_ids

    # ------------------------------------------------------------------- chat
    def check_messages(self, messages: list[dict[str, Any]]) -> None:
        """What can be known of messages without rendering them: the model has a chat template, and every role
        is one it may see. (ValueError otherwise.)"""
        if self.chat_template is None:
            raise ValueError("this model has no chat template")
        for m in messages:
            role = m.get("role") if isinstance(m, dict) else None
            if role not in CHAT_ROLES:
                raise ValueError(f"unknown message role {role!r}; expected one of {sorted(CHAT_ROLES)}")

    @property
    def grammars(self) -> GrammarCompiler:
        """Structured outputs' compiler for this tokenizer, with its cache of compiled grammars; built at first use
        (a few hundred ms) by whichever thread asks first."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.hf_files()["tokenizer.json"], self.eos_token_ids, self.vocab_size)
            return self._grammars

    def hf_files(self) -> dict[str, str]:
        """This tokenizer as the files a Hugging Face loader reads (tokenizer.json, tokenizer_config.json with
        the chat template and the special tokens), a GGUF's made from its metadata: another process (the
        gateway) then tokenizes and renders exactly as this one does."""
        token = self._backend.id_to_token
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None if self.bos_token_id is None else token(self.bos_token_id),
            "eos_token": None if self._eos_token_id is None else token(self._eos_token_id),
            "add_bos_token": self._prepend_bos,
            "chat_template": self.chat_template,
            "clean_up_tokenization_spaces": False,
        }
        return {"tokenizer.json": self._backend.to_str(), "tokenizer_config.json": json.dumps(config, indent=2)}

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render messages the way transformers' `apply_chat_template(tokenize=False)` does."""
        self.check_messages(messages)
        # As transformers: tools and documents are none, and a special token the model lacks is undefined (a
        # template that prints it prints nothing, not "None").
        specials = {
            name: self._backend.id_to_token(i)
            for name, i in (("bos_token", self.bos_token_id), ("eos_token", self._eos_token_id))
            if i is not None
        }
        try:
            return _compile_template(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=None, documents=None, **specials
            )
        except jinja2.TemplateSyntaxError as e:  # the model's template, not the messages
            raise ValueError(f"this model's chat template does not compile: {e}") from e
        except jinja2.TemplateError as e:  # raise_exception() or a missing field: the messages don't fit
            raise ValueError(f"chat template rejected the messages: {e}") from e


# --------------------------------------------------------------------- helpers
def _without_prepended_space(backend: _Backend) -> _Backend | None:
    """A copy of `backend` whose normalizer no longer puts "▁" before every piece of text (older SentencePiece
    tokenizer.json files: Prepend("▁"), then spaces replaced by "▁"), for text that continues earlier text, as
    transformers' non-legacy Llama tokenizer encodes it; None if its normalizer has no such step."""
    if backend.normalizer is None:  # most byte-level BPE models: no need to write the whole tokenizer out
        return None
    normalizer = json.loads(backend.normalizer.__getstate__())  # its JSON form, as in tokenizer.json
    steps = normalizer.get("normalizers", []) if normalizer.get("type") == "Sequence" else [normalizer]
    kept = [step for step in steps if not (step.get("type") == "Prepend" and step.get("prepend") == "▁")]
    if len(kept) == len(steps):
        return None
    spec = json.loads(backend.to_str())
    spec["normalizer"] = {"type": "Sequence", "normalizers": kept} if kept else None
    return _Backend.from_str(json.dumps(spec))


def _byte_level_bpe(vocab: dict[str, int], merges: list[str], pre: str | None) -> _Backend:
    backend = _Backend(
        models.BPE(
            vocab=vocab,
            merges=cast("list[tuple[str, str]]", [tuple(m.split(" ", 1)) for m in merges]),  # GGUF's "a b" pairs
            fuse_unk=False,
            ignore_merges=pre in _WHOLE_WORD_PRE,
        )
    )
    if pre == "smollm":  # as SmolLM2's own tokenizer.json: every digit is its own pre-token
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    elif pre in _PRE_SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre in _GPT2_PRE:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        known = sorted(["smollm", *_PRE_SPLITS, *filter(None, _GPT2_PRE)])
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(known)})")
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(vocab: dict[str, int], merges: list, unk: str | None, add_space_prefix: bool) -> _Backend:
    """SentencePiece BPE as `LlamaTokenizer` builds it: '▁' for spaces, byte fallback for unknown chars."""
    if merges and isinstance(merges[0], str):
        merges = [tuple(m.split(" ", 1)) for m in merges]
    backend = _Backend(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    scheme = "first" if add_space_prefix else "never"
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_from_scores(tokens: list[str], scores: list[float] | None) -> list[tuple[str, str]]:
    """SentencePiece GGUFs carry scores, not merges: every split of a token into two vocabulary
    tokens is a merge, ranked by the merged token's score (higher first)."""
    if scores is None:
        raise ValueError("GGUF 'llama' tokenizer has neither merges nor scores")
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for tok, score in zip(tokens, scores):
        pairs = [(tok[:k], tok[k:]) for k in range(1, len(tok)) if tok[:k] in vocab and tok[k:] in vocab]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        found += [(score, left, right) for left, right in pairs]
    found.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [(left, right) for _, left, right in found]


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


class _GenerationBlock(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}`: it marks the assistant's text for training
    masks; rendering keeps what it encloses as it is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    """Same environment transformers uses, so templates written for it render identically."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
        # Jinja's own tojson HTML-escapes; transformers overrides it like this.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationBlock]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
