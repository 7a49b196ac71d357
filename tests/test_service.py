"""The Inference service over real gRPC on loopback: streams, sessions, cancellation, errors."""

from __future__ import annotations

import asyncio
import itertools
import socket
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from lmgate.engine.gateway.request import RequestOutput
from lmgate.engine.sampling.sampler import SamplingParams
from lmgate.service.server import max_request_bytes
from lmgate.service.servicer import MAX_TOKENS_PER_MESSAGE, queued_behind
from lmgate.v1 import lmgate_pb2 as pb
from lmgate.v1 import lmgate_pb2_grpc as pb_grpc
from tests.serving import serve_process

GREEDY = pb.SamplingParams(max_new_tokens=24, ignore_eos=True)
GUARD = 300  # seconds: a guard against a hang, never a performance bound
LONG = pb.SamplingParams(max_new_tokens=2000, ignore_eos=True)


@pytest.fixture(params=["server", "thread_ranks_server", "process_ranks_server"])
def served(request):
    """The session, cancel and end tests run on one engine loop, two as threads, and two as processes."""
    return request.getfixturevalue(request.param)


def collect(stream) -> tuple[list[int], str, pb.GenerateResponse]:
    ids, text, last = [], "", None
    for msg in stream:
        ids += msg.token_ids
        text += msg.text
        last = msg
    return ids, text, last


def chat(text: str) -> pb.ChatMessages:
    return pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=text)])


def wait_first_token(stream) -> pb.GenerateResponse:
    for msg in stream:
        if msg.token_ids:
            return msg
    raise AssertionError("stream ended before its first token")


def test_generate_stateless_matches_engine(server):
    ids, text, last = collect(
        server.stub().Generate(pb.GenerateRequest(messages=chat("Tell me about owls."), sampling=GREEDY))
    )
    prompt = server.engine.tokenizer.encode(
        server.engine.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about owls."}]),
        add_special_tokens=False,
    )
    ref = server.engine.generate(prompt, SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert ids == ref.token_ids
    assert text == server.engine.tokenizer.decode(ids)
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert last.usage.completion_tokens == 24 and last.usage.prompt_tokens == len(prompt)


def test_logprobs_name_each_token_and_alternative_by_its_text(server):
    """As OpenAI's logprobs do: each token's text (its leading space kept, U+FFFD for part of a character),
    and the alternatives'; the tokens' texts make the reply's text where no character is split."""
    request = pb.GenerateRequest(
        prompt="The capital of France is", sampling=pb.SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=3)
    )
    messages = list(server.stub().Generate(request))
    logprobs = [lp for m in messages for lp in m.logprobs]
    tok = server.engine.tokenizer
    assert [lp.token for lp in logprobs] == [
        tok.decode([tok.encode("a", False)[-1], lp.token_id])[1:] for lp in logprobs
    ]
    assert "".join(lp.token for lp in logprobs) == "".join(m.text for m in messages)
    assert any(lp.token.startswith(" ") for lp in logprobs)
    for lp in logprobs:
        assert [t.token for t in lp.top] == [tok.token_text(t.token_id) for t in lp.top] and all(
            t.token for t in lp.top
        )


def test_token_text_keeps_a_sentencepiece_space_and_marks_split_characters(tmp_path):
    import gguf

    from lmgate.engine.text.tokenizer import Tokenizer
    from tests.test_tokenizer import _tiny_llama_gguf

    _tiny_llama_gguf(str(tmp_path / "tiny.gguf"))
    tok = Tokenizer.from_gguf(gguf.GGUFReader(str(tmp_path / "tiny.gguf")))
    world, *emoji = tok.encode(" world🙂", add_special_tokens=False)
    assert tok.decode([world]) == "world" and tok.token_text(world) == " world"
    assert [tok.token_text(i) for i in emoji] == ["\ufffd"] * 4
    assert tok.token_text(tok.eos_token_ids and min(tok.eos_token_ids)) == "</s>"


def test_serve_stream_interval_sends_fewer_messages_with_the_same_tokens(server):
    """`lmgate serve --stream-interval 3`: the first token alone, then three a message (outputs that queue up
    behind a slow reader go as one), the same tokens as the default's one a message. The server's engine loop
    is a rank process that overlaps its steps (the defaults on CUDA)."""
    request = pb.GenerateRequest(tokens=pb.TokenIds(ids=[504, 3575, 282]), sampling=GREEDY)
    proc, address = serve_process(
        "--dtype",
        "float32",
        "--kv-cache-tokens",
        "1024",
        "--stream-interval",
        "3",
        "--dp-backend",
        "process",
        "--overlap-scheduling",
        "on",
    )
    try:
        with grpc.insecure_channel(address) as channel:
            msgs = list(pb_grpc.InferenceStub(channel).Generate(request))
    finally:
        proc.terminate()
        proc.wait()
    sent = list(itertools.accumulate(len(m.token_ids) for m in msgs))  # a slow reader may get outputs merged
    assert len(sent) > 1 and set(sent) <= {1, 4, 7, 10, 13, 16, 19, 22, 24}
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert [t for m in msgs for t in m.token_ids] == collect(server.stub().Generate(request))[0]


def test_serve_session_idle_timeout_ends_sessions_their_clients_left():
    """`lmgate serve --session-idle-timeout 2`: a session left without End is ended once idle that long, as
    End would end it: its KV freed, Info no longer counting it, its next turn NOT_FOUND; and counted."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        metrics_port = sock.getsockname()[1]
    proc, address = serve_process(
        "--dtype",
        "float32",
        "--kv-cache-tokens",
        "1024",
        "--session-idle-timeout",
        "2",
        "--metrics-port",
        str(metrics_port),
    )
    try:
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.InferenceStub(channel)
            sid = stub.Start(pb.StartRequest()).session_id
            collect(stub.Generate(pb.GenerateRequest(session_id=sid, prompt="Hello", sampling=GREEDY)))
            guard = time.monotonic() + GUARD  # a guard against a hang, not a timing
            info = stub.Info(pb.InfoRequest())
            while (info.active_sessions or info.kv_blocks_free != info.kv_blocks_total) and time.monotonic() < guard:
                time.sleep(0.1)
                info = stub.Info(pb.InfoRequest())
            assert info.active_sessions == 0 and info.kv_blocks_free == info.kv_blocks_total
            with pytest.raises(grpc.RpcError) as err:
                collect(stub.Generate(pb.GenerateRequest(session_id=sid, prompt=" Again", sampling=GREEDY)))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read().decode()
        assert [
            s.value
            for f in text_string_to_metric_families(metrics)
            for s in f.samples
            if s.name == "lmgate_sessions_expired_total"
        ] == [1]
    finally:
        proc.terminate()
        proc.wait()


def test_generate_echoes_request_id_and_accepts_token_ids(server):
    msgs = list(
        server.stub().Generate(
            pb.GenerateRequest(request_id="r-1", tokens=pb.TokenIds(ids=[504, 3575, 282]), sampling=GREEDY)
        )
    )
    assert {m.request_id for m in msgs} == {"r-1"}
    assert sum(len(m.token_ids) for m in msgs) == 24


def test_session_two_turns_reuse_history(served):
    stub = served.stub()
    sid = stub.Start(pb.StartRequest()).session_id
    turn1 = [504, 3575, 282, 4649, 314]
    turn2 = [1060, 314, 253]
    out1, _, _ = collect(
        stub.Generate(pb.GenerateRequest(session_id=sid, tokens=pb.TokenIds(ids=turn1), sampling=GREEDY))
    )
    out2, _, last2 = collect(
        stub.Generate(pb.GenerateRequest(session_id=sid, tokens=pb.TokenIds(ids=turn2), sampling=GREEDY))
    )
    ref, _, _ = collect(
        stub.Generate(pb.GenerateRequest(tokens=pb.TokenIds(ids=turn1 + out1 + turn2), sampling=GREEDY))
    )
    assert out2 == ref
    assert last2.usage.cached_tokens >= len(turn1) + len(out1) - 1
    assert last2.usage.prompt_tokens == len(turn1) + len(out1) + len(turn2)
    stub.End(pb.EndRequest(session_id=sid))


def test_chat_session_turns_equal_stateless_conversation(served):
    """The README's two-turn chat: each turn sends its new messages, the session renders the conversation."""
    stub = served.stub()
    sid = stub.Start(pb.StartRequest()).session_id
    chat_params = pb.SamplingParams(max_new_tokens=24)
    conversation = pb.ChatMessages()
    for question in ("Name a large city in Italy.", "And one in Spain?"):
        got, text, last = collect(
            stub.Generate(pb.GenerateRequest(session_id=sid, messages=chat(question), sampling=chat_params))
        )
        conversation.messages.add(role="user", content=question)
        want, _, want_last = collect(stub.Generate(pb.GenerateRequest(messages=conversation, sampling=chat_params)))
        assert got == want and last.usage.prompt_tokens == want_last.usage.prompt_tokens
        conversation.messages.add(role="assistant", content=text)
    assert last.usage.cached_tokens > 0
    stub.End(pb.EndRequest(session_id=sid))


def test_info_says_dtype_and_why(server):
    info = server.info()
    assert info.dtype == "float32" and info.dtype_reason == "asked for float32"
    assert info.kv_cache_dtype == "float32"  # auto: the model's


def test_cancel_mid_stream_keeps_history(served):
    stub = served.stub()
    sid = stub.Start(pb.StartRequest()).session_id
    stream = stub.Generate(
        pb.GenerateRequest(session_id=sid, request_id="to-cancel", prompt="Count to one thousand:", sampling=LONG)
    )
    first = wait_first_token(stream)
    assert stub.Cancel(pb.CancelRequest(request_id="to-cancel")).cancelled
    ids, _, last = collect(stream)
    assert last.finish_reason == pb.FINISH_REASON_CANCELLED
    generated = len(first.token_ids) + len(ids)
    _, _, nxt = collect(stub.Generate(pb.GenerateRequest(session_id=sid, prompt=" And then?", sampling=GREEDY)))
    assert nxt.finish_reason == pb.FINISH_REASON_LENGTH
    assert nxt.usage.cached_tokens >= generated  # the cancelled turn's tokens stayed in the history
    stub.End(pb.EndRequest(session_id=sid))


def test_next_turn_follows_a_cancel_at_once(served):
    """Cancel, then the session's next turn at once, before the cancelled stream's last message has come: the
    next turn starts after the cancelled one (not FAILED_PRECONDITION), its history included."""
    stub = served.stub()
    sid = stub.Start(pb.StartRequest()).session_id
    for _ in range(5):
        stream = stub.Generate(pb.GenerateRequest(session_id=sid, prompt=" Count to one thousand:", sampling=LONG))
        seen = len(wait_first_token(stream).token_ids)
        assert stub.Cancel(pb.CancelRequest(session_id=sid)).cancelled
        _, _, nxt = collect(stub.Generate(pb.GenerateRequest(session_id=sid, prompt=" And then?", sampling=GREEDY)))
        assert nxt.finish_reason == pb.FINISH_REASON_LENGTH
        assert nxt.usage.cached_tokens >= seen  # the cancelled turn's tokens are in the history it continues
        assert collect(stream)[2].finish_reason == pb.FINISH_REASON_CANCELLED
    stub.End(pb.EndRequest(session_id=sid))
    assert_idle(served)


def test_cancel_by_session(served):
    stub = served.stub()
    sid = stub.Start(pb.StartRequest()).session_id
    stream = stub.Generate(pb.GenerateRequest(session_id=sid, prompt="Once upon a time", sampling=LONG))
    wait_first_token(stream)
    assert stub.Cancel(pb.CancelRequest(session_id=sid)).cancelled
    assert collect(stream)[2].finish_reason == pb.FINISH_REASON_CANCELLED
    assert not stub.Cancel(pb.CancelRequest(session_id=sid)).cancelled
    stub.End(pb.EndRequest(session_id=sid))


def test_end_during_stream_cancels_and_forgets(served):
    stub = served.stub()
    sid = stub.Start(pb.StartRequest()).session_id
    stream = stub.Generate(pb.GenerateRequest(session_id=sid, prompt="Once upon a time", sampling=LONG))
    wait_first_token(stream)
    stub.End(pb.EndRequest(session_id=sid))
    assert collect(stream)[2].finish_reason == pb.FINISH_REASON_CANCELLED
    with pytest.raises(grpc.RpcError) as err:
        collect(stub.Generate(pb.GenerateRequest(session_id=sid, prompt="hello", sampling=GREEDY)))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    stub.End(pb.EndRequest(session_id=sid))  # idempotent
    with pytest.raises(grpc.RpcError) as err:
        stub.Cancel(pb.CancelRequest(session_id=sid))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_concurrent_generate_on_one_session_refused(served):
    stub = served.stub()
    sid = stub.Start(pb.StartRequest()).session_id
    first = stub.Generate(pb.GenerateRequest(session_id=sid, prompt="Once upon a time", sampling=LONG))
    wait_first_token(first)
    with pytest.raises(grpc.RpcError) as err:
        collect(stub.Generate(pb.GenerateRequest(session_id=sid, prompt="again", sampling=GREEDY)))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert stub.Cancel(pb.CancelRequest(session_id=sid)).cancelled  # it was still running all along
    assert collect(first)[2].finish_reason == pb.FINISH_REASON_CANCELLED
    stub.End(pb.EndRequest(session_id=sid))


def test_start_existing_session_already_exists(served):
    stub = served.stub()
    stub.Start(pb.StartRequest(session_id=4242))
    with pytest.raises(grpc.RpcError) as err:
        stub.Start(pb.StartRequest(session_id=4242))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    stub.End(pb.EndRequest(session_id=4242))


def test_deadline_cancels_and_frees_kv(served):
    stub = served.stub()
    with pytest.raises(grpc.RpcError) as err:
        collect(stub.Generate(pb.GenerateRequest(prompt="Once upon a time", sampling=LONG), timeout=1.0))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_idle(served)


BAD_REQUESTS = [
    (pb.GenerateRequest(prompt=""), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(tokens=pb.TokenIds(ids=[])), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(tokens=pb.TokenIds(ids=[10, 999999])), grpc.StatusCode.INVALID_ARGUMENT),
    (
        pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="wizard", content="hi")])),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    (pb.GenerateRequest(messages=pb.ChatMessages()), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(temperature=-1)), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(top_p=float("nan"))), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(top_k=-2)), grpc.StatusCode.INVALID_ARGUMENT),
    (
        pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(repetition_penalty=float("inf"))),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    (
        pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_new_tokens=4, min_new_tokens=8)),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(logprobs=500)), grpc.StatusCode.INVALID_ARGUMENT),
    (
        pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(stop_token_ids=[10**6])),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(stop=[""])), grpc.StatusCode.INVALID_ARGUMENT),
    (
        pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(stop_token_ids=range(257))),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_new_tokens=10**6)), grpc.StatusCode.OUT_OF_RANGE),
    (pb.GenerateRequest(tokens=pb.TokenIds(ids=[10] * 9000)), grpc.StatusCode.OUT_OF_RANGE),
    (pb.GenerateRequest(prompt="x" * (5 * 2**20)), grpc.StatusCode.RESOURCE_EXHAUSTED),  # past the 4 MiB limit
    (pb.GenerateRequest(session_id=987654321, prompt="hi"), grpc.StatusCode.NOT_FOUND),
    (pb.GenerateRequest(request_id="x" * 257, prompt="hi"), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(prompt="hi", session_epoch=3), grpc.StatusCode.INVALID_ARGUMENT),  # no session
    (
        pb.GenerateRequest(request_id="a\n12:00:00 INFO lmgate.access: request_id=forged", prompt="hi"),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
]


def test_the_request_size_limit_grows_with_the_context_window():
    """gRPC's 4 MiB, unless a prompt that fits a long context window could be longer (README: Errors)."""
    assert max_request_bytes(8192) == 4 * 2**20
    assert max_request_bytes(1_048_576) == 64 * 2**20


@pytest.mark.parametrize("request_, code", BAD_REQUESTS)
def test_bad_generate_gets_status_and_changes_nothing(served, request_, code):
    before = served.info()
    with pytest.raises(grpc.RpcError) as err:
        collect(served.stub().Generate(request_))
    assert err.value.code() == code
    assert err.value.details()
    assert_idle(served, before)


def test_session_rpcs_answer_bad_values_with_documented_statuses(served):
    stub = served.stub()
    before = served.info()
    sid = stub.Start(pb.StartRequest()).session_id
    cases = [
        (lambda: stub.End(pb.EndRequest()), grpc.StatusCode.INVALID_ARGUMENT),  # no session id
        (lambda: stub.Cancel(pb.CancelRequest(session_id=987654321)), grpc.StatusCode.NOT_FOUND),
        (lambda: stub.Start(pb.StartRequest(session_id=sid)), grpc.StatusCode.ALREADY_EXISTS),
        (lambda: list(stub.Generate(pb.GenerateRequest(session_id=987654321, prompt="hi"))), grpc.StatusCode.NOT_FOUND),
    ]
    for call, code in cases:
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == code and err.value.details()
    stub.End(pb.EndRequest(session_id=987654321))  # ending an unknown session is a no-op, as End is idempotent
    stub.End(pb.EndRequest(session_id=sid))
    assert stub.Tokenize(pb.TokenizeRequest(text="")).token_ids == []
    assert_idle(served, before)


def test_cancel_without_target_invalid(server):
    with pytest.raises(grpc.RpcError) as err:
        server.stub().Cancel(pb.CancelRequest())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not server.stub().Cancel(pb.CancelRequest(request_id="nobody")).cancelled


def test_tokenize_matches_engine(server):
    ids = server.stub().Tokenize(pb.TokenizeRequest(text="Hello, world! 123")).token_ids
    assert list(ids) == server.engine.tokenizer.encode("Hello, world! 123", add_special_tokens=False)


def test_reflection_lists_both_services_and_health_serving(server):
    with server.channel() as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        reply = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in reply.list_services_response.service}
        assert {"lmgate.v1.Inference", "lmgate.v1.Admin", "grpc.health.v1.Health"} <= names
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "lmgate.v1.Inference"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
            assert status == health_pb2.HealthCheckResponse.SERVING


def assert_idle(server, before: pb.InfoResponse | None = None) -> None:
    """All KV blocks free and nothing running once in-flight cancellations have landed."""
    guard = time.monotonic() + 60  # time for those cancellations on a slow machine, not a timing
    info = server.info()
    while (
        info.kv_blocks_free != info.kv_blocks_total or info.running_requests or info.waiting_requests
    ) and time.monotonic() < guard:
        threading.Event().wait(0.05)
        info = server.info()
    assert info.kv_blocks_free == info.kv_blocks_total
    assert info.running_requests == 0 and info.waiting_requests == 0
    if before is not None:
        assert info.active_sessions == before.active_sessions


def test_full_queue_resource_exhausted_and_changes_nothing(checkpoint):
    """One batch slot and room for two waiting requests: the fourth stream is refused at once."""
    from lmgate.engine.config import EngineConfig
    from tests.serving import ServerThread

    small = ServerThread(
        EngineConfig(dtype="float32", kv_cache_tokens=2048, max_batch_size=1, max_queued_requests=2), checkpoint
    )
    try:
        stub = small.stub()
        sid = stub.Start(pb.StartRequest()).session_id
        running = stub.Generate(pb.GenerateRequest(prompt="Once upon a time", sampling=LONG))
        wait_first_token(running)
        queued = [stub.Generate(pb.GenerateRequest(prompt=f"Story {i}:", sampling=GREEDY)) for i in range(2)]
        while small.info().queued_requests < 2:  # the batch is full, so both stay queued
            threading.Event().wait(0.01)
        before = small.info()
        with pytest.raises(grpc.RpcError) as err:
            collect(stub.Generate(pb.GenerateRequest(session_id=sid, prompt="one more", sampling=GREEDY)))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry" in err.value.details()
        after = small.info()  # (the running stream's KV grows meanwhile: it is checked once everything ends)
        assert (after.queued_requests, after.active_sessions) == (before.queued_requests, before.active_sessions)
        # The refused turn left the session free: once there is room, it runs.
        running.cancel()
        assert [collect(q)[2].finish_reason for q in queued] == [pb.FINISH_REASON_LENGTH] * 2
        assert (
            collect(stub.Generate(pb.GenerateRequest(session_id=sid, prompt="one more", sampling=GREEDY)))[
                2
            ].finish_reason
            == pb.FINISH_REASON_LENGTH
        )
        stub.End(pb.EndRequest(session_id=sid))
        assert_idle(small)
    finally:
        small.stop()


def test_a_slow_clients_backlog_goes_in_messages_of_bounded_size():
    """Outputs that queued while the client was slow go as one message, but one of at most about
    MAX_TOKENS_PER_MESSAGE tokens: a long backlog with logprobs would pass a client's limit on a message."""

    async def batches() -> list[int]:
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        for _ in range(2 * MAX_TOKENS_PER_MESSAGE + 1):
            outputs.put_nowait(RequestOutput("r", 0, token_ids=[7]))
        sizes = []
        while not outputs.empty():
            sizes.append(len(queued_behind(outputs.get_nowait(), outputs)))
        return sizes

    assert asyncio.run(batches()) == [MAX_TOKENS_PER_MESSAGE, MAX_TOKENS_PER_MESSAGE, 1]


@pytest.mark.parametrize("by", ["request_id", "session_id"])
def test_a_cancel_while_the_prompt_is_encoded_cancels_the_turn(server, monkeypatch, by):
    """A prompt is encoded on a worker thread (a long one takes seconds): a Cancel that comes meanwhile says it
    cancelled, and the turn ends CANCELLED once submitted, rather than running on unasked."""
    engine, servicer = server.engine, server.server.inference
    submit, go_on = engine.submit, threading.Event()

    def slow_submit(*args, **kwargs):
        assert go_on.wait(GUARD)  # as a long prompt's encoding would take
        return submit(*args, **kwargs)

    monkeypatch.setattr(engine, "submit", slow_submit)
    stub = server.stub()
    sid = stub.Start(pb.StartRequest()).session_id
    try:
        stream = stub.Generate(
            pb.GenerateRequest(session_id=sid, request_id="encoding", prompt="Count to a thousand:", sampling=LONG),
            timeout=GUARD,
        )
        deadline = time.monotonic() + GUARD  # a guard against a hang only
        while "encoding" not in servicer._submitting:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        target = pb.CancelRequest(request_id="encoding") if by == "request_id" else pb.CancelRequest(session_id=sid)
        assert stub.Cancel(target).cancelled
    finally:
        go_on.set()
    assert [m.finish_reason for m in stream][-1] == pb.FINISH_REASON_CANCELLED
    stub.End(pb.EndRequest(session_id=sid))
