"""SIGTERM on a real `python -m lmgate.service.main` process: NOT_SERVING, UNAVAILABLE, streams end, exit 0."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lmgate.v1 import lmgate_pb2 as pb
from lmgate.v1 import lmgate_pb2_grpc as pb_grpc


def start_server(*flags: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmgate.service.main", "--port", "0", "--kv-cache-tokens", "4096", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    for line in proc.stdout:
        m = re.search(r"serving .* on (\S+:\d+)", line)
        if m:
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep draining its log
            return proc, m.group(1)
    raise AssertionError(f"server exited with {proc.wait()} before serving")


def test_sigterm_drains_and_exits_zero():
    proc, address = start_server("--grace", "2")
    try:
        channel = grpc.insecure_channel(address)
        stub = pb_grpc.InferenceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
        stream = stub.Generate(pb.GenerateRequest(prompt="Once upon a time", sampling=pb.SamplingParams(max_new_tokens=4000, ignore_eos=True)))
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
        # The running stream gets its grace period, then ends with its last message, never hangs.
        assert [m.finish_reason for m in stream][-1] == pb.FINISH_REASON_CANCELLED
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
