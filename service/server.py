"""Building the gRPC server: services, health, reflection; and its graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from lmgate.engine.engine import Engine
from lmgate.v1 import lmgate_pb2 as pb
from lmgate.v1 import lmgate_pb2_grpc as pb_grpc
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from .admin import AdminServicer
from .auth import ApiKeyInterceptor
from .replica import ReplicaHeaderInterceptor, default_replica_id
from .metrics import Metrics
from .servicer import InferenceServicer, log_access
from .vllm_servicer import SERVICE as VLLM_SERVICE
from .vllm_servicer import VllmEngineServicer, default_model_name
from .weight_chunks import ChunkViewInterceptor

log = logging.getLogger(__name__)
SHUTDOWN_FLUSH_SECONDS = 1.0  # for the last messages of cancelled streams to reach their clients
INFERENCE = pb.DESCRIPTOR.services_by_name["Inference"].full_name
SERVICES = (INFERENCE, pb.DESCRIPTOR.services_by_name["Admin"].full_name, VLLM_SERVICE)
# The largest request a client may send: gRPC's default of 4 MiB, or more where the context window is long
# enough for a prompt to need it (a token's text is rarely past a few bytes; 64 leaves room for long ones).
DEFAULT_MESSAGE_BYTES = 4 * 2**20
BYTES_PER_CONTEXT_TOKEN = 64


def max_request_bytes(max_context_length: int) -> int:
    """The server's limit on a received message (beyond it gRPC answers RESOURCE_EXHAUSTED itself)."""
    return max(DEFAULT_MESSAGE_BYTES, BYTES_PER_CONTEXT_TOKEN * max_context_length)


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files of the server's TLS: its certificate chain and key, and the CA that client certificates
    must chain to (mutual TLS; None: no client certificate asked for)."""

    cert: str
    key: str
    client_ca: str | None = None

    def credentials(self) -> grpc.ServerCredentials:
        ca = _read(self.client_ca) if self.client_ca else None
        return grpc.ssl_server_credentials(
            [(_read(self.key), _read(self.cert))], root_certificates=ca, require_client_auth=ca is not None
        )


GENERATE = f"/{INFERENCE}/Generate"


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


class Server:
    """A running `grpc.aio` server in front of one engine. Create and stop it on the same event loop."""

    def __init__(
        self,
        engine: Engine,
        address: str = "127.0.0.1:0",
        admin_token: str | None = None,
        tls: TlsFiles | None = None,
        api_key: str | None = None,
        replica_id: str | None = None,
        session_idle_timeout: float = 0.0,
        served_model_name: str | None = None,
    ) -> None:
        """`session_idle_timeout`: seconds after which a session without a turn is ended, 0: never;
        `served_model_name`: the model's name to the gateway's clients (default: its file or folder name)."""
        self.engine = engine
        self.session_idle_timeout = session_idle_timeout
        self._expiry: asyncio.Task | None = None
        self.metrics = Metrics(engine)
        self.replica_id = replica_id or default_replica_id()
        interceptors: list[grpc.aio.ServerInterceptor] = [ReplicaHeaderInterceptor(self.replica_id)]
        if api_key:
            interceptors.append(ApiKeyInterceptor(api_key, (INFERENCE, VLLM_SERVICE), self._refused))
        interceptors.append(ChunkViewInterceptor())  # innermost: it changes the servicer's own handler
        self.grpc = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", max_request_bytes(engine.max_context_length)),
                # The gateway pings its workers every 30 s, calls or not: accepted, and never counted as abuse.
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_recv_ping_interval_without_data_ms", 10000),
                ("grpc.http2.max_ping_strikes", 0),
            ],
        )
        self.inference = InferenceServicer(engine, self.metrics, self.replica_id)
        pb_grpc.add_InferenceServicer_to_server(self.inference, self.grpc)
        admin = AdminServicer(engine, self.metrics, admin_token, self.refresh_health)
        pb_grpc.add_AdminServicer_to_server(admin, self.grpc)
        name = served_model_name or default_model_name(engine.model_path)
        self.worker = VllmEngineServicer(engine, name, self.unhealthy)
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(self.worker, self.grpc)
        self.health = health.aio.HealthServicer()
        self.failed = asyncio.Event()  # set once the engine has lost a rank
        self._stopping = False
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection(SERVICES + (health.SERVICE_NAME, reflection.SERVICE_NAME), self.grpc)
        if tls is None:
            self.port = self.grpc.add_insecure_port(address)
        else:
            self.port = self.grpc.add_secure_port(address, tls.credentials())
        if self.port == 0:
            raise OSError(f"cannot listen on {address}")

    def _refused(self, method: str, request: Any, context: grpc.aio.ServicerContext) -> None:
        """A call the API key refused: a Generate is counted and logged as every refused Generate is."""
        if method == GENERATE:
            self.metrics.refused("UNAUTHENTICATED")
            log_access(request.request_id, request.session_id, context.peer(), "UNAUTHENTICATED")

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.engine.on_failure(
            lambda _: loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._engine_failed()))
        )
        await self.grpc.start()
        if not self.failed.is_set():  # else a rank died while this server was being built
            await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        await self.refresh_health()
        if self.session_idle_timeout > 0:
            self._expiry = asyncio.create_task(self._expire_idle_sessions())

    async def _expire_idle_sessions(self) -> None:
        """Ends sessions idle past the timeout, checking a few times per timeout (every 0.1 to 30 s)."""
        period = min(max(self.session_idle_timeout / 4, 0.1), 30.0)
        while True:
            await asyncio.sleep(period)
            try:
                expired = self.engine.expire_idle_sessions(self.session_idle_timeout)
            except Exception:  # keep expiring: a failure here must not leak every later idle session
                log.exception("ending idle sessions failed")
                continue
            if expired:
                self.metrics.sessions_expired.inc(len(expired))
                log.info("ended %d session(s) idle for %g s", len(expired), self.session_idle_timeout)

    async def _engine_failed(self) -> None:
        """A rank died: NOT_SERVING everywhere at once; whoever runs the server sees `failed` and stops it."""
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.failed.set()

    def unhealthy(self) -> str | None:
        """Why this server should get no work now, or None: the gateway's HealthCheck says it."""
        if self.failed.is_set():
            return f"an engine rank failed: {self.engine.failure}"
        if self._stopping:
            return "the server is shutting down"
        if self.engine.sleeping:
            return f"asleep ({', '.join(sorted(self.engine.sleeping))}): call Admin.Wakeup"
        if self.engine.pause_mode is not None:
            return f"paused ({self.engine.pause_mode}): call Admin.Resume"
        return None

    async def refresh_health(self, closing: bool = False) -> None:
        """While any part of the engine sleeps or generation is paused (or is about to), Generate is refused:
        Inference and the server as a whole ("") report NOT_SERVING, so load balancers send traffic elsewhere;
        Admin stays SERVING, to be woken. After `stop` began, nothing changes any more."""
        if self._stopping or self.failed.is_set():
            return
        asleep = closing or bool(self.engine.sleeping) or self.engine.pause_mode is not None
        serving = health_pb2.HealthCheckResponse.NOT_SERVING if asleep else health_pb2.HealthCheckResponse.SERVING
        for name in ("", INFERENCE, VLLM_SERVICE):
            await self.health.set(name, serving)

    async def stop(self, grace: float) -> None:
        """NOT_SERVING and UNAVAILABLE for new work at once; running streams get `grace` seconds to finish,
        then the engine cancels them, so each still ends with its last message (FINISH_REASON_CANCELLED)."""
        self._stopping = True
        if self._expiry is not None:
            self._expiry.cancel()
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.engine.gateway.close_admission("shutdown", "the server is shutting down")
        await self._wait_idle(grace)
        await asyncio.to_thread(self.engine.shutdown)
        await self.grpc.stop(SHUTDOWN_FLUSH_SECONDS)
        self.inference.close()

    async def _wait_idle(self, timeout: float) -> None:
        """Until no Generate stream of either service is open, or `timeout` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (self.inference.busy or self.worker.busy) and loop.time() < deadline:
            await asyncio.sleep(0.05)

    async def _set_health(self, status: int) -> None:
        for name in ("",) + SERVICES:
            await self.health.set(name, status)
