"""SIGTERM on a real `python -m lmgate.service.main` process: NOT_SERVING, UNAVAILABLE, streams end, exit 0."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc

from lmgate.engine.config import EngineConfig
from lmgate.engine.engine import Engine
from lmgate.engine.sampling.sampler import SamplingParams
from lmgate.service.server import Server
from lmgate.v1 import lmgate_pb2 as pb
from lmgate.v1 import lmgate_pb2_grpc as pb_grpc

GUARD = 300  # seconds: a guard against a hang, never a performance bound


def start_server(*flags: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmgate.service.main", "--port", "0", "--kv-cache-tokens", "4096", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    for line in proc.stdout:
        m = re.search(r"serving .* on (\S+:\d+)", line)
        if m:
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep draining its log
            return proc, m.group(1)
    raise AssertionError(f"server exited with {proc.wait()} before serving")


@pytest.mark.parametrize("flags", [(), ("--dp-backend", "process")], ids=["a thread", "a rank process"])
def test_sigterm_serves_a_request_queued_before_it_in_the_grace_period(flags):
    """One sequence per step: a request admitted before SIGTERM but still queued behind a running one runs in
    the grace period, as the running one does, rather than ending CANCELLED with nothing."""
    proc, address = start_server("--grace", str(GUARD), "--max-batch-size", "1", *flags)
    try:
        channel = grpc.insecure_channel(address)
        stub = pb_grpc.InferenceStub(channel)
        sampling = pb.SamplingParams(max_new_tokens=48, ignore_eos=True)
        running = stub.Generate(pb.GenerateRequest(prompt="Once upon a time", sampling=sampling), timeout=GUARD)
        assert next(m for m in running if m.token_ids)
        few = pb.SamplingParams(max_new_tokens=5, ignore_eos=True)
        queued = stub.Generate(pb.GenerateRequest(prompt="Hello", sampling=few), timeout=GUARD)
        worker = vllm_grpc.VllmEngineStub(channel)  # the gateway's protocol gets the same grace
        gateway_params = vllm.SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        gateways = worker.Generate(vllm.GenerateRequest(text="Hi", sampling_params=gateway_params), timeout=GUARD)
        deadline = time.monotonic() + GUARD
        while (info := stub.Info(pb.InfoRequest())).queued_requests + info.waiting_requests < 2:
            assert time.monotonic() < deadline, "the queued requests never reached the engine"
        proc.send_signal(signal.SIGTERM)
        assert list(running)[-1].finish_reason == pb.FINISH_REASON_LENGTH
        replies = list(queued)
        assert replies[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert sum(len(m.token_ids) for m in replies) == 5
        assert list(gateways)[-1].complete.finish_reason == "length"
        assert proc.wait(timeout=GUARD) == 0
    finally:
        proc.kill()


@pytest.mark.parametrize(
    "flags", [(), ("--engine-loops", "2", "--dp-backend", "process")], ids=["one loop", "two rank processes"]
)
def test_sigterm_drains_and_exits_zero(flags):
    """With two rank processes, a stream on each: the leaders agree to close, and one may see that agreement
    before its own "close" arrives; it must still stop as closed (its streams CANCELLED, exit 0), not as failed."""
    proc, address = start_server("--grace", "2", *flags)
    try:
        channel = grpc.insecure_channel(address)
        stub = pb_grpc.InferenceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
        sampling = pb.SamplingParams(max_new_tokens=4000, ignore_eos=True)
        streams = [
            stub.Generate(pb.GenerateRequest(prompt=f"Once upon a time {i}", sampling=sampling), timeout=GUARD)
            for i in range(2)
        ]  # stateless requests go to the ranks in turn
        for stream in streams:
            assert next(m for m in stream if m.token_ids)
        proc.send_signal(signal.SIGTERM)
        while health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING:
            pass
        try:
            list(stub.Generate(pb.GenerateRequest(prompt="hi")))
            raise AssertionError("a request was accepted during shutdown")
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in err.details()
        # The running streams get their grace period, then end with their last message, never hang.
        for stream in streams:
            assert [m.finish_reason for m in stream][-1] == pb.FINISH_REASON_CANCELLED
        assert proc.wait(timeout=GUARD) == 0
    finally:
        proc.kill()


def test_a_server_built_after_its_engine_failed_says_not_serving_and_stops(checkpoint):
    """A rank may die while the server is still being built (start-up is when memory peaks): the server hears
    of it when it starts, so it never says SERVING to a load balancer, and `failed` tells its owner to stop."""
    engine = Engine(EngineConfig(dtype="float32", kv_cache_tokens=512), checkpoint=checkpoint)
    try:

        def broken_pop(*args):
            raise RuntimeError("the queue broke")

        failed = threading.Event()
        engine.on_failure(lambda _: failed.set())
        engine.gateway.pop = broken_pop
        engine.submit([504], SamplingParams(max_new_tokens=1))  # wakes the loop, which fails
        assert failed.wait(GUARD)

        async def start_and_check() -> int:
            server = Server(engine, "127.0.0.1:0")
            await server.start()
            await asyncio.wait_for(server.failed.wait(), GUARD)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                status = (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())).status
            await server.stop(0)
            return status

        assert asyncio.run(start_and_check()) == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        engine.shutdown()


def test_a_second_sigterm_ends_the_server_at_once():
    """The first SIGTERM gives running streams their grace (here far longer than the test); a second ends the
    process at once, as an operator who will not wait asks."""
    proc, address = start_server("--grace", str(10 * GUARD))
    try:
        stub = pb_grpc.InferenceStub(grpc.insecure_channel(address))
        stream = stub.Generate(
            pb.GenerateRequest(
                prompt="Once upon a time", sampling=pb.SamplingParams(max_new_tokens=4000, ignore_eos=True)
            ),
            timeout=GUARD,
        )
        assert next(m for m in stream if m.token_ids)
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + GUARD  # a guard against a hang only
        while health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline  # until the first is handled: the grace period has begun
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=GUARD) == 128 + signal.SIGTERM
    finally:
        proc.kill()
