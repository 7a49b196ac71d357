"""`ThreadComm`: a `HostComm` whose ranks are threads of one process, after TurboMind's ThreadCommImpl."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import cast

from .host_comm import CommAborted, HostComm, RedOp, T

_REDUCE: dict[RedOp, Callable[[Iterable[int]], int]] = {RedOp.SUM: sum, RedOp.MIN: min, RedOp.MAX: max}


class _Group:
    """State shared by the `ThreadComm`s of one group: one slot per rank and the barrier ordering them.

    Slot r is written only by rank r's thread and read by all of them between the two barrier phases of a
    collective. `_lock` guards only `_children` and `_aborted`; it is a leaf, never held while waiting.
    """

    def __init__(self, size: int) -> None:
        self.slots: list[object] = [None] * size
        self.barrier = threading.Barrier(size)
        self._lock = threading.Lock()
        self._children: list[_Group] = []  # groups split from this one, aborted along with it
        self._aborted = False

    def adopt(self, child: _Group) -> None:
        with self._lock:
            self._children.append(child)
            aborted = self._aborted
        if aborted:
            child.abort()

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            children, self._children = self._children, []
        self.barrier.abort()
        for child in children:
            child.abort()


class ThreadComm(HostComm):
    """A communicator whose ranks are threads of one process; build a group with `create_group`.

    Each `ThreadComm` object is owned by one thread (its rank's engine loop), which alone calls its
    collectives. The group's `threading.Barrier` is the only synchronisation between ranks, and it is never
    waited on while the caller holds another lock. A collective writes the caller's slot, waits (phase 1:
    every slot is written), reads the slots, and waits again (phase 2: every rank has read), so the next
    collective cannot overwrite a slot that a slower rank has yet to read. Values are shared by reference,
    not copied: treat what you pass and receive as immutable.

    Shutdown: `abort()` breaks the barrier (`Barrier.abort`), so ranks waiting in a collective, and every
    later collective on any rank, raise `CommAborted` instead of waiting forever for a rank that has left.
    Aborting a communicator also aborts those split from it. There is no timeout: an engine loop may
    legitimately wait a long time for an idle peer.
    """

    def __init__(self, group: _Group, rank: int) -> None:
        """Internal; use `create_group` or `split`."""
        self._group = group
        self._rank = rank

    @classmethod
    def create_group(cls, size: int) -> list[ThreadComm]:
        """One communicator per rank, to be handed to that rank's thread. A size-1 group needs no threads."""
        if size < 1:
            raise ValueError(f"group size must be at least 1, got {size}")
        group = _Group(size)
        return [cls(group, rank) for rank in range(size)]

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return len(self._group.slots)

    def broadcast(self, value: T, root: int = 0, patient: bool = False) -> T:  # no time limit to lift
        if not 0 <= root < self.size:
            raise ValueError(f"root {root} out of range for a group of {self.size}")
        return self._exchange(value)[root]

    def all_gather(self, value: T) -> list[T]:
        return self._exchange(value)

    def all_reduce(self, value: int | list[int], op: RedOp) -> int | list[int]:
        reduce = _REDUCE[op]
        values = self._exchange(value)
        if isinstance(value, list):
            return [reduce(column) for column in zip(*values, strict=True)]
        return reduce(cast("list[int]", values))  # every rank passes an int when this one does

    def sync(self) -> None:
        self._wait()

    def split(self, color: int, key: int) -> ThreadComm:
        entries = self.all_gather((color, key))
        members = sorted((r for r, (c, _) in enumerate(entries) if c == color), key=lambda r: (entries[r][1], r))
        # The lowest old rank of each color creates the new group and publishes it to the others.
        leader = min(members)
        created = None
        if self._rank == leader:
            created = _Group(len(members))
            self._group.adopt(created)
        groups = self.all_gather(created)
        group = groups[leader]
        assert group is not None  # the leader published the group it created
        return ThreadComm(group, members.index(self._rank))

    def abort(self) -> None:
        self._group.abort()

    def _wait(self) -> None:
        try:
            self._group.barrier.wait()
        except threading.BrokenBarrierError:
            raise CommAborted("host communicator aborted") from None

    def _exchange(self, value: T) -> list[T]:
        """Every rank's value, indexed by rank: the two-phase step all collectives but `sync` are built on."""
        slots = self._group.slots
        if len(slots) == 1:  # a loop alone (every step's `Gateway.pop`): nobody to wait for, unless aborted
            if self._group.barrier.broken:
                raise CommAborted("host communicator aborted")
            return [value]
        slots[self._rank] = value
        self._wait()
        seen = cast("list[T]", list(slots))  # every slot holds a rank's `value` of this collective
        self._wait()
        slots[self._rank] = None  # everyone has read it; do not keep the value alive until the next call
        return seen
