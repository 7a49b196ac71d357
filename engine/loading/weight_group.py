"""`WeightGroup`: this server's side of a torch.distributed group with a trainer, which broadcasts new weights.

The trainer holds rank 0 and serves the group's `TCPStore`; this server joins at its own rank, as a store
client. The group is a `ProcessGroupGloo` (or NCCL) made directly over a `PrefixStore` of that store: never
torch's default group, so the engine's own groups, and a trainer's, are untouched. The wire protocol, which a
trainer in any framework follows (docs/rl.md):

- the process group's keys live under GROUP_PREFIX in the trainer's store;
- on joining, this server sets `joined_key(rank)` before it makes its side of the group;
- for an update, once its header is checked and the buffer is ready, it sets `ready_key(rank)`, then
  receives the tensors' bytes (header order, row-major, packed) in buckets of `bucket_bytes` (the last shorter),
  each broadcast from rank 0 as a uint8 tensor. A trainer that waits for the key before broadcasting never
  broadcasts into a refused update (refusals come before the key).

Every wait has a limit: the join, `timeout` in all; each bucket, `timeout`. A bucket that fails (the trainer
gone: its connections close; or silent past the limit) destroys the group: gloo's state is then unknown.
"""

from __future__ import annotations

import datetime
import re
import threading
import time
from typing import Any, Callable, Sequence

import torch
from torch.distributed import PrefixStore, Store, TCPStore
from torch.distributed.distributed_c10d import BroadcastOptions

from ..comm.gloo_comm import gloo_group, local_address
from ..errors import Aborted, DeadlineExceeded, FailedPrecondition, InvalidRequest
from .pushed import TensorSpec, host_buffer, tensor_views

BACKENDS = ("gloo", "nccl")
DEFAULT_TIMEOUT = 60.0  # seconds: the join, and each bucket's broadcast
DEFAULT_BUCKET_BYTES = 512 << 20
GROUP_PREFIX = "lmgate/weights/group"


def joined_key(rank: int) -> str:
    """Set in the trainer's store by the server at `rank` once it reached the store, before its group is made."""
    return f"lmgate/weights/joined/{rank}"


def ready_key(rank: int) -> str:
    """Set by the server at `rank` once an update's header is checked and it waits for the first bucket."""
    return f"lmgate/weights/ready/{rank}"


class WeightGroup:
    """This server's rank in a trainer's group. `join`, then any number of `receive`s, each run on the calling
    admin thread, one at a time (a second while one runs is FailedPrecondition); `destroy` may come from any
    thread and never waits on the network.

    `_lock` guards `_busy` and `_destroyed`; a leaf, never held while waiting on the network. A destroy while
    a join or receive runs only marks the group: that call, when its collective ends (its bucket arrives, the
    trainer closes, or the limit passes), tears the group down on its own thread and raises Aborted. Dropping
    a gloo group with a collective pending would block until that collective's limit.
    """

    def __init__(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        rank: int,
        backend: str,
        timeout: float,
        device: torch.device,
        buffer: Callable[[int], memoryview] = host_buffer,
    ) -> None:
        if backend not in BACKENDS:
            raise InvalidRequest(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
        if backend == "nccl" and device.type != "cuda":
            raise InvalidRequest(f"backend 'nccl' needs a CUDA device; this server runs on {device.type}: use gloo")
        if not master_address or not 0 < master_port < 65536:
            raise InvalidRequest(f"the trainer's store address {master_address}:{master_port} is not one")
        if not 0 < rank < world_size:
            raise InvalidRequest(f"rank_offset {rank} must lie in 1..{world_size - 1} (world_size {world_size})")
        if timeout <= 0:
            raise InvalidRequest(f"timeout must be positive, got {timeout}")
        self.master_address, self.master_port = master_address, master_port
        self.world_size, self.rank, self.backend = world_size, rank, backend
        self.timeout = datetime.timedelta(seconds=timeout)
        self._buffer = buffer  # the host memory a receive fills (the engine's: its ranks read it without a copy)
        # NCCL connects on one device, named by its index.
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" and device.index is None else device
        )
        self._store: Store | None = None
        self._group: Any = None  # a ProcessGroupGloo or ProcessGroupNCCL (torch's stubs give them no collectives)
        self._lock = threading.Lock()
        self._busy: str | None = None  # "joining" or "receiving" while a call uses the group
        self._destroyed = False

    def join(self) -> None:
        """Meet the trainer at its store and make this rank's side of the group; DeadlineExceeded when the
        trainer has not joined within the timeout (its store unreachable, or its side never made)."""
        self._begin("joining")
        where = f"{self.master_address}:{self.master_port}"
        try:
            deadline = time.monotonic() + self.timeout.total_seconds()
            store = TCPStore(self.master_address, self.master_port, is_master=False, timeout=self.timeout)
            store.set(joined_key(self.rank), "1")
            left = datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))
            self._store, self._group = store, self._make_group(store, left)
        except RuntimeError as exc:  # torch.distributed's errors, the timeouts among them
            self._failed()
            raise DeadlineExceeded(
                f"the trainer's group at {where} was not joined within {self.timeout.total_seconds():g}s: "
                f"{_first_line(exc)}"
            ) from None
        finally:
            destroyed = self._end()
        if destroyed:
            raise Aborted("the weight group was destroyed while it was being joined")

    def receive(self, specs: Sequence[TensorSpec], bucket_bytes: int) -> dict[str, torch.Tensor]:
        """The tensors `specs` announce, broadcast by the trainer in buckets (checked by the caller before):
        views of one host buffer, by name. A bucket that fails destroys the group (Aborted)."""
        if bucket_bytes <= 0:
            raise InvalidRequest(f"bucket_bytes must be positive, got {bucket_bytes}")
        self._begin("receiving")
        total = sum(spec.nbytes for spec in specs)
        buckets, received = -(-total // bucket_bytes), 0
        try:
            buffer = self._buffer(total)
            whole = torch.frombuffer(buffer, dtype=torch.uint8) if total else torch.empty(0, dtype=torch.uint8)
            assert self._store is not None
            self._store.set(ready_key(self.rank), "1")
            for start in range(0, total, bucket_bytes):
                self._broadcast(whole[start : start + bucket_bytes])
                received += 1
                if self._marked_destroyed():
                    raise Aborted(f"the weight group was destroyed after {received} of {buckets} buckets")
        except RuntimeError as exc:  # gloo's: the trainer closed, or was silent past the limit
            self._failed()
            raise Aborted(
                f"the trainer's broadcast broke off after {received} of {buckets} buckets ({_first_line(exc)}): "
                "the old weights still serve and the group is destroyed; make a new one"
            ) from None
        except Aborted:
            self._failed()
            raise
        finally:
            self._end()
        return tensor_views(specs, buffer)

    def destroy(self) -> None:
        """Leave the group (idempotent). While a join or receive runs, that call tears it down as it ends."""
        with self._lock:
            self._destroyed = True
            if self._busy:
                return
        self._tear_down()

    def _make_group(self, store: Store, timeout: datetime.timedelta) -> Any:
        """This rank's side of the group; returns once every rank has made its own (or raises at `timeout`)."""
        prefixed = PrefixStore(GROUP_PREFIX, store)
        if self.backend == "gloo":
            hostname = local_address(self.master_address, self.master_port)
            return gloo_group(prefixed, self.rank, self.world_size, timeout, hostname)
        from torch.distributed import ProcessGroupNCCL  # only in CUDA builds of torch

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = ProcessGroupNCCL(prefixed, self.rank, self.world_size, options)
        group.eager_connect_single_device(self.device)  # NCCL connects lazily: here, so the join means joined
        return group

    def _broadcast(self, out: torch.Tensor) -> None:
        """One bucket from rank 0 into `out` (a contiguous slice of the host buffer)."""
        options = BroadcastOptions()
        options.rootRank, options.timeout = 0, self.timeout
        assert self._group is not None
        if self.backend == "gloo":
            self._group.broadcast([out], options).wait()
            return
        bucket = torch.empty(out.numel(), dtype=torch.uint8, device=self.device)
        self._group.broadcast([bucket], options).wait()
        out.copy_(bucket)

    def _begin(self, what: str) -> None:
        with self._lock:
            if self._destroyed:
                raise Aborted("the weight group was destroyed: make a new one")
            if self._busy:
                raise FailedPrecondition(f"the weight group is {self._busy}: one call at a time")
            if what == "receiving" and self._group is None:
                raise FailedPrecondition("the weight group is not joined")
            self._busy = what

    def _end(self) -> bool:
        """Whether the group was destroyed meanwhile (and is now torn down)."""
        with self._lock:
            self._busy = None
            destroyed = self._destroyed
        if destroyed:
            self._tear_down()
        return destroyed

    def _failed(self) -> None:
        with self._lock:
            self._destroyed = True

    def _marked_destroyed(self) -> bool:
        with self._lock:
            return self._destroyed

    def _tear_down(self) -> None:
        """With no collective pending: the group's connections close at once, and the trainer's side sees it."""
        with self._lock:
            group, self._group, self._store = self._group, None, None
        if group is not None and self.backend == "nccl":
            group.shutdown()


def _first_line(exc: BaseException) -> str:
    """The error's first line, without the source location gloo puts first ("[.../pair.cc:537] ")."""
    line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return re.sub(r"^\[[^\]]*\] ", "", line)
