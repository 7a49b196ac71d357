"""The Admin service: sleep, wake-up and weight updates, each a blocking engine call run off the event loop."""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

import grpc

from lmgate.engine.engine import Engine
from lmgate.engine.errors import EngineError, InternalError
from lmgate.v1 import lmgate_pb2 as pb
from lmgate.v1 import lmgate_pb2_grpc as pb_grpc

from .auth import admin_denial
from .metrics import Metrics
from .status import abort

log = logging.getLogger(__name__)


class AdminServicer(pb_grpc.AdminServicer):
    def __init__(
        self, engine: Engine, metrics: Metrics, admin_token: str | None,
        on_state_change: Callable[[bool], Awaitable[None]],
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.admin_token = admin_token
        self.on_state_change = on_state_change  # health follows sleep and wake-up; True: admission is closing

    async def Sleep(self, request: pb.SleepRequest, context: grpc.aio.ServicerContext) -> pb.SleepResponse:
        await self._run(context, self.engine.sleep, request.level, closes_admission=request.level in (1, 2))
        self.metrics.sleep_transitions.labels(self.metrics.model_name, f"sleep_level_{request.level}").inc()
        return pb.SleepResponse()

    async def Wakeup(self, request: pb.WakeupRequest, context: grpc.aio.ServicerContext) -> pb.WakeupResponse:
        await self._run(context, self.engine.wakeup, list(request.tags))
        transition = "wakeup_" + ("_".join(sorted(request.tags)) or "all")
        self.metrics.sleep_transitions.labels(self.metrics.model_name, transition).inc()
        return pb.WakeupResponse()

    async def UpdateWeights(
        self, request: pb.UpdateWeightsRequest, context: grpc.aio.ServicerContext
    ) -> pb.UpdateWeightsResponse:
        await self._run(context, self.engine.update_weights, request.path)
        self.metrics.weight_updates.inc()
        return pb.UpdateWeightsResponse()

    async def _run(self, context: grpc.aio.ServicerContext, call, arg, closes_admission: bool = False) -> None:
        denial = admin_denial(context, self.admin_token)
        if denial is not None:
            await context.abort(*denial)
        if closes_admission:
            await self.on_state_change(True)
        try:
            await asyncio.to_thread(call, arg)
        except EngineError as exc:
            await abort(context, exc)
        except Exception as exc:  # a bug: say INTERNAL with its cause, never UNKNOWN
            log.exception("%s failed", call.__name__)
            await abort(context, InternalError(f"{call.__name__} failed: {exc}"))
        finally:
            await self.on_state_change()
