"""Structured outputs in the engine loop: a constraint's mask applied to its rows' logits each step (llguidance;
engine/sampling/constraints.py), its matcher advanced as the draws are read. Sampled at temperature 1.0 over
many seeds, outputs still parse and validate; greedy ones equal the free greedy output where that already fits;
rows without a constraint never change for sharing a batch with constrained ones."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import pytest

from lmgate.engine import Engine
from lmgate.engine.config import EngineConfig
from lmgate.engine.errors import InvalidRequest
from lmgate.engine.gateway.request import FinishReason
from lmgate.engine.sampling.constraints import Constraint, ConstraintKind
from lmgate.engine.sampling.sampler import SamplingParams
from lmgate.v1 import lmgate_pb2 as pb

SEEDS = range(20)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16, "pattern": "^[A-Z][a-z]+$"},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
ARITHMETIC = """
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= num | "(" expr ")"
num ::= [1-9] [0-9]?
"""
ASK = [{"role": "user", "content": "Reply with a JSON record of one person."}]


@pytest.fixture(scope="module", params=["off", "on"])
def engine(request, checkpoint):
    """Overlap on too: a constrained row waits for its last draw before its next mask."""
    eng = Engine(
        EngineConfig(dtype="float32", kv_cache_tokens=8192, overlap_scheduling=request.param), checkpoint=checkpoint
    )
    yield eng
    eng.shutdown()


def assert_idle(engine: Engine) -> None:
    info = engine.info()
    assert info.kv_blocks_free == info.kv_blocks_total
    assert info.running_sequences == 0 and info.waiting_sequences == 0


def sample_all(engine: Engine, prompt, constraint: Constraint, max_new_tokens: int) -> list:
    """One request per seed, all in flight together (one batch), merged."""
    streams = [
        engine.submit(
            prompt, SamplingParams(temperature=1.0, seed=s, max_new_tokens=max_new_tokens, constraint=constraint)
        )
        for s in SEEDS
    ]
    return [merged(stream) for stream in streams]


def merged(stream) -> tuple[str, FinishReason, list[int]]:
    outputs = list(stream)
    return "".join(o.text for o in outputs), outputs[-1].finish_reason, [t for o in outputs for t in o.token_ids]


def parses_arithmetic(text: str) -> bool:
    """A recursive descent over ARITHMETIC's language."""
    at = 0

    def expr() -> bool:
        nonlocal at
        if not term():
            return False
        while at < len(text) and text[at] in "+-":
            at += 1
            if not term():
                return False
        return True

    def term() -> bool:
        nonlocal at
        if text.startswith("(", at):
            at += 1
            if not expr() or not text.startswith(")", at):
                return False
            at += 1
            return True
        m = re.compile(r"[1-9][0-9]?").match(text, at)
        if m is None:
            return False
        at = m.end()
        return True

    return expr() and at == len(text)


# ------------------------------------------------------------------------------------------- every kind
def test_json_schema_outputs_parse_and_validate(engine):
    for text, reason, _ in sample_all(engine, ASK, Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(PERSON)), 160):
        assert reason is FinishReason.STOP, text
        jsonschema.validate(json.loads(text), PERSON)
    for text, reason, _ in sample_all(engine, ASK, Constraint(ConstraintKind.JSON_OBJECT), 80):
        assert reason is FinishReason.LENGTH or isinstance(json.loads(text), dict)
    assert_idle(engine)


def test_regexes_choices_and_grammars_hold_for_every_seed(engine):
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    for text, reason, _ in sample_all(engine, "Call me at", Constraint(ConstraintKind.REGEX, phone), 24):
        assert reason is FinishReason.STOP and re.fullmatch(phone, text), text
    colors = ["red", "green", "light blue"]
    picked = {text for text, _, _ in sample_all(engine, "My favourite colour is", Constraint.choice(colors), 8)}
    assert picked <= set(colors) and len(picked) > 1
    for text, reason, _ in sample_all(engine, "2+2=", Constraint(ConstraintKind.GRAMMAR, ARITHMETIC), 24):
        assert reason is FinishReason.LENGTH or parses_arithmetic(text), text
    assert_idle(engine)


def test_greedy_under_a_constraint_equals_free_greedy_where_that_fits(engine):
    prompt = "The three primary colors are"
    free = engine.generate(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert re.fullmatch(r"[^0-9]*", free.text)  # the premise: free greedy already fits
    constraint = Constraint(ConstraintKind.REGEX, r"[^0-9]{0,200}")
    held = engine.generate(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True, constraint=constraint))
    assert held.token_ids == free.token_ids


def test_rows_without_a_constraint_are_untouched_by_constrained_ones_in_their_batch(engine):
    prompts = ["Once upon a time", "The ocean is", "My favourite food", "In the year 3000"]
    free = [SamplingParams(max_new_tokens=16), SamplingParams(max_new_tokens=16, temperature=0.8, seed=5)]
    alone = [engine.generate(p, params).token_ids for p in prompts for params in free]
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(PERSON))
    held = [engine.submit(ASK, SamplingParams(temperature=1.0, seed=s, constraint=constraint)) for s in range(4)]
    mixed = [engine.submit(p, params) for p in prompts for params in free]
    assert [merged(s)[2] for s in mixed] == alone
    for stream in held:
        jsonschema.validate(json.loads(merged(stream)[0]), PERSON)
    assert_idle(engine)


@pytest.mark.parametrize(
    "kind, text, words",
    [
        ("json_schema", "{not json", "json_schema"),
        ("json_schema", json.dumps({"type": "array", "uniqueItems": True}), "uniqueItems"),
        ("regex", "(unclosed", "regex"),
        ("grammar", "root ::= missing", "missing"),
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_and_changes_nothing(engine, kind, text, words):
    before = engine.info()
    with pytest.raises(InvalidRequest, match=words):
        engine.submit("Hi", SamplingParams(constraint=Constraint(ConstraintKind(kind), text)))
    assert engine.info().queued_requests == before.queued_requests
    assert_idle(engine)


# ------------------------------------------------------------------------------------------- with everything else
def test_n_samples_a_session_and_a_cancel_keep_their_constraints(engine):
    colors = Constraint.choice(["red", "green", "blue", "yellow"])
    samples = engine.generate_samples("A colour:", SamplingParams(n=4, seed=2, temperature=1.0, constraint=colors))
    assert all(s.text in ("red", "green", "blue", "yellow") for s in samples)
    for i, sample in enumerate(samples):  # each as its own request with seed + i
        alone = engine.generate("A colour:", SamplingParams(seed=2 + i, temperature=1.0, constraint=colors))
        assert sample.token_ids == alone.token_ids
    session = engine.start_session()
    digits = Constraint(ConstraintKind.REGEX, r"[0-9]{2,4}")
    for turn in ("Pick a number:", " And another:", " One more:"):
        out = engine.generate(turn, SamplingParams(temperature=1.0, seed=3, constraint=digits), session_id=session)
        assert re.fullmatch(r"[0-9]{2,4}", out.text)
    engine.end_session(session)
    endless = Constraint(ConstraintKind.REGEX, r"(ab){300}")  # no end in sight when it is cancelled
    stream = engine.submit("x", SamplingParams(max_new_tokens=500, constraint=endless))
    outputs = [next(iter(stream))]
    assert stream.cancel()
    outputs += list(stream)
    assert outputs[-1].finish_reason is FinishReason.CANCELLED
    assert re.fullmatch(r"(ab)*a?", "".join(o.text for o in outputs))
    assert_idle(engine)


def test_a_sleep_ends_constrained_streams_and_after_the_wakeup_they_hold_again(engine):
    endless = Constraint(ConstraintKind.REGEX, r"(ab){300}")
    stream = engine.submit("x", SamplingParams(max_new_tokens=500, constraint=endless))
    first = next(iter(stream))
    engine.sleep(level=1)
    rest = list(stream)
    assert (rest or [first])[-1].finish_reason is FinishReason.CANCELLED
    engine.wakeup()
    out = engine.generate(
        "Call me at", SamplingParams(temperature=1.0, seed=4, constraint=Constraint(ConstraintKind.REGEX, r"\d{4}"))
    )
    assert re.fullmatch(r"\d{4}", out.text)
    assert_idle(engine)


def test_constrained_rows_preempted_for_lack_of_blocks_keep_their_place_in_the_grammar(checkpoint):
    engine = Engine(
        EngineConfig(dtype="float32", kv_cache_tokens=512, block_size=16, max_batch_size=8), checkpoint=checkpoint
    )
    try:
        constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(PERSON))
        outputs = sample_all(engine, ASK, constraint, 160)[:8]
        assert engine.info().preemptions > 0
        for text, reason, _ in outputs:
            assert reason is FinishReason.STOP
            jsonschema.validate(json.loads(text), PERSON)
        assert_idle(engine)
    finally:
        engine.shutdown()


# ------------------------------------------------------------------------------------------- lmgate.v1
def test_lmgate_v1_takes_each_kind_of_constraint(server):
    from lmgate.client import Client

    with Client(server.address) as client:
        text = "".join(
            d.text for d in client.generate(messages=ASK, temperature=1.0, seed=1, json_schema=json.dumps(PERSON))
        )
        jsonschema.validate(json.loads(text), PERSON)
        picked = "".join(d.text for d in client.generate("Yes or no?", choice=["yes", "no"]))
        assert picked in ("yes", "no")
        assert re.fullmatch(r"[a-z]{3}", "".join(d.text for d in client.generate("Hi", regex="[a-z]{3}")))
        with pytest.raises(grpc.RpcError) as err:
            list(client.generate("Hi", regex="(unclosed"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "regex" in err.value.details()
    request = pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(json_object=True, max_new_tokens=40))
    text = "".join(m.text for m in server.stub().Generate(request, timeout=120))
    assert text.startswith("{")
