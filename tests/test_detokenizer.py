import random

import gguf
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models

from lmgate.engine.text.detokenizer import IncrementalDetokenizer, reply_context
from lmgate.engine.text.tokenizer import Tokenizer
from tests.test_tokenizer import _tiny_llama_gguf

TEXTS = [
    "Party time 🎉🚀 with family 👩‍👩‍👧 in 🇫🇷!",
    "中文分词测试，日本語のテキスト、한국어 문장。",
    "Mixed: naïve café — 価格は 1200円 😀 ok",
    "🙂",
    "plain ascii text, nothing special",
]

PROMPT = "<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n"


def _chunks(ids, sizes):
    i = 0
    while i < len(ids):
        n = next(sizes)
        yield ids[i : i + n]
        i += n


def _stream(tokenizer, ids, *, stop=(), skip_special_tokens=True, sizes=None):
    """Feed ids through a detokenizer; return (deltas, stop_hit, finish_text, detokenizer)."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens, stop)
    deltas, hit = [], False
    for chunk in _chunks(ids, sizes or iter(lambda: 1, None)):
        delta, hit = detok.step(chunk)
        deltas.append(delta)
        if hit:  # the engine stops feeding a sequence once a stop string is hit
            break
    return deltas, hit, ("" if hit else detok.finish()), detok


def test_detokenizer_tokens_split_characters_in_test_texts(tokenizer):
    # Guards the tests below: per-token decoding really does produce U+FFFD on these texts.
    for text in TEXTS[:4]:
        assert any("\ufffd" in tokenizer.decode([i]) for i in tokenizer.encode(text))


@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_one_token_at_a_time_matches_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    deltas, hit, tail, detok = _stream(tokenizer, ids)
    assert not hit
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + tail == tokenizer.decode(ids) == text
    assert detok.text == text


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_random_chunks_match_full_decode(tokenizer, text, seed):
    rng = random.Random(seed)
    ids = tokenizer.encode(text)
    deltas, hit, tail, _ = _stream(tokenizer, ids, sizes=iter(lambda: rng.randint(1, 4), None))
    assert not hit
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + tail == text


@pytest.mark.parametrize("skip", [True, False])
def test_detokenizer_special_tokens_follow_skip_flag(tokenizer, skip):
    ids = tokenizer.encode("Answer: 🎉<|im_end|>\n<|endoftext|>")
    deltas, _, tail, _ = _stream(tokenizer, ids, skip_special_tokens=skip)
    assert "".join(deltas) + tail == tokenizer.decode(ids, skip_special_tokens=skip)


def test_detokenizer_invalid_utf8_tail_is_released_by_finish(tokenizer):
    # Generation cut in the middle of an emoji: the dangling bytes decode to U+FFFD in the full
    # decode too, so finish() must hand them out rather than drop them.
    ids = tokenizer.encode("ok 🎉")[:-1]
    deltas, _, tail, _ = _stream(tokenizer, ids)
    full = tokenizer.decode(ids)
    assert full.endswith("\ufffd")
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + tail == full


def _assert_stopped_before(tokenizer, text, stop, **kw):
    ids = tokenizer.encode(text)
    deltas, hit, _, detok = _stream(tokenizer, ids, stop=stop, **kw)
    emitted = "".join(deltas)
    first = min(text.index(s) for s in stop if s in text)
    assert hit
    assert emitted == detok.text == text[:first]
    for s in stop:
        assert s not in emitted
    assert detok.step(tokenizer.encode(" more")) == ("", True)
    assert detok.finish() == ""
    return ids


def test_detokenizer_stop_single_token(tokenizer):
    text = "The answer is yes. Done here"
    assert len(tokenizer.encode(" Done")) == 1
    _assert_stopped_before(tokenizer, text, [" Done"])


def test_detokenizer_stop_multi_token(tokenizer):
    text = "Step one. Step two. ###END### trailing words"
    assert len(tokenizer.encode("###END###")) > 1
    _assert_stopped_before(tokenizer, text, ["###END###"])


def test_detokenizer_stop_inside_a_token(tokenizer):
    # The stop ends in the middle of " world": text after it in that same token is dropped.
    _assert_stopped_before(tokenizer, "Hello world and more", ["lo wo"])


def test_detokenizer_stop_spanning_held_back_text(tokenizer):
    # "ab" is held back as a possible start of "abc"; the stop completes two tokens later.
    text = "x ab ab abc tail"
    _assert_stopped_before(tokenizer, text, ["ab abc"])
    _assert_stopped_before(tokenizer, text, ["ab abc"], sizes=iter(lambda: 2, None))


def test_detokenizer_stop_with_emoji_and_special_token(tokenizer):
    _assert_stopped_before(tokenizer, "Cheers 🎉🎉 bye", ["🎉 b"])
    _assert_stopped_before(tokenizer, "Done.<|im_end|> junk", ["<|im_end|>"], skip_special_tokens=False)


def test_detokenizer_earliest_of_several_stops_wins(tokenizer):
    _assert_stopped_before(tokenizer, "alpha beta gamma delta", ["delta", "beta", "gamma"])


@pytest.mark.parametrize("seed", range(5))
def test_detokenizer_stop_never_partially_emitted(tokenizer, seed):
    rng = random.Random(seed)
    text = "one STO two STOP three STOP four"
    stop = "STOP"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, True, [stop])
    emitted, hit = "", False
    for chunk in _chunks(ids, iter(lambda: rng.randint(1, 3), None)):
        delta, hit = detok.step(chunk)
        emitted += delta
        assert stop not in emitted
        if hit:
            break
    assert hit and emitted == text[: text.index(stop)]


def held_back(decoded: str, stops: list[str]) -> tuple[str, bool]:
    """What may be emitted of `decoded`, by the definition: up to the earliest stop string, else all but the
    longest tail that is a proper prefix of a stop string."""
    hits = [decoded.find(s) for s in stops if s in decoded]
    if hits:
        return decoded[: min(hits)], True
    tail = max((k for s in stops for k in range(1, len(s)) if decoded.endswith(s[:k])), default=0)
    return decoded[: len(decoded) - tail], False


@pytest.mark.parametrize("seed", range(3))
def test_detokenizer_holds_back_exactly_the_tails_that_could_begin_a_stop_string(tokenizer, seed):
    """Texts and stop strings of a small alphabet, so that stop strings overlap, repeat their first character and
    begin in the middle of one another's prefixes: after every token the text emitted is the definition's, and
    `finish` releases what was held."""
    rng = random.Random(seed)
    alphabet = "ab \n."
    for _ in range(100):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
        ids = tokenizer.encode(text)
        detok = IncrementalDetokenizer(tokenizer, True, stops)
        emitted, hit = "", False
        for n, token in enumerate(ids, 1):
            delta, hit = detok.step_one(token)
            emitted += delta
            assert (emitted, hit) == held_back(tokenizer.decode(ids[:n]), stops), (text, stops)
            if hit:
                break
        if not hit:
            assert emitted + detok.finish() == tokenizer.decode(ids)


def test_detokenizer_finish_releases_held_back_text_without_stop(tokenizer):
    text = "the story ends with ST"
    ids = tokenizer.encode(text)
    deltas, hit, tail, detok = _stream(tokenizer, ids, stop=["STOP"])
    assert not hit
    assert "".join(deltas) == "the story ends with "  # "ST" could still become "STOP"
    assert tail == "ST"
    assert detok.text == text


def byte_fallback_backend() -> tuple[Backend, dict[str, int]]:
    """Llama 2's kind of decoder: SentencePiece pieces, and bytes as <0xXX> tokens fused back into UTF-8."""
    vocab = {"<unk>": 0, **{f"<0x{i:02X}>": 1 + i for i in range(256)}}
    for piece in ("\u2581Hello", "\u2581world", "a"):
        vocab[piece] = len(vocab)
    backend = Backend(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return backend, vocab


def wrapped(backend: Backend) -> Tokenizer:
    return Tokenizer(backend, bos_token_id=None, eos_token_ids=[], add_bos_token=False, chat_template=None)


def test_detokenizer_byte_fallback_characters_come_out_whole():
    backend, vocab = byte_fallback_backend()
    tokenizer = wrapped(backend)
    ids = [vocab[p] for p in ("\u2581Hello", "<0xC3>", "<0xA9>", "\u2581world", "<0xF0>", "<0x9F>", "<0x99>", "<0x82>")]
    deltas, _, tail, _ = _stream(tokenizer, ids)
    assert "\ufffd" not in "".join(deltas)
    assert "".join(deltas) + tail == tokenizer.decode(ids) == "Hello\u00e9 world\U0001f642"


def test_detokenizer_stray_bytes_through_a_byte_fallback_decoder_do_not_raise():
    """Stray bytes fused with their neighbours make the decode window's texts stop being prefixes of one
    another, where tokenizers' DecodeStream raises: the stream starts a fresh window instead, and the text
    after them comes out."""
    backend, vocab = byte_fallback_backend()
    ids = [vocab[p] for p in ("<0xD4>", "<0x81>", "<0x13>", "<0xFA>", "a", "\u2581world")]
    stream = wrapped(backend).decode_stream()
    with pytest.raises(Exception, match="Invalid prefix"):  # what the fresh window stands in for
        raw = decoders.DecodeStream(skip_special_tokens=True)
        for i in ids:
            raw.step(backend, i)
    assert "".join(stream(i) for i in ids).endswith("a world")


def test_detokenizer_continues_a_sentencepiece_prompt_with_its_space(tmp_path):
    """SentencePiece's decoder strips the leading space of a text: decoded alone, a reply's first "▁world"
    would lose its space and run into the prompt. With the prompt's last token as context, prompt text plus
    the deltas is the decode of the whole, as vLLM and llama.cpp's server stream it."""
    path = str(tmp_path / "tiny.gguf")
    _tiny_llama_gguf(path)
    tok = Tokenizer.from_gguf(gguf.GGUFReader(path))
    prompt = tok.encode("hello")
    generated = tok.encode(" world hello", add_special_tokens=False)
    for stop in ((), ("zz",)):  # streamed at once, and held back while a stop string could start
        d = IncrementalDetokenizer(tok, True, stop, context=prompt[-1:])
        deltas = [d.step([t])[0] for t in generated] + [d.finish()]
        assert "hello" + "".join(deltas) == tok.decode(prompt + generated) == "hello world hello"


# ------------------------------------------------ a reply after a prompt that ends inside a character
PIECES = [
    "日本語",
    "東京は",
    "、",
    "；",
    "中文",
    "한국어",
    "🐍",
    "💡",
    "🎉",
    "👩\u200d👩\u200d👧",
    "🇫🇷",
    "e\u0301",
    "\u0915\u094d\u0937",
    "a\u0308\u0323",
    "é",
    "ok",
    " ",
    "\n",
    "I love",
    " café",
]


@pytest.fixture(scope="module")
def tokenizer_pairs(tokenizer, hf_tokenizer_dir, tmp_path_factory):
    """(name, ours, transformers') for the embedded tokenizer and the tiny test tokenizers: a byte-level BPE
    of single bytes (tests/gpu_models.py) and a SentencePiece vocabulary with byte fallback."""
    import transformers

    from tests.gpu_models import write_tokenizer

    path = tmp_path_factory.mktemp("detok")
    write_tokenizer(str(path / "bytes"), 300)
    _tiny_llama_gguf(str(path / "tiny.gguf"))
    return [
        ("embedded", tokenizer, transformers.AutoTokenizer.from_pretrained(hf_tokenizer_dir)),
        (
            "bytes",
            Tokenizer.from_hf_dir(str(path / "bytes")),
            transformers.AutoTokenizer.from_pretrained(str(path / "bytes")),
        ),
        (
            "sentencepiece",
            Tokenizer.from_gguf(gguf.GGUFReader(str(path / "tiny.gguf"))),
            transformers.AutoTokenizer.from_pretrained(str(path), gguf_file="tiny.gguf"),
        ),
    ]


def _reply(ours: Tokenizer, before: list[int], generated: list[int], stop: tuple[str, ...], sizes) -> str:
    detok = IncrementalDetokenizer(ours, True, stop, context=reply_context(ours, before))
    deltas = [detok.step(chunk)[0] for chunk in _chunks(generated, sizes)]
    return "".join(deltas) + detok.finish()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_detokenizer_reply_is_whole_decode_past_the_prompts_decode(tokenizer_pairs, data):
    """A reply's text is transformers' decode of prompt + output past its decode of the prompt, wherever the
    prompt ends: inside a CJK character, an emoji, a ZWJ sequence, a combining sequence, or between them."""
    name, ours, hf = data.draw(st.sampled_from(tokenizer_pairs))
    text = "".join(data.draw(st.lists(st.sampled_from(PIECES), min_size=2, max_size=8)))
    ids = ours.encode(text, add_special_tokens=data.draw(st.booleans()))
    assume(len(ids) >= 2)
    cut = data.draw(st.integers(1, len(ids) - 1))
    prompt, generated = ids[:cut], ids[cut:]
    want = hf.decode(prompt + generated, skip_special_tokens=True)[len(hf.decode(prompt, skip_special_tokens=True)) :]
    stop = data.draw(st.sampled_from([(), ("\x00",)]))  # streamed at once, or held back for a stop string
    rng = random.Random(data.draw(st.integers(0, 2**16)))
    assert _reply(ours, prompt, generated, stop, iter(lambda: rng.randint(1, 3), None)) == want, (name, text, cut)


def test_detokenizer_reply_after_prompts_of_the_issue(tokenizer):
    """The prompts a newcomer saw start their reply with U+FFFD: each ends in a character its last id
    splits."""
    for prompt, reply in [("日本語", "；アネ"), ("I love 🐍", "💡"), ("東京は", "、アネ")]:
        ids = tokenizer.encode(prompt + reply, add_special_tokens=False)
        cut = len(tokenizer.encode(prompt, add_special_tokens=False))
        assert "\ufffd" in tokenizer.decode(ids[cut - 1 : cut])  # the last id alone is part of a character
        assert _reply(tokenizer, ids[:cut], ids[cut:], (), iter(lambda: 1, None)) == reply
