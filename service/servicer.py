"""The Inference service: each RPC validated, mapped onto the engine, and streamed back."""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable

import grpc

from lmgate.engine.engine import Engine
from lmgate.engine.errors import EngineError, InvalidRequest
from lmgate.engine.gateway.request import Request, RequestOutput
from lmgate.v1 import lmgate_pb2 as pb
from lmgate.v1 import lmgate_pb2_grpc as pb_grpc

from . import convert
from .metrics import Metrics, StreamTracker
from .relay import OutputRelay
from .shared_memory import shared_memory_id
from .status import abort, status_code

log = logging.getLogger(__name__)
access_log = logging.getLogger("lmgate.access")
MAX_REQUEST_ID = 256  # characters; an id goes into every response and the access log
# Tokens one message carries at most: what a slow client left queued leaves in several (with 20 logprobs
# each, 4096 tokens make about 1 MB, well within a client's default limit of 4 MB a message).
MAX_TOKENS_PER_MESSAGE = 4096
DROPPED_WAIT = 60.0  # seconds a stream whose client left waits for the engine to end its request


class InferenceServicer(pb_grpc.InferenceServicer):
    """Runs on the gRPC event loop; reaches the engine only through its thread-safe calls.

    `_requests` (request id -> engine request), `_submitting` and `_cancel_once_submitted` are touched only
    on the event loop, so they need no lock.
    """

    def __init__(self, engine: Engine, metrics: Metrics, replica_id: str) -> None:
        self.engine = engine
        self.metrics = metrics
        self.replica_id = replica_id
        self._requests: dict[str, Request] = {}
        # Generates whose prompts are being encoded (request id -> session id), and those of them a Cancel asked
        # for meanwhile: cancelled as soon as they are submitted.
        self._submitting: dict[str, int] = {}
        self._cancel_once_submitted: set[str] = set()
        # Its own threads: the default pool also runs admin calls, which can wait minutes for the engine
        self._encoders = ThreadPoolExecutor(max_workers=4, thread_name_prefix="lmgate-encode")
        self._relay: OutputRelay | None = None  # made on the event loop, by the first Generate
        self._dropped: set[asyncio.Future] = set()  # `_end_dropped` tasks, held until done

    def close(self) -> None:
        self._encoders.shutdown(wait=False)

    @property
    def busy(self) -> bool:
        """A Generate stream is open."""
        return bool(self._requests or self._submitting)

    async def Start(self, request: pb.StartRequest, context: grpc.aio.ServicerContext) -> pb.StartResponse:
        try:
            session_id = self.engine.start_session(request.session_id)
            epoch = self.engine.session_epoch(session_id)  # NOT_FOUND if an End came between
        except EngineError as exc:
            await abort(context, exc)
        self.metrics.sessions_started.inc()
        return pb.StartResponse(session_id=session_id, epoch=epoch)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        relay = self._relay = self._relay or OutputRelay(asyncio.get_running_loop())
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        request_id = request.request_id or uuid.uuid4().hex
        # Read now: once the client has gone, the finally below runs after gRPC has freed the call, and asking
        # the context for its peer then crashes the process (grpcio 1.85).
        peer = context.peer()
        try:
            if request_id in self._requests or request_id in self._submitting:
                raise InvalidRequest(f"request_id {request_id!r} is already in use by an active request")
            if len(request_id) > MAX_REQUEST_ID or not request_id.isprintable() or " " in request_id:
                raise InvalidRequest(
                    f"request_id must be at most {MAX_REQUEST_ID} characters, with no space or control character"
                )
            prompt = convert.prompt(request)
            params = convert.sampling_params(request.sampling)
            self._submitting[request_id] = request.session_id
            try:
                engine_request = await self._submit(
                    functools.partial(
                        self.engine.submit,
                        prompt,
                        params,
                        session_id=request.session_id,
                        request_id=request_id,
                        on_output=lambda out: relay.put(outputs, out),
                        session_epoch=request.session_epoch if request.HasField("session_epoch") else None,
                    )
                )
            except asyncio.CancelledError:  # the client left while its prompt was encoded
                log_access(request_id, request.session_id, peer, "CANCELLED")
                raise
            finally:
                del self._submitting[request_id]
                cancel_now = request_id in self._cancel_once_submitted
                self._cancel_once_submitted.discard(request_id)
        except EngineError as exc:
            self.metrics.refused(status_code(exc).name)
            log_access(request_id, request.session_id, peer, status_code(exc).name)
            await abort(context, exc)
        self._requests[request_id] = engine_request
        if cancel_now:
            self.engine.cancel(engine_request)
        tracker = self.metrics.track()
        finished = False
        try:
            while not finished:
                batch = queued_behind(await outputs.get(), outputs)
                tokens = sum(len(o.token_ids) for o in batch)
                error = next((o.error for o in batch if o.error is not None), None)
                if error is not None:
                    finished = True
                    tracker.failed(error)
                    await abort(context, error)
                finished = batch[-1].finished
                tracker.tokens(tokens, batch[-1].finish_reason, batch[-1].usage)
                for response in convert.responses(batch, self.engine.tokenizer.token_text, params.logprobs_mode):
                    yield response
        finally:
            if finished:
                del self._requests[request_id]
                log_access(request_id, request.session_id, peer, tracker.outcome, tracker)
            else:  # the client disconnected or its deadline passed, with the request still running
                self.engine.cancel(engine_request)
                ending = asyncio.ensure_future(
                    self._end_dropped(request_id, request.session_id, peer, outputs, tracker)
                )
                self._dropped.add(ending)
                ending.add_done_callback(self._dropped.discard)

    async def _end_dropped(
        self, request_id: str, session_id: int, peer: str, outputs: asyncio.Queue[RequestOutput], tracker: StreamTracker
    ) -> None:
        """A stream whose client left: counted and logged once the engine has ended its request, whose last
        output says how long the prompt was (the id stays taken until then), or after DROPPED_WAIT seconds."""

        async def last_output() -> None:
            while True:
                out = await outputs.get()
                tracker.usage = out.usage or tracker.usage
                if out.finished:
                    return

        try:
            await asyncio.wait_for(last_output(), DROPPED_WAIT)
        except asyncio.TimeoutError:
            log.warning("request %s: no end from the engine %.0fs after its client left", request_id, DROPPED_WAIT)
        finally:
            tracker.finish_cancelled()
            del self._requests[request_id]
            log_access(request_id, session_id, peer, tracker.outcome, tracker)

    async def _submit(self, submit: Callable[[], Request]) -> Request:
        """`submit()` on a worker thread: encoding a long prompt takes seconds (about 2 s a million tokens), which
        every stream would wait out on the event loop. Cancelled meanwhile (its client gone), the Generate
        cancels what it submitted once that is done."""
        submitted = asyncio.get_running_loop().run_in_executor(self._encoders, submit)
        try:
            return await asyncio.shield(submitted)
        except asyncio.CancelledError:
            submitted.add_done_callback(self._cancel_submitted)
            raise

    def _cancel_submitting(self, session_id: int) -> bool:
        """A Cancel of the session whose turn is still being submitted: that turn is cancelled once it is."""
        turns = [rid for rid, sid in self._submitting.items() if sid == session_id]
        self._cancel_once_submitted.update(turns)
        return bool(turns)

    def _cancel_submitted(self, submitted: asyncio.Future) -> None:
        if not submitted.cancelled() and submitted.exception() is None:
            self.engine.cancel(submitted.result())

    async def Cancel(self, request: pb.CancelRequest, context: grpc.aio.ServicerContext) -> pb.CancelResponse:
        try:
            if request.request_id in self._submitting:
                self._cancel_once_submitted.add(request.request_id)
                cancelled = True
            elif request.request_id:
                target = self._requests.get(request.request_id)
                cancelled = target is not None and self.engine.cancel(target)
            elif request.session_id:
                cancelled = self.engine.cancel_session(request.session_id) or self._cancel_submitting(
                    request.session_id
                )
            else:
                raise InvalidRequest("set request_id or session_id")
        except EngineError as exc:
            await abort(context, exc)
        return pb.CancelResponse(cancelled=cancelled)

    async def End(self, request: pb.EndRequest, context: grpc.aio.ServicerContext) -> pb.EndResponse:
        if not request.session_id:
            await abort(context, InvalidRequest("session_id is required"))
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self.engine.end_session(request.session_id, on_done=lambda _: loop.call_soon_threadsafe(_resolve, done))
        await done
        self.metrics.sessions_ended.inc()
        return pb.EndResponse()

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        ids = await asyncio.to_thread(self.engine.tokenizer.encode, request.text, request.add_special_tokens)
        return pb.TokenizeResponse(token_ids=ids)

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        i = self.engine.info()
        return pb.InfoResponse(
            model=i.model,
            architecture=i.architecture,
            max_context_length=i.max_context_length,
            vocab_size=i.vocab_size,
            engine_loops=i.engine_loops,
            kv_blocks_total=i.kv_blocks_total,
            kv_blocks_free=i.kv_blocks_free,
            kv_block_size=i.kv_block_size,
            active_sessions=i.active_sessions,
            running_requests=i.running_sequences,
            waiting_requests=i.waiting_sequences,
            queued_requests=i.queued_requests,
            preemptions=i.preemptions,
            sleeping=bool(i.sleeping_tags),
            sleeping_tags=i.sleeping_tags,
            weights_bytes=i.weights_bytes,
            kv_cache_bytes=i.kv_cache_bytes,
            dtype=str(self.engine.dtype).removeprefix("torch."),
            dtype_reason=self.engine.dtype_reason,
            kv_cache_dtype=str(self.engine.kv_dtype).removeprefix("torch."),
            prefix_cache_queried_tokens=i.prefix_cache_queried_tokens,
            prefix_cache_hit_tokens=i.prefix_cache_hit_tokens,
            computed_tokens=i.computed_tokens,
            prefix_cache_hit_rate=i.prefix_cache_hit_tokens / max(i.prefix_cache_queried_tokens, 1),
            replica_id=self.replica_id,
            device=str(self.engine.device),
            weight_version=i.weight_version,
            paused=i.pause_mode is not None,
            pause_mode=convert.pause_mode_value(i.pause_mode),
            shared_memory_id=shared_memory_id(),
        )


def queued_behind(first: RequestOutput, outputs: asyncio.Queue[RequestOutput]) -> list[RequestOutput]:
    """`first` and the outputs queued behind it while the client was slow, to go as one message: until about
    MAX_TOKENS_PER_MESSAGE tokens, the rest left for the next."""
    batch, tokens = [first], len(first.token_ids)
    while not outputs.empty() and tokens < MAX_TOKENS_PER_MESSAGE:
        batch.append(outputs.get_nowait())
        tokens += len(batch[-1].token_ids)
    return batch


def log_access(request_id: str, session_id: int, peer: str, outcome: str, t: StreamTracker | None = None) -> None:
    """One line per Generate, finished or refused, as key=value pairs (fields of their own in JSON logs).
    `outcome`: the finish reason, or the status it ended with."""
    usage = t.usage if t else None
    if len(request_id) > MAX_REQUEST_ID:  # a refused one, which may be megabytes
        request_id = f"{request_id[:MAX_REQUEST_ID]}...({len(request_id)} characters)"
    fields = {
        "request_id": request_id,
        "session_id": session_id,
        "peer": peer,
        "prompt_tokens": usage.prompt_tokens if usage else 0,
        "completion_tokens": t.num_tokens if t else 0,
        "cached_tokens": usage.cached_tokens if usage else 0,
        "ttft_s": None if t is None or t.first_token is None else round(t.first_token, 4),
        "duration_s": round(t.duration, 4) if t else 0.0,
        "outcome": outcome,
    }
    access_log.info(" ".join(f"{k}={_plain(v)}" for k, v in fields.items()), extra={"fields": fields})


def _plain(value: object) -> str:
    """A field's value as one word of the text line: quoted where it holds a space or control character (a
    refused request_id), so no caller can write a line or field of its own."""
    text = str(value)
    return text if text.isprintable() and " " not in text else repr(text)


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
