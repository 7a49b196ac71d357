"""The Python client of lmgate: `Client` (blocking) and `AsyncClient` (asyncio), over the generated stubs.

Both have the same methods; AsyncClient's are coroutines, and its `generate` is an async iterator.
Errors are not wrapped: a failed call raises `grpc.RpcError` (`grpc.aio.AioRpcError` on AsyncClient), whose
`code()` is the status the proto documents (NOT_FOUND for an ended session, UNAVAILABLE while asleep, ...).
Passing no input, several inputs, or an unknown sampling keyword raises TypeError before anything is sent;
a sampling integer beyond its proto field's range (`seed=-1`), ValueError naming it and the range.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import functools
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncGenerator, Callable, Generator, Generic, Iterable, Iterator, Mapping, Sequence, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lmgate.v1 import lmgate_pb2 as pb
from lmgate.v1 import lmgate_pb2_grpc as pb_grpc

from .history import History
from .shared_memory import SharedMemoryFile, shared_memory_id
from .weights import COMMIT, UPLOAD_METHOD, shared_memory_stream, weight_stream
from .weight_group import init_request, update_request
from .routing import Target, channel_target
from .wire import Delta, bearer_metadata, generate_request, new_session_id, session_metadata, to_delta

DEFAULT_TARGET = "127.0.0.1:50051"
# `wait_ready` watches the Inference service's health: NOT_SERVING while the server is asleep or draining.
READY_CHECK = health_pb2.HealthCheckRequest(service=pb.DESCRIPTOR.services_by_name["Inference"].full_name)

StreamT = TypeVar("StreamT", Generator[Delta, None, None], AsyncGenerator[Delta, None])
T = TypeVar("T")
CANCEL_SECONDS = 5.0  # the deadline of the Cancel a session turn left early sends
# A resumable session's turn that gets one of these starts the session again and replays its conversation:
# NOT_FOUND, the session is gone (its replica restarted, or the route leads to another); ABORTED, the route
# leads back to a copy from before it moved, whose history is not the conversation's.
RESTART_CODES = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ABORTED)
# A turn that ends in one of these was cancelled on the server (a deadline, the call closed), whose session
# keeps what it generated, as the history does. After any other error the server's session may have left the
# turn out (a failed step) or kept it (a proxy that broke the call): the next turn ends it first and starts
# again from the history, which leaves the turn out.
CANCEL_CODES = (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)
# A turn refused with one of these before its first message never ran: the server's session is as it was
# (a bad parameter, a prompt too long, a full server, a credential). Not FAILED_PRECONDITION: a turn left
# early may still run there, holding more than the history, which the next turn then replays over.
REFUSAL_CODES = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNIMPLEMENTED,
)
# `pause(mode)`: what a pause does to the requests running or queued (the proto's PauseMode).
PAUSE_MODES = {"abort": pb.PAUSE_MODE_ABORT, "wait": pb.PAUSE_MODE_WAIT, "keep": pb.PAUSE_MODE_KEEP}


def _pause_request(mode: str, keep_kv: bool) -> pb.PauseRequest:
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
    return pb.PauseRequest(mode=PAUSE_MODES[mode], keep_kv=keep_kv)


async def _to_thread_to_its_end(call: Callable[[], T]) -> T:
    """`call` in a thread; a cancel waits for it to end before it is raised (a write into the client's file
    goes on in its thread: the lock it is under must not be let go before it has)."""
    work = asyncio.ensure_future(asyncio.to_thread(call))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        await asyncio.wait([work])
        raise


def _path_alone(shared_memory: bool | None) -> None:
    if shared_memory:
        raise ValueError("shared_memory carries the weights themselves: a path is read by the server")


def _update_pause(pause: str, keep_kv: bool) -> pb.PauseRequest | None:
    """`update_weights`' pause: its request, or None for none (then keep_kv, a pause's, is refused)."""
    if pause:
        return _pause_request(pause, keep_kv)
    if keep_kv:
        raise ValueError("keep_kv is a pause's: give pause= too")
    return None


class _PauseBeforeCommit:
    """`update_weights(..., pause=...)`'s pause: made on the thread that reads the request stream (gRPC's)
    once every chunk is sent, before the commit, unless the call has ended meanwhile (`close`); `close` waits
    for a pause under way, so a pause the server made is always seen, and resumed."""

    def __init__(self, pause: Callable[[], Paused]) -> None:
        self._pause = pause
        self._lock = threading.Lock()
        self._closed = False
        self._outcome: Paused | grpc.RpcError | None = None

    def messages(self, stream: Iterator[bytes]) -> Iterator[bytes]:
        """`stream` (without its commit), the pause, the commit; a pause that fails ends it uncommitted."""
        yield from stream
        with self._lock:
            if self._closed:
                return
            try:
                self._outcome = self._pause()
            except grpc.RpcError as exc:
                self._outcome = exc
                return
        yield COMMIT

    def close(self) -> Paused | grpc.RpcError | None:
        """No pause after this; the pause made (or its error), if any."""
        with self._lock:
            self._closed = True
            return self._outcome


class _AsyncPauseBeforeCommit:
    """As `_PauseBeforeCommit`, in the event loop: the pause a task of its own, which `close` awaits (a
    cancelled call stops the stream's reading, not a Pause already sent)."""

    def __init__(self, pausing: AsyncPause) -> None:
        self._pausing = pausing
        self._closed = False
        self._task: asyncio.Future | None = None

    async def messages(self, stream: Iterator[bytes]) -> AsyncGenerator[bytes, None]:
        for message in stream:
            yield message
        if self._closed:
            return
        self._task = asyncio.ensure_future(self._pausing)
        try:
            await asyncio.shield(self._task)
        except grpc.RpcError:
            return
        yield COMMIT

    async def close(self) -> bool | grpc.RpcError | None:
        """No pause after this; where the pause was made, whether it is this call's to end (the server was not
        paused already); its error where it failed; None if none began."""
        self._closed = True
        if self._task is None:
            return None
        try:
            await self._task
        except grpc.RpcError as exc:
            return exc
        return not self._pausing.already_paused


class Paused:
    """A pause under way (`Client.pause`): leaving its `with` block resumes, unless the server was paused
    already when it came (`already_paused`: an earlier pause, perhaps another client's, which its maker ends).
    `requests`: those the pause aborted or froze."""

    def __init__(self, requests: int, resume: Callable[[], None], already_paused: bool = False) -> None:
        self.requests = requests
        self.already_paused = already_paused
        self._resume = resume

    def end(self) -> None:
        """Resumes, where this pause is the one that paused the server."""
        if not self.already_paused:
            self._resume()

    def __enter__(self) -> Paused:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()


class AsyncPause:
    """`AsyncClient.pause`: awaited, the number of requests aborted or frozen; as `async with`, a pause that
    resumes when the block is left, unless the server was paused already (as `Paused`)."""

    def __init__(self, client: AsyncClient, request: pb.PauseRequest) -> None:
        self._client, self._request = client, request
        self.requests = 0
        self.already_paused = False

    async def _pause(self) -> int:
        client = self._client
        response = await client._admin.Pause(self._request, timeout=client._timeout, metadata=client._admin_metadata)
        self.requests, self.already_paused = response.requests, response.already_paused
        return self.requests

    def __await__(self) -> Generator[Any, None, int]:
        return self._pause().__await__()

    async def __aenter__(self) -> AsyncPause:
        await self._pause()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self.already_paused:
            await self._client.resume()


class _ClientBase(abc.ABC, Generic[StreamT]):
    """What the two clients share: stubs, call options and building a Generate call."""

    def __init__(
        self,
        channel: grpc.Channel | grpc.aio.Channel,
        admin_token: str | None,
        api_key: str | None,
        timeout: float | None,
        routed: bool,
    ) -> None:
        self._channel = channel
        self._inference = pb_grpc.InferenceStub(channel)
        self._admin_stub = pb_grpc.AdminStub(channel)
        # UpdateWeightsFromTensors takes its messages as `weights` serializes them: no protobuf message per chunk
        self._upload_call = channel.stream_unary(
            UPLOAD_METHOD, request_serializer=None, response_deserializer=pb.UpdateWeightsResponse.FromString
        )
        self._routed = routed
        self._admin_metadata = bearer_metadata(admin_token)
        self._inference_metadata = bearer_metadata(api_key)
        self._timeout = timeout
        self._shared_memory: SharedMemoryFile | None = None  # update_weights' file, made at its first use
        self._server_shares_memory: bool | None = None  # whether the server reads this /dev/shm: asked once
        self._closed = False

    @property
    def _admin(self) -> pb_grpc.AdminStub:
        self._one_server()
        return self._admin_stub

    @property
    def _upload(self) -> Any:
        """UpdateWeightsFromTensors' call (sync or async), for one server as every Admin call."""
        self._one_server()
        return self._upload_call

    def _one_server(self) -> None:
        """Admin calls are one server's: a client routed over several replicas (by ring hash, skipping those that
        sleep) would pause, put to sleep or update one of them, at random; ValueError instead."""
        if self._routed:
            raise ValueError(
                "Admin calls (pause, sleep, wakeup, weight updates) need one server: this client routes over a list of "
                "replicas (skipping those that sleep), so make a Client for each replica's own address"
            )

    def _learn_shared_memory(self, info: pb.InfoResponse | grpc.RpcError) -> None:
        """Remembers whether the server that answered `info` (Info's answer, or its failure) reads this machine's
        /dev/shm as this user: not where this client may not call Info (an api key it lacks); a failure that
        may pass (a deadline) says nothing, so this push sends chunks and the next asks again."""
        if isinstance(info, grpc.RpcError):
            if info.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                self._server_shares_memory = False
            return
        self._server_shares_memory = bool(info.shared_memory_id) and info.shared_memory_id == shared_memory_id()

    def _unread(self, exc: BaseException) -> bool:
        """Whether a push by this client's file was refused as a file the server cannot read (the refusal names
        it): a server that answered Info as this machine's, and reads another /dev/shm (a proxy's other one)."""
        if not isinstance(exc, grpc.RpcError) or exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
            return False
        return self._shared_memory is not None and self._shared_memory.name in (exc.details() or "")

    def _tensor_messages(
        self, weights: Mapping[str, Any], version: str, shared_memory: bool | None, commit: bool
    ) -> Iterator[bytes]:
        """An UpdateWeightsFromTensors stream's messages, serialized: the bytes in chunks (`shared_memory` False), or
        written now into this client's shared-memory file (True; None: where /dev/shm has room for them, else
        in chunks). Its caller holds the file's lock until the call returns."""
        if shared_memory is False:
            return weight_stream(weights, version, commit=commit)
        if self._closed:
            raise ValueError("the client is closed")
        try:
            if self._shared_memory is None:
                self._shared_memory = SharedMemoryFile()
            spare = shared_memory is None  # by default, /dev/shm keeps room for the server's own file
            return iter(shared_memory_stream(weights, self._shared_memory, version, commit, spare))
        except OSError:
            if shared_memory:
                raise
            self._close_shared_memory()  # no room there (a container's 64 MiB /dev/shm): the next push tries again
            return weight_stream(weights, version, commit=commit)

    def _after_failed_push(self, exc: BaseException) -> None:
        """A push by the file that was not refused (a deadline, a cancel) may still be read by the server: its
        file goes, and the next makes a new one. A refused one (INVALID_ARGUMENT) has been read no more."""
        if not (isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.INVALID_ARGUMENT):
            self._close_shared_memory()

    def _close_shared_memory(self) -> None:
        """The file removed, its caller holding its lock: at `close`, and after a push `_after_failed_push` says."""
        if self._shared_memory is not None:
            self._shared_memory.close()
            self._shared_memory = None

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[Mapping[str, str]] | None = None,
        token_ids: Sequence[int] | None = None,
        session_id: int = 0,
        request_id: str = "",
        session_epoch: int | None = None,
        **sampling: Any,
    ) -> StreamT:
        """Streams one turn as `Delta`s; the last carries finish_reason and usage.

        Give exactly one of `prompt`, `messages` ([{"role": ..., "content": ...}], rendered by the server's
        chat template) or `token_ids`. `session_id` 0 is a stateless request; `request_id` "" lets the server
        pick one (every delta carries it); `session_epoch`, the session's copy the turn is for (ABORTED
        elsewhere; None: any). `sampling` are SamplingParams' fields (max_new_tokens, temperature,
        top_p, top_k, min_p, seed, stop, ...); `logprobs=N` returns each token's log-probability and N
        alternatives, with `logprobs_mode="raw"` (the default: the model's distribution) or "processed" (the
        distribution the token was drawn from), which each such delta's `logprobs_mode` repeats. The request
        is built and checked here; it is sent now, and leaving the iterator early cancels it on the server (a
        session's turn by a Cancel call first, so that the session's next turn may follow at once).
        """
        request = generate_request(
            prompt,
            messages=messages,
            token_ids=token_ids,
            session_id=session_id,
            request_id=request_id,
            session_epoch=session_epoch,
            **sampling,
        )
        return self._send(request)

    def _send(self, request: pb.GenerateRequest) -> StreamT:
        """Starts the Generate call; its responses as Deltas."""
        if (
            request.session_id and not request.request_id
        ):  # known before any reply: a turn left early is cancelled by it
            request.request_id = uuid.uuid4().hex
        metadata = self._session_metadata(request.session_id)
        return self._stream(self._inference.Generate(request, timeout=self._timeout, metadata=metadata), request)

    def _session_metadata(self, session_id: int) -> tuple[tuple[str, str], ...]:
        """Inference metadata plus the session's routing key, so a proxy sends its calls to one replica."""
        return self._inference_metadata + session_metadata(session_id)

    @abc.abstractmethod
    def _stream(self, call: Any, request: pb.GenerateRequest) -> StreamT:
        """The call's responses as Deltas, cancelling the call if the caller stops early. A session's turn is
        cancelled by a Cancel call before the stream goes, even before its first reply (a long prefill):
        dropping the stream alone tells the server without an order, and a next turn that came first would
        find the session still generating."""

    def _cancel_turn(
        self, request: pb.GenerateRequest, last: pb.GenerateResponse | None, exc: BaseException
    ) -> tuple[pb.CancelRequest, dict[str, Any]] | None:
        """Cancel's request and call options for a session's turn left before its last reply (`last`, the
        latest one, if any) by `exc`; None where there is nothing to cancel (a stateless request, a turn that
        ended, or a call the server ended with its status). By its request id (by the session, a late close
        could cancel the session's next turn), routed by the session, within CANCEL_SECONDS (a server that no
        longer answers must not hold up the caller's `break`)."""
        if not request.session_id or (last is not None and last.finish_reason):
            return None
        if isinstance(exc, grpc.RpcError) and exc.code() not in CANCEL_CODES:
            return None
        options = {"timeout": CANCEL_SECONDS, "metadata": self._session_metadata(request.session_id)}
        return pb.CancelRequest(request_id=request.request_id), options


@dataclass(frozen=True, slots=True)
class Tls:
    """TLS to the server: `ca`, the PEM bundle its certificate chains to (None: the system's roots); `cert`
    and `key`, this client's certificate and key where the server asks for one (mutual TLS); `server_name`,
    the name its certificate carries where that is not the target's host. A list of replicas needs it: the
    channel's one authority would be the whole list, which no certificate names."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):  # grpc would abort the process on a certificate without its key
            raise ValueError("Tls: cert and key go together (a client certificate and its key)")

    def credentials(self) -> grpc.ChannelCredentials:
        read = lambda path: Path(path).read_bytes() if path else None  # noqa: E731
        return grpc.ssl_channel_credentials(read(self.ca), read(self.key), read(self.cert))

    def options(self, target: Target) -> list[tuple[str, str]]:
        """Channel options: the name to verify, which a list of replicas must give."""
        if self.server_name:
            return [("grpc.ssl_target_name_override", self.server_name)]
        if not isinstance(target, str):
            raise ValueError("Tls: a list of replicas needs server_name, the name their certificate carries")
        return []


def _channel_args(target: Target, tls: Tls | None) -> tuple[str, list[tuple[str, str]]]:
    """The channel's target and options, TLS's included."""
    address, options = channel_target(target)
    return address, options + (tls.options(target) if tls else [])


class Client(_ClientBase[Generator[Delta, None, None]]):
    """A blocking client over one channel. `target` is "host:port", or a list of replicas' "ip:port" routed
    by ring hash on the session id (see `routing`; Admin calls then raise ValueError: each is one server's).
    `timeout` is each call's deadline in seconds (streams included); `admin_token` is sent as 'authorization:
    Bearer <token>' on Admin calls only, `api_key` the same way on Inference calls only; `tls` makes the
    channel TLS."""

    def __init__(
        self,
        target: Target = DEFAULT_TARGET,
        *,
        admin_token: str | None = None,
        api_key: str | None = None,
        tls: Tls | None = None,
        timeout: float | None = None,
    ) -> None:
        address, options = _channel_args(target, tls)
        channel = (
            grpc.secure_channel(address, tls.credentials(), options) if tls else grpc.insecure_channel(address, options)
        )
        super().__init__(channel, admin_token, api_key, timeout, routed=not isinstance(target, str))
        self._shared_memory_lock = threading.Lock()  # one update at a time writes the file and has it read

    def _stream(self, call: Any, request: pb.GenerateRequest) -> Generator[Delta, None, None]:
        last = None
        try:
            for last in call:
                yield to_delta(last)
        except BaseException as exc:  # closed early, or an exception thrown in while it waited (a deadline, Ctrl-C)
            cancel = self._cancel_turn(request, last, exc)
            if cancel is not None:
                with contextlib.suppress(grpc.RpcError, ValueError):  # ValueError: the channel has closed
                    self._inference.Cancel(cancel[0], **cancel[1])
            raise
        finally:
            call.cancel()  # a no-op once the stream has ended; otherwise frees the server's work

    def start(self, session_id: int = 0, *, resume: bool = False) -> Session:
        """Opens a session (0: a random id picked here, so its first call can carry the routing key too); use
        it as a context manager to end it. `resume`: see `Session`."""
        return Session(self, *self._start(session_id or new_session_id()), resume)

    def open(self, session_id: int) -> int:
        """The Start call itself: opens the session `session_id` where its routing key leads."""
        return self._start(session_id)[0]

    def _start(self, session_id: int) -> tuple[int, int]:
        """Start: the session's id and the epoch of the copy it opened."""
        request = pb.StartRequest(session_id=session_id)
        reply = self._inference.Start(request, timeout=self._timeout, metadata=self._session_metadata(session_id))
        return reply.session_id, reply.epoch

    def wait_ready(self, timeout: float) -> None:
        """Returns once the server serves (its Inference health: SERVING), waiting at most `timeout` seconds for
        a server that is still starting (its port not open yet: the call waits for the connection) or asleep;
        grpc.RpcError DEADLINE_EXCEEDED after that."""
        health = health_pb2_grpc.HealthStub(self._channel)
        for reply in health.Watch(READY_CHECK, timeout=timeout, wait_for_ready=True):
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return

    def cancel(self, request_id: str | None = None, session_id: int = 0) -> bool:
        """Cancels a request by id, or a session's active turn; True if something was running or queued."""
        request = pb.CancelRequest(request_id=request_id or "", session_id=session_id)
        return self._inference.Cancel(
            request, timeout=self._timeout, metadata=self._session_metadata(session_id)
        ).cancelled

    def end(self, session_id: int) -> None:
        """Ends a session: cancels its turn and frees its KV cache. Idempotent."""
        self._inference.End(
            pb.EndRequest(session_id=session_id), timeout=self._timeout, metadata=self._session_metadata(session_id)
        )

    def info(self) -> pb.InfoResponse:
        return self._inference.Info(pb.InfoRequest(), timeout=self._timeout, metadata=self._inference_metadata)

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        request = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list(
            self._inference.Tokenize(request, timeout=self._timeout, metadata=self._inference_metadata).token_ids
        )

    def sleep(self, level: int = 1) -> None:
        """Admin: ends every stream and session, then frees the KV cache (level 1) and the weights (level 2)."""
        self._admin.Sleep(pb.SleepRequest(level=level), timeout=self._timeout, metadata=self._admin_metadata)

    def wakeup(self, tags: Iterable[str] = ()) -> pb.WakeupResponse:
        """Admin: restores "weights" and / or "kv_cache" (none: both); says what it restored and what still
        sleeps."""
        return self._admin.Wakeup(pb.WakeupRequest(tags=tags), timeout=self._timeout, metadata=self._admin_metadata)

    def update_weights(
        self,
        weights: str | Mapping[str, Any],
        version: str = "",
        pause: str = "",
        keep_kv: bool = False,
        shared_memory: bool | None = None,
    ) -> str:
        """Admin: new weights of the same architecture, served as `version` (empty: the server counts), which
        is returned. `weights`: a HF directory or GGUF file on the server, or the weights themselves, every
        one of the model's by Hugging Face name (a `state_dict()`: torch tensors, float32, float16 or
        bfloat16), streamed in chunks (`weights.weight_stream`; `shared_memory=False`), or written into a
        file of /dev/shm this client keeps for its next updates (`close` removes it), which the server reads
        (True: a server on this machine; None, the default: where the server's Info, asked once, says it reads
        this machine's /dev/shm as this user, and /dev/shm has room for them twice over; a push the server then
        cannot read goes again in chunks, as do the next). `pause` (a `pause` mode, with `keep_kv`):
        generation pauses for the commit alone and resumes after it (unless it was paused already), while the
        bytes travel it goes on, so "keep"'s streams wait for the install only (with weights themselves; a
        path pauses for the call)."""
        self._one_server()
        request = _update_pause(pause, keep_kv)  # before a byte is sent
        if isinstance(weights, str):
            _path_alone(shared_memory)
            with self._pause(request) if request is not None else contextlib.nullcontext():
                path = pb.UpdateWeightsRequest(path=weights, weight_version=version)
                return self._admin.UpdateWeights(
                    path, timeout=self._timeout, metadata=self._admin_metadata
                ).weight_version
        if shared_memory is None and self._server_shares_memory is None:
            try:
                self._learn_shared_memory(self.info())
            except grpc.RpcError as exc:
                self._learn_shared_memory(exc)
        if shared_memory is not False and (shared_memory or self._server_shares_memory):
            with self._shared_memory_lock:
                try:
                    return self._update_from_tensors(weights, version, request, shared_memory)
                except BaseException as exc:
                    self._after_failed_push(exc)
                    if shared_memory is not None or not self._unread(exc):
                        raise
                    self._server_shares_memory = False  # refused, nothing changed: the same push in chunks
        return self._update_from_tensors(weights, version, request, False)

    def _update_from_tensors(
        self, weights: Mapping[str, Any], version: str, request: pb.PauseRequest | None, shared_memory: bool | None
    ) -> str:
        messages = self._tensor_messages(weights, version, shared_memory, commit=request is None)
        if request is None:
            return self._upload(messages, timeout=self._timeout, metadata=self._admin_metadata).weight_version
        gate = _PauseBeforeCommit(functools.partial(self._pause, request))
        try:
            return self._upload(
                gate.messages(messages),
                timeout=self._timeout,
                metadata=self._admin_metadata,
            ).weight_version
        except grpc.RpcError:
            if isinstance(failed := gate.close(), grpc.RpcError):
                raise failed from None  # the stream ended without its commit
            raise
        finally:
            if isinstance(paused := gate.close(), Paused):
                paused.end()

    def init_weight_group(
        self,
        master_address: str,
        master_port: int,
        *,
        world_size: int = 2,
        rank_offset: int = 1,
        backend: str = "gloo",
        timeout_seconds: int = 60,
    ) -> None:
        """Admin: the server joins, at `rank_offset`, the torch.distributed group whose store a trainer (rank
        0) serves at master_address:master_port; returns once the group is made, which the trainer makes its
        side of meanwhile (`weight_group.WeightGroup` does both). DEADLINE_EXCEEDED after `timeout_seconds`;
        FAILED_PRECONDITION while the server has a group."""
        request = init_request(master_address, master_port, world_size, rank_offset, backend, timeout_seconds)
        self._admin.InitWeightUpdateGroup(request, timeout=self._timeout, metadata=self._admin_metadata)

    def update_weights_from_distributed(
        self, tensors: Sequence[pb.TensorSpec], version: str = "", bucket_bytes: int = 0
    ) -> str:
        """Admin: the server receives the tensors `tensors` announce, broadcast by the trainer over the group
        meanwhile in buckets of `bucket_bytes` (0: 512 MiB), and serves them as `version` (empty: the server
        counts), which is returned. `weight_group.WeightGroup.push` does both sides."""
        request = update_request(tensors, version, bucket_bytes)
        return self._admin.UpdateWeightsFromDistributed(
            request, timeout=self._timeout, metadata=self._admin_metadata
        ).weight_version

    def destroy_weight_group(self) -> None:
        """Admin: the server leaves its weight group, if it has one."""
        request = pb.DestroyWeightUpdateGroupRequest()
        self._admin.DestroyWeightUpdateGroup(request, timeout=self._timeout, metadata=self._admin_metadata)

    def pause(self, mode: str = "abort", keep_kv: bool = False) -> Paused:
        """Admin: stops generation for a weight update, returning once done: "abort" ends what runs or is queued
        (finish_reason "aborted", partial output), "wait" lets it finish, "keep" freezes it until the resume
        (after an update meanwhile its KV is recomputed by the new weights, unless `keep_kv`). New Generate
        calls are refused (UNAVAILABLE) until `resume`; as a context manager, leaving the block resumes:
        `with client.pause("keep"): client.update_weights(model.state_dict())` (unless the server was paused
        already, `Paused.already_paused`: a pause another caller made is left for it to end)."""
        return self._pause(_pause_request(mode, keep_kv))

    def _pause(self, request: pb.PauseRequest) -> Paused:
        response = self._admin.Pause(request, timeout=self._timeout, metadata=self._admin_metadata)
        return Paused(response.requests, self.resume, response.already_paused)

    def resume(self) -> None:
        """Admin: ends a pause; frozen requests go on, new ones are admitted (unless the server sleeps)."""
        self._admin.Resume(pb.ResumeRequest(), timeout=self._timeout, metadata=self._admin_metadata)

    def close(self) -> None:
        self._channel.close()
        with self._shared_memory_lock:  # after an update under way: its file is not written once closed
            self._closed = True
            self._close_shared_memory()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_ClientBase[AsyncGenerator[Delta, None]]):
    """`Client` for asyncio: the same methods as coroutines, `generate` as an async iterator.
    Create it inside the event loop that uses it (`async with AsyncClient(...) as client:`)."""

    def __init__(
        self,
        target: Target = DEFAULT_TARGET,
        *,
        admin_token: str | None = None,
        api_key: str | None = None,
        tls: Tls | None = None,
        timeout: float | None = None,
    ) -> None:
        address, options = _channel_args(target, tls)
        channel = (
            grpc.aio.secure_channel(address, tls.credentials(), options)
            if tls
            else grpc.aio.insecure_channel(address, options)
        )
        super().__init__(channel, admin_token, api_key, timeout, routed=not isinstance(target, str))
        self._shared_memory_lock = asyncio.Lock()  # as Client's

    async def _stream(self, call: Any, request: pb.GenerateRequest) -> AsyncGenerator[Delta, None]:
        last = None
        try:
            async for last in call:
                yield to_delta(last)
        except (
            BaseException
        ) as exc:  # closed early, or an exception thrown in while it waited (a timeout's CancelledError)
            cancel = self._cancel_turn(request, last, exc)
            if cancel is not None:
                with contextlib.suppress(
                    grpc.aio.AioRpcError, grpc.aio.UsageError
                ):  # UsageError: the channel has closed
                    await self._inference.Cancel(cancel[0], **cancel[1])
            raise
        finally:
            call.cancel()

    async def start(self, session_id: int = 0, *, resume: bool = False) -> AsyncSession:
        return AsyncSession(self, *await self._start(session_id or new_session_id()), resume)

    async def open(self, session_id: int) -> int:
        return (await self._start(session_id))[0]

    async def _start(self, session_id: int) -> tuple[int, int]:
        request = pb.StartRequest(session_id=session_id)
        reply = await self._inference.Start(request, timeout=self._timeout, metadata=self._session_metadata(session_id))
        return reply.session_id, reply.epoch

    async def wait_ready(self, timeout: float) -> None:
        health = health_pb2_grpc.HealthStub(self._channel)
        async for reply in health.Watch(READY_CHECK, timeout=timeout, wait_for_ready=True):
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return

    async def cancel(self, request_id: str | None = None, session_id: int = 0) -> bool:
        request = pb.CancelRequest(request_id=request_id or "", session_id=session_id)
        return (
            await self._inference.Cancel(request, timeout=self._timeout, metadata=self._session_metadata(session_id))
        ).cancelled

    async def end(self, session_id: int) -> None:
        await self._inference.End(
            pb.EndRequest(session_id=session_id), timeout=self._timeout, metadata=self._session_metadata(session_id)
        )

    async def info(self) -> pb.InfoResponse:
        return await self._inference.Info(pb.InfoRequest(), timeout=self._timeout, metadata=self._inference_metadata)

    async def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        request = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list(
            (
                await self._inference.Tokenize(request, timeout=self._timeout, metadata=self._inference_metadata)
            ).token_ids
        )

    async def sleep(self, level: int = 1) -> None:
        await self._admin.Sleep(pb.SleepRequest(level=level), timeout=self._timeout, metadata=self._admin_metadata)

    async def wakeup(self, tags: Iterable[str] = ()) -> pb.WakeupResponse:
        return await self._admin.Wakeup(
            pb.WakeupRequest(tags=tags), timeout=self._timeout, metadata=self._admin_metadata
        )

    async def update_weights(
        self,
        weights: str | Mapping[str, Any],
        version: str = "",
        pause: str = "",
        keep_kv: bool = False,
        shared_memory: bool | None = None,
    ) -> str:
        """As `Client.update_weights` (the shared-memory file written off the event loop)."""
        self._one_server()
        request = _update_pause(pause, keep_kv)
        if isinstance(weights, str):
            _path_alone(shared_memory)
            path = pb.UpdateWeightsRequest(path=weights, weight_version=version)
            if request is None:
                response = await self._admin.UpdateWeights(path, timeout=self._timeout, metadata=self._admin_metadata)
            else:
                async with AsyncPause(self, request):
                    response = await self._admin.UpdateWeights(
                        path, timeout=self._timeout, metadata=self._admin_metadata
                    )
            return response.weight_version
        if shared_memory is None and self._server_shares_memory is None:
            try:
                self._learn_shared_memory(await self.info())
            except grpc.RpcError as exc:
                self._learn_shared_memory(exc)
        if shared_memory is not False and (shared_memory or self._server_shares_memory):
            async with self._shared_memory_lock:
                try:
                    return await self._update_from_tensors(weights, version, request, shared_memory)
                except BaseException as exc:
                    self._after_failed_push(exc)
                    if shared_memory is not None or not self._unread(exc):
                        raise
                    self._server_shares_memory = False  # as Client's
        return await self._update_from_tensors(weights, version, request, False)

    async def _update_from_tensors(
        self, weights: Mapping[str, Any], version: str, request: pb.PauseRequest | None, shared_memory: bool | None
    ) -> str:
        make = functools.partial(self._tensor_messages, weights, version, shared_memory, commit=request is None)
        messages = await _to_thread_to_its_end(make) if shared_memory is not False else make()  # the file: seconds
        if request is None:
            response = await self._upload(messages, timeout=self._timeout, metadata=self._admin_metadata)
            return response.weight_version
        gate = _AsyncPauseBeforeCommit(AsyncPause(self, request))
        try:
            response = await self._upload(
                gate.messages(messages),
                timeout=self._timeout,
                metadata=self._admin_metadata,
            )
        except grpc.RpcError:
            if isinstance(failed := await gate.close(), grpc.RpcError):
                raise failed from None
            raise
        finally:
            if await gate.close() is True:
                await self.resume()
        return response.weight_version

    async def init_weight_group(
        self,
        master_address: str,
        master_port: int,
        *,
        world_size: int = 2,
        rank_offset: int = 1,
        backend: str = "gloo",
        timeout_seconds: int = 60,
    ) -> None:
        request = init_request(master_address, master_port, world_size, rank_offset, backend, timeout_seconds)
        await self._admin.InitWeightUpdateGroup(request, timeout=self._timeout, metadata=self._admin_metadata)

    async def update_weights_from_distributed(
        self, tensors: Sequence[pb.TensorSpec], version: str = "", bucket_bytes: int = 0
    ) -> str:
        request = update_request(tensors, version, bucket_bytes)
        response = await self._admin.UpdateWeightsFromDistributed(
            request, timeout=self._timeout, metadata=self._admin_metadata
        )
        return response.weight_version

    async def destroy_weight_group(self) -> None:
        request = pb.DestroyWeightUpdateGroupRequest()
        await self._admin.DestroyWeightUpdateGroup(request, timeout=self._timeout, metadata=self._admin_metadata)

    def pause(self, mode: str = "abort", keep_kv: bool = False) -> AsyncPause:
        """As `Client.pause`: `await client.pause("wait")`, or `async with client.pause("keep"): ...`."""
        return AsyncPause(self, _pause_request(mode, keep_kv))

    async def resume(self) -> None:
        await self._admin.Resume(pb.ResumeRequest(), timeout=self._timeout, metadata=self._admin_metadata)

    async def close(self) -> None:
        await self._channel.close()
        async with self._shared_memory_lock:
            self._closed = True
            self._close_shared_memory()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _SessionBase(Generic[StreamT]):
    """A conversation on the server: each turn continues its history and reuses its KV cache.

    With `resume=True` the session also keeps its conversation here: when a turn finds the session gone
    (NOT_FOUND: its replica restarted, or a proxy now routes it to another) or finds an older copy of it
    (ABORTED: the route came back to a replica it had left, whose copy missed the turns since), the session
    is started again under the same id and the whole conversation is sent as that turn's prefix. The caller sees one slower
    turn whose tokens are those of a stateless request over the whole conversation. Its turns must all be of
    one kind (prompts, messages or token ids)."""

    def __init__(
        self, client: _ClientBase[StreamT], session_id: int, epoch: int | None = None, resume: bool = False
    ) -> None:
        self.client: _ClientBase[StreamT] = client
        self.id = session_id
        self.epoch = epoch  # the copy of the session this one's turns are for (None: any)
        self.history = History() if resume else None
        self._sent: Any = None  # the stream of the turn sent last, closed when the next is sent
        # A resumable session's turn failed: the server's copy may hold what the history does not, so the next
        # turn ends it and replays the history
        self._stale = False

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[Mapping[str, str]] | None = None,
        token_ids: Sequence[int] | None = None,
        request_id: str = "",
        **sampling: Any,
    ) -> StreamT:
        """One turn: the new input is appended to the history (a prompt gets the model's BOS on the session's
        first turn only; messages are rendered on their own, so send only the new ones). The turn is sent
        when its stream is first read. One turn at a time: the previous turn's stream, if sent and left
        unfinished (a `break` that kept it), is closed first, which cancels that turn; one that another thread
        or task is still reading makes this turn FAILED_PRECONDITION."""
        if self.history is None:
            request = generate_request(
                prompt,
                messages=messages,
                token_ids=token_ids,
                session_id=self.id,
                request_id=request_id,
                session_epoch=self.epoch,
                **sampling,
            )
            start = functools.partial(self.client._send, request)
        else:
            start = functools.partial(
                self._resumable, self.history.turn_input(prompt, messages, token_ids), request_id, sampling
            )
        return self._after(start)

    @abc.abstractmethod
    def _after(self, start: Callable[[], StreamT]) -> StreamT:
        """The stream `start` gives, sent once the turn sent before it is closed."""

    @abc.abstractmethod
    def _resumable(self, turn: dict[str, Any], request_id: str, sampling: dict[str, Any]) -> StreamT:
        """The turn's deltas, recorded in the history; a session found gone is started again and replayed."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id})"


class Session(_SessionBase[Generator[Delta, None, None]]):
    """A session of a `Client`; `with client.start() as session:` ends it on exit."""

    client: Client

    def _after(self, start: Callable[[], Generator[Delta, None, None]]) -> Generator[Delta, None, None]:
        if self._sent is not None:
            with contextlib.suppress(ValueError):  # another thread is reading it: the server refuses this turn
                self._sent.close()
        self._sent = stream = start()
        yield from stream

    def _resumable(
        self, turn: dict[str, Any], request_id: str, sampling: dict[str, Any]
    ) -> Generator[Delta, None, None]:
        assert self.history is not None  # generate sends only a resumable session's turns here
        deltas: list[Delta] = []
        if self._stale:  # a turn failed: end the copy that may hold it (raises while it cannot be reached)
            self.client.end(self.id)
            self._stale = False
            stream = self._reopened(turn, request_id, sampling, deltas)
        else:
            stream = self.client.generate(
                **turn, session_id=self.id, request_id=request_id, session_epoch=self.epoch, **sampling
            )
            try:
                deltas.append(next(stream))
            except grpc.RpcError as err:
                if err.code() not in RESTART_CODES:
                    self._stale = err.code() not in CANCEL_CODES + REFUSAL_CODES
                    raise
                if err.code() == grpc.StatusCode.ABORTED:  # a copy from before the session moved: not ours
                    self.client.end(self.id)
                stream = self._reopened(turn, request_id, sampling, deltas)
        kept = True
        try:
            yield deltas[0]
            for delta in stream:
                deltas.append(delta)
                yield delta
        except grpc.RpcError as err:
            kept = err.code() in CANCEL_CODES
            self._stale = not kept
            raise
        finally:
            stream.close()  # a caller who stops early cancels the call now, not when the collector runs
            if kept:
                self.history.record(turn, deltas)

    def _reopened(
        self, turn: dict[str, Any], request_id: str, sampling: dict[str, Any], deltas: list[Delta]
    ) -> Generator[Delta, None, None]:
        """The session started again, its turn sent after the whole conversation; its first delta in `deltas`."""
        assert self.history is not None  # only a resumable session's turns are replayed
        _, self.epoch = self.client._start(self.id)
        stream = self.client.generate(
            **self.history.replay(turn), session_id=self.id, request_id=request_id, session_epoch=self.epoch, **sampling
        )
        try:
            deltas.append(next(stream))
        except BaseException:  # the reopened session is empty: end it, so the next turn replays again
            with contextlib.suppress(grpc.RpcError):
                self.client.end(self.id)
            raise
        return stream

    def cancel(self) -> bool:
        """Stops the active turn (its stream ends "cancelled"); the history keeps what was generated."""
        return self.client.cancel(session_id=self.id)

    def end(self) -> None:
        self.client.end(self.id)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()


class AsyncSession(_SessionBase[AsyncGenerator[Delta, None]]):
    """A session of an `AsyncClient`; `async with await client.start() as session:` ends it on exit."""

    client: AsyncClient

    async def _after(self, start: Callable[[], AsyncGenerator[Delta, None]]) -> AsyncGenerator[Delta, None]:
        if self._sent is not None:
            with contextlib.suppress(RuntimeError):  # another task is reading it: the server refuses this turn
                await self._sent.aclose()
        self._sent = stream = start()
        try:
            async for delta in stream:
                yield delta
        finally:
            await stream.aclose()

    async def _resumable(
        self, turn: dict[str, Any], request_id: str, sampling: dict[str, Any]
    ) -> AsyncGenerator[Delta, None]:
        assert self.history is not None  # generate sends only a resumable session's turns here
        deltas: list[Delta] = []
        if self._stale:
            await self.client.end(self.id)
            self._stale = False
            stream = await self._reopened(turn, request_id, sampling, deltas)
        else:
            stream = self.client.generate(
                **turn, session_id=self.id, request_id=request_id, session_epoch=self.epoch, **sampling
            )
            try:
                deltas.append(await anext(stream))
            except grpc.aio.AioRpcError as err:
                if err.code() not in RESTART_CODES:
                    self._stale = err.code() not in CANCEL_CODES + REFUSAL_CODES
                    raise
                if err.code() == grpc.StatusCode.ABORTED:
                    await self.client.end(self.id)
                stream = await self._reopened(turn, request_id, sampling, deltas)
        kept = True
        try:
            yield deltas[0]
            async for delta in stream:
                deltas.append(delta)
                yield delta
        except grpc.RpcError as err:
            kept = err.code() in CANCEL_CODES
            self._stale = not kept
            raise
        finally:
            await stream.aclose()
            if kept:
                self.history.record(turn, deltas)

    async def _reopened(
        self, turn: dict[str, Any], request_id: str, sampling: dict[str, Any], deltas: list[Delta]
    ) -> AsyncGenerator[Delta, None]:
        assert self.history is not None  # only a resumable session's turns are replayed
        _, self.epoch = await self.client._start(self.id)
        stream = self.client.generate(
            **self.history.replay(turn), session_id=self.id, request_id=request_id, session_epoch=self.epoch, **sampling
        )
        try:
            deltas.append(await anext(stream))
        except BaseException:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self.client.end(self.id)
            raise
        return stream

    async def cancel(self) -> bool:
        return await self.client.cancel(session_id=self.id)

    async def end(self) -> None:
        await self.client.end(self.id)

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.end()
