import json
import os

import gguf
import numpy as np
import pytest
import tokenizers
import transformers
from tokenizers import Tokenizer as _Backend
from tokenizers import decoders, models, normalizers
from tokenizers.models import WordLevel

from lmgate.engine.text.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing   ",
    "def add(a, b):\n    return a + b\n\n\tprint(add(1, 2))",
    "Prices: 12345 apples, 3.14159 pies, 2024-06-01, x² + y³",
    "emoji: 🎉🚀👩‍👩‍👧 and flags 🇫🇷",
    "中文分词测试，日本語のテキスト、한국어 문장",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "mixed<|endoftext|>tokens<|im_end|>",
    "Ünïcödé çàfé naïve — “quotes” … ",
    "",
]

CHATS = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Another 🙂?"},
    ],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "tool", "content": "c"}],
]


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path):
    """transformers' own tokenizer built from the same GGUF: the oracle."""
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_encode_matches_transformers_gguf(tokenizer, hf_tokenizer, text):
    # transformers builds SmolLM2's GGUF tokenizer with plain ByteLevel (no Digits pre-tokenizer);
    # the vocabulary has no multi-digit tokens, so both split digits one by one and agree anyway.
    assert tokenizer.encode(text) == hf_tokenizer.encode(text)


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_decode_roundtrips(tokenizer, hf_tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_tokenizer_splits_digits_individually(tokenizer):
    ids = tokenizer.encode("9876543210")
    assert len(ids) == 10
    assert [tokenizer.decode([i]) for i in ids] == list("9876543210")


def test_tokenizer_chat_tokens_are_single_special_ids(tokenizer):
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.is_special(1) and tokenizer.is_special(2) and not tokenizer.is_special(ids[1])
    assert tokenizer.decode(ids) == "user\nhi"
    assert tokenizer.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]


def test_tokenizer_gguf_special_ids(tokenizer, hf_tokenizer):
    assert tokenizer.vocab_size == len(hf_tokenizer) == 49152
    assert tokenizer.bos_token_id == hf_tokenizer.bos_token_id == 1
    # <|im_end|> as the GGUF says, and <|endoftext|> too, as llama.cpp ends generation at it by its text.
    assert tokenizer.eos_token_ids == {hf_tokenizer.eos_token_id, 0} == {2, 0}
    # add_bos_token is False in this GGUF: no BOS is prepended.
    assert tokenizer.encode("hi") == tokenizer.encode("hi", add_special_tokens=False)


@pytest.mark.parametrize("messages", CHATS)
def test_tokenizer_chat_template_matches_transformers(tokenizer, hf_tokenizer, messages):
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(messages) == expected
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False) == expected


def test_tokenizer_chat_template_rejects_unknown_role(tokenizer):
    with pytest.raises(ValueError, match="role"):
        tokenizer.apply_chat_template([{"role": "wizard", "content": "hi"}])


def test_tokenizer_chat_template_errors_become_value_error(hf_tokenizer, tmp_path):
    hf_tokenizer.save_pretrained(tmp_path)
    loaded = Tokenizer.from_hf_dir(str(tmp_path))
    loaded.chat_template = "{% if messages[0]['role'] == 'tool' %}{{ raise_exception('no tools first') }}{% endif %}ok"
    assert loaded.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ValueError, match="no tools first"):
        loaded.apply_chat_template([{"role": "tool", "content": "x"}])


def test_tokenizer_from_hf_dir_matches_gguf(tokenizer, hf_tokenizer, tmp_path):
    hf_tokenizer.save_pretrained(tmp_path)
    loaded = Tokenizer.from_hf_dir(str(tmp_path))
    for text in TEXTS:
        assert loaded.encode(text) == tokenizer.encode(text)
    assert loaded.chat_template == tokenizer.chat_template
    assert loaded.bos_token_id == 1 and 2 in loaded.eos_token_ids
    assert loaded.apply_chat_template(CHATS[1]) == tokenizer.apply_chat_template(CHATS[1])


def test_a_tokenizer_files_own_truncation_and_padding_are_ignored(tokenizer, hf_tokenizer, tmp_path):
    """Some tokenizer.json files enable truncation (or padding): as transformers, a prompt is encoded whole."""
    hf_tokenizer.save_pretrained(tmp_path)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    spec["padding"] = {
        "strategy": {"Fixed": 64},
        "direction": "Right",
        "pad_to_multiple_of": None,
        "pad_id": 0,
        "pad_type_id": 0,
        "pad_token": "<|endoftext|>",
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    loaded = Tokenizer.from_hf_dir(str(tmp_path))
    for text in TEXTS:
        assert loaded.encode(text) == tokenizer.encode(text)


def test_tokenizer_from_hf_dir_reads_eos_lists_and_jinja_file(hf_tokenizer, tmp_path):
    hf_tokenizer.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 0]}')
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    config = tmp_path / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"chat_template"', '"unused_template"'))
    loaded = Tokenizer.from_hf_dir(str(tmp_path))
    assert loaded.eos_token_ids == frozenset({0, 2})
    assert loaded.apply_chat_template([{"role": "user", "content": "x"}]) == "x"


def test_tokenizer_chat_template_renders_as_transformers_does(hf_tokenizer, tmp_path):
    """chat_template.jinja before tokenizer_config.json's template; no tools or documents; a special token the
    model lacks is undefined, not the text "None"."""
    hf_tokenizer.save_pretrained(tmp_path)
    config = tmp_path / "tokenizer_config.json"
    config.write_text(
        json.dumps({**json.loads(config.read_text()), "chat_template": "OLD {{ messages[0]['content'] }}"})
    )
    (tmp_path / "chat_template.jinja").write_text(
        "{% if tools is not none %}[TOOLS]{% endif %}{% if documents is not none %}[DOCS]{% endif %}"
        "{{ bos_token }}NEW {{ messages[0]['content'] }}"
    )
    messages = [{"role": "user", "content": "hi"}]
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = Tokenizer.from_hf_dir(str(tmp_path))
    assert (
        ours.apply_chat_template(messages)
        == theirs.apply_chat_template(messages, tokenize=False)
        == "<|im_start|>NEW hi"
    )
    ours.bos_token_id = None
    assert ours.apply_chat_template(messages) == "NEW hi"


def test_tokenizer_chat_template_generation_blocks_render_and_broken_templates_are_value_errors(hf_tokenizer, tmp_path):
    """transformers' {% generation %} tag (training masks) renders its body; a template that does not compile
    is the model's fault, told as such, and never a crash of the caller."""
    hf_tokenizer.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}A: {{ m['content'] }}"
        "{% endgeneration %}{% else %}U: {{ m['content'] }}{% endif %}\n{% endfor %}"
    )
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = Tokenizer.from_hf_dir(str(tmp_path))
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(messages, tokenize=False) == "U: hiA: hello"
    ours.chat_template = "{% for m in messages %}{{ m['content'] }"
    with pytest.raises(ValueError, match="does not compile"):
        ours.apply_chat_template(messages)


def _tiny_llama_gguf(path: str) -> None:
    """A SentencePiece-style ('llama') vocabulary with scores and no merges, as such GGUFs ship."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "llo", "hello", "▁hello"]
    pieces += ["▁w", "or", "▁wor", "ld", "▁world"]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(pieces) - 259)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces) - 259)]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("dummy", np.zeros(1, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_tokenizer_llama_gguf_encodes_with_bos_and_byte_fallback(tmp_path):
    path = str(tmp_path / "tiny.gguf")
    _tiny_llama_gguf(path)
    tok = Tokenizer.from_gguf(gguf.GGUFReader(path))
    ids = tok.encode("hello world")
    assert tok.convert_ids_to_tokens(ids) == ["<s>", "▁hello", "▁world"]
    assert tok.decode(ids) == "hello world"
    emoji_ids = tok.encode("hello 🙂", add_special_tokens=False)
    assert len(emoji_ids) == 2 + 4  # "▁hello", "▁", then the emoji's four UTF-8 bytes
    assert tok.decode(emoji_ids) == "hello 🙂"


def test_a_continuation_gets_no_space_before_its_start(tmp_path, tokenizer):
    """A session's later text turn continues its history: a SentencePiece tokenizer puts a space ("▁") before
    a text's start, so "world" after "hello" would read " world" (and "\nQ:" as " \nQ:"). A byte-level one
    puts none."""
    path = str(tmp_path / "tiny.gguf")
    _tiny_llama_gguf(path)
    tok = Tokenizer.from_gguf(gguf.GGUFReader(path))
    assert tok.convert_ids_to_tokens(tok.encode("world", add_special_tokens=False)) == ["▁world"]
    assert tok.decode(tok.encode("hello", add_special_tokens=False) + tok.encode_continuation("world")) == "helloworld"
    assert tok.encode("hello", add_special_tokens=False) + tok.encode_continuation(" world") == tok.encode(
        "hello world", add_special_tokens=False
    )
    for text in (" world", "world", "\n\nA: yes", "2 + 2"):
        assert tokenizer.encode_continuation(text) == tokenizer.encode(text, add_special_tokens=False)


def test_a_continuation_gets_no_space_where_the_normalizer_prepends_one_to_every_text(tmp_path):
    """Older SentencePiece tokenizer.json files (Llama 2's, TinyLlama's) prepend "▁" to every piece of text in
    their normalizer, after a special token too, so no anchor keeps it off a continuation: "hello" then
    " world" must still encode as "hello world" does, and a first turn as a stateless prompt."""
    pieces = ["<unk>", "<s>", "</s>", "▁", "▁hello", "▁world", "hello", "world", *"helowrd"]
    backend = _Backend(
        models.Unigram([(p, -1.0 if len(p) > 1 else -5.0) for p in pieces], unk_id=0, byte_fallback=False)
    )
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True})
    )
    tok = Tokenizer.from_hf_dir(str(tmp_path))
    assert tok.convert_ids_to_tokens(tok.encode("hello world")) == ["<s>", "▁hello", "▁world"]
    first = tok.encode_continuation("hello")
    assert tok.encode_first_turn("hello", first) == tok.encode("hello")
    assert tok.encode("hello") + tok.encode_continuation(" world") == tok.encode("hello world")
    assert tok.decode(tok.encode("hello") + tok.encode_continuation("world")) == "helloworld"


def test_tokenizer_gguf_rejects_unsupported_model(tmp_path):
    path = str(tmp_path / "bert.gguf")
    writer = gguf.GGUFWriter(path, "bert")
    writer.add_tokenizer_model("bert")
    writer.add_token_list(["[PAD]", "a"])
    writer.add_tensor("dummy", np.zeros(1, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF tokenizer model 'bert'"):
        Tokenizer.from_gguf(gguf.GGUFReader(path))


def _llama3_vocabulary_gguf(path: str, **add_bos_token: bool) -> None:
    """A byte-level vocabulary in which "abc" is a token no merge builds, with Llama 3's special tokens and
    only eos_token_id among the end keys, as older Llama 3 Instruct GGUFs ship."""
    tokens = ["a", "b", "c", "ab", "bc", "abc", "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 6 + [3] * 3)
    writer.add_token_merges(["a b", "b c"])
    writer.add_bos_token_id(6)
    writer.add_eos_token_id(7)
    if add_bos_token:
        writer.add_add_bos_token(add_bos_token["add_bos_token"])
    writer.add_tensor("dummy", np.zeros(1, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_tokenizer_llama3_gguf_takes_whole_words_bos_and_eot_as_llama_cpp_does(tmp_path):
    """A llama-bpe GGUF without add_bos_token starts text with BOS, takes a word that is a token whole
    (ignore_merges, as Llama 3's tokenizer.json), and ends generation at <|eot_id|> too."""
    path = str(tmp_path / "llama3.gguf")
    _llama3_vocabulary_gguf(path)
    tok = Tokenizer.from_gguf(gguf.GGUFReader(path))
    assert tok.prefix_ids == (6,)
    assert tok.encode("abc") == [6, 5]
    assert tok.eos_token_ids == {7, 8}
    _llama3_vocabulary_gguf(path, add_bos_token=False)  # the file's own word wins
    assert Tokenizer.from_gguf(gguf.GGUFReader(path)).encode("abc") == [5]


def _vocabulary_gguf(path, source: str, pre: str) -> None:
    """A qwen2 GGUF with the embedded model's byte-level vocabulary, stating pre-tokenizer `pre`."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(path), "qwen2")
    for key, value in dict(
        vocab_size=49152, context_length=4096, embedding_length=64, block_count=1, feed_forward_length=128
    ).items():
        writer.add_uint32(f"qwen2.{key}", value)
    writer.add_uint32("qwen2.attention.head_count", 4)
    for key, f in reader.fields.items():
        if key.startswith("tokenizer."):
            kind = f.types[0]
            writer.add_key_value(
                key,
                pre if key == "tokenizer.ggml.pre" else f.contents(),
                kind,
                f.types[1] if kind == gguf.GGUFValueType.ARRAY else None,
            )
    writer.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("pre", ["qwen2", "tekken", "llama-bpe"])
def test_tokenizer_gguf_splits_text_as_its_pre_tokenizer_says(gguf_path, tmp_path, pre):
    """Qwen2's GGUFs (and DeepSeek-R1's distills) split every digit alone, Mistral NeMo's keep a leading
    punctuation mark with the word: each splits as transformers builds it from the same file."""
    _vocabulary_gguf(tmp_path / "vocab.gguf", gguf_path, pre)
    ours = Tokenizer.from_gguf(gguf.GGUFReader(str(tmp_path / "vocab.gguf")))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="vocab.gguf")
    for text in TEXTS + ["a\n\n\nb  \n c", "Year 2024: 12345 items", "(Hello) .World I'M here, you'LL see"]:
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False), text


def test_tokenizer_gguf_refuses_a_pre_tokenizer_it_does_not_know(gguf_path, tmp_path):
    _vocabulary_gguf(tmp_path / "vocab.gguf", gguf_path, "made-up")
    with pytest.raises(ValueError, match="pre-tokenizer 'made-up' is not supported"):
        Tokenizer.from_gguf(gguf.GGUFReader(str(tmp_path / "vocab.gguf")))


def test_vocab_size_bounds_every_id_where_ids_leave_gaps(tmp_path):
    """Three tokens at ids 0, 1 and 5, and an added one: a count (4) would put `b` past the vocabulary, where
    the engine refuses it as input and masks its logit."""
    backend = tokenizers.Tokenizer(WordLevel({"<unk>": 0, "a": 1, "b": 5}, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<|end|>"])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    loaded = Tokenizer.from_hf_dir(str(tmp_path))
    assert loaded.encode("a b", add_special_tokens=False) == [1, 5]
    assert loaded.vocab_size == 6
