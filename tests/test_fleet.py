"""Three replicas behind real proxies (nginx and Envoy, with deploy/'s own files): a session's calls reach the
replica that holds it, stateless calls spread over all, and Envoy's health checks drop a sleeping replica."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import grpc
import pytest

from lmgate.client import AsyncClient, Client
from lmgate.client.routing import channel_target
from lmgate.client.wire import new_session_id, session_metadata
from lmgate.engine.config import EngineConfig
from lmgate.service.replica import HEADER
from lmgate.v1 import lmgate_pb2 as pb
from lmgate.v1 import lmgate_pb2_grpc as pb_grpc
from tests.proxies import READY_TIMEOUT, running_proxy
from tests.serving import ServerThread, serve_process

REPLICAS = ("r0", "r1", "r2")
SAMPLING = pb.SamplingParams(max_new_tokens=4, ignore_eos=True)
PROBE = pb.SamplingParams(max_new_tokens=1)  # a stateless call that only asks who answers


@pytest.fixture(scope="module")
def replicas(checkpoint):
    servers = [
        ServerThread(EngineConfig(dtype="float32", kv_cache_tokens=4096), checkpoint, replica_id=r) for r in REPLICAS
    ]
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture(scope="module", params=["nginx", "envoy"])
def proxy(request, replicas, tmp_path_factory):
    named = {s.server.replica_id: s.address for s in replicas}
    with running_proxy(request.param, named, tmp_path_factory.mktemp(request.param)) as address:
        yield address


def _turn(stub, session_id: int, prompt: str) -> tuple[str, pb.Usage]:
    """One turn; the replica that answered (the response header) and the turn's usage."""
    call = stub.Generate(
        pb.GenerateRequest(session_id=session_id, prompt=prompt, sampling=SAMPLING),
        metadata=session_metadata(session_id),
    )
    responses = list(call)
    return dict(call.initial_metadata())[HEADER], responses[-1].usage


def test_session_calls_reach_the_replica_that_holds_the_session(proxy):
    """20 sessions x 3 turns, named and routed as the client library does: a turn on another replica would be
    NOT_FOUND; each turn after the first reuses the session's KV."""
    placed = Counter()
    with grpc.insecure_channel(proxy) as channel:
        stub = pb_grpc.InferenceStub(channel)
        for _ in range(20):
            session_id = new_session_id()
            start = stub.Start.with_call(pb.StartRequest(session_id=session_id), metadata=session_metadata(session_id))
            home = dict(start[1].initial_metadata())[HEADER]
            turns = [_turn(stub, session_id, prompt) for prompt in ("Hello there.", " And then?", " Why?")]
            assert [replica for replica, _ in turns] == [home] * 3
            assert all(usage.cached_tokens > 0 for _, usage in turns[1:])
            stub.End(pb.EndRequest(session_id=session_id), metadata=session_metadata(session_id))
            placed[home] += 1
    assert len(placed) > 1, placed  # 20 random ids on one replica of three: about 1 in 10^9


def test_client_library_sessions_through_the_proxy(proxy):
    with Client(proxy) as client:
        for _ in range(6):
            with client.start() as session:
                for prompt in ("Hi.", " More.", " Again."):
                    deltas = list(session.generate(prompt, max_new_tokens=2, ignore_eos=True))
                    assert deltas[-1].finish_reason == "length"


def test_stateless_calls_reach_every_replica(proxy):
    with grpc.insecure_channel(proxy) as channel:
        stub = pb_grpc.InferenceStub(channel)
        answered = Counter()
        for _ in range(60):
            call = stub.Generate(pb.GenerateRequest(prompt="Hi", sampling=PROBE))
            list(call)
            answered[dict(call.initial_metadata())[HEADER]] += 1
    assert set(answered) == set(REPLICAS), answered


def test_a_request_of_megabytes_reaches_a_replica(proxy):
    """A prompt of 2 MB (a long document, a resumable session's replay) is the replica's to judge, as when sent
    to it directly, not the proxy's: nginx's default 1 MiB request body refused it as UNKNOWN."""
    with grpc.insecure_channel(proxy) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            list(
                pb_grpc.InferenceStub(channel).Generate(
                    pb.GenerateRequest(prompt="word " * 400_000, sampling=PROBE), timeout=READY_TIMEOUT
                )
            )
    assert refused.value.code() == grpc.StatusCode.OUT_OF_RANGE, refused.value


def test_admin_calls_are_refused_through_the_proxy(proxy, replicas):
    """Replicas trust Admin calls from loopback, and the proxy's connections come from loopback: the proxy
    itself refuses Admin, so no client reaching it can put a replica to sleep."""
    with grpc.insecure_channel(proxy) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.AdminStub(channel).Sleep(pb.SleepRequest(level=1), timeout=READY_TIMEOUT)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value
    assert "each replica's own address" in refused.value.details()
    assert not any(s.engine.sleeping for s in replicas)


@pytest.mark.parametrize("proxy", ["envoy"], indirect=True)  # nginx's open-source build has no active checks
def test_envoy_health_checks_take_sleeping_replicas_out_and_back(proxy, replicas):
    """Asleep, a replica reports NOT_SERVING; Envoy stops sending it calls, and sends them again after wake-up.
    Two of three asleep (an RL step's training phase): below Envoy's default panic threshold, 50% healthy, it
    would send calls to every replica again; the file sets none."""
    _sleeping_replicas_leave_and_come_back(proxy, replicas)


def test_client_side_health_checks_take_sleeping_replicas_out_and_back(replicas):
    """Client([addresses]) watches each replica's health as Envoy does: its ring hash skips the sleeping ones
    (before, two of three stateless calls failed UNAVAILABLE while two replicas slept)."""
    _sleeping_replicas_leave_and_come_back([s.address for s in replicas], replicas)


def _sleeping_replicas_leave_and_come_back(target: str | list[str], replicas) -> None:
    admins = [Client(s.address) for s in replicas[1:]]
    try:
        for admin in admins:
            admin.sleep()
        # 20 in a row from r0 by chance with probability (1/3)^20; while Envoy still sends the sleeping replicas
        # calls, they fail UNAVAILABLE and the run starts again
        assert _until_answered_by(target, lambda r: r == "r0", 20), "calls still reached the sleeping replicas"
    finally:
        for admin in admins:
            admin.wakeup()
            admin.close()
    for name in REPLICAS[1:]:
        assert _until_answered_by(target, lambda r: r == name, 1), f"the woken replica {name} never came back"


def _until_answered_by(address: str | list[str], wanted, consecutive: int) -> bool:
    """Stateless calls until `consecutive` in a row are answered by replicas `wanted` accepts (each health
    check takes a second, so the proxy's view lags), or the guard runs out."""
    deadline = time.monotonic() + READY_TIMEOUT
    run = 0
    with grpc.insecure_channel(*channel_target(address)) as channel:
        stub = pb_grpc.InferenceStub(channel)
        while time.monotonic() < deadline:
            try:
                call = stub.Generate(pb.GenerateRequest(prompt="Hi", sampling=PROBE))
                list(call)
                run = run + 1 if wanted(dict(call.initial_metadata())[HEADER]) else 0
            except grpc.RpcError as err:  # the sleeping replica's UNAVAILABLE, before Envoy has noticed
                assert err.code() == grpc.StatusCode.UNAVAILABLE, err
                run = 0
            if run >= consecutive:
                return True
    return False


def test_client_side_ring_hash_without_a_proxy(replicas):
    """Client([addresses]): sessions stick to one replica by ring hash (a turn elsewhere would be NOT_FOUND),
    stateless calls reach every replica."""
    with Client([s.address for s in replicas]) as client:
        for _ in range(10):
            with client.start() as session:
                for prompt in ("Hi.", " More.", " Again."):
                    assert (
                        list(session.generate(prompt, max_new_tokens=2, ignore_eos=True))[-1].finish_reason == "length"
                    )
        assert {client.info().replica_id for _ in range(40)} == set(REPLICAS)
        # Admin calls are one server's: a hashed route would reach one replica at random, never a sleeping one
        for call in (lambda: client.pause("keep"), client.sleep, lambda: client.update_weights({}, "never")):
            with pytest.raises(ValueError, match="one server"):
                call()

    async def async_pause() -> None:
        async with AsyncClient([s.address for s in replicas]) as client:
            await client.pause("abort")

    with pytest.raises(ValueError, match="one server"):
        asyncio.run(async_pause())
    assert not any(s.info().paused or s.info().sleeping for s in replicas)


def test_a_resumable_session_whose_route_comes_back_replays_over_the_copy_it_left(replicas):
    """A resumable session's route moves to another replica and back (a proxy's health check that failed
    once). The copy it left missed the turn in between: the turn that comes back is ABORTED there, and the
    session ends that copy, starts again and replays, so its tokens are a stateless request's over the whole
    conversation, not a continuation of the old copy's history."""
    turn = dict(max_new_tokens=8, ignore_eos=True)
    with Client(replicas[0].address) as home, Client(replicas[1].address) as away:
        session = home.start(resume=True)
        first_epoch = session.epoch
        list(session.generate("Tell me about the sea.", **turn))
        session.client = away  # the route leads elsewhere: NOT_FOUND there, so started and replayed
        list(session.generate(" And then?", **turn))
        session.client = home  # and back, to a copy that has the first turn only
        text = session.history.text + " Why?"
        resumed = [t for d in session.generate(" Why?", **turn) for t in d.token_ids]
        alone = [t for d in home.generate(text, **turn) for t in d.token_ids]
        assert resumed == alone and session.epoch != first_epoch
        with pytest.raises(grpc.RpcError) as err:  # a turn naming the old copy, as a stale client would
            list(home.generate(" Hm.", session_id=session.id, session_epoch=first_epoch, **turn))
        assert err.value.code() == grpc.StatusCode.ABORTED
        assert [t for d in session.generate(" Go on.", **turn) for t in d.token_ids]  # the refusal changed nothing
        session.end()
        away.end(session.id)
    assert all(s.engine.info().active_sessions == 0 for s in replicas)


def test_a_resumable_session_survives_its_replica(tmp_path):
    """Three `lmgate serve` processes behind nginx; the one holding two sessions is killed (SIGKILL). The next
    turn of the session started with resume=True succeeds elsewhere, with the tokens of a stateless request
    over its whole conversation; the other's is NOT_FOUND."""
    processes = {}
    try:
        for i in range(3):
            processes[f"k{i}"] = serve_process("--replica-id", f"k{i}", "--threads", "1", "--kv-cache-tokens", "4096")
        named = {name: address for name, (_, address) in processes.items()}
        with running_proxy("nginx", named, tmp_path) as address, Client(address) as client:
            stub = pb_grpc.InferenceStub(client._channel)
            resumable = client.start(resume=True)
            home = _home(stub, resumable.id)
            plain = client.start()
            while _home(stub, plain.id) != home:  # a third of the ids land there
                plain = client.start()
            first = [d for session in (resumable, plain) for d in session.generate("Tell me about the sea.", **TURN)]
            assert first[-1].finish_reason == "length"
            processes[home][0].kill()
            processes[home][0].wait()
            text = resumable.history.text
            resumed = [t for d in resumable.generate(" And then?", **TURN) for t in d.token_ids]
            alone = [t for d in client.generate(text + " And then?", **TURN) for t in d.token_ids]
            assert resumed == alone and len(resumed) == TURN["max_new_tokens"]
            assert _home(stub, resumable.id) != home
            with pytest.raises(grpc.RpcError) as err:
                list(plain.generate(" And then?", **TURN))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        for proc, _ in processes.values():
            proc.kill()
            proc.wait()


def _home(stub: pb_grpc.InferenceStub, session_id: int) -> str:
    """The replica a session's calls reach: the header of a Cancel that finds nothing to cancel."""
    _, call = stub.Cancel.with_call(pb.CancelRequest(session_id=session_id), metadata=session_metadata(session_id))
    return dict(call.initial_metadata())[HEADER]


TURN = {"max_new_tokens": 6, "ignore_eos": True}
