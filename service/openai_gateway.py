"""`lmgate serve --openai-port`: the Shepherd Model Gateway (smg) as a child process in front of this server, serving
the OpenAI API on its own port. It speaks the VllmEngine worker protocol to lmgate (vllm_servicer.py)."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys

log = logging.getLogger(__name__)
STOP_SECONDS = 10.0  # for the gateway to exit after SIGTERM before it is killed


def smg_binary() -> str | None:
    """The smg launcher of this environment (beside its python), else the PATH's; None where it is not installed."""
    beside = os.path.join(os.path.dirname(sys.executable), "smg")
    return beside if os.access(beside, os.X_OK) else shutil.which("smg")


def free_port(host: str) -> int:
    with socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        return s.getsockname()[1]


class OpenAIGateway:
    """The smg child: started once this server serves, stopped before it stops. Owned by the serving coroutine."""

    def __init__(self, binary: str, host: str, port: int, worker: str) -> None:
        """`worker`: this server's gRPC address as smg reaches it (host:port)."""
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
        # Its Prometheus metrics on a free port of the same host: smg's default, 29000 on every address, would
        # collide with a second server's gateway on the machine.
        self.metrics_port = free_port(host)
        self.stopping = False
        self.process = subprocess.Popen(
            [binary, "launch", "--host", host, "--port", str(port), "--worker-urls", f"grpc://{worker}",
             "--policy", "round_robin", "--log-level", "warn",
             "--prometheus-host", host, "--prometheus-port", str(self.metrics_port)],
            stdin=subprocess.DEVNULL,
        )  # fmt: skip

    def wait(self) -> int:
        """Blocks until the gateway exits; its status. Run on a worker thread."""
        return self.process.wait()

    def stop(self) -> None:
        self.stopping = True
        self.process.terminate()
        try:
            self.process.wait(STOP_SECONDS)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
