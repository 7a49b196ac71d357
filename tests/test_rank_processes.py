"""Data-parallel ranks as processes: what only processes have (spawned ranks, a rank killed or hung mid-stream).

The session, cancel, end, sleep and stress tests run over processes too, through the `server2`, `served` and
`sleepy` fixtures."""

from __future__ import annotations

import dataclasses
import errno
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.context import SpawnProcess
from typing import Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lmgate.engine.config import DP_BACKENDS, EngineConfig
from lmgate.engine.engine import Engine
from lmgate.engine.loading.loader import embedded_model_path
from lmgate.engine.errors import InternalError, InvalidRequest, Unavailable
from lmgate.engine.gateway.request import (
    CancelFlag,
    FinishReason,
    Request,
    RequestKind,
    RequestOutput,
    StopFound,
    TokenLogprob,
    Usage,
    token_output,
)
from lmgate.engine.ranks.rank_process import Outbox, RankGateway, from_wire, to_wire
from lmgate.engine.sampling.sampler import SamplingParams
from lmgate.engine.text.chat import render_ids
from lmgate.engine.text.detokenizer import IncrementalDetokenizer, reply_context
from lmgate.v1 import lmgate_pb2 as pb
from lmgate.v1 import lmgate_pb2_grpc as pb_grpc
from tests.serving import StreamEnds, free_port, serve_process

LONG = pb.SamplingParams(max_new_tokens=4000, ignore_eos=True)
GUARD = 300  # seconds: a guard against a hang, far above what any run takes, never a performance bound


def rank_pids(pid: int) -> list[int]:
    """The serving process's spawned children (multiprocessing's spawn runs them with `spawn_main`)."""
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            children += [int(c) for c in f.read().split()]
    ranks = []
    for child in children:
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                ranks.append(child)
    return sorted(ranks)


def test_each_rank_is_a_process_and_info_counts_them_all(process_ranks_server, server):
    info = process_ranks_server.info()
    assert info.engine_loops == 2 and info.kv_blocks_total == 2 * 8192 // info.kv_block_size
    assert info.weights_bytes == 2 * server.info().weights_bytes > 0  # each rank holds its own copy of the weights
    assert len(rank_pids(os.getpid())) >= 2


def test_an_output_crosses_the_pipe_whole():
    """Every field of a RequestOutput survives the pickling a rank's outputs cross to the server by."""
    full = RequestOutput(
        "r-1",
        7,
        token_ids=[5, 6],
        text="hi",
        logprobs=[TokenLogprob(5, -0.5, [(5, -0.5), (9, -1.0)])],
        finish_reason=FinishReason.LENGTH,
        usage=Usage(3, 2, 1, 0.25),
        text_context=[11, 12],
    )
    failed = RequestOutput("r-2", 0, error=Unavailable("engine rank 0 has gone"))
    for output in (full, failed, RequestOutput("r-3", 0)):
        copy = pickle.loads(pickle.dumps(output))
        assert (
            copy.request_id,
            copy.session_id,
            copy.token_ids,
            copy.text,
            copy.logprobs,
            copy.finish_reason,
            copy.usage,
            copy.text_context,
        ) == (
            output.request_id,
            output.session_id,
            output.token_ids,
            output.text,
            output.logprobs,
            output.finish_reason,
            output.usage,
            output.text_context,
        )
        assert type(copy.error) is type(output.error) and str(copy.error) == str(output.error)


def test_an_output_of_token_ids_alone_crosses_as_a_tuple_and_any_other_whole():
    """`to_wire`: an output of token ids (with its ids, index and weights) crosses as a tuple of those fields, and
    arrives equal; one with any other field set crosses as itself. Each field is tried on its own, so a field
    added to RequestOutput that `only_tokens` does not know of fails here."""
    plain = RequestOutput("r-1", 7, [5, 6], index=2, weight_version="v3")
    others = {
        "text": "hi",
        "logprobs": [TokenLogprob(5, -0.5, [])],
        "finish_reason": FinishReason.STOP,
        "usage": Usage(3, 2, 1, 0.25),
        "error": Unavailable("gone"),
        "others_running": True,
        "prompt_logprobs": [],
        "stop_string": "x",
        "handled": 1,
        "text_context": [],
    }
    kept = {"request_id", "session_id", "token_ids", "index", "weight_version"}
    assert {f.name for f in dataclasses.fields(RequestOutput)} == kept | set(others)
    item = pickle.loads(pickle.dumps(to_wire(4, plain)))
    assert len(item) == 6 and from_wire(item) == (4, plain)
    for name, value in others.items():
        output = dataclasses.replace(plain, **{name: value})
        assert not output.only_tokens, name
        wire_id, copy = from_wire(pickle.loads(pickle.dumps(to_wire(4, output))))
        assert wire_id == 4 and getattr(copy, name) is not None and copy.token_ids == [5, 6], name


def test_a_ranks_outputs_leave_in_order_as_to_wire_makes_them_one_message_a_delivery():
    """A rank's signal thread makes the wire item of a token delta itself (no output, no callback): what arrives
    is what `to_wire` of each output would send, in the order delivered, token deltas and whole outputs mixed."""
    import zmq

    context = zmq.Context.instance()
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    pull.bind("inproc://rank-outputs")
    push.connect("inproc://rank-outputs")
    outbox = Outbox(push, rank=0)
    gateway = RankGateway(0, 1, 16, outbox)
    a, b = (Request(RequestKind.GENERATE, i, outbox.collector(10 + i), request_id=f"r{i}") for i in (1, 2))
    for request in (a, b):  # as its loop took it
        request.cancel_flag.compare_exchange(CancelFlag.QUEUED, CancelFlag.ACTIVE)
    last = RequestOutput("r1", 1, [9], finish_reason=FinishReason.LENGTH, index=0, weight_version="v2")
    try:
        gateway._deliver_all([(a, 7, 0, "v1"), (b, 8, 1, "v1"), (a, last), (b, 5, 1, "v2")])
        kind, rank, _, items = pull.recv_pyobj()
    finally:
        pull.close(linger=0)
        push.close(linger=0)
    assert (kind, rank) == ("outputs", 0)
    want = [
        (11, token_output("r1", 1, [7], 0, "v1")),
        (12, token_output("r2", 2, [8], 1, "v1")),
        (11, last),
        (12, token_output("r2", 2, [5], 1, "v2")),
    ]
    assert items == [to_wire(*pair) for pair in want] and [from_wire(item) for item in items] == want
    assert last.finish_reason is FinishReason.LENGTH and a.cancel_flag.value == CancelFlag.FINISHED


def test_the_serving_process_writes_the_text_a_ranks_loop_leaves_it(process_ranks_server, monkeypatch):
    """A rank's loop leaves the text of its samples to the serving process, whose signal thread writes it
    (`gateway.detokenize`), stop strings or not: the rank writes none. Delta by delta the text is the same, with
    stop strings (which hold back a tail that could start one) and without, characters split over tokens
    included; a stop id's text is left out."""
    engine = process_ranks_server.engine
    tokenizer, threads = engine.tokenizer, []
    step_one = IncrementalDetokenizer.step_one

    def recorded(self, token_id):
        threads.append(threading.current_thread().name)
        return step_one(self, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "step_one", recorded)
    prompt = tokenizer.encode(" ".join(["Да добро"] * 6))
    greedy = SamplingParams(max_new_tokens=32, ignore_eos=True)
    front = list(engine.submit(prompt, greedy))
    front_threads, threads[:] = set(threads), []
    ranks = list(engine.submit(prompt, dataclasses.replace(greedy, stop=("never-in-this-text",))))
    assert front_threads == set(threads) == {"lmgate-signal"}
    ids = [t for o in front for t in o.token_ids]
    assert ids == [t for o in ranks for t in o.token_ids]
    assert "".join(o.text for o in front) == "".join(o.text for o in ranks) == tokenizer.decode(ids)
    k = ids.index(ids[10])  # a stop id's first appearance
    out = engine.generate(prompt, SamplingParams(max_new_tokens=32, stop_token_ids=(ids[k],)))
    assert out.finish_reason is FinishReason.STOP and out.token_ids == ids[: k + 1]
    assert out.text == tokenizer.decode(ids[:k])


@pytest.mark.parametrize("ranks", ["thread_ranks_server", "process_ranks_server"])
def test_a_caller_that_reads_ids_only_gets_no_text_but_its_stop_strings_still_stop(ranks, request, monkeypatch):
    """`submit(text=False)` (the gateway's worker protocol reads ids): no text is written for it, neither by a
    loop nor by the serving process, and its ids are those of a caller that reads text; a stop string still
    ends it where the text shows it, and then its text is written (its loop reads it)."""
    engine = request.getfixturevalue(ranks).engine
    calls = []
    step_one = IncrementalDetokenizer.step_one

    def recorded(self, token_id):
        calls.append(token_id)
        return step_one(self, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "step_one", recorded)
    prompt = engine.tokenizer.encode("Once upon a time")
    greedy = SamplingParams(max_new_tokens=24, ignore_eos=True)
    with_text = list(engine.submit(prompt, greedy))
    calls.clear()
    ids_only = list(engine.submit(prompt, greedy, text=False))
    assert calls == [] and all(o.text == "" for o in ids_only)  # nothing written, in this process or a rank's
    assert [t for o in ids_only for t in o.token_ids] == [t for o in with_text for t in o.token_ids]
    text = "".join(o.text for o in with_text)
    word = text[10:14]
    stop = dataclasses.replace(greedy, stop=(word,))
    stopped = [list(engine.submit(prompt, stop, text=reads)) for reads in (True, False)]
    assert [[t for o in run for t in o.token_ids] for run in stopped[1:]] == [
        [t for o in stopped[0] for t in o.token_ids]
    ]
    assert stopped[1][-1].stop_string == word and stopped[1][-1].finish_reason is FinishReason.STOP
    assert "".join(o.text for o in stopped[1]) == "".join(o.text for o in stopped[0]) == text[: text.index(word)]


def cut_at_stop(tokenizer, prompt: list[int], ids: list[int], stop: str) -> tuple[int, str]:
    """Where a loop that writes the text stops `ids` on `stop`: the tokens kept (through the one that completes
    it) and the text before it."""
    return cut_at_stop_strings(tokenizer, reply_context(tokenizer, prompt), ids, (stop,))


def cut_at_stop_strings(tokenizer, context: list[int], ids: list[int], stops: tuple[str, ...]) -> tuple[int, str]:
    detokenizer = IncrementalDetokenizer(tokenizer, True, stops, context=context)
    text = ""
    for n, token in enumerate(ids, 1):
        delta, hit = detokenizer.step_one(token)
        text += delta
        if hit:
            return n, text
    raise AssertionError(f"{stops!r} are not in the text")


def test_the_serving_process_finds_a_stop_string_and_its_rank_ends_the_sample_there(process_ranks_server):
    """The serving process finds the stop strings in the text it writes: the client gets the tokens through the
    one that completed a stop string (and their log-probabilities) and the text before it, STOP with that
    string, and usage counting those tokens, as from a loop that writes its text; the rank ends the sample there, long before its length (the
    tokens drawn before it heard never reach the client). Of n samples, each ends at its own."""
    engine = process_ranks_server.engine
    tokenizer = engine.tokenizer
    prompt = "Once upon a time"
    prompt_ids = tokenizer.encode(prompt)
    free = engine.generate(prompt, SamplingParams(max_new_tokens=48, ignore_eos=True))
    stop = free.text[20:24]
    kept, text = cut_at_stop(tokenizer, prompt_ids, free.token_ids, stop)
    long = SamplingParams(max_new_tokens=2000, ignore_eos=True, stop=(stop,), logprobs=1)
    before = engine.info().computed_tokens
    outputs = list(engine.submit(prompt, long))
    computed = engine.info().computed_tokens - before
    last = outputs[-1]
    assert [t for o in outputs for t in o.token_ids] == free.token_ids[:kept]
    assert [lp.token_id for o in outputs for lp in o.logprobs] == free.token_ids[:kept]
    assert "".join(o.text for o in outputs) == text == free.text[: free.text.index(stop)]
    assert (last.finish_reason, last.stop_string, last.usage.completion_tokens) == (FinishReason.STOP, stop, kept)
    assert all(o.finish_reason is None for o in outputs[:-1])
    assert computed < len(prompt_ids) + 1000  # its rank ended it: 2000 tokens unstopped
    seeded = SamplingParams(max_new_tokens=40, temperature=1.0, seed=7, n=2, ignore_eos=True)
    samples = engine.generate_samples(prompt, seeded)
    stopped = engine.generate_samples(prompt, dataclasses.replace(seeded, stop=("e",)))
    for free_sample, sample in zip(samples, stopped, strict=True):
        kept, text = cut_at_stop(tokenizer, prompt_ids, free_sample.token_ids, "e")
        assert (sample.token_ids, sample.text) == (free_sample.token_ids[:kept], text)
        assert (sample.finish_reason, sample.usage.completion_tokens) == (FinishReason.STOP, kept)


def test_a_session_turn_stopped_by_the_serving_process_leaves_history_through_its_stop(process_ranks_server):
    """A session's turn that the serving process stopped on a string leaves the session's history through the
    stop, as a turn of just those tokens would: the next turn's prompt counts them, and it goes on identically.
    Whether its rank hears of the stop before it ends the turn at its length (a token later) or after, the
    history is the same."""
    engine = process_ranks_server.engine
    prompt, follow = "Once upon a time", " And then"
    free = engine.generate(prompt, SamplingParams(max_new_tokens=48, ignore_eos=True))
    stop = free.text[20:24]
    kept, _ = cut_at_stop(engine.tokenizer, engine.tokenizer.encode(prompt), free.token_ids, stop)
    greedy = SamplingParams(max_new_tokens=16, ignore_eos=True)

    def next_turn(first: SamplingParams) -> tuple[list[int], int]:
        session = engine.start_session()
        try:
            engine.generate(prompt, first, session_id=session)
            out = engine.generate(follow, greedy, session_id=session)
            return out.token_ids, out.usage.prompt_tokens
        finally:
            engine.end_session(session)

    expected = next_turn(dataclasses.replace(greedy, max_new_tokens=kept))
    for length in (kept + 1, 2000):
        assert next_turn(dataclasses.replace(greedy, max_new_tokens=length, stop=(stop,))) == expected, length


def test_a_loop_cuts_only_the_turn_a_stop_string_was_found_in(thread_ranks_server, monkeypatch):
    """The loop's half of a stop string found by the front end, told to loops that are threads as a rank's
    receiver tells its loop (`Gateway.stop_found`): the history is cut after the ids kept of the turn it was
    found in, and not at all once a later turn has ended (a stop that came late, after a cancelled turn's
    next). A chat turn's reply, which the loop writes once at its end where the front end writes the text, is
    cut before the first stop string to complete: not before another stop string that begins earlier and that
    the tokens drawn past the stop complete."""
    engine = thread_ranks_server.engine
    for loop in engine.loops:
        monkeypatch.setattr(loop, "text_at_front_end", True)  # text and stop strings are the front end's
    greedy = SamplingParams(max_new_tokens=8, ignore_eos=True)

    def turn(session: int, prompt, params: SamplingParams = greedy) -> tuple[Request, RequestOutput]:
        """The turn's request, and its last output with all its tokens."""
        stream = engine.submit(prompt, params, session_id=session)
        outputs = list(stream)
        return stream.request, dataclasses.replace(outputs[-1], token_ids=[t for o in outputs for t in o.token_ids])

    def stop_found(session: int, request: Request, kept: int) -> None:
        rank = engine.gateway.binding.find(session)
        engine.gateway.stop_found(rank, StopFound(request, session, 0, kept))

    session = engine.start_session()
    more = len(engine.tokenizer.encode(" The end"))
    first, _ = turn(session, "Once upon a time")
    _, second = turn(session, " And then")
    stop_found(session, first, 2)  # late: the second turn has ended since
    third_request, third = turn(session, " The end")
    assert third.usage.prompt_tokens == second.usage.prompt_tokens + 8 + more
    stop_found(session, third_request, 3)
    _, fourth = turn(session, " The end")
    assert fourth.usage.prompt_tokens == third.usage.prompt_tokens + 3 + more
    engine.end_session(session)

    question = [{"role": "user", "content": "Tell me a story about a dragon."}]
    free = engine.generate(question, SamplingParams(max_new_tokens=24, ignore_eos=True))
    text = engine.tokenizer.decode(free.token_ids)
    at = text.index(text[12:14])
    inner, outer = text[at : at + 2], text[at - 3 : at + 8]  # a stop string inside one that begins earlier
    context = reply_context(engine.tokenizer, render_ids(engine.tokenizer, question))
    kept, reply = cut_at_stop_strings(engine.tokenizer, context, free.token_ids, (inner, outer))
    assert at >= 3 and reply == text[:at] and kept < 24  # the inner one completes first, its token kept
    session = engine.start_session()
    stopped, _ = turn(session, question, SamplingParams(max_new_tokens=24, ignore_eos=True, stop=(inner, outer)))
    stop_found(session, stopped, kept)
    follow = [{"role": "user", "content": "And then?"}]
    _, got = turn(session, follow)
    engine.end_session(session)
    want = engine.generate([*question, {"role": "assistant", "content": reply}, *follow], greedy)
    assert (got.usage.prompt_tokens, got.token_ids) == (want.usage.prompt_tokens, want.token_ids)


def test_a_detokenizer_that_fails_ends_its_stream_and_the_rank_ends_the_request(process_ranks_server, monkeypatch):
    """The serving process's signal thread survives a detokenizer that raises: that stream ends INTERNAL, the
    rank ends the request and frees its blocks, and the next request's text is written as before."""
    engine = process_ranks_server.engine

    def broken(self, token_id):
        raise RuntimeError("a broken decoder")

    monkeypatch.setattr(IncrementalDetokenizer, "step_one", broken)
    prompt = engine.tokenizer.encode("Once upon a time")
    with pytest.raises(InternalError, match="detokenizing"):
        list(engine.submit(prompt, SamplingParams(max_new_tokens=4000, ignore_eos=True)))
    monkeypatch.undo()
    deadline = time.monotonic() + GUARD
    while engine.info().running_sequences:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    info = engine.info()
    assert info.kv_blocks_free == info.kv_blocks_total
    out = engine.generate(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert out.text == engine.tokenizer.decode(out.token_ids)


def test_auto_takes_processes_on_cuda_only():
    """On a GPU the loop would share the server's GIL while it streams (README: "Ranks as processes")."""
    assert EngineConfig().dp_backend == "auto"
    assert not EngineConfig().rank_processes
    assert EngineConfig(device="cuda").rank_processes and EngineConfig(device="cuda:1").rank_processes
    assert not EngineConfig(device="cuda", dp_backend="thread").rank_processes
    assert EngineConfig(dp_backend="process").rank_processes
    with pytest.raises(InvalidRequest, match="dp_backend must be one of auto, thread, process"):
        EngineConfig(dp_backend="fibers")


def raised_on_a_thread(call: Callable[[], object]) -> BaseException | None:
    """What `call` raised, run on a daemon thread so that a call left waiting fails the test, not hangs it."""
    return on_a_thread(call)()


def on_a_thread(call: Callable[[], object]) -> Callable[[], BaseException | None]:
    """Start `call` on a daemon thread; what it returns waits for the call and gives what the call raised."""
    raised: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            raised.append(None)
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def result() -> BaseException | None:
        thread.join(GUARD)
        assert raised, "the call never returned"
        return raised[0]

    return result


@pytest.mark.parametrize("backend", DP_BACKENDS)
def test_admin_calls_after_shutdown_are_refused_not_left_waiting(checkpoint, backend):
    """Sleep, Wakeup and UpdateWeights wait for every rank to answer: once the ranks have gone, they get
    UNAVAILABLE. A weight call that slipped past the engine's check (racing with shutdown) too."""
    engine = Engine(EngineConfig(dtype="float32", kv_cache_tokens=512, dp_backend=backend), checkpoint=checkpoint)
    engine.shutdown()
    calls = [
        lambda: engine.sleep(1),
        engine.wakeup,
        lambda: engine.update_weights(embedded_model_path()),
        engine.ranks.restore_weights,
    ]  # as a Wakeup past the engine's check would: no model loaded again
    for call in calls:
        error = raised_on_a_thread(call)
        assert isinstance(error, Unavailable) and "shut down" in str(error), error


def test_a_wakeup_that_a_dead_rank_never_did_fails(checkpoint):
    """A rank dies holding a Wakeup's request: the Wakeup fails UNAVAILABLE, as no loop woke there. It once
    returned as if every rank had woken (and a Sleep so answered, as if every rank had freed its KV)."""
    engine = Engine(
        EngineConfig(dtype="float32", kv_cache_tokens=512, engine_loops=1, dp_backend="process"), checkpoint=checkpoint
    )  # one rank: no peer whose own failure answers the Wakeup first
    try:
        engine.sleep(1)
        rank = engine.ranks._procs[0].pid
        os.kill(rank, signal.SIGSTOP)  # it takes nothing off its socket, and answers nothing
        wakeup = on_a_thread(lambda: engine.wakeup(["kv_cache"]))
        deadline = time.monotonic() + GUARD
        while not any(r.kind is RequestKind.WAKE_KV for r in list(engine.ranks.queues[0]._inflight.values())):
            assert time.monotonic() < deadline, "the Wakeup never reached the rank"
            time.sleep(0.01)
        os.kill(rank, signal.SIGKILL)
        error = wakeup()
        assert isinstance(error, Unavailable) and "engine rank" in str(error), error
    finally:
        engine.shutdown()


def test_a_turn_that_cannot_cross_to_its_rank_is_refused_and_changes_nothing(process_ranks_server):
    """A library caller's chat message holding a value no pickle carries: the turn is refused, and the
    session's next turn runs (the refused one once left the session busy for ever)."""
    engine = process_ranks_server.engine
    sid = engine.start_session()
    try:
        with pytest.raises(InvalidRequest, match="cannot be sent"):
            engine.submit([{"role": "user", "content": "Hi", "lock": threading.Lock()}], session_id=sid)
        out = engine.generate(
            [{"role": "user", "content": "Hi"}], SamplingParams(max_new_tokens=2, ignore_eos=True), session_id=sid
        )
        assert len(out.token_ids) == 2
    finally:
        engine.end_session(sid)


def test_a_rank_that_cannot_start_takes_the_started_ones_with_it(checkpoint, monkeypatch):
    """The second rank's process cannot be made (no memory for it): the engine fails to start, and the first
    rank, already started, is killed and reaped, not left waiting for its peer (and for ever joined at exit)."""
    started = []
    start = SpawnProcess.start

    def start_or_fail(process: SpawnProcess) -> None:
        if started:
            raise OSError(errno.EAGAIN, "injected: no process can be made")
        start(process)
        started.append(process)

    monkeypatch.setattr(SpawnProcess, "start", start_or_fail)
    with pytest.raises(OSError, match="injected"):
        Engine(
            EngineConfig(dtype="float32", kv_cache_tokens=512, engine_loops=2, dp_backend="process"),
            checkpoint=checkpoint,
        )
    assert len(started) == 1 and started[0].exitcode is not None


def test_an_engine_shut_down_frees_its_master_port_at_once(checkpoint):
    """A fixed --master-port (as several nodes need): an engine started again on it right after a shutdown,
    while the old engine object lives on, binds it."""
    config = EngineConfig(dtype="float32", kv_cache_tokens=512, dp_backend="process", master_port=free_port())
    first = Engine(config, checkpoint=checkpoint)
    first.shutdown()
    second = Engine(config, checkpoint=checkpoint)
    try:
        assert len(second.generate([1, 2, 3], SamplingParams(max_new_tokens=2, ignore_eos=True)).token_ids) == 2
    finally:
        second.shutdown()
    assert first.failure is None


def listening_addresses(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net writes them) of every socket listening on TCP `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    found.append(address)
    return found


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads the listening sockets from /proc/net")
def test_on_one_machine_only_this_user_reaches_the_ranks(checkpoint):
    """Rank messages are pickles, which run code as they load: the sockets they cross are files in a directory
    only this user may enter (removed at shutdown), and the rendezvous store listens on loopback alone, not
    on every interface as a TCPStore binds by itself."""
    engine = Engine(
        EngineConfig(dtype="float32", kv_cache_tokens=512, dp_backend="process", engine_loops=2), checkpoint=checkpoint
    )
    try:
        specs = engine.ranks._specs
        addresses = {a for spec in specs for a in (spec.requests_address, spec.outputs_address)}
        assert len(addresses) == 3 and all(a.startswith("ipc://") for a in addresses)
        folder = {os.path.dirname(a.removeprefix("ipc://")) for a in addresses}.pop()
        info = os.stat(folder)
        assert (info.st_mode & 0o777, info.st_uid) == (0o700, os.getuid())
        assert listening_addresses(specs[0].store_port) == ["0100007F"]  # 127.0.0.1, and nothing else
        assert len(engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2, ignore_eos=True)).token_ids) == 2
    finally:
        engine.shutdown()
    assert not os.path.exists(folder)


def test_an_owner_that_exits_without_shutdown_leaves_no_socket_directory(tmp_path):
    """A script that forgets `shutdown` (or an error before the server's handlers are in place): its ranks
    are killed at exit, and their sockets' directory goes with them."""
    script = (
        "from lmgate.engine.config import EngineConfig\n"
        "from lmgate.engine.engine import Engine\n"
        "engine = Engine(EngineConfig(dtype='float32', kv_cache_tokens=512, dp_backend='process'))\n"
        "import os, sys; print(os.listdir(sys.argv[1]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=GUARD,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr
    assert "lmgate-" in done.stdout  # it was there while the engine ran
    assert not [name for name in os.listdir(tmp_path) if name.startswith("lmgate-")]


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="finds the rank processes through /proc")
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_rank_killed_or_hung_mid_stream_ends_every_stream_and_the_server_exits_non_zero(how):
    """Killed: its process's end tells at once. Hung (stopped: nothing closes, its peers wait in their
    collectives): its heartbeat's silence tells, after HEARTBEAT_TIMEOUT."""
    proc, address = serve_process("--engine-loops", "2", "--dp-backend", "process", "--kv-cache-tokens", "4096")
    try:
        ranks = rank_pids(proc.pid)
        assert len(ranks) == 2
        channel = grpc.insecure_channel(address)
        stub = pb_grpc.InferenceStub(channel)
        health = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service="lmgate.v1.Inference"))
        assert next(health).status == health_pb2.HealthCheckResponse.SERVING
        sid = stub.Start(pb.StartRequest()).session_id
        streams = [
            stub.Generate(pb.GenerateRequest(prompt=f"Story {i}:", sampling=LONG), timeout=GUARD) for i in range(5)
        ]
        streams.append(stub.Generate(pb.GenerateRequest(session_id=sid, prompt="Once", sampling=LONG), timeout=GUARD))
        for s in streams:  # every stream is running, on both ranks (stateless requests go round robin)
            assert next(m for m in s if m.token_ids)
        ends = StreamEnds(streams)
        os.kill(ranks[1], how)
        for i in range(6):  # new work while the death is noticed: refused, never a server that stops answering
            with pytest.raises(grpc.RpcError) as err:
                for _ in stub.Generate(pb.GenerateRequest(prompt=f"Late {i}:", sampling=LONG), timeout=GUARD):
                    pass
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        statuses = ends.join()
        assert len(statuses) == len(streams)
        for status in statuses:
            assert status[0] == grpc.StatusCode.UNAVAILABLE and "engine rank" in status[1], status
        assert_server_stopped(health, proc, ranks)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="finds the rank processes through /proc")
def test_a_rank_killed_while_idle_stops_the_server():
    """No stream runs, so only the rank's process end tells: the server goes NOT_SERVING and exits 1. The other
    rank's heartbeats once kept the server draining the dead rank's last messages, and it never said so."""
    proc, address = serve_process("--engine-loops", "2", "--dp-backend", "process", "--kv-cache-tokens", "4096")
    try:
        ranks = rank_pids(proc.pid)
        channel = grpc.insecure_channel(address)
        health = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service="lmgate.v1.Inference"), timeout=GUARD
        )
        assert next(health).status == health_pb2.HealthCheckResponse.SERVING
        os.kill(ranks[1], signal.SIGKILL)
        assert_server_stopped(health, proc, ranks)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


OWNER_THAT_FORGETS_SHUTDOWN = """
import os
from lmgate.engine.config import DP_BACKENDS, EngineConfig
from lmgate.engine.engine import Engine
from lmgate.engine.loading.loader import embedded_model_path
from lmgate.engine.engine import Engine
engine = Engine(EngineConfig(dp_backend="process", engine_loops=1, dtype="float32", kv_cache_tokens=1024))
print(" ".join(str(p.pid) for p in engine.ranks._procs.values()), flush=True)
raise RuntimeError("a caller's bug, before any shutdown")
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="watches the rank processes through /proc")
def test_an_owner_that_exits_without_shutdown_takes_its_ranks_with_it():
    """multiprocessing's exit handler SIGTERMs daemon children, which rank processes ignore, then joins them,
    while they wait for their owner to go: the owner hung at exit. Now the ranks are killed first."""
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER_THAT_FORGETS_SHUTDOWN], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        ranks = [int(pid) for pid in owner.stdout.readline().split()]
        assert ranks
        assert owner.wait(timeout=GUARD) == 1
        assert "a caller's bug" in owner.stderr.read()
        assert not any(_alive(pid) for pid in ranks)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


def assert_server_stopped(health, proc: subprocess.Popen, ranks: list[int]) -> None:
    """After a rank's failure: health said NOT_SERVING before the server went away, the server exited 1, and
    no rank process is left."""
    seen = []
    try:
        for update in health:
            seen.append(update.status)
    except grpc.RpcError:
        pass  # the server went away after saying NOT_SERVING
    assert health_pb2.HealthCheckResponse.NOT_SERVING in seen
    assert proc.wait(timeout=GUARD) == 1
    assert not any(_alive(pid) for pid in ranks)


def _alive(pid: int) -> bool:
    """Running, not gone nor a zombie (an exited child its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False
