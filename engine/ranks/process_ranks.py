"""`ProcessRanks`: each data-parallel rank a process of its own, started with spawn (the serving side;
rank_process.py is the rank's side and lists the messages).

The serving process keeps the Gateway and the SequenceBinding. Its queues are `RemoteQueue`s, which
forward each request to its rank's process; one receiver thread turns the ranks' output messages back into
the Gateway's signals, and notices a rank that dies.

With more than one node, the ranks are spread evenly: node 0 (this process) spawns the first share, and
publishes the others' `RankSpec`s in its TCPStore, where each other node's `run_node` (node.py) finds them.
Its sockets then listen on `master_addr`, and its remote ranks are watched by heartbeats. On one machine the
sockets are files in a private directory, and the store listens on `master_addr` (loopback) only.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import multiprocessing.util
import os
import pickle
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterable
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

import zmq

from ..config import EngineConfig
from ..step.engine_loop import LoopStats
from ..loading.pushed import PushedWeights, host_buffer
from ..step.weights import WeightSource
from ..errors import EngineError, InternalError, InvalidRequest, Unavailable
from ..gateway.gateway import Gateway, Signal, unanswered_output
from ..gateway.request import CancelFlag, FinishReason, Request, RequestKind, RequestOutput
from ..comm.gloo_comm import GlooComm, new_secret
from .rank_process import HEARTBEAT_SECONDS, HEARTBEAT_TIMEOUT, RankSpec, from_wire, request_fields, run_rank
from .ranks import Ranks
from .weight_transfer import (
    SharedWeights,
    awaits_ranks,
    lend,
    pack,
    release_kept_files,
    released,
    remove,
    remove_stale,
    share,
    shared_buffer,
)

if TYPE_CHECKING:
    from torch.distributed import TCPStore

log = logging.getLogger(__name__)

EXIT_DRAIN_SECONDS = 2.0  # after a rank's process ended, how long its last messages may still take to arrive
JOIN_SECONDS = 30.0  # for a rank to exit after close, before it is killed


class RemoteQueue:
    """The serving process's link to one rank process; a tensor-parallel leader's is the Gateway's stand-in
    for that data-parallel rank's `RequestQueue`: `push` forwards the request at once.

    `_lock` guards the socket, `_inflight` and `_closed`; it is a leaf. A request is marked active before it
    leaves, under the lock, so its cancel (`on_cancel`, which takes the lock too) always follows it.
    """

    def __init__(self, socket: zmq.Socket, rank: int, ids: itertools.count, ranks: "ProcessRanks") -> None:
        self.rank = rank
        self._socket = socket
        self._ids = ids  # shared by all ranks' queues; next() on a count is atomic in CPython
        self._ranks = ranks
        self._inflight: dict[int, Request] = {}
        self._closed = False
        self._lock = threading.Lock()

    def push(self, request: Request) -> bool:
        wire_id = next(self._ids)
        try:  # before it counts as active: a request that cannot cross is refused, and changes nothing
            message = pickle.dumps(("request", wire_id, request_fields(request)))
        except Exception as exc:  # a library caller's chat message holding a value no pickle carries
            raise InvalidRequest(f"the request cannot be sent to its engine rank: {exc}") from exc
        with self._lock:
            if self._closed:
                return False
            request.on_cancel = lambda: self._cancel(wire_id)  # before a cancel can see it active
            session_id = 0 if request.stateless else request.session_id
            request.on_stop = lambda index, num_output: self._stop(wire_id, session_id, index, num_output)
            if not request.cancel_flag.compare_exchange(CancelFlag.QUEUED, CancelFlag.ACTIVE):
                return True  # cancelled before it left: the canceller has ended its stream
            if not self._send(message):
                return False  # its rank process has gone: refused as at shutdown
            self._inflight[wire_id] = request
        self._ranks.wake_all_but(self.rank)
        return True

    def _cancel(self, wire_id: int) -> None:
        """Tell the rank, and wake the others: idle loops step only together, and one holding frozen requests
        (a pause) steps to end the cancelled one."""
        if self.send(("cancel", wire_id)):
            self._ranks.wake_all_but(self.rank)

    def _stop(self, wire_id: int, session_id: int, index: int, num_output: int) -> None:
        """The front end found a stop string in sample `index`: the rank ends it after `num_output` tokens. Its
        session's next turn, which the client sends only once it has read that end, follows on this link."""
        if self.send(("stop", wire_id, session_id, index, num_output)):
            self._ranks.wake_all_but(self.rank)

    def send(self, message: tuple) -> bool:
        """False when the rank process is not connected (gone, or not yet there): the message is dropped."""
        data = pickle.dumps(message, protocol=5)  # 5: a bytearray (pushed weights) in one copy; outside the lock
        with self._lock:
            return self._send(data)

    def _send(self, message: bytes) -> bool:
        """Under `_lock`. Never blocks: a PUSH socket with no peer would wait for ever, lock held."""
        if self._socket.closed:
            return False
        try:
            self._socket.send(message, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def take(self, wire_id: int, finished: bool) -> Request | None:
        """The request an output belongs to; forgotten once its last output has come."""
        with self._lock:
            return self._inflight.pop(wire_id, None) if finished else self._inflight.get(wire_id)

    def close(self) -> list[Request]:
        """The rank cancels what it still holds queued, so nothing is handed back here."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._send(pickle.dumps(("close",)))
        return []

    def close_socket(self) -> None:
        with self._lock:
            self._socket.close(linger=0)

    def fail(self) -> list[Request]:
        """Refuse new requests and hand back every request still in flight: its rank will never answer."""
        with self._lock:
            self._closed = True
            inflight, self._inflight = list(self._inflight.values()), {}
        return inflight


NNODES_KEY = "lmgate/nnodes"  # node 0 publishes its --nnodes, which every other node checks


def node_specs_key(node: int) -> str:
    """The TCPStore key under which node 0 publishes the `RankSpec`s of `node`'s ranks."""
    return f"lmgate/node/{node}/specs"


def node_failed_key(node: int) -> str:
    """The TCPStore key under which `node` says that one of its ranks exited with an error."""
    return f"lmgate/node/{node}/failed"


class ProcessRanks(Ranks):
    """Owns the rank processes, the sockets to them, the TCPStore their `GlooComm` meets at, and the receiver
    thread. `_lock` guards `_stats`, `_weights_bytes`, `_shut_down` and `_acks` (a condition waited on by
    weight calls).
    `_procs` holds this node's rank processes, by world rank; the others are `remote` ranks."""

    def __init__(
        self, config: EngineConfig, model_path: str, max_context_length: int, threads_per_loop: int, log_level: int
    ) -> None:
        super().__init__()
        self.config = config
        self.threads_per_loop = threads_per_loop
        self.tp_size = tp = config.tensor_parallel
        size = config.world_size
        per_node = size // config.nnodes
        host = socket.gethostbyname(config.master_addr)  # node 0's own address: other nodes reach it there
        self._store: TCPStore | None = GlooComm.create_store(host, config.master_port)
        self._context = zmq.Context()
        # One machine's sockets are files in a directory only this user may enter: a TCP port would take
        # pickles (run on unpickling) from any local user, and hand them the prompts.
        self._socket_dir = tempfile.mkdtemp(prefix="lmgate-") if config.nnodes == 1 else None
        # Removed at shutdown; at exit, or when collected, where shutdown never ran. A Finalize runs once.
        self._remove_socket_dir = (
            multiprocessing.util.Finalize(
                self, shutil.rmtree, args=(self._socket_dir,), kwargs={"ignore_errors": True}, exitpriority=0
            )
            if self._socket_dir is not None
            else lambda: None
        )
        self._outputs = self._context.socket(zmq.PULL)
        outputs_address = self._bind(self._outputs, "outputs", host)
        self._ids = ids = itertools.count(1)  # wire ids of requests and weight calls
        self._links: list[RemoteQueue] = []  # one per rank process, by world rank
        self._specs = []
        secret = new_secret()
        for rank in range(size):
            push = self._context.socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, 0)  # never block a caller: the rank takes what it is sent
            requests_address = self._bind(push, f"rank-{rank}", host)
            self._links.append(RemoteQueue(push, rank // tp, ids, self))
            self._specs.append(
                RankSpec(
                    config,
                    model_path,
                    rank,
                    size,
                    tp,
                    host,
                    self._rendezvous.port,
                    secret,
                    requests_address,
                    outputs_address,
                    threads_per_loop,
                    max_context_length,
                    log_level,
                    node=rank // per_node,
                )
            )
        self._leaders = self._links[::tp]  # the tensor-parallel leaders take the requests
        self.queues = self._leaders
        self.remote = set(range(per_node, size))
        self._procs: dict[int, BaseProcess] = {}
        self._last_heard = dict.fromkeys(range(size), time.monotonic())  # receiver thread only
        self._exited: set[int] = set()  # ranks that said "exited" (a clean close)
        self._stats = [LoopStats() for _ in range(config.engine_loops)]
        self._weights_bytes = [0] * size
        self._lock = threading.Lock()
        self._acks = threading.Condition(self._lock)
        self._pending_acks: dict[int, list] = {}  # wire id -> [ranks yet to answer, first error]
        self._shut_down = False
        self._gateway: Gateway | None = None
        self._receiver: threading.Thread | None = None
        remove_stale()  # pushed weights' files left by a server killed on this machine

    @property
    def _front(self) -> Gateway:
        """The Gateway `start` was given: a rank's outputs and failures only come once it has started."""
        assert self._gateway is not None, "outputs and failures come after start"
        return self._gateway

    @property
    def _rendezvous(self) -> TCPStore:
        """The store the nodes meet by, until the sockets close at shutdown."""
        assert self._store is not None, "used while starting, long before shutdown"
        return self._store

    def _bind(self, sock: zmq.Socket, name: str, host: str) -> str:
        """Where `sock` listens for its rank(s): a socket file `name` on one machine, else a free TCP port on
        `host` (several machines: their network is trusted, as torch.distributed's own is)."""
        if self._socket_dir is None:
            return f"tcp://{host}:{sock.bind_to_random_port(f'tcp://{host}')}"
        address = f"ipc://{os.path.join(self._socket_dir, name)}"
        sock.bind(address)
        return address

    # start -------------------------------------------------------------------------------------------------

    def start(self, gateway: Gateway) -> None:
        """Spawn this node's ranks (never fork: gRPC's threads may be running), publish the other nodes', and
        wait until every rank is ready; a rank that fails to start fails this, with its error."""
        self._gateway = gateway
        for node in range(1, self.config.nnodes):
            specs = pickle.dumps([s for s in self._specs if s.node == node])
            self._rendezvous.set(node_specs_key(node), specs)  # type: ignore[arg-type]  # torch's stub: str; bytes work
        self._rendezvous.set(NNODES_KEY, str(self.config.nnodes))
        spawn = multiprocessing.get_context("spawn")
        self._procs = {
            spec.rank: spawn.Process(target=run_rank, args=(spec,), name=f"lmgate-rank-{spec.rank}", daemon=True)
            for spec in self._specs
            if spec.node == 0
        }
        # An owner that exits without `shutdown` (an error before the server's handlers are in place, a script
        # that forgets it): at exit multiprocessing would SIGTERM these daemons, which ignore it, and join them
        # for ever, while they wait for this process to go. Killed first instead; after a shutdown, no-op.
        multiprocessing.util.Finalize(self, kill_processes, args=(list(self._procs.values()),), exitpriority=10)
        waiting = set(range(len(self._specs)))
        try:
            for p in self._procs.values():
                p.start()  # one that cannot start (no memory for it) leaves the started ones to the except below
            log.info(
                "engine ranks started as processes: %s",
                ", ".join(f"rank {i} pid {p.pid}" for i, p in self._procs.items()),
            )
            if self.remote:
                log.info(
                    "waiting for ranks %s from nodes 1..%d (lmgate serve --nnodes %d --node-rank K --master-addr "
                    "%s --master-port %d)",
                    ", ".join(map(str, sorted(self.remote))),
                    self.config.nnodes - 1,
                    self.config.nnodes,
                    self.config.master_addr,
                    self._rendezvous.port,
                )
            checked = time.monotonic()
            while waiting:
                message = self._receive_during_start(waiting)
                if time.monotonic() - checked >= HEARTBEAT_SECONDS:  # however busy the ready ranks' heartbeats
                    checked = time.monotonic()
                    self._check_nodes(waiting)
                if message[0] == "failed":
                    raise message[2]
                if message[0] != "ready":
                    continue  # a heartbeat
                _, rank, stats, nbytes = message
                self._weights_bytes[rank] = nbytes
                if rank % self.tp_size == 0:
                    self._stats[rank // self.tp_size] = stats
                waiting.discard(rank)
            self._await_connections()
            self._last_heard = dict.fromkeys(range(len(self._links)), time.monotonic())
        except BaseException:
            self._kill_all()
            self._close_sockets()
            raise
        self._receiver = threading.Thread(target=self._receive, name="lmgate-rank-receiver", daemon=True)
        self._receiver.start()

    def _await_connections(self) -> None:
        """Until every rank's socket has its peer (sends never block, so one sent earlier would be lost)."""
        deadline = time.monotonic() + HEARTBEAT_TIMEOUT
        for rank, link in enumerate(self._links):
            while not link.send(("hello",)):
                proc = self._procs.get(rank)
                if proc is not None and not proc.is_alive():
                    raise InternalError(f"engine rank {proc.name} exited while starting (exit status {proc.exitcode})")
                if proc is None and time.monotonic() > deadline:
                    raise InternalError(
                        f"engine rank {rank} on node {self._specs[rank].node} said it was ready "
                        f"but never connected to {self.config.master_addr}"
                    )
                time.sleep(0.01)

    def _receive_during_start(self, waiting: set[int]) -> tuple:
        """The next message (("tick",) after a quiet HEARTBEAT_SECONDS), or the error of a local rank that
        exited (a remote one sends nothing before it is ready: `_check_nodes`). One that said ready too, since
        it leaves when a peer it waits on in a collective has died."""
        poller = zmq.Poller()
        poller.register(self._outputs, zmq.POLLIN)
        local = list(self._procs)
        for rank in local:
            poller.register(self._procs[rank].sentinel, zmq.POLLIN)
        ready = dict(poller.poll(int(HEARTBEAT_SECONDS * 1000)))
        if self._outputs in ready:
            return self._outputs.recv_pyobj()
        if not ready:
            return ("tick",)
        rank = next(r for r in local if self._procs[r].sentinel in ready)
        deadline = time.monotonic() + EXIT_DRAIN_SECONDS
        while (left := deadline - time.monotonic()) > 0 and self._outputs.poll(int(left * 1000)):
            message = self._outputs.recv_pyobj()  # the others' heartbeats, or (most likely) its "failed"
            if message[0] == "failed":
                return message
        raise InternalError(
            f"engine rank {rank} exited while starting (exit status {self._procs[rank].exitcode}); "
            f"ranks {sorted(waiting)} had not said ready"
        )

    def _check_nodes(self, waiting: set[int]) -> None:
        """Raise where another node reported a rank of its own that exited while starting (one killed sends
        nothing)."""
        for node in range(1, self.config.nnodes):
            if self._rendezvous.check([node_failed_key(node)]):
                reason = self._rendezvous.get(node_failed_key(node)).decode()
                raise InternalError(f"node {node}: {reason} while starting; ranks {sorted(waiting)} had not said ready")

    # state -------------------------------------------------------------------------------------------------

    def stats(self) -> list[LoopStats]:
        with self._lock:
            return list(self._stats)

    @property
    def weights_bytes(self) -> int:
        with self._lock:
            return sum(self._weights_bytes)

    def wake_all_but(self, rank: int) -> None:
        for queue in self._leaders:
            if queue.rank != rank:
                queue.send(("wake",))

    # weights -----------------------------------------------------------------------------------------------

    def offload_weights(self) -> None:
        self._weights("offload")

    def drop_weights(self) -> None:
        self._weights("drop")

    def restore_weights(self) -> None:
        self._weights("restore")

    def host_buffer(self, nbytes: int) -> memoryview:
        """A file this machine's ranks map, where /dev/shm has room (`shared_buffer`): one an earlier push was
        received into once every rank has let go of it, the ranks asked first where one has not said so yet
        (they say it in their answers: `weights_done`)."""
        if awaits_ranks(nbytes):
            self._weights("report", links=[self._links[rank] for rank in self._procs])
        return shared_buffer(nbytes) or host_buffer(nbytes)

    def release_host_buffers(self) -> None:
        super().release_host_buffers()
        release_kept_files()

    def load_weights(self, source: WeightSource, name: str, in_place: bool = False) -> None:
        """In two phases: every rank stages its weights (or shard), then each group's leader puts its group's
        in at its next step; none switches unless all loaded. Pushed weights reach this machine's ranks through
        one shared-memory file (`share`: the one `host_buffer` received them into, kept for a later push, else
        a copy, removed once they have staged them), and another machine's as bytes in their messages (`pack`;
        this machine's too, where /dev/shm has no room). `in_place`: each rank checks that they fit its model
        when it stages them, and writes them into it at the install."""
        version = next(self._ids)
        shared: SharedWeights | None = None
        written: str | None = None  # a file `share` wrote them into, removed once staged
        carried: object = source  # what the ranks get: the source, or the pushed weights' bytes
        try:
            if isinstance(source, PushedWeights):
                shared = share(source)  # this node has ranks
                carried = pack(source) if shared is None or self.remote else shared
                if shared is not None and not lend(shared.path, self._procs):
                    written = shared.path
            local = (shared, name, in_place) if shared is not None else None
            self._weights("load", (carried, name, in_place), wire_id=version, local=local)
        except EngineError:
            self._weights("discard", version)
            raise
        finally:
            if written is not None:
                remove(written)
        self._weights("install", version, links=self._leaders)

    def _weights(
        self,
        action: str,
        argument: object = None,
        links: list[RemoteQueue] | None = None,
        wire_id: int | None = None,
        local: object = None,
    ) -> None:
        """Every rank (of `links`, else all) does `action` on its own model; returns once all have, raising
        the first error. `local`: the argument this machine's ranks get instead, if any."""
        links = self._links if links is None else links
        wire_id = next(self._ids) if wire_id is None else wire_id
        with self._lock:
            if self.failure is not None:
                raise Unavailable(f"{self.failure}: the server is stopping")
            if self._shut_down:
                raise Unavailable("the engine has shut down")
            self._pending_acks[wire_id] = [len(links), None]
        for link in links:
            rank = self._links.index(link)
            here = local is not None and rank not in self.remote
            if not link.send(("weights", wire_id, action, local if here else argument)):  # its process has gone
                with self._lock:
                    self._ack(wire_id, Unavailable(f"engine rank {rank} has gone"))
        with self._lock:
            self._acks.wait_for(lambda: self._pending_acks[wire_id][0] == 0)
            error = self._pending_acks.pop(wire_id)[1]
        if error is not None:
            raise error

    # the receiver thread -----------------------------------------------------------------------------------

    def _receive(self) -> None:
        """Until every rank has ended: a local one's process exited; a remote one said "exited", or is given
        up after a failure (it leaves when the pings stop). A rank silent for HEARTBEAT_TIMEOUT, hung or on a
        machine gone, is a failure."""
        poller = zmq.Poller()
        poller.register(self._outputs, zmq.POLLIN)
        for p in self._procs.values():
            poller.register(p.sentinel, zmq.POLLIN)
        running = set(range(len(self._links)))
        pinged = 0.0
        while running:
            ready = dict(poller.poll(int(HEARTBEAT_SECONDS * 1000)))
            # A backlog that never empties must not stop the pings below: unpinged remote ranks would leave.
            drained_by = time.monotonic() + HEARTBEAT_SECONDS
            while self._outputs.poll(0) and time.monotonic() < drained_by:
                self._handle(self._outputs.recv_pyobj())
            for rank in [r for r in running - self.remote if self._procs[r].sentinel in ready]:
                poller.unregister(self._procs[rank].sentinel)
                running.discard(rank)
                self._rank_ended(rank)
            now = time.monotonic()
            for rank in sorted(running):
                silent = now - self._last_heard[rank]
                if rank in self.remote and (rank in self._exited or self.failure is not None):
                    running.discard(rank)
                elif silent > HEARTBEAT_TIMEOUT and self.failure is None and rank not in self._exited:
                    running -= {rank} & self.remote  # a local one is still waited for: shutdown kills it
                    where = (
                        f"on node {self._specs[rank].node}" if rank in self.remote else f"(pid {self._procs[rank].pid})"
                    )
                    self._fail(f"engine rank {rank} {where} has not answered for {silent:.0f}s")
            if now - pinged >= HEARTBEAT_SECONDS:
                pinged = now
                for rank in self.remote:
                    self._links[rank].send(("ping",))

    def _rank_ended(self, rank: int) -> None:
        """A rank's process is gone: after a close it said "exited" (perhaps still in flight); otherwise it died.
        After a failure the ranks are killed: nothing more is waited for."""
        wait = 0.0 if self.failure else EXIT_DRAIN_SECONDS
        deadline = time.monotonic() + wait  # not from each message: the others' heartbeats never stop
        while rank not in self._exited and self._outputs.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
            self._handle(self._outputs.recv_pyobj())
        if rank not in self._exited:
            self._fail(
                f"engine rank {rank} (pid {self._procs[rank].pid}) exited with status {self._procs[rank].exitcode}"
            )

    def _handle(self, message: tuple) -> None:
        kind, rank = message[0], message[1]
        self._last_heard[rank] = time.monotonic()
        if kind == "outputs":  # only from leaders
            with self._lock:
                self._stats[rank // self.tp_size] = message[2]
            queue = self._links[rank]
            signals: list[Signal] = []
            for item in message[3]:
                wire_id, output = from_wire(item)
                request = queue.take(wire_id, output.finished)
                if request is not None:
                    signals.append((request, output))
            self._front.notify(signals)
        elif kind == "kv_events":  # only from leaders
            self._front.publish_kv_events(rank // self.tp_size, message[2])
        elif kind == "weights_done":
            _, _, wire_id, error, nbytes, unmapped = message
            released(unmapped, rank)  # before the answer: a push waiting on it may take the file
            with self._lock:
                if nbytes is not None:  # None: a report's, which may have overtaken a drop's or an install's
                    self._weights_bytes[rank] = nbytes
                self._ack(wire_id, error)
        elif kind == "exited":
            self._exited.add(rank)

    def _ack(self, wire_id: int, error: EngineError | None) -> None:
        """Under `_lock`: one rank has answered a weight call."""
        pending = self._pending_acks.get(wire_id)
        if pending is not None:
            pending[0] = max(pending[0] - 1, 0)  # a late answer after `_fail` released the call
            pending[1] = pending[1] or error
            self._acks.notify_all()

    def _fail(self, reason: str) -> None:
        """A rank died: refuse new work, end every stream in flight with UNAVAILABLE (kills and controls
        answered, so no caller waits for ever), release waiting weight calls, tell the listeners."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
            for wire_id in list(self._pending_acks):
                self._pending_acks[wire_id] = [0, Unavailable(reason)]
            self._acks.notify_all()
        log.error("%s; ending every stream and stopping", reason)
        self._front.close_admission("failed", f"{reason}: the server is stopping")
        error = Unavailable(f"{reason}: the server is stopping")
        signals: list[Signal] = []
        for queue in self._leaders:
            for request in queue.fail():
                if request.kind is RequestKind.KILL:  # its session has gone with the rank: the End is done
                    signals.append((request, RequestOutput("", request.session_id, finish_reason=FinishReason.STOP)))
                else:  # a stream, or a Sleep's or Wakeup's part that this rank never did
                    signals.append((request, RequestOutput(request.request_id, request.session_id, error=error)))
        self._front.notify(signals)
        self._tell_listeners(reason)

    # shutdown ----------------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """The Gateway has sent every rank "close": wait for them (killing any that do not exit in
        `JOIN_SECONDS`, or all at once after a failure), then for the receiver's last outputs."""
        for p in self._procs.values():
            p.join(0 if self.failure else JOIN_SECONDS)
        self._kill_all()
        if self._receiver is not None:
            self._receiver.join()
        # What a rank never answered (one that stopped with its peers before it read its own "close"): every
        # stream ends, and an End or a control waiting on its request returns.
        self._front.notify([(r, unanswered_output(r)) for queue in self._leaders for r in queue.fail()])
        with self._lock:  # a weight call whose ranks exited before answering; later ones are refused
            self._shut_down = True
            for wire_id in self._pending_acks:
                self._pending_acks[wire_id] = [0, Unavailable("the engine has shut down")]
            self._acks.notify_all()
        self._close_sockets()

    def _kill_all(self) -> None:
        kill_processes(self._procs.values())

    def _close_sockets(self) -> None:
        for link in self._links:
            link.close_socket()
        self._outputs.close(linger=0)
        self._context.term()
        self._remove_socket_dir()
        self._store = None  # its port is free once it goes, not when the collector breaks this object's cycles


def kill_processes(procs: Iterable[BaseProcess]) -> None:
    """SIGKILL those still running, and reap them all (those never started, there are none to reap)."""
    for p in procs:
        if p.pid is None:
            continue
        if p.is_alive():
            p.kill()
        p.join()
