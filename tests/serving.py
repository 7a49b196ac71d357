"""A real lmgate server on loopback for integration tests: the engine plus grpc.aio on a thread of its own."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time

import grpc

from grpc_health.v1 import health_pb2, health_pb2_grpc

from lmgate.engine.config import EngineConfig
from lmgate.engine.engine import Engine
from lmgate.engine.loading.loader import Checkpoint
from lmgate.service.server import Server
from lmgate.v1 import lmgate_pb2 as pb
from lmgate.v1 import lmgate_pb2_grpc as pb_grpc


# `lmgate` as this interpreter runs it: the console script is not installed where lmgate was (the GPU machine
# may install it with --target).
LMGATE = [sys.executable, "-m", "lmgate.client.cli"]


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (another process may take it before the caller binds it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def status_bytes(pid: int, field: str = "VmRSS") -> int:
    """A memory figure of /proc/<pid>/status (VmRSS, VmSize, ...), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(f"{field}:"))


class ServerThread:
    """Starts on construction, bound to 127.0.0.1 on a free port; `stop()` shuts it down as SIGTERM would."""

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None, **server_kw) -> None:
        self.engine = Engine(config, checkpoint)
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._server_kw = server_kw
        self._thread = threading.Thread(target=self._run, name="test-grpc-server", daemon=True)
        self._thread.start()
        self._ready.wait()
        self.address = f"127.0.0.1:{self.server.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = Server(self.engine, "127.0.0.1:0", **self._server_kw)
        self.loop.run_until_complete(self.server.start())
        self._ready.set()
        self.loop.run_forever()

    def stop(self, grace: float = 5.0) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(grace), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)

    def stub(self) -> pb_grpc.InferenceStub:
        return pb_grpc.InferenceStub(self.channel())

    def info(self) -> pb.InfoResponse:
        with self.channel() as ch:
            return pb_grpc.InferenceStub(ch).Info(pb.InfoRequest())


def serve_process(*flags: str) -> tuple[subprocess.Popen, str]:
    """`lmgate serve --port 0 *flags` as a child process, once its health says SERVING; the process and its
    address."""
    proc = subprocess.Popen([*LMGATE, "serve", "--port", "0", *flags], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # "lmgate serving <model> on <host>:<port> (ready in ...)"
    if " on " not in line:
        proc.kill()
        raise RuntimeError(f"lmgate serve did not start: {line!r}")
    address = line.split(" on ")[1].split()[0]
    deadline = time.monotonic() + 60  # a guard against a server that never serves, not a performance bound
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while health.Check(health_pb2.HealthCheckRequest()).status != health_pb2.HealthCheckResponse.SERVING:
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"lmgate serve at {address} never reported SERVING")
            time.sleep(0.01)
    return proc, address


class StreamEnds:
    """Reads each stream to its end on a thread of its own, from construction; `join` returns how each ended:
    "finished", or the (code, details) of its status."""

    def __init__(self, streams) -> None:
        self.ends: list = []
        self._readers = [threading.Thread(target=self._drain, args=(s,)) for s in streams]
        for r in self._readers:
            r.start()

    def _drain(self, stream) -> None:
        try:
            for _ in stream:
                pass
            self.ends.append("finished")
        except grpc.RpcError as err:
            self.ends.append((err.code(), err.details()))

    def join(self) -> list:
        for r in self._readers:
            r.join()
        return self.ends
