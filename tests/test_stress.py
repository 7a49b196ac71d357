"""Many concurrent streams over two engine loops with cancels, session ends and client disconnects mixed in."""

from __future__ import annotations

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
