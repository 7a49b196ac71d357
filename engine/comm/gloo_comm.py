"""`GlooComm`: a `HostComm` whose ranks are processes, over torch.distributed's gloo backend.

After TurboMind's gloo HostComm: one `ProcessGroupGloo` per communicator, made directly over a `PrefixStore`
of one shared `TCPStore` (no default process group, so several groups, and a server's own code, can live in
one process). `split` builds its new group from the ranks ordered by (key, old rank): torch's `new_group`
sorts ranks by global rank, so it cannot honour the key.

Values cross as pickles: `broadcast` and `all_gather` send a length, then the bytes. `all_reduce` reduces
int64 tensors, after a first reduce that checks every rank passed the same shape.

The store and gloo's connections are plain TCP, which other users of a machine reach too (the store even
lists its keys), and unpickling runs code. So every pickle is signed with the group's secret, which its
ranks get from their parent (on one machine never through the store; the ranks of other machines fetch it
there, on the network they must trust), and one that fails the check is never unpickled.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import pickle
import secrets
import socket
import threading
from typing import Any, Callable, cast

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, ReduceOp, Store, TCPStore, Work
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, BroadcastOptions

from .host_comm import CommAborted, HostComm, RedOp, T

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)  # one collective; idle ranks wait outside collectives
# A patient broadcast's wait for its root (HostComm.broadcast): a follower of an idle leader waits inside
# one, and with the default limit died after 10 idle minutes. A peer that dies still breaks it at once.
PATIENT_TIMEOUT = datetime.timedelta(days=365)
SIGNATURE_BYTES = 32
ABORT_POLL = 0.1  # seconds a waiting collective goes between looks at its peers' abort keys
_OPS = {RedOp.SUM: ReduceOp.SUM, RedOp.MIN: ReduceOp.MIN, RedOp.MAX: ReduceOp.MAX}


class GlooComm(HostComm):
    """A communicator whose ranks are processes; build one per process with `connect`, or `split` one.

    Owned by one thread of its process (its rank's engine loop), which alone calls its collectives; `abort`
    may come from any thread. `_lock` guards `_aborted` and `_children`; it is a leaf, and a collective waits
    on its condition (`_done`) without holding anything else.

    Abort: this rank's pending and later collectives, and those of communicators split from it, raise
    `CommAborted` at once. The abort is also written to the store (gloo's own abort does not close its
    connections), and a collective that waits checks the store every `ABORT_POLL` seconds, so peers blocked
    with this rank raise within that. A peer that dies mid-collective makes the others raise `CommAborted`
    as gloo notices the closed connection.
    """

    def __init__(
        self,
        store: Store,
        rank: int,
        size: int,
        secret: bytes,
        prefix: str = "lmgate",
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
        abort_keys: tuple[str, ...] = (),
        hostname: str = "127.0.0.1",
    ) -> None:
        """Collective over the `size` processes: each must call it with its own rank and the same secret and
        prefix. `secret`: the key that signs the values they send (`new_secret`), up to 64 bytes.
        `abort_keys`: the store keys of the communicators it was split from, whose abort aborts it too.
        `hostname`: this process's address that its peers reach it by (`local_address`)."""
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} out of range for a group of {size}")
        self.hostname = hostname
        self._store = store
        self._secret = secret
        self._prefix = prefix
        self._timeout = timeout
        self._rank = rank
        self._size = size
        # A ProcessGroupGloo (torch's stubs give it no collectives).
        self._group: Any = gloo_group(PrefixStore(prefix, store), rank, size, timeout, hostname)
        self._splits = 0  # split() calls so far: every rank counts the same, so it names the new group's keys
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._aborted = False
        self._children: list[GlooComm] = []
        self._abort_keys = (*abort_keys, f"{prefix}/aborted")

    @classmethod
    def connect(
        cls, host: str, port: int, rank: int, size: int, secret: bytes, timeout: datetime.timedelta = DEFAULT_TIMEOUT
    ) -> GlooComm:
        """Join the group whose `TCPStore` listens at host:port (made by `create_store`), from any machine
        that reaches it."""
        store = TCPStore(host, port, is_master=False, timeout=timeout)
        return cls(store, rank, size, secret, timeout=timeout, hostname=local_address(host, port))

    @staticmethod
    def create_store(host: str = "127.0.0.1", port: int = 0) -> TCPStore:
        """The rendezvous the ranks `connect` to, served by this process at host:port (port 0: any free port,
        see `.port`). On `host` alone: a TCPStore left to bind itself listens on every interface, where any
        machine could write the keys gloo's ranks meet by."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            listener.listen(socket.SOMAXCONN)
        except OSError:
            listener.close()
            raise
        return TCPStore(
            host, listener.getsockname()[1], is_master=True, wait_for_workers=False, master_listen_fd=listener.detach()
        )  # the store owns the socket, and closes it when it goes

    @property
    def store(self) -> Store:
        """The rendezvous this communicator's group met at, for other groups of the same ranks."""
        return self._store

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def broadcast(self, value: T, root: int = 0, patient: bool = False) -> T:
        if not 0 <= root < self._size:
            raise ValueError(f"root {root} out of range for a group of {self._size}")
        data = self._encode(value) if self._rank == root else torch.empty(0, dtype=torch.uint8)
        length = torch.tensor([data.numel()])
        self._run(
            lambda: self._group.broadcast([length], _broadcast_options(root, PATIENT_TIMEOUT if patient else None))
        )
        if self._rank != root:
            data = torch.empty(int(length), dtype=torch.uint8)
        self._run(lambda: self._group.broadcast([data], _broadcast_options(root)))
        return value if self._rank == root else cast("T", self._decode(data.numpy().tobytes()))

    def all_gather(self, value: T) -> list[T]:
        data = self._encode(value)
        lengths = self._gather(torch.tensor([data.numel()]))
        longest = max(int(n) for n in lengths)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: data.numel()] = data
        return [cast("T", self._decode(d[: int(n)].numpy().tobytes())) for d, n in zip(self._gather(padded), lengths)]

    def all_reduce(self, value: int | list[int], op: RedOp) -> int | list[int]:
        if self._size == 1:  # a lone rank's own value: no round trip through gloo's thread at every step's pop
            self._check_open()
            return list(value) if isinstance(value, list) else value
        values = value if isinstance(value, list) else [value]
        shape = -1 if isinstance(value, int) else len(values)  # -1: a scalar
        lo, hi = self._reduce(torch.tensor([-shape, shape]), ReduceOp.MAX).tolist()
        if -lo != hi:
            raise ValueError("all_reduce: the ranks passed values of different lengths")
        out = self._reduce(torch.tensor(values, dtype=torch.int64), _OPS[op]).tolist()
        return out if isinstance(value, list) else out[0]

    def sync(self) -> None:
        self._run(self._group.barrier)

    def split(self, color: int, key: int) -> GlooComm:
        entries = self.all_gather((color, key))
        members = sorted((r for r, (c, _) in enumerate(entries) if c == color), key=lambda r: (entries[r][1], r))
        self._splits += 1
        child = GlooComm(
            self._store,
            members.index(self._rank),
            len(members),
            self._secret,
            f"{self._prefix}/{self._splits}/{color}",
            self._timeout,
            self._abort_keys,
            self.hostname,
        )
        with self._lock:
            self._children.append(child)
            aborted = self._aborted
        if aborted:
            child.abort()
        return child

    def abort(self) -> None:
        self._abort_here()
        try:
            self._store.set(self._abort_keys[-1], "1")  # the peers' waiting collectives see it
        except RuntimeError:  # the store has gone (its process exited): the peers' connections went with it
            pass

    def _abort_here(self) -> None:
        with self._lock:
            self._aborted = True
            children, self._children = self._children, []
            self._done.notify_all()
        for child in children:
            child._abort_here()

    def _encode(self, value: object) -> torch.Tensor:
        """`value` pickled, after its signature."""
        payload = pickle.dumps(value)
        return torch.frombuffer(bytearray(self._sign(payload) + payload), dtype=torch.uint8)

    def _decode(self, data: bytes) -> object:
        """The value a peer sent; a message this group's secret did not sign aborts the group unread."""
        signature, payload = data[:SIGNATURE_BYTES], data[SIGNATURE_BYTES:]
        if not hmac.compare_digest(signature, self._sign(payload)):
            self.abort()
            raise CommAborted("a message not signed with this group's secret: is another process on its ports?")
        return pickle.loads(payload)

    def _sign(self, payload: bytes) -> bytes:
        return hashlib.blake2b(payload, key=self._secret, digest_size=SIGNATURE_BYTES).digest()

    def _gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(self._size)]
        self._run(lambda: self._group.allgather([out], [tensor], AllgatherOptions()))
        return out

    def _reduce(self, tensor: torch.Tensor, op: ReduceOp.RedOpType) -> torch.Tensor:
        options = AllreduceOptions()
        options.reduceOp = op  # type: ignore[assignment]  # torch's stub: it takes ReduceOp.SUM and the like too
        self._run(lambda: self._group.allreduce([tensor], options))
        return tensor

    def _run(self, start: Callable[[], Work]) -> None:
        """Start a collective, unless aborted, and wait until it completes or this communicator is aborted.
        gloo's failures (a peer gone, the timeout) abort it, so every later call raises too."""
        self._check_open()
        work = start()
        future, done = work.get_future(), self._done
        # The callback runs on gloo's thread and must not hold this object: dropping the last reference to a
        # process group there would make its destructor join that very thread.
        future.add_done_callback(lambda _: _notify(done))
        while True:
            with self._lock:
                self._done.wait_for(lambda: future.done() or self._aborted, timeout=ABORT_POLL)
                aborted, finished = self._aborted, future.done()
            if aborted:
                raise CommAborted("host communicator aborted")
            if finished:
                break
            if self._peer_aborted():
                # This rank's own abort sets its flag before the store's key: a key seen with the flag set is ours.
                with self._lock:
                    here = self._aborted
                self._abort_here()
                raise CommAborted("host communicator aborted" if here else "host communicator aborted by a peer")
        try:
            work.wait()
        except RuntimeError as exc:
            # A peer that aborted and then dropped its groups closes its connections before this rank's next
            # look at the store: its abort, set before it closed them, is the cause to report.
            by_peer = self._peer_aborted()
            self.abort()
            if by_peer:
                raise CommAborted("host communicator aborted by a peer") from exc
            raise CommAborted(f"a collective failed: {str(exc).splitlines()[0]}") from exc

    def _check_open(self) -> None:
        with self._lock:
            if self._aborted:
                raise CommAborted("host communicator aborted")

    def _peer_aborted(self) -> bool:
        try:
            return any(self._store.check([key]) for key in self._abort_keys)
        except RuntimeError:  # the store has gone: gloo reports the lost peers itself
            return False


def local_address(peer_host: str, peer_port: int) -> str:
    """This machine's address on the route to `peer_host`: the one peers there can reach it by. gloo's own
    default resolves the host name, which on many machines names an address other nodes cannot reach."""
    family, kind, _, _, peer = socket.getaddrinfo(peer_host, peer_port or 1, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind) as probe:
        probe.connect(peer)  # a datagram socket sends nothing: this only picks the route
        return probe.getsockname()[0]


def gloo_group(store: Store, rank: int, size: int, timeout: datetime.timedelta, hostname: str) -> ProcessGroupGloo:
    """A gloo process group whose connections use `hostname`."""
    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's stub names it Options
    options._timeout = timeout
    options._devices = [ProcessGroupGloo.create_device(hostname=hostname)]
    return ProcessGroupGloo(store, rank, size, options)


def _notify(done: threading.Condition) -> None:
    with done:
        done.notify_all()


def _broadcast_options(root: int, timeout: datetime.timedelta | None = None) -> BroadcastOptions:
    """gloo takes a time limit per call; None keeps the group's."""
    options = BroadcastOptions()
    options.rootRank = root
    if timeout is not None:
        options.timeout = timeout
    return options


def new_secret() -> bytes:
    """A key for a new group's `GlooComm`s, to hand to its ranks the way they are started."""
    return secrets.token_bytes(SIGNATURE_BYTES)
