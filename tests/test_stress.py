"""Many concurrent streams over two engine loops with cancels, session ends, client disconnects and stop strings
mixed in."""

from __future__ import annotations

import functools
import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from lmgate.engine.sampling.sampler import SamplingParams
from lmgate.v1 import lmgate_pb2 as pb
from lmgate.v1 import lmgate_pb2_grpc as pb_grpc
from tests.test_service import assert_idle

STREAMS = 64
NEW_TOKENS = 12
PROMPTS = [
    "The quick brown fox",
    "In a distant galaxy",
    "def fibonacci(n):",
    "Water boils at",
    "My favourite recipe is",
    "The history of Rome",
    "Once upon a time",
    "Photosynthesis is",
]
SAMPLING = pb.SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def references(server2) -> dict[str, list[int]]:
    """Each prompt's greedy tokens, run alone through the engine API."""
    engine = server2.engine
    return {
        p: engine.generate(
            engine.tokenizer.encode(p), SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
        ).token_ids
        for p in PROMPTS
    }


def _stream(stub, request):
    """Yields (token ids, finish reason) per message."""
    for msg in stub.Generate(request):
        yield list(msg.token_ids), msg.finish_reason


def _plain(stub, prompt, ref, rng):
    ids, reason = [], None
    for tokens, reason in _stream(stub, pb.GenerateRequest(prompt=prompt, sampling=SAMPLING)):
        ids += tokens
    assert (ids, reason) == (ref, pb.FINISH_REASON_LENGTH)


def _session(stub, prompt, ref, rng):
    sid = stub.Start(pb.StartRequest()).session_id
    ids = [
        t
        for tokens, _ in _stream(stub, pb.GenerateRequest(session_id=sid, prompt=prompt, sampling=SAMPLING))
        for t in tokens
    ]
    stub.End(pb.EndRequest(session_id=sid))
    assert ids == ref  # a session turn's text gets no added special tokens; SmolLM2 adds none anyway


def _cancel(stub, prompt, ref, rng):
    rid = f"stress-{rng.random()}"
    ids, reason = [], None
    for tokens, reason in _stream(stub, pb.GenerateRequest(request_id=rid, prompt=prompt, sampling=SAMPLING)):
        if tokens and not ids:  # the first message with tokens (a busy server may merge several into one)
            stub.Cancel(pb.CancelRequest(request_id=rid))
        ids += tokens
    assert reason in (pb.FINISH_REASON_CANCELLED, pb.FINISH_REASON_LENGTH)
    assert ids == ref[: len(ids)]


def _end(stub, prompt, ref, rng):
    sid = stub.Start(pb.StartRequest()).session_id
    ids, reason = [], None
    for tokens, reason in _stream(stub, pb.GenerateRequest(session_id=sid, prompt=prompt, sampling=SAMPLING)):
        if tokens and not ids:  # the first message with tokens (a busy server may merge several into one)
            stub.End(pb.EndRequest(session_id=sid))
        ids += tokens
    assert reason in (pb.FINISH_REASON_CANCELLED, pb.FINISH_REASON_LENGTH)
    assert ids == ref[: len(ids)]
    try:
        list(stub.Generate(pb.GenerateRequest(session_id=sid, prompt=prompt, sampling=SAMPLING)))
        raise AssertionError("an ended session accepted a turn")
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.NOT_FOUND


def _disconnect(stub, prompt, ref, rng):
    call = stub.Generate(pb.GenerateRequest(prompt=prompt, sampling=SAMPLING))
    try:
        for msg in call:
            if msg.token_ids:
                call.cancel()
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.CANCELLED


ACTIONS = [_plain, _session, _cancel, _end, _disconnect]


def run_plan(server, actions: list, references: dict[str, list[int]], seed: int) -> pb.InfoResponse:
    """STREAMS concurrent streams, each a random action on a random prompt; every block free afterwards.
    Returns the server's Info from before."""
    before = server.info()
    rng = random.Random(seed)
    prompts = list(references)
    plan = [(rng.choice(actions), rng.choice(prompts), random.Random(rng.random())) for _ in range(STREAMS)]
    with server.channel() as channel:
        stub = pb_grpc.InferenceStub(channel)
        with ThreadPoolExecutor(STREAMS) as pool:
            futures = [pool.submit(action, stub, prompt, references[prompt], r) for action, prompt, r in plan]
            for f in futures:
                f.result(timeout=300)  # a guard against a hang, not a performance bound
    assert_idle(server, before)
    assert server.info().active_sessions == 0
    return before


@pytest.mark.parametrize("round_", range(3))
def test_many_streams_with_cancels_ends_and_disconnects(server2, references, round_):
    run_plan(server2, ACTIONS, references, round_)


# --------------------------------------------------------- the same with stop strings ending session turns
FOLLOW = " And then"  # a stopped turn's session goes on with it


@pytest.fixture(scope="module")
def stopped_turns(server2, references) -> dict[str, tuple[str, int, list[int], int]]:
    """Per prompt: a stop string from its greedy text, the tokens a turn keeps that stops on it, and the next
    turn's tokens and prompt count after a turn of just those tokens (run alone, with no stop string)."""
    engine = server2.engine
    stops = {}
    for prompt, ref in references.items():
        text = engine.tokenizer.decode(ref)
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        stopping = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, stop=(stop,))
        kept = len(engine.generate(prompt, stopping).token_ids)
        session = engine.start_session()
        engine.generate(prompt, SamplingParams(max_new_tokens=kept, ignore_eos=True), session_id=session)
        follow = engine.generate(FOLLOW, SamplingParams(max_new_tokens=4, ignore_eos=True), session_id=session)
        engine.end_session(session)
        stops[prompt] = (stop, kept, follow.token_ids, follow.usage.prompt_tokens)
    return stops


def _stopped(stops, stub, prompt, ref, rng):
    """A session turn that stops on a string (found by the serving process where the loop is a rank process),
    then the session's next turn: it goes on from the stop, as after a turn of just the tokens kept."""
    stop, kept, follow, follow_prompt = stops[prompt]
    sid = stub.Start(pb.StartRequest()).session_id
    sampling = pb.SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, stop=[stop])
    first = list(stub.Generate(pb.GenerateRequest(session_id=sid, prompt=prompt, sampling=sampling)))
    assert [t for m in first for t in m.token_ids] == ref[:kept]
    assert (first[-1].finish_reason, first[-1].usage.completion_tokens) == (pb.FINISH_REASON_STOP, kept)
    sampling = pb.SamplingParams(max_new_tokens=4, ignore_eos=True)
    second = list(stub.Generate(pb.GenerateRequest(session_id=sid, prompt=FOLLOW, sampling=sampling)))
    assert ([t for m in second for t in m.token_ids], second[-1].usage.prompt_tokens) == (follow, follow_prompt)
    stub.End(pb.EndRequest(session_id=sid))


@pytest.mark.parametrize("round_", range(2))
def test_many_streams_with_stop_strings_cancels_and_ends(server2, references, stopped_turns, round_):
    """Turns that stop on strings among the other actions: each keeps the tokens through its stop, and its
    session's next turn goes on from there; every block free afterwards."""
    run_plan(server2, ACTIONS + [functools.partial(_stopped, stopped_turns)] * 2, references, 200 + round_)


# --------------------------------------------------------- the same under a shared prefix, with chat turns
SHARED = "You are a careful assistant. Answer briefly and precisely, in plain words. " * 3
CHAT_SAMPLING = pb.SamplingParams(max_new_tokens=8)


def _chat(stub, prompt, ref, rng):
    """Two message turns on a session, the second equal to a stateless request on the conversation."""
    sid = stub.Start(pb.StartRequest()).session_id
    conversation = pb.ChatMessages()
    for question in (prompt, "And then?"):
        turn = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=question)])
        got = list(stub.Generate(pb.GenerateRequest(session_id=sid, messages=turn, sampling=CHAT_SAMPLING)))
        conversation.messages.add(role="user", content=question)
        want = list(stub.Generate(pb.GenerateRequest(messages=conversation, sampling=CHAT_SAMPLING)))
        assert [t for m in got for t in m.token_ids] == [t for m in want for t in m.token_ids]
        conversation.messages.add(role="assistant", content="".join(m.text for m in got))
    stub.End(pb.EndRequest(session_id=sid))


@pytest.fixture(scope="module")
def shared_references(server2) -> dict[str, list[int]]:
    engine = server2.engine
    return {
        SHARED + p: engine.generate(
            engine.tokenizer.encode(SHARED + p), SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
        ).token_ids
        for p in PROMPTS
    }


@pytest.mark.parametrize("round_", range(3))
def test_streams_sharing_a_prefix_with_chats_cancels_and_ends(server2, shared_references, round_):
    """Prefix-cache hits, shared blocks released by cancels, ends and disconnects, chat re-renders: every
    stream's tokens as when run alone, and every block free afterwards."""
    before = run_plan(server2, ACTIONS + [_chat], shared_references, 100 + round_)
    assert server2.info().prefix_cache_hit_tokens > before.prefix_cache_hit_tokens
