"""A data-parallel rank as a process of its own (the rank side; process_ranks.py is the serving process's).

The process holds its own model and KV cache and runs one `EngineLoop` over a `RankGateway`: the ordinary
Gateway, its queue filled from the serving process. The loops of all ranks agree in `Gateway.pop` over
`GlooComm`, exactly as threads do over `ThreadComm`. Messages cross on pyzmq sockets as pickles:

  serving → rank (PUSH → PULL, one socket per rank):
    ("request", wire_id, fields)   a generate, kill or control request (`request_fields`)
    ("cancel", wire_id)            a request it sent was cancelled
    ("stop", wire_id, session_id, index, num_output)   its front end found a stop string in that sample:
                                   the sample ends after num_output tokens (`Gateway.stop_found`)
    ("wake",)                      a request arrived at another rank: idle loops here must step with it
    ("weights", wire_id, action, argument)   offload / drop / restore / load (argument: source, name; pushed
                                   weights as bytes: weight_transfer.py) / report (nothing: the answer), done
                                   off the loop thread; a load only stages, as version wire_id, and
                                   "install" (to leaders) or "discard" of it follows once every rank answered
    ("close",)                     shut down: cancel everything, stop the loop, exit 0
    ("ping",)                      every HEARTBEAT_SECONDS: the serving process is alive
  (a tensor-parallel follower gets only "weights": its leader tells it the rest over their GlooComm)
  rank → serving (PUSH → one PULL):
    ("ready", rank, stats, weights_bytes) | ("failed", rank, error)
    ("outputs", rank, stats, [item, ...])   one message per delivered batch, an item per output (`to_wire`)
    ("kv_events", rank, [event, ...])   a step's prefix-cache events (gateway/kv_events.py), from the loop thread
    ("weights_done", rank, wire_id, error | None, weights_bytes | None, [pushed file no longer mapped, ...])
    ("exited", rank)               its last message after a clean close
    ("alive", rank)                every HEARTBEAT_SECONDS

A rank on another machine cannot be watched through its process's sentinel, nor watch its server's: each
side takes HEARTBEAT_TIMEOUT without a message from the other as a death.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, cast

import torch
import zmq

from ..config import EngineConfig
from ..step.engine_loop import EngineLoop, LoopStats, build_runner
from ..errors import EngineError, InternalError
from ..gateway.gateway import Gateway, Signal, unanswered_output
from ..gateway.kv_events import RawEvent
from ..machine.hardware import choose_dtype
from ..loading.loader import load_checkpoint
from ..machine.memory import freeze_startup_heap, keep_freed_memory, release_host_memory
from ..gateway.request import Request, RequestKind, RequestOutput, StopFound, token_output
from ..machine.threads import on_fresh_thread
from ..models.tensor_parallel import shard_of
from ..step.weights import LocalWeights, TensorParallel, keep_quantized
from ..comm.device_group import DeviceGroup
from ..comm.gloo_comm import GlooComm
from ..comm.host_comm import CommAborted
from .weight_transfer import PackedWeights, SharedWeights, unmapped
from ..machine.placement import check_placement, rank_device, use_device

log = logging.getLogger(__name__)

REQUEST_FIELDS = (
    "kind",
    "session_id",
    "request_id",
    "input_ids",
    "params",
    "stateless",
    "messages",
    "first_turn_ids",
    "text",
)
HEARTBEAT_SECONDS = 1.0
HEARTBEAT_TIMEOUT = 10.0  # silence that counts as a death, either way


def request_fields(request: Request) -> tuple:
    """What of a request crosses to a rank: everything but its callbacks and flag, and its age rather than
    its arrival (monotonic clocks differ between machines)."""
    return (*(getattr(request, f) for f in REQUEST_FIELDS), time.monotonic() - request.arrival)


def to_wire(wire_id: int, output: RequestOutput) -> tuple:
    """An output as it crosses to the serving process: (wire_id, output), or where it is token ids alone (most
    are: `RequestOutput.only_tokens`) a tuple of the fields it has, which pickle writes in a fifth of an
    output's time (hundreds a step, in the process of the loop)."""
    if output.only_tokens:
        return wire_id, output.request_id, output.session_id, output.token_ids, output.index, output.weight_version
    return wire_id, output


def from_wire(item: tuple) -> tuple[int, RequestOutput]:
    """`to_wire`'s item as (wire_id, output)."""
    if len(item) == 2:
        return item[0], item[1]
    wire_id, request_id, session_id, token_ids, index, version = item
    return wire_id, token_output(request_id, session_id, token_ids, index, version)


def rebuild_request(fields: tuple, on_output: Callable[[RequestOutput], None]) -> Request:
    """The request `request_fields` described, on this machine's clock."""
    *values, age = fields
    return Request(on_output=on_output, arrival=time.monotonic() - age, **dict(zip(REQUEST_FIELDS, values)))


@dataclass(frozen=True, slots=True)
class RankSpec:
    """Everything a rank process starts from (pickled by spawn). Rank `rank` of the world is tensor-parallel
    rank `rank % tp_size` of data-parallel rank `rank // tp_size`; only the tensor-parallel leaders (0) run
    engine loops and take requests."""

    config: EngineConfig
    model_path: str
    rank: int
    size: int
    tp_size: int
    store_host: str  # the serving process's TCPStore, for GlooComm
    store_port: int
    secret: bytes  # signs what the ranks' GlooComm sends (past node 0 it comes through the store)
    requests_address: str  # this rank's PULL connects here
    outputs_address: str  # every rank's PUSH connects here
    num_threads: int
    max_context_length: int
    log_level: int
    node: int = 0  # the machine it runs on; past node 0 its server is watched by heartbeats

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def local_rank(self) -> int:
        """Its place among its machine's ranks (each machine holds an equal, consecutive share)."""
        return self.rank % (self.size // self.config.nnodes)


class Outbox:
    """Outputs collected while the signal thread delivers one batch, then sent as one message. `_lock` guards
    `_items` and the socket (the signal thread sends, and so does the main thread, before start and at exit)."""

    def __init__(self, socket: zmq.Socket, rank: int) -> None:
        self._socket = socket
        self._rank = rank
        self._items: list[tuple] = []  # `to_wire`'s
        self._lock = threading.Lock()
        self.stats: Callable[[], LoopStats] = LoopStats

    def collector(self, wire_id: int) -> Collector:
        """The `on_output` of the request the serving process knows as `wire_id`."""
        return Collector(self, wire_id)

    def add(self, wire_id: int, output: RequestOutput) -> None:
        item = to_wire(wire_id, output)
        with self._lock:
            self._items.append(item)

    def extend(self, items: list[tuple]) -> None:
        """`to_wire`'s items, already made."""
        with self._lock:
            self._items += items

    def flush(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            if items:
                self._socket.send_pyobj(("outputs", self._rank, self.stats(), items))

    def send(self, message: tuple) -> None:
        with self._lock:
            self._socket.send_pyobj(message)

    def send_kv_events(self, events: list[RawEvent]) -> None:
        self.send(("kv_events", self._rank, events))


class Collector:
    """A request's `on_output` in a rank process: its outputs into the outbox, under the serving process's id."""

    __slots__ = ("outbox", "wire_id")

    def __init__(self, outbox: Outbox, wire_id: int) -> None:
        self.outbox = outbox
        self.wire_id = wire_id

    def __call__(self, output: RequestOutput) -> None:
        self.outbox.add(self.wire_id, output)


class RankGateway(Gateway):
    """The Gateway of one rank process: every request goes to its own loop, and each delivered batch of
    outputs leaves as one message."""

    def __init__(self, rank: int, size: int, max_queued: int, outbox: Outbox) -> None:
        super().__init__(size, max_queued)
        self.rank = rank
        self.outbox = outbox

    def _next_loop(self) -> int:
        return self.rank

    def _deliver_all(self, signals: list[Signal]) -> None:
        """A token delta (most of a step's outputs) becomes its wire item at once, with no output made and no
        callback called for it (the serving process writes its text); the rest go as a Gateway delivers them,
        in their order."""
        items: list[tuple] = []
        plain = self.tokenizer is None  # else this side writes text: every output as a Gateway delivers it
        for given in signals:
            if plain and len(given) == 4 and type(on := given[0].on_output) is Collector:
                request, token, index, version = given  # as `to_wire` sends a `token_output` of it
                items.append((on.wire_id, request.request_id, request.session_id, [token], index, version))
                continue
            if items:
                self.outbox.extend(items)
                items = []
            super()._deliver_all([given])
        self.outbox.extend(items)
        self.outbox.flush()

    def publish_kv_events(self, rank: int, events: list[RawEvent]) -> None:
        self.outbox.send_kv_events(events)  # the serving process publishes them


class RankProcess:
    """Built in the spawned process; `serve` runs until the serving process says close, or dies.

    A tensor-parallel leader runs an `EngineLoop` whose runner tells its followers each step's plan (and
    each KV sleep and wake-up) over the group's `GlooComm`; a follower runs `_follow`, doing the same to its
    shard. Both sum activations over a `DeviceGroup`.
    """

    def __init__(self, spec: RankSpec, context: zmq.Context, outbox: Outbox) -> None:
        c = spec.config
        self.spec = spec
        keep_freed_memory()
        num_gpus = torch.cuda.device_count()
        check_placement(c.device, spec.tp_size, spec.size // c.nnodes, num_gpus)  # this machine's own GPUs
        device = rank_device(c.device, spec.local_rank, num_gpus)
        use_device(device)
        world = GlooComm.connect(spec.store_host, spec.store_port, spec.rank, spec.size, spec.secret)
        dp_comm = world.split(color=spec.tp_rank, key=spec.dp_rank)  # the leaders' group agrees in `pop`
        self.tp_comm = world.split(color=spec.dp_rank, key=spec.tp_rank)
        ckpt = on_fresh_thread(lambda: load_checkpoint(spec.model_path))
        dtype, _ = choose_dtype(c.dtype, device)  # the one the front end chose (never auto here)
        tp = None
        if spec.tp_size > 1:
            group = DeviceGroup(
                world.store, f"tp-device/{spec.dp_rank}", spec.tp_rank, spec.tp_size, device, world.hostname
            )
            tp = TensorParallel(shard_of(ckpt.config, spec.tp_rank, spec.tp_size), group.all_reduce)
        self.weights = LocalWeights(
            ckpt, dtype, device, c.max_batched_tokens, tp, keep_quantized(c, dtype, device), c.int8_activations
        )
        self.gateway = RankGateway(spec.dp_rank, spec.size // spec.tp_size, c.max_queued_requests, outbox)
        self.loop: EngineLoop | None = None
        if spec.tp_rank == 0:
            tokenizer = ckpt.tokenizer  # read now: the checkpoint is let go of below
            self.loop = on_fresh_thread(
                lambda: EngineLoop.build(
                    spec.dp_rank,
                    dp_comm,
                    self.gateway,
                    self.weights,
                    tokenizer,
                    c,
                    spec.max_context_length,
                    spec.num_threads,
                    text_at_front_end=True,  # the serving process writes it
                )
            )
            self.runner = self.loop.runner
            if spec.tp_size > 1:
                self.runner.install_weights = self.weights.install_staged
                self.runner.followers = self.tp_comm
                group_kv = sum(len(shard_of(ckpt.config, r, spec.tp_size).kv_heads) for r in range(spec.tp_size))
                self.runner.group_kv_share = group_kv / self.weights.config.num_kv_heads
            outbox.stats = self.loop.stats
        else:
            self.runner = on_fresh_thread(lambda: build_runner(self.weights, c, spec.max_context_length))
        del ckpt  # the raw weights: the model holds what it needs
        self.outbox = outbox
        self.requests = context.socket(zmq.PULL)
        self.requests.connect(spec.requests_address)
        self.live: weakref.WeakValueDictionary[int, Request] = weakref.WeakValueDictionary()  # for cancels and stops
        self.clean_exit = False  # the loop stopped by a close (or its leader's stop), not by a failure: exit 0

    def serve(self) -> int:
        """Exit status: 0 after a close (a follower: its leader's stop), 1 when the loop stopped by itself (a
        peer rank died, a step raised)."""
        freeze_startup_heap()  # as the serving process does (engine.py)
        stopped_r, stopped_w = os.pipe()
        thread = threading.Thread(target=self._run, args=(stopped_w,), name=f"lmgate-engine-{self.spec.rank}")
        thread.start()
        stats = self.loop.stats() if self.loop else LoopStats()
        self.outbox.send(("ready", self.spec.rank, stats, self.weights.nbytes))
        poller = zmq.Poller()
        poller.register(self.requests, zmq.POLLIN)
        poller.register(stopped_r, zmq.POLLIN)
        parent = multiprocessing.parent_process()
        assert parent is not None  # a rank runs in a process of its own, started by the serving or node process
        poller.register(parent.sentinel, zmq.POLLIN)
        beat, heard = time.monotonic(), None  # until the server's first word, its start-up may still take long
        while True:
            ready = dict(poller.poll(int(HEARTBEAT_SECONDS * 1000)))
            if parent.sentinel in ready:
                os._exit(1)  # the serving process (or this node's) has gone: nobody is left to serve
            now = time.monotonic()
            if self.requests in ready:
                heard = now
                # A backlog that never empties must not stop the heartbeat below (node 0 would count us dead).
                drained_by = now + HEARTBEAT_SECONDS
                while self.requests.poll(0) and time.monotonic() < drained_by:
                    self._handle(self.requests.recv_pyobj())
            if stopped_r in ready:
                break
            if now - beat >= HEARTBEAT_SECONDS:
                beat = now
                self.outbox.send(("alive", self.spec.rank))
            if self.spec.node and heard is not None and now - heard > HEARTBEAT_TIMEOUT:
                log.error(
                    "rank %d: nothing from the serving process on node 0 for %.0fs; exiting",
                    self.spec.rank,
                    now - heard,
                )
                os._exit(1)
        thread.join()
        self.gateway.stop_signals()  # delivers, and so sends, the last outputs
        self.weights.drop()
        if not self.clean_exit:
            return 1
        self.outbox.send(("exited", self.spec.rank))
        return 0

    def _run(self, stopped: int) -> None:
        try:
            if self.loop is None:
                self.clean_exit = self._follow()
                return
            self.clean_exit = self.loop.run() is None
            if self.clean_exit:  # the leaders agreed to close: maybe before this one's "close" arrived
                self.gateway.shutdown()  # so what is still queued here is answered now, not left unread
                try:
                    self.runner.stop_followers()
                except CommAborted:
                    pass  # a follower has gone: the serving process sees its exit
            # Else the loop failed, maybe mid-step after a "close": followers may sit in that step's
            # all-reduce, which this process's exit breaks (a "stop" would wait for them as long as they for it).
        finally:
            os.write(stopped, b"x")

    def _follow(self) -> bool:
        """A tensor-parallel follower: what the leader does to its model and KV cache, this rank does to its
        shard, in the same order. True once the leader says stop; False when the group broke."""
        torch.set_num_threads(self.spec.num_threads)
        runner = self.runner
        use_device(runner.device)
        try:
            while True:
                # The leader sends (command, argument); nothing while idle.
                command, plan = cast("tuple[str, Any]", self.tp_comm.broadcast(None, patient=True))
                if command == "step":
                    runner.forward(runner.prepare(plan), logits=False)
                elif command == "release_kv":
                    runner.release_kv_cache()
                elif command == "allocate_kv":
                    runner.allocate_kv_cache_as_follower(self.tp_comm)
                elif command == "install_weights":
                    self.weights.install_staged(plan)  # the argument: a version
                elif command == "stop":
                    return True
        except CommAborted:
            return False
        except Exception:
            log.exception("rank %d: a tensor-parallel step failed", self.spec.rank)
            self.tp_comm.abort()
            return False

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "request":
            self._request(message[1], rebuild_request(message[2], self.outbox.collector(message[1])))
        elif kind == "cancel":
            request = self.live.get(message[1])
            if request is not None:
                self.gateway.cancel(request)
        elif kind == "stop":
            _, wire_id, session_id, index, num_output = message
            found = StopFound(self.live.get(wire_id), session_id, index, num_output)
            self.gateway.stop_found(self.spec.dp_rank, found)
        elif kind == "wake":
            self.gateway.wake_loops()
        elif kind == "weights":
            threading.Thread(target=self._weights, args=message[1:], name="lmgate-weights").start()
        elif kind == "close":
            self.gateway.shutdown()

    def _request(self, wire_id: int, request: Request) -> None:
        """As `Gateway.push`, `kill` and `control` would for a caller here; the serving process has already
        checked admission and the session's binding, so the binding here only mirrors it. Every request
        counts as exactly one arrival here, refused or not, as it does at every other rank (as their "wake"):
        idle loops agree on the arrival count (`Gateway.pop`)."""
        gateway = self.gateway
        if request.kind is not RequestKind.GENERATE:
            if request.kind is RequestKind.SLEEP:
                gateway.binding.clear()  # the loop ends every session; queued turns end CANCELLED
            if request.kind is RequestKind.KILL:
                gateway.binding.unbind(request.session_id)  # queued turns end CANCELLED; the loop frees its KV
            if not gateway.enqueue(self.spec.dp_rank, request):  # a stopping rank
                request.on_output(unanswered_output(request))
                gateway.outbox.flush()
                gateway.wake_loops()
            return
        if not request.stateless and gateway.binding.find(request.session_id) is None:
            gateway.binding.bind(request.session_id, self.spec.dp_rank)
        try:
            if request.params.constraint is not None:  # compiled here, not on the loop's thread
                assert self.loop is not None  # requests come to leaders only: a follower gets only "weights"
                self.loop.tokenizer.grammars.compile(request.params.constraint)
            gateway.push(request)
            self.live[wire_id] = request
        except EngineError as exc:
            request.on_output(RequestOutput(request.request_id, request.session_id, error=exc))
            gateway.outbox.flush()
            gateway.wake_loops()

    def _install(self, version: int) -> object:
        """A lone rank's staged weights go in at once (its loop reads the model once per step, and an idle
        loop may not step for long); a tensor-parallel group's at its leader's next step, all ranks at once.
        What the install let go of, to be freed after the answer (`LocalWeights.install_staged`)."""
        if self.spec.tp_size > 1:
            self.runner.switch_weights_at_next_step(version)
            return None
        return self.weights.install_staged(version)

    def _weights(self, wire_id: int, action: str, argument: Any) -> None:
        """`argument`: a load's source, weight version name and whether to write in place; the version (the
        load's wire id) to install or discard."""
        error, replaced = None, None
        try:
            use_device(self.runner.device)
            replaced = {
                "offload": self.weights.offload,
                "drop": self.weights.drop,
                "restore": self.weights.restore,
                "load": lambda: self.weights.load(
                    _opened(argument[0]), argument[1], version=wire_id, in_place=argument[2]
                ),
                "discard": lambda: self.weights.discard_staged(argument),
                "install": lambda: self._install(argument),
                "report": lambda: None,  # the answer alone: which pushed files this rank let go of
            }[action]()
            if action in ("drop", "install"):  # a dropped or replaced model (not kept as the spare) goes back
                release_host_memory()
        except Exception as exc:
            log.exception("rank %d: weights %s failed", self.spec.rank, action)
            error = exc if isinstance(exc, EngineError) else InternalError(f"weights {action} failed: {exc}")
        nbytes = None if action == "report" else self.weights.nbytes  # a report may overtake the call before it
        self.outbox.send(("weights_done", self.spec.rank, wire_id, error, nbytes, unmapped()))
        del replaced  # only now: the serving process, and the requests it holds paused, need not wait for it


def _opened(source: Any) -> Any:
    """A load's source as the rank's weights take it: pushed weights' bytes as tensors (on the weights thread:
    the main thread keeps the heartbeat)."""
    return source.open() if isinstance(source, (SharedWeights, PackedWeights)) else source


def run_rank(spec: RankSpec) -> None:
    """The spawned process's entry point."""
    logging.basicConfig(
        level=spec.log_level, format=f"%(asctime)s %(levelname)s rank {spec.rank} %(name)s: %(message)s"
    )
    # A terminal's Ctrl-C or a supervisor's SIGTERM to the whole group is for the serving process, which
    # closes its ranks in order; a rank leaves on its own only when that process has gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(spec.num_threads)
    context = zmq.Context()
    outputs = context.socket(zmq.PUSH)
    # Sends never block (the Outbox sends under its lock, which the heartbeat needs too): were a send to wait
    # for a serving process that reads nothing, the main thread would stop watching for that process's end.
    outputs.setsockopt(zmq.SNDHWM, 0)
    outputs.connect(spec.outputs_address)
    outbox = Outbox(outputs, spec.rank)
    try:
        rank = RankProcess(spec, context, outbox)
    except Exception as exc:
        log.exception("rank %d failed to start", spec.rank)
        outbox.send(
            ("failed", spec.rank, exc if isinstance(exc, EngineError) else InternalError(f"rank {spec.rank}: {exc}"))
        )
        _exit(context, 1)
    _exit(context, rank.serve())


def _exit(context: zmq.Context, status: int) -> Any:
    """Deliver what was sent (sockets linger until then), then leave without running torch's exit hooks."""
    context.destroy(linger=5000)
    logging.shutdown()
    os._exit(status)
