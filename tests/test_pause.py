"""Admin.Pause and Resume over a real server on loopback, with sixteen greedy streams running through a weight
update in each mode: ABORT ends them at once with whole partial outputs that a resubmission completes; WAIT
lets them finish on the old weights; KEEP freezes them, and their later tokens come from the new weights,
computed as a fresh request of the same tokens would be. Afterwards every KV block is free."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lmgate.client import client as client_module
from lmgate.client.client import AsyncClient, Client
from lmgate.client.weights import weight_stream
from lmgate.engine.config import EngineConfig
from lmgate.engine.engine import PauseResult
from lmgate.engine.errors import InvalidRequest
from lmgate.v1 import lmgate_pb2 as pb
from lmgate.v1 import lmgate_pb2_grpc as pb_grpc
from tests.serving import ServerThread
from tests.test_weight_push import bf16_state

STREAMS = 16
GUARD = 60.0  # seconds: a guard against a hang, never a timing
MAX_NEW = 40
PROMPTS = [[504, 3575, 282, 4649 + i, 314] for i in range(STREAMS)]


@pytest.fixture
def server(checkpoint):
    s = ServerThread(EngineConfig(dtype="float32", kv_cache_tokens=8192, prefix_caching=True), checkpoint)
    yield s
    s.stop()


class Streams:
    """Greedy streams, each read on a thread of its own; `started` once every one has its first tokens."""

    def __init__(self, server, prompts: list[list[int]], max_new: int = MAX_NEW, keep_kv: bool = False) -> None:
        self.channel = server.channel()
        stub = pb_grpc.InferenceStub(self.channel)
        self.messages: list[list[pb.GenerateResponse]] = [[] for _ in prompts]
        self._first = threading.Semaphore(0)
        sampling = pb.SamplingParams(max_new_tokens=max_new, ignore_eos=True, logprobs=1, keep_kv_on_update=keep_kv)
        self.calls = [
            stub.Generate(pb.GenerateRequest(tokens=pb.TokenIds(ids=p), sampling=sampling, request_id=f"r{i}"))
            for i, p in enumerate(prompts)
        ]
        self._readers = [threading.Thread(target=self._read, args=(i,)) for i in range(len(prompts))]
        for reader in self._readers:
            reader.start()

    def _read(self, i: int) -> None:
        told = False
        try:
            for message in self.calls[i]:
                self.messages[i].append(message)
                if not told and sum(len(m.token_ids) for m in self.messages[i]) >= 2:
                    told = True
                    self._first.release()
        except grpc.RpcError as err:
            self.messages[i].append(err)
        finally:
            if not told:
                self._first.release()

    def started(self) -> None:
        for _ in self._readers:
            self._first.acquire()

    def ended(self, i: int) -> list:
        """Stream `i`'s messages once it has ended (an error last, if it ended with one)."""
        self._readers[i].join()
        return self.messages[i]

    def join(self) -> list[list[pb.GenerateResponse]]:
        for reader in self._readers:
            reader.join()
        self.channel.close()
        return self.messages


def tokens(messages: list[pb.GenerateResponse], version: str | None = None) -> list[int]:
    return [t for m in messages for t in m.token_ids if version is None or m.weight_version == version]


def greedy(server, prompt: list[int], max_new: int) -> list[int]:
    with server.channel() as channel:
        sampling = pb.SamplingParams(max_new_tokens=max_new, ignore_eos=True)
        request = pb.GenerateRequest(tokens=pb.TokenIds(ids=prompt), sampling=sampling)
        return tokens(list(pb_grpc.InferenceStub(channel).Generate(request)))


def inference_health(server) -> int:
    with server.channel() as channel:
        service = pb.DESCRIPTOR.services_by_name["Inference"].full_name
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service)).status


def assert_all_free(server) -> None:
    info = server.info()
    assert info.kv_blocks_free == info.kv_blocks_total
    assert info.running_requests == info.waiting_requests == info.queued_requests == 0


def assert_prefix_cache_empty(server) -> None:
    """No block is keyed: the KV the old weights computed is found by no later prompt."""
    for loop in server.engine.loops:
        assert not loop.blocks.cached and not any(loop.blocks.keys)


def test_abort_ends_every_stream_with_whole_partial_output_and_a_resubmission_completes(server, trainer):
    streams = Streams(server, PROMPTS)
    streams.started()
    with Client(server.address) as client:
        paused = client.pause("abort")
        assert paused.requests == STREAMS
        outputs = streams.join()
        info = server.info()
        assert info.paused and info.pause_mode == pb.PAUSE_MODE_ABORT
        assert inference_health(server) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as refused:
            greedy(server, PROMPTS[0], 4)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "Resume" in refused.value.details()
        assert client.update_weights(bf16_state(trainer), version="after-abort") == "after-abort"
        assert_prefix_cache_empty(server)
        with paused:  # leaving it resumes
            pass
    assert not server.info().paused
    assert inference_health(server) == health_pb2.HealthCheckResponse.SERVING
    for prompt, messages in zip(PROMPTS, outputs):
        last = messages[-1]
        assert last.finish_reason == pb.FINISH_REASON_ABORTED
        partial = tokens(messages)
        assert 2 <= len(partial) < MAX_NEW
        assert last.usage.completion_tokens == len(partial)
        assert sum(len(m.logprobs) for m in messages) == len(partial)
        assert all(m.weight_version == "0" for m in messages if m.token_ids)
    for prompt, messages in list(zip(PROMPTS, outputs))[:4]:  # resubmitted: prompt plus partial output
        partial = tokens(messages)
        assert len(greedy(server, prompt + partial, MAX_NEW - len(partial))) == MAX_NEW - len(partial)
    assert_all_free(server)


def test_wait_lets_every_stream_finish_on_the_old_weights(server, trainer):
    streams = Streams(server, PROMPTS)
    streams.started()
    with Client(server.address) as client:
        with client.pause("wait") as paused:
            assert paused.requests == 0
            info = server.info()  # nothing runs once the pause has returned: every stream has had its last word
            assert info.running_requests == info.waiting_requests == 0
            assert info.pause_mode == pb.PAUSE_MODE_WAIT
            outputs = streams.join()
            client.update_weights(bf16_state(trainer), version="after-wait")
    for messages in outputs:
        assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert len(tokens(messages, "0")) == MAX_NEW
    assert server.info().weight_version == "after-wait" and not server.info().paused
    assert_all_free(server)


def test_keep_freezes_streams_which_go_on_under_the_new_weights_with_their_kv_recomputed(server, trainer):
    streams = Streams(server, PROMPTS)
    streams.started()
    with Client(server.address) as client:
        with client.pause("keep") as paused:
            assert paused.requests == STREAMS
            frozen = server.info()
            assert frozen.running_requests + frozen.waiting_requests == STREAMS
            client.update_weights(bf16_state(trainer), version="after-keep")
            assert_prefix_cache_empty(server)
    outputs = streams.join()
    for prompt, messages in zip(PROMPTS, outputs):
        assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
        old, new = tokens(messages, "0"), tokens(messages, "after-keep")
        assert len(old) >= 2 and len(new) >= 1 and len(old) + len(new) == MAX_NEW
        assert tokens(messages) == old + new  # no version's tokens after the other's
    for prompt, messages in list(zip(PROMPTS, outputs))[:4]:  # recomputed: as a fresh request of those tokens
        old, new = tokens(messages, "0"), tokens(messages, "after-keep")
        assert greedy(server, prompt + old, len(new)) == new
    assert_all_free(server)


def test_keep_kv_goes_on_from_the_old_weights_kv_and_a_frozen_stream_can_be_cancelled(server, trainer):
    streams = Streams(server, PROMPTS[:4])
    streams.started()
    with Client(server.address) as client:
        with client.pause("keep", keep_kv=True):
            streams.calls[0].cancel()  # while frozen: its stream ends at once, not at the resume
            assert isinstance(streams.ended(0)[-1], grpc.RpcError)
            with server.channel() as channel:
                cancel = pb_grpc.InferenceStub(channel).Cancel(pb.CancelRequest(request_id="r1"))
            assert cancel.cancelled
            assert streams.ended(1)[-1].finish_reason == pb.FINISH_REASON_CANCELLED
            client.update_weights(bf16_state(trainer), version="kept")
    outputs = streams.join()
    for messages in outputs[2:]:
        assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert tokens(messages, "kept") and len(tokens(messages)) == MAX_NEW
    assert_all_free(server)


def test_a_request_that_keeps_its_kv_goes_on_from_it_through_an_update_that_recomputes(server, trainer):
    """`keep_kv_on_update`: the pause recomputes KV, but not this request's: after the update the engine computes
    only the tokens it goes on to generate, none of those it had."""
    streams = Streams(server, PROMPTS[:1], keep_kv=True)
    streams.started()
    with Client(server.address) as client:
        with client.pause("keep"):
            computed = server.info().computed_tokens
            client.update_weights(bf16_state(trainer), version="kept-by-request")
    messages = streams.join()[0]
    old, new = tokens(messages, "0"), tokens(messages, "kept-by-request")
    assert len(old) >= 2 and new and len(old) + len(new) == MAX_NEW
    assert server.info().computed_tokens - computed == len(new)  # recomputed: len(prompt) + len(old) - 1 more
    assert_all_free(server)


def test_pause_refuses_an_unknown_mode_and_resume_without_a_pause_changes_nothing(server):
    with server.channel() as channel:
        admin = pb_grpc.AdminStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            admin.Pause(pb.PauseRequest(mode=9))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        admin.Resume(pb.ResumeRequest())
    assert not server.info().paused
    assert len(greedy(server, PROMPTS[0], 3)) == 3


def test_a_pause_made_inside_another_leaves_the_server_paused_for_its_maker_to_end(server, trainer):
    """Two admin clients: while one holds `with pause("abort")`, the other's nested `with pause("keep")` and its
    `update_weights(..., pause="keep")` (sync and async) each find the server paused already (the response says
    so) and leave it paused: new requests stay refused until the first one's block ends. Resume itself always
    ends a pause."""
    state = bf16_state(trainer)

    def refused() -> bool:
        with pytest.raises(grpc.RpcError) as err:
            greedy(server, PROMPTS[0], 2)
        return err.value.code() == grpc.StatusCode.UNAVAILABLE and server.info().paused

    async def from_the_async_client() -> tuple[bool, str]:
        async with AsyncClient(server.address) as client:
            async with client.pause("wait") as nested:
                pass
            version = await client.update_weights(state, version="async", pause="keep", shared_memory=False)
            return nested.already_paused, version

    with Client(server.address) as first, Client(server.address) as second:
        with first.pause("abort") as outer:
            assert not outer.already_paused
            with second.pause("keep") as inner:
                assert inner.already_paused
            assert refused()
            assert second.update_weights(state, version="inside", pause="keep", shared_memory=False) == "inside"
            assert refused() and server.info().weight_version == "inside"
            assert asyncio.run(from_the_async_client()) == (True, "async")
            assert refused()
        assert not server.info().paused and len(greedy(server, PROMPTS[0], 2)) == 2
        first.pause("keep")
        second.resume()  # a Resume ends whichever pause
        assert not server.info().paused and len(greedy(server, PROMPTS[0], 2)) == 2
    assert_all_free(server)


def test_a_pause_whose_caller_left_before_it_was_made_is_undone(server, monkeypatch):
    """A Pause whose caller's deadline passes while another admin call holds the engine (a push's install, a
    long WAIT): the caller sees DEADLINE_EXCEEDED, and the server, which finishes the call, undoes the pause
    once made, so none stays that no one would resume. One that found the server paused already changed the
    mode alone: the pause stays its maker's."""
    engine, made, resumed = server.engine, queue.Queue(), threading.Event()
    pause, resume = engine.pause, engine.resume
    monkeypatch.setattr(engine, "pause", lambda *args: made.put(pause(*args)) or made.queue[-1])
    monkeypatch.setattr(engine, "resume", lambda: resume() or resumed.set())

    def late_pause() -> None:
        """A pause with a short deadline, made while a thread holds the engine's admin lock."""
        held, release = threading.Event(), threading.Event()

        def hold() -> None:
            with engine._admin_lock:
                held.set()
                release.wait(GUARD)

        holder = threading.Thread(target=hold)
        holder.start()
        held.wait(GUARD)
        with Client(server.address, timeout=0.5) as late, pytest.raises(grpc.RpcError) as err:
            late.pause("keep")
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        release.set()
        holder.join()

    late_pause()
    assert made.get(timeout=GUARD) == PauseResult(0, False)  # made once the lock was free, then undone
    assert resumed.wait(GUARD) and not server.info().paused and len(greedy(server, PROMPTS[0], 2)) == 2
    resumed.clear()
    with Client(server.address) as first:
        first.pause("abort")
        assert made.get(timeout=GUARD) == PauseResult(0, False)
        late_pause()
        assert made.get(timeout=GUARD) == PauseResult(0, True)
        assert not resumed.is_set() and server.info().paused and server.info().pause_mode == pb.PAUSE_MODE_KEEP
        first.resume()
    assert not server.info().paused and len(greedy(server, PROMPTS[0], 2)) == 2
    assert_all_free(server)


def test_an_update_made_while_serving_writes_into_the_model_the_one_before_replaced(server, trainer, caplog):
    """On the CPU, once updates repeat, the model a serving update replaced is kept: the next serving update
    writes its values into it while streams run on the served one, and switches to it; each answers as the same
    weights built do. A level-2 sleep lets it go, and the model its wakeup builds on the pushed bytes is not
    kept. The log says once that a model is kept, and its size."""
    caplog.set_level(logging.INFO, logger="lmgate.engine.step.weights")
    weights, name = server.engine.ranks.weights, "model.layers.5.mlp.down_proj.weight"
    other = bf16_state(trainer)
    other[name] = -other[name]
    with Client(server.address) as client:
        client.update_weights(bf16_state(trainer), version="a")  # built; what one update replaced is not kept
        first, trained, one = weights.model, greedy(server, PROMPTS[0], 8), server.info().weights_bytes
        assert weights._spare is None
        client.update_weights(other, version="b")  # built, `first` kept: updates repeat
        second, negated = weights.model, greedy(server, PROMPTS[0], MAX_NEW)
        assert second is not first and negated != trained
        assert server.info().weights_bytes == 2 * one  # Info counts what is held: the spare too
        streams = Streams(server, PROMPTS[:8])
        streams.started()
        client.update_weights(bf16_state(trainer), version="c")  # into `first`, while the streams run on `second`
        assert weights.model is first
        for messages in streams.join():
            assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH and len(tokens(messages)) == MAX_NEW
            assert tokens(messages) == tokens(messages, "b") + tokens(messages, "c")
        assert tokens(streams.messages[0], "b") == negated[: len(tokens(streams.messages[0], "b"))]
        assert greedy(server, PROMPTS[0], 8) == trained
        client.update_weights(other, version="d")
        assert weights.model is second and greedy(server, PROMPTS[0], 8) == negated[:8]
        told = [r.getMessage() for r in caplog.records if "is kept for the next serving update" in r.getMessage()]
        assert len(told) == 1 and " GB)" in told[0]
        client.sleep(2)
        client.wakeup()
        woken = weights.model
        assert woken not in (first, second) and greedy(server, PROMPTS[0], 8) == negated[:8]
        assert server.info().weights_bytes == one
        client.update_weights(bf16_state(trainer), version="e")
        assert weights.model not in (first, second, woken) and greedy(server, PROMPTS[0], 8) == trained
    assert_all_free(server)


def test_keep_over_rank_processes_freezes_cancels_and_resumes_under_new_weights(process_ranks_server, gguf_path):
    server = process_ranks_server
    streams = Streams(server, PROMPTS[:4])
    streams.started()
    with Client(server.address) as client:
        try:
            assert client.pause("keep").requests == 4
            streams.calls[0].cancel()  # a frozen request in a rank process ends while paused
            streams.ended(0)
            version = client.update_weights(gguf_path, version="reloaded")  # the same weights, by path
        finally:
            client.resume()
    outputs = streams.join()
    assert isinstance(outputs[0][-1], grpc.RpcError)
    for messages in outputs[1:]:
        assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert tokens(messages, version) and len(tokens(messages)) == MAX_NEW
    assert_all_free(server)


def test_weights_pushed_while_asleep_at_level_two_are_served_after_the_wakeup(server, trainer):
    before = greedy(server, PROMPTS[0], 8)
    with Client(server.address) as client:
        client.sleep(2)
        assert client.update_weights(bf16_state(trainer), version="while-asleep") == "while-asleep"
        assert server.info().weight_version == "while-asleep" and server.info().weights_bytes == 0
        client.wakeup()
        pushed = greedy(server, PROMPTS[0], 8)
        assert pushed != before
        client.update_weights(bf16_state(trainer), version="awake")  # the same weights pushed awake
    assert greedy(server, PROMPTS[0], 8) == pushed


def test_an_update_that_pauses_for_its_commit_alone_freezes_what_runs_for_the_install(server, trainer, monkeypatch):
    """`update_weights(state, pause="keep")`, in chunks: the bytes travel while the streams run (every chunk is
    sent before the server pauses); the server is paused (KEEP) when the update is installed, and resumed after it,
    so the streams go on under the new weights with their KV recomputed. A mode the server does not know is
    refused before a byte is sent; a pause the server refuses ends the stream uncommitted, and nothing changes."""
    engine, seen, sent = server.engine, [], [0]
    pause, install = engine.pause, engine.update_weights_from_tensors
    state = bf16_state(trainer)
    chunks = len(list(weight_stream(state, commit=False)))

    def counted(*args, **kwargs):
        for message in weight_stream(*args, **kwargs):
            sent[0] += 1
            yield message

    def pause_seen(mode, keep_kv=False):
        if mode == "abort":  # refused, as a server may refuse a pause
            raise InvalidRequest("not now")
        seen.append(("pause", mode, sent[0], pause(mode, keep_kv)))
        return seen[-1][3]

    def install_seen(*args, **kwargs):
        seen.append(("install", engine.pause_mode))
        return install(*args, **kwargs)

    monkeypatch.setattr(client_module, "weight_stream", counted)
    engine.pause, engine.update_weights_from_tensors = pause_seen, install_seen
    streams = Streams(server, PROMPTS)
    streams.started()
    with Client(server.address) as client:
        with pytest.raises(ValueError, match="pause mode"):
            client.update_weights(state, version="never", pause="sideways", shared_memory=False)
        with pytest.raises(grpc.RpcError) as refused:
            client.update_weights(state, version="never", pause="abort", shared_memory=False)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not now" in refused.value.details()
        assert seen == [] and server.info().weight_version == "0" and not server.info().paused
        # Refused at its header while its one chunk is long sent: a pause made meanwhile is resumed
        with pytest.raises(grpc.RpcError) as unknown:
            client.update_weights({"model.no_such.weight": np.zeros(4, np.float32)}, pause="keep", shared_memory=False)
        assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert not server.info().paused and server.info().weight_version == "0"
        seen.clear()
        sent[0] = 0
        assert client.update_weights(state, version="committed", pause="keep", shared_memory=False) == "committed"
    assert seen == [("pause", "keep", chunks, PauseResult(STREAMS, False)), ("install", "keep")]
    assert not server.info().paused and server.info().weight_version == "committed"
    outputs = streams.join()
    for messages in outputs:
        assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
        old, new = tokens(messages, "0"), tokens(messages, "committed")
        assert len(old) >= 2 and len(new) >= 1 and tokens(messages) == old + new
    for prompt, messages in list(zip(PROMPTS, outputs))[:4]:  # recomputed: as a fresh request of those tokens
        old, new = tokens(messages, "0"), tokens(messages, "committed")
        assert greedy(server, prompt + old, len(new)) == new

    async def from_the_async_client() -> str:
        async with AsyncClient(server.address) as client:
            return await client.update_weights(state, version="async", pause="keep", shared_memory=False)

    seen.clear()
    sent[0] = 0
    assert asyncio.run(from_the_async_client()) == "async"
    assert seen == [("pause", "keep", chunks, PauseResult(0, False)), ("install", "keep")] and not server.info().paused
    assert_all_free(server)
