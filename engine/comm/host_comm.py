"""Host-side collectives among data-parallel engine loops, after TurboMind's HostComm / ThreadCommImpl.

Every engine loop owns one communicator and calls the same collectives, in the same order, as its
peers: a communicator has no tags, so a rank that skips or reorders a call deadlocks the group (or, once
someone calls `abort`, makes every rank raise `CommAborted`). The loops use an `all_reduce` each step so
that they agree on what `Gateway.pop` returned before they run a step.

Implementations: `ThreadComm` (ranks are threads of one process, thread_comm.py) and `GlooComm` (ranks
are processes, over torch.distributed's gloo, gloo_comm.py). Callers hold a `HostComm` and never know which.
"""

from __future__ import annotations

import abc
import enum
from typing import TypeVar

T = TypeVar("T")


class CommAborted(RuntimeError):
    """A collective cannot complete: some rank called `abort` on this communicator or on its parent."""


class RedOp(enum.Enum):
    SUM = "sum"
    MIN = "min"
    MAX = "max"


class HostComm(abc.ABC):
    """Collectives among `size` ranks; each call blocks until every rank of the group has made it."""

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """This rank's index in the group, 0 <= rank < size."""

    @property
    @abc.abstractmethod
    def size(self) -> int:
        """Number of ranks in the group."""

    @abc.abstractmethod
    def broadcast(self, value: T, root: int = 0, patient: bool = False) -> T:
        """`root`'s value on every rank; the value the other ranks pass is ignored. `patient`: the ranks may
        wait for the root beyond the communicator's time limit on a collective (a tensor-parallel follower
        waiting for its leader's next command, which an idle leader does not send)."""

    @abc.abstractmethod
    def all_gather(self, value: T) -> list[T]:
        """Every rank's value, indexed by rank."""

    @abc.abstractmethod
    def all_reduce(self, value: int | list[int], op: RedOp) -> int | list[int]:
        """`op` over every rank's value; lists (of equal length on all ranks) are reduced elementwise."""

    @abc.abstractmethod
    def sync(self) -> None:
        """Barrier: returns once every rank has called it."""

    @abc.abstractmethod
    def split(self, color: int, key: int) -> HostComm:
        """Collective: ranks passing the same color form a new communicator, ranked by (key, old rank)."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Make pending and future collectives on every rank raise `CommAborted`; never blocks."""
