"""Structured-output constraints (engine/sampling/constraints.py) with the real llguidance and the embedded model's
tokenizer: each kind compiles, masks allow exactly the tokens that keep the output satisfiable, bad constraints are
InvalidRequest, the mask on logits against a reference, and greedy walks over masked random logits give outputs
that parse and validate."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import numpy as np
import pytest
import torch

from lmgate.engine.errors import InvalidRequest
from lmgate.engine.sampling.constraints import (
    CompiledGrammar,
    Constraint,
    ConstraintKind,
    GrammarCompiler,
    GrammarMatcher,
    TokenMasks,
    apply_token_mask,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "user", "guest"]},
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "maxItems": 4},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "code", "address", "tags"],
    "additionalProperties": False,
}
PERSON_VALUE = {
    "name": "Ada",
    "age": 36,
    "role": "admin",
    "code": "AB-123",
    "address": {"city": "London", "zip": "12345"},
    "tags": ["math"],
    "scores": [3, -2],
    "active": True,
}
ARITHMETIC = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")"
"""


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.hf_files()["tokenizer.json"], tokenizer.eos_token_ids, tokenizer.vocab_size)


@pytest.fixture(scope="module")
def token_texts(tokenizer) -> list[str]:
    return [tokenizer.decode([i], skip_special_tokens=False) for i in range(tokenizer.vocab_size)]


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def allowed(matcher: GrammarMatcher, vocab: int) -> set[int]:
    bitmask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    matcher.fill_mask(bitmask, 0)
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:vocab]
    return set(np.flatnonzero(bits).tolist())


def walk(matcher: GrammarMatcher, token_ids: list[int], vocab: int) -> None:
    """Each token is allowed by the mask before it and accepted."""
    for t in token_ids:
        assert t in allowed(matcher, vocab)
        assert matcher.accept(t)


def schema(value: dict) -> Constraint:
    return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(value))


# ------------------------------------------------------------------------------------------------ each kind


@pytest.mark.parametrize(
    "constraint, output",
    [
        (schema(PERSON), json.dumps(PERSON_VALUE)),
        (Constraint(ConstraintKind.JSON_OBJECT), '{"anything": [1, {"goes": null}], "x": "y"}'),
        (Constraint(ConstraintKind.REGEX, r"[0-9]{3}-[a-z]+"), "123-abc"),
        (Constraint(ConstraintKind.GRAMMAR, ARITHMETIC), "(1+23)*4"),
        (Constraint(ConstraintKind.GRAMMAR, 'start: "a" NUM+\nNUM: /[0-9]/'), "a42"),  # Lark
        (Constraint.choice(["positive", "negative", "neutral"]), "negative"),
        (Constraint("regex", "yes|no"), "no"),  # a kind's value will do
    ],
    ids=["json_schema", "json_object", "regex", "ebnf", "lark", "choice", "kind_by_value"],
)
def test_each_kind_compiles_and_takes_a_valid_output(compiler, tokenizer, constraint, output):
    grammar = compiler.compile(constraint)
    assert isinstance(grammar, CompiledGrammar)
    matcher = grammar.matcher()
    assert not matcher.eos_allowed
    walk(matcher, ids(tokenizer, output), compiler.vocab_size)
    assert matcher.eos_allowed
    eos = min(tokenizer.eos_token_ids)
    assert eos in allowed(matcher, compiler.vocab_size)
    assert matcher.accept(eos) and matcher.is_terminated
    assert not matcher.accept(eos)  # nothing after the end


def test_a_structural_tag_leaves_text_free_and_holds_each_call_to_its_schema(compiler, tokenizer):
    spec = {
        "structures": [
            {
                "begin": "<function=get_weather>",
                "schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
                "end": "</function>",
            }
        ],
        "triggers": ["<function="],
    }
    grammar = compiler.compile(Constraint(ConstraintKind.STRUCTURAL_TAG, json.dumps(spec)))
    text = 'Let me look. <function=get_weather>{"city": "Paris"}</function> Done.'
    matcher = grammar.matcher()
    walk(matcher, ids(tokenizer, text), compiler.vocab_size)
    assert matcher.eos_allowed
    bad = grammar.matcher()
    prefix = ids(tokenizer, "Hi <function=get_weather>")
    walk(bad, prefix, compiler.vocab_size)
    assert not bad.accept(ids(tokenizer, "[")[0])  # the call's arguments are an object


# ------------------------------------------------------------------------------------ masks, exactly


def test_a_regex_mask_allows_exactly_the_tokens_that_keep_a_match_possible(compiler, tokenizer, token_texts):
    """Fixed-length pattern: a text can still match iff each character is in its position's class. At every
    step the mask is compared with that rule over the whole vocabulary, along a walk of random allowed tokens."""
    classes = ["0123456789"] * 3 + ["-"] + ["abcdefghijklmnopqrstuvwxyz"] * 2
    matcher = compiler.compile(Constraint(ConstraintKind.REGEX, r"[0-9]{3}-[a-z]{2}")).matcher()
    special = {i for i in range(compiler.vocab_size) if tokenizer.is_special(i)}
    rng = np.random.default_rng(0)
    text = ""
    while True:
        want = {
            i
            for i, piece in enumerate(token_texts)
            if piece
            and i not in special
            and len(text + piece) <= len(classes)
            and all(c in classes[k] for k, c in enumerate(text + piece))
        }
        if len(text) == len(classes):
            want |= tokenizer.eos_token_ids
        got = allowed(matcher, compiler.vocab_size)
        assert got == want, f"after {text!r}: extra {sorted(got - want)[:10]}, missing {sorted(want - got)[:10]}"
        if len(text) == len(classes):
            break
        token = int(rng.choice(sorted(want)))
        assert matcher.accept(token)
        text += token_texts[token]
    assert matcher.is_terminated and re.fullmatch(r"[0-9]{3}-[a-z]{2}", text)


def test_a_choice_mask_allows_exactly_the_prefixes_of_the_choices(compiler, tokenizer, token_texts):
    """Every token that keeps some choice reachable, and end-of-sequence at a whole choice; but where one choice
    is left and its rest is forced, llguidance allows only the forced text's own (canonical) first token, never
    another split of it: the tokens the model was trained on."""
    choices = ["red", "green", "greenish blue"]
    matcher = compiler.compile(Constraint.choice(choices)).matcher()
    text, forced_steps = "", 0
    for step in ids(tokenizer, "greenish blue"):
        rests = [c[len(text) :] for c in choices if c.startswith(text)]
        if len(rests) == 1:
            want = {ids(tokenizer, rests[0])[0]}
            forced_steps += 1
        else:
            want = {
                i
                for i, piece in enumerate(token_texts)
                if piece and not tokenizer.is_special(i) and any(r.startswith(piece) for r in rests)
            }
            if "" in rests:
                want |= tokenizer.eos_token_ids
        assert allowed(matcher, compiler.vocab_size) == want, text
        assert matcher.accept(step)
        text += token_texts[step]
    assert text == "greenish blue" and matcher.is_terminated and forced_steps == 1


def test_an_invalid_continuation_is_refused_and_changes_nothing(compiler, tokenizer):
    matcher = compiler.compile(schema(PERSON)).matcher()
    prefix = ids(tokenizer, '{"name": "Ada", "age": ')
    walk(matcher, prefix, compiler.vocab_size)
    before = allowed(matcher, compiler.vocab_size)
    assert not tokenizer.eos_token_ids & before  # an object cut short never ends
    for wrong in ('"', "-", "true", "}"):  # a string, a negative, a boolean, an end without the required keys
        token = ids(tokenizer, wrong)[0]
        assert token not in before and not matcher.accept(token)
        assert matcher.error == "" and allowed(matcher, compiler.vocab_size) == before
    two, zero = ids(tokenizer, "2")[0], ids(tokenizer, "0")[0]
    walk(matcher, [two, zero], compiler.vocab_size)  # 20, but 200 is past the maximum of 130
    assert zero not in allowed(matcher, compiler.vocab_size) and not matcher.accept(zero)
    assert matcher.num_tokens == len(prefix) + 2


def test_end_of_sequence_only_where_the_grammar_is_complete(compiler, tokenizer):
    matcher = compiler.compile(Constraint(ConstraintKind.GRAMMAR, ARITHMETIC)).matcher()
    eos = tokenizer.eos_token_ids
    for token in ids(tokenizer, "12+3"):
        assert (eos <= allowed(matcher, compiler.vocab_size)) == matcher.eos_allowed
        assert not matcher.eos_allowed or matcher.num_tokens in (1, 2)
        matcher.accept(token)
    assert matcher.eos_allowed and eos <= allowed(matcher, compiler.vocab_size)
    matcher.accept(ids(tokenizer, "*")[0])
    assert not matcher.eos_allowed and not eos & allowed(matcher, compiler.vocab_size)
    assert not matcher.accept(min(eos))


def test_rollback_reset_and_replay_return_to_the_same_place(compiler, tokenizer):
    grammar = compiler.compile(schema(PERSON))
    tokens = ids(tokenizer, json.dumps(PERSON_VALUE))
    matcher = grammar.matcher()
    masks = []
    for t in tokens:
        masks.append(allowed(matcher, compiler.vocab_size))
        assert matcher.accept(t)
    eos = min(tokenizer.eos_token_ids)
    assert matcher.is_terminated and matcher.accept(eos)  # complete: end-of-sequence only
    matcher.rollback(6)  # the end-of-sequence too
    assert matcher.num_tokens == len(tokens) - 5
    assert allowed(matcher, compiler.vocab_size) == masks[-5]
    for t in tokens[-5:]:
        assert matcher.accept(t)
    assert matcher.is_terminated
    with pytest.raises(ValueError):
        matcher.rollback(len(tokens) + 1)
    matcher.reset()
    assert matcher.num_tokens == 0 and allowed(matcher, compiler.vocab_size) == masks[0]
    assert matcher.replay(tokens[:20]) and allowed(matcher, compiler.vocab_size) == masks[20]
    assert not grammar.matcher().replay(ids(tokenizer, '{"age": 1}'))  # "name" comes first


# --------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "constraint, words",
    [
        (Constraint(ConstraintKind.JSON_SCHEMA, "{not json"), ["json_schema", "not JSON"]),
        (Constraint(ConstraintKind.JSON_SCHEMA, "[1, 2]"), ["expected a JSON Schema"]),
        (schema({"type": "objekt"}), ["objekt"]),
        (schema({"type": "string", "format": "no-such-format"}), ["no-such-format"]),
        (schema({"not": {"type": "string"}}), ["Unimplemented", "not"]),
        (schema({"type": "array", "uniqueItems": True}), ["uniqueItems"]),
        (schema({"if": {"type": "integer"}, "then": {"minimum": 3}}), ["if", "then"]),
        (schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}), ["missing"]),
        (Constraint(ConstraintKind.REGEX, "a(b"), ["regex", "unclosed group"]),
        (Constraint(ConstraintKind.REGEX, "[z-a]"), ["regex", "range"]),
        (Constraint(ConstraintKind.GRAMMAR, 'root ::= "a" | undefined_rule'), ["grammar", "undefined_rule"]),
        (Constraint(ConstraintKind.GRAMMAR, "start: foo"), ["foo"]),
        (Constraint(ConstraintKind.CHOICE, "[]"), ["choice", "non-empty strings"]),
        (Constraint(ConstraintKind.CHOICE, '["a", 3]'), ["non-empty strings"]),
        (Constraint(ConstraintKind.STRUCTURAL_TAG, '{"structures": []}'), ["structural_tag", "structures"]),
        (
            Constraint(
                ConstraintKind.STRUCTURAL_TAG,
                json.dumps({"structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}], "triggers": ["<g"]}),
            ),
            ["none of the triggers"],
        ),
    ],
)
def test_a_constraint_that_does_not_compile_is_an_invalid_request_naming_what(compiler, constraint, words):
    for _ in range(2):  # the second from the cache
        with pytest.raises(InvalidRequest) as caught:
            compiler.compile(constraint)
        for word in words:
            assert word in str(caught.value)
    assert compiler.cached(constraint) is None


@pytest.mark.parametrize(
    "kind, text, words",
    [
        ("yaml", "a: 1", ["unknown constraint kind", "json_schema"]),
        (ConstraintKind.REGEX, "", ["must not be empty"]),
        (ConstraintKind.JSON_OBJECT, "{}", ["takes no text"]),
        (ConstraintKind.REGEX, "a" * ((1 << 20) + 1), ["limited to"]),
    ],
)
def test_a_malformed_constraint_is_refused_when_made(kind, text, words):
    with pytest.raises(InvalidRequest) as caught:
        Constraint(kind, text)
    for word in words:
        assert word in str(caught.value)


def test_compiled_grammars_are_cached_by_kind_and_text_and_compile_on_any_thread(compiler):
    constraint = schema({"type": "object", "properties": {"cached": {"type": "integer"}}})
    assert compiler.cached(constraint) is None
    with ThreadPoolExecutor(4) as pool:
        grammars = list(pool.map(compiler.compile, [constraint] * 8))
    assert all(g is grammars[0] for g in grammars)
    assert compiler.cached(constraint) is grammars[0]
    assert compiler.compile(Constraint(ConstraintKind.JSON_SCHEMA, constraint.text)) is grammars[0]
    assert compiler.cached(Constraint(ConstraintKind.REGEX, constraint.text)) is None  # the kind is in the key


def test_the_cache_keeps_the_most_recently_used(tokenizer):
    small = GrammarCompiler(tokenizer.hf_files()["tokenizer.json"], tokenizer.eos_token_ids, tokenizer.vocab_size, 2)
    a, b, c = (Constraint(ConstraintKind.REGEX, x) for x in ("a+", "b+", "c+"))
    small.compile(a), small.compile(b)
    small.compile(a)  # a is now the most recent
    small.compile(c)
    assert small.cached(a) is not None and small.cached(c) is not None and small.cached(b) is None


# ---------------------------------------------------------------------------------------- masks on logits


def reference_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Entry by entry: bit (t % 32) of word (t // 32) of the row's mask allows token t."""
    want = logits.clone()
    words = bitmask.tolist()
    for j, r in enumerate(rows):
        for t in range(logits.shape[1]):
            w = t // 32
            if w >= len(words[j]) or not (words[j][w] >> (t % 32)) & 1:
                want[r, t] = float("-inf")
    return want


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [96, 100, 130])  # whole words; a part of the last word; wider than the mask
def test_the_mask_sets_disallowed_logits_to_minus_infinity_and_leaves_the_rest(device, vocab):
    gen = torch.Generator().manual_seed(vocab)
    words = (min(vocab, 100) + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=gen)
    bitmask[1] = -1  # everything allowed
    logits = torch.randn(5, vocab, generator=gen)
    logits[4, 7] = float("nan")  # an unconstrained row's NaN stays as it is
    rows = [3, 0, 2]  # bitmask row j -> logits row rows[j]; rows 1 and 4 unconstrained
    want = reference_mask(logits, bitmask, rows)
    got = apply_token_mask(logits.to(device), bitmask, rows).cpu()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert torch.equal(got[[1, 4]].nan_to_num(), logits[[1, 4]].nan_to_num())
    whole = logits[:3].to(device)  # every row constrained, in order
    assert torch.equal(apply_token_mask(whole, bitmask).cpu(), reference_mask(logits[:3], bitmask, [0, 1, 2]))


def test_the_mask_applies_to_inference_tensors_and_half_precision():
    with torch.inference_mode():
        logits = torch.randn(2, 64).to(torch.bfloat16)
    bitmask = torch.tensor([[0x0000FFFF, 0], [-1, 1]], dtype=torch.int32)
    apply_token_mask(logits, bitmask)
    assert logits[0, :16].isfinite().all() and logits[0, 16:].isneginf().all()
    assert logits[1, :33].isfinite().all() and logits[1, 33:].isneginf().all()


# -------------------------------------------------------------------------------- greedy walks, end to end


def greedy_walk(matchers: list[GrammarMatcher], vocab: int, seed: int, max_steps: int = 400) -> list[list[int]]:
    """Each step: the masks of the rows still going, random logits for them and an unconstrained row beside
    them (which the masks must leave as it is), the argmax of each; until each row's grammar has ended."""
    gen = torch.Generator().manual_seed(seed)
    masks = TokenMasks(vocab, rows=2)  # grows to the batch
    outputs: list[list[int]] = [[] for _ in matchers]
    for _ in range(max_steps):
        live = [j for j, m in enumerate(matchers) if not m.is_terminated]
        if not live:
            return outputs
        logits = torch.randn(len(live) + 1, vocab, generator=gen) * 4
        free = logits[-1].clone()
        apply_token_mask(logits, masks.fill([matchers[j] for j in live]), list(range(len(live))))
        assert torch.equal(logits[-1], free)
        for row, j in enumerate(live):
            token = int(logits[row].argmax())
            assert matchers[j].accept(token), f"row {j} drew {token}, which its mask allowed"
            outputs[j].append(token)
    raise AssertionError(f"not done in {max_steps} steps")


def test_greedy_walks_over_masked_random_logits_give_json_that_validates(compiler, tokenizer):
    grammar = compiler.compile(schema(PERSON))
    matchers = [grammar.matcher() for _ in range(6)]
    outputs = greedy_walk(matchers, compiler.vocab_size, seed=1)
    for tokens in outputs:
        text = tokenizer.decode(tokens)
        jsonschema.validate(json.loads(text), PERSON)


def test_greedy_walks_of_mixed_constraints_in_one_batch(compiler, tokenizer):
    regex = r"(\+33|0)[1-9]( [0-9]{2}){4}"
    choices = ["alpha", "beta", "gamma delta"]
    grammars = [
        compiler.compile(Constraint(ConstraintKind.REGEX, regex)),
        compiler.compile(Constraint.choice(choices)),
        compiler.compile(Constraint(ConstraintKind.GRAMMAR, ARITHMETIC)),
        compiler.compile(Constraint(ConstraintKind.JSON_OBJECT)),
    ]
    for seed in range(3):
        outputs = greedy_walk([g.matcher() for g in grammars[:2]], compiler.vocab_size, seed)
        assert re.fullmatch(regex, tokenizer.decode(outputs[0]))
        assert tokenizer.decode(outputs[1]) in choices
    # Arithmetic and any JSON object never have to end: walk them a while, then check what they hold so far.
    matchers = [g.matcher() for g in grammars[2:]]
    gen = torch.Generator().manual_seed(5)
    masks = TokenMasks(compiler.vocab_size)
    for _ in range(30):
        logits = torch.randn(2, compiler.vocab_size, generator=gen)
        apply_token_mask(logits, masks.fill(matchers))
        for m, t in zip(matchers, logits.argmax(dim=-1).tolist()):
            assert m.accept(t)
    assert matchers[1].replay(ids(tokenizer, '{"a": [true, {"b": null}]}')) and matchers[1].eos_allowed


def test_a_vocabulary_padded_past_the_tokenizer_is_never_drawn(tokenizer):
    """An embedding wider than the tokenizer (Qwen2.5's): the masks cover the logits' width, the ids past the
    tokenizer's tokens disallowed."""
    wide = tokenizer.vocab_size + 100
    padded = GrammarCompiler(tokenizer.hf_files()["tokenizer.json"], tokenizer.eos_token_ids, wide)
    assert padded.vocab_size == wide
    matcher = padded.compile(Constraint(ConstraintKind.REGEX, "[ab]+")).matcher()
    logits = apply_token_mask(torch.zeros(1, wide), TokenMasks(wide, rows=1).fill([matcher]))
    kept = logits[0].isfinite().nonzero().flatten().tolist()
    assert kept and max(kept) < tokenizer.vocab_size
    assert all(set(tokenizer.decode([t])) <= {"a", "b"} for t in kept)
