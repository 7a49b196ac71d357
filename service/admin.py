"""The Admin service: sleep, wake-up and weight updates, each a blocking engine call run off the event loop.
Weights pushed as a stream (`UpdateWeightsFromTensors`) are gathered here, on the event loop (bytes a client names
in its shared memory read off it), into one buffer; the engine sees them only once the stream has committed
them whole."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable

import grpc
import torch
from google.protobuf.message import DecodeError

from lmgate.engine.engine import Engine, PauseResult
from lmgate.engine.errors import EngineError, InternalError, InvalidRequest
from lmgate.engine.loading.pushed import TensorSpec, tensor_views
from lmgate.engine.loading.weight_group import DEFAULT_BUCKET_BYTES, DEFAULT_TIMEOUT
from lmgate.v1 import lmgate_pb2 as pb
from lmgate.v1 import lmgate_pb2_grpc as pb_grpc

from . import convert
from .auth import admin_denial
from .metrics import Metrics
from .shared_memory import read_shared_memory
from .status import abort

log = logging.getLogger(__name__)


class AdminServicer(pb_grpc.AdminServicer):
    def __init__(
        self,
        engine: Engine,
        metrics: Metrics,
        admin_token: str | None,
        on_state_change: Callable[[bool], Awaitable[None]],
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.admin_token = admin_token
        self.on_state_change = on_state_change  # health follows sleep and wake-up; True: admission is closing
        self._working: set[asyncio.Future] = set()  # engine calls under way, held until done
        self._sleeps_pending = 0  # Sleep calls not yet done; read and written on the event loop only

    async def Sleep(self, request: pb.SleepRequest, context: grpc.aio.ServicerContext) -> pb.SleepResponse:
        await self._run(
            context,
            self.engine.sleep,
            request.level,
            lambda: self._transition(f"sleep_level_{request.level}"),
            closes_admission=request.level in (1, 2),
        )
        return pb.SleepResponse()

    async def Wakeup(self, request: pb.WakeupRequest, context: grpc.aio.ServicerContext) -> pb.WakeupResponse:
        transition = "wakeup_" + ("_".join(sorted(set(request.tags))) or "all")  # one series per set of tags
        restored, still_asleep = await self._run(
            context, self.engine.wakeup, list(request.tags), lambda: self._transition(transition)
        )
        return pb.WakeupResponse(restored=restored, still_asleep=still_asleep)

    async def Pause(self, request: pb.PauseRequest, context: grpc.aio.ServicerContext) -> pb.PauseResponse:
        def pause(request: pb.PauseRequest) -> PauseResult:
            return self.engine.pause(convert.pause_mode(request.mode), request.keep_kv)

        done = await self._run(
            context, pause, request, lambda: self._transition("pause"), closes_admission=True, undo=self._unpause
        )
        return pb.PauseResponse(requests=done.requests, already_paused=done.already_paused)

    def _unpause(self, done: PauseResult) -> None:
        """A Pause whose caller left (a deadline, a cancel) before it was made is undone once made: its caller
        was told it failed, and no one would resume it. One that found the server paused already changed the
        mode alone, which stays."""
        if not done.already_paused:
            self._start(lambda _: self.engine.resume(), None, lambda: self._transition("resume"), False)

    async def Resume(self, request: pb.ResumeRequest, context: grpc.aio.ServicerContext) -> pb.ResumeResponse:
        def resume(request: pb.ResumeRequest) -> None:
            self.engine.resume()

        await self._run(context, resume, request, lambda: self._transition("resume"))
        return pb.ResumeResponse()

    def _transition(self, name: str) -> None:
        """Counted once done: a refused call (a bad level or tag) makes no series."""
        self.metrics.sleep_transitions.labels(self.metrics.model_name, name).inc()

    async def UpdateWeights(
        self, request: pb.UpdateWeightsRequest, context: grpc.aio.ServicerContext
    ) -> pb.UpdateWeightsResponse:
        def update_weights(request: pb.UpdateWeightsRequest) -> str:
            return self.engine.update_weights(request.path, request.weight_version)

        version = await self._run(context, update_weights, request, self.metrics.weight_updates.inc)
        return pb.UpdateWeightsResponse(weight_version=version)

    async def UpdateWeightsFromTensors(
        self,
        request_iterator: AsyncIterator[memoryview | pb.UpdateWeightsFromTensorsRequest],
        context: grpc.aio.ServicerContext,
    ) -> pb.UpdateWeightsResponse:
        denial = admin_denial(context, self.admin_token)
        if denial is not None:  # before a byte is read
            await context.abort(*denial)
        try:
            version, tensors = await self._receive_tensors(request_iterator)
        except DecodeError as exc:  # a message gRPC's deserializer could not parse, raised where it is read
            await abort(
                context, InvalidRequest(f"a message is no UpdateWeightsFromTensorsRequest ({exc}): nothing changed")
            )
        except EngineError as exc:
            await abort(context, exc)

        def update_weights_from_tensors(pushed: tuple[str, dict[str, torch.Tensor]]) -> str:
            return self.engine.update_weights_from_tensors(pushed[1], pushed[0], owned=True)  # this call's buffer

        version = await self._run(
            context, update_weights_from_tensors, (version, tensors), self.metrics.weight_updates.inc
        )
        return pb.UpdateWeightsResponse(weight_version=version)

    # weights from a trainer's torch.distributed group: the engine joins it and receives its broadcasts
    # (engine/loading/weight_group.py); each wait on the trainer has its limit, none holds the event loop.

    async def InitWeightUpdateGroup(
        self, request: pb.InitWeightUpdateGroupRequest, context: grpc.aio.ServicerContext
    ) -> pb.InitWeightUpdateGroupResponse:
        def init_weight_group(request: pb.InitWeightUpdateGroupRequest) -> None:
            rank = request.rank_offset or 1
            self.engine.init_weight_group(
                request.master_address,
                request.master_port,
                world_size=request.world_size or rank + 1,
                rank=rank,
                backend=request.backend or "gloo",
                timeout=request.timeout_seconds or DEFAULT_TIMEOUT,
            )

        await self._run(context, init_weight_group, request, _uncounted)
        return pb.InitWeightUpdateGroupResponse()

    async def UpdateWeightsFromDistributed(
        self, request: pb.UpdateWeightsFromDistributedRequest, context: grpc.aio.ServicerContext
    ) -> pb.UpdateWeightsResponse:
        def update_weights_from_distributed(request: pb.UpdateWeightsFromDistributedRequest) -> str:
            specs = _specs(request.tensors)
            bucket_bytes = request.bucket_bytes or DEFAULT_BUCKET_BYTES
            return self.engine.update_weights_from_distributed(specs, request.weight_version, bucket_bytes)

        version = await self._run(context, update_weights_from_distributed, request, self.metrics.weight_updates.inc)
        return pb.UpdateWeightsResponse(weight_version=version)

    async def DestroyWeightUpdateGroup(
        self, request: pb.DestroyWeightUpdateGroupRequest, context: grpc.aio.ServicerContext
    ) -> pb.DestroyWeightUpdateGroupResponse:
        def destroy_weight_group(request: pb.DestroyWeightUpdateGroupRequest) -> None:
            self.engine.destroy_weight_group()

        await self._run(context, destroy_weight_group, request, _uncounted)
        return pb.DestroyWeightUpdateGroupResponse()

    async def _receive_tensors(
        self, requests: AsyncIterator[memoryview | pb.UpdateWeightsFromTensorsRequest]
    ) -> tuple[str, dict[str, torch.Tensor]]:
        """The header (checked by the engine before any byte is read), its tensors' bytes into one buffer, the
        commit: the version and the tensors, views of that buffer. A stream that ends otherwise is refused."""
        header: pb.WeightsHeader | None = None
        specs: list[TensorSpec] = []
        buffer = memoryview(b"")
        received = 0
        async for request in requests:  # a chunk as `weight_chunks.chunk_or_request` hands it: a view of its bytes
            part = "chunk" if isinstance(request, memoryview) else request.WhichOneof("part")
            if header is None:
                if part != "header":
                    raise InvalidRequest("the stream's first message must be its header")
                header = request.header
                specs = _specs(header.tensors)
                self.engine.check_weight_specs(specs)
                # Off the event loop: a buffer the rank processes map takes its room first (0.9 s for 2.47 GB)
                buffer = await asyncio.to_thread(self.engine.host_buffer, sum(spec.nbytes for spec in specs))
            elif part == "chunk":
                chunk = request if isinstance(request, memoryview) else request.chunk  # read once: each read copies
                _check_room(buffer, received, len(chunk))
                buffer[received : received + len(chunk)] = chunk
                received += len(chunk)
            elif part == "shared_memory":  # a client on this machine: the bytes read from its file
                named = request.shared_memory
                _check_room(buffer, received, named.length)
                into = buffer[received : received + named.length]
                await asyncio.to_thread(read_shared_memory, named.name, named.offset, named.length, into)
                received += named.length
            elif part == "commit":
                if received != len(buffer):
                    raise InvalidRequest(f"commit after {received} of {len(buffer)} bytes: nothing changed")
                return header.weight_version, tensor_views(specs, buffer)
            else:
                raise InvalidRequest(f"unexpected {part or 'empty message'} after the header")
        raise InvalidRequest("the stream ended before its commit: nothing changed")

    async def _run(
        self,
        context: grpc.aio.ServicerContext,
        call: Callable[[Any], Any],
        arg: Any,
        count: Callable[[], None],
        closes_admission: bool = False,
        undo: Callable[[Any], None] | None = None,
    ) -> Any:
        """The engine call's result; a refusal or failure aborts the RPC with its status. `undo`: what undoes
        the call's result where its caller leaves before it is done (called with it, on the event loop)."""
        denial = admin_denial(context, self.admin_token)
        if denial is not None:
            await context.abort(*denial)
        work = self._start(call, arg, count, closes_admission)
        try:
            return await asyncio.shield(work)  # a caller that leaves (deadline, cancel) does not stop the call
        except asyncio.CancelledError:
            if undo is not None:
                work.add_done_callback(lambda done: _succeeded(done) and undo(done.result()))
            raise
        except EngineError as exc:
            await abort(context, exc)
        except Exception as exc:  # a bug (logged by `_forget`): say INTERNAL with its cause, never UNKNOWN
            await abort(context, InternalError(f"{call.__name__} failed: {exc}"))

    def _start(
        self, call: Callable[[Any], Any], arg: Any, count: Callable[[], None], closes_admission: bool
    ) -> asyncio.Future:
        """The engine call as a task held until done (`_complete`)."""
        self._sleeps_pending += closes_admission  # no await before the task owns it: it always comes down
        work = asyncio.ensure_future(self._complete(call, arg, count, closes_admission))
        self._working.add(work)
        work.add_done_callback(self._forget)
        return work

    async def _complete(
        self, call: Callable[[Any], Any], arg: Any, count: Callable[[], None], closes_admission: bool
    ) -> Any:
        """The engine call to its end, whether or not its caller still waits: health and the counters then
        say what the engine did, not what the caller saw (and a Sleep still to run counts as asleep)."""
        try:
            if closes_admission:  # here, not in the caller, whose cancel during it would leave the count raised
                await self.on_state_change(True)
            result = await asyncio.to_thread(call, arg)
            count()
            return result
        finally:
            self._sleeps_pending -= closes_admission
            await self.on_state_change(self._sleeps_pending > 0)

    def _forget(self, work: asyncio.Future) -> None:
        """Logs a failed call here, where it is seen whether or not its caller stayed to hear of it."""
        self._working.discard(work)
        error = None if work.cancelled() else work.exception()
        if isinstance(error, EngineError):
            log.warning("admin call failed: %s", error)
        elif error is not None:
            log.error("admin call failed", exc_info=error)


def _succeeded(work: asyncio.Future) -> bool:
    return not work.cancelled() and work.exception() is None


def _check_room(buffer: memoryview, received: int, length: int) -> None:
    if received + length > len(buffer):
        raise InvalidRequest(f"more bytes than the header's tensors hold ({len(buffer)}): nothing changed")


def _specs(tensors: Iterable[pb.TensorSpec]) -> list[TensorSpec]:
    return [TensorSpec(t.name, t.dtype, tuple(t.shape)) for t in tensors]


def _uncounted() -> None:
    """The count of a call no metric counts."""
