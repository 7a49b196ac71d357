"""`KvEventLog`: what every engine loop's prefix cache keyed and forgot, as one numbered history that a gateway's
cache-aware router follows (the worker protocol's SubscribeKvEvents: service/kv_events.py words it).

A loop's `BlockManager` records its keys' changes as tuples, and only with prefix caching on:

  (KEYED, digest, key, position)   a full block got its key (its parent's digest, its token ids): later
                                   prompts may share it; `digest` stands for the key and the prefix before it
  (FORGOTTEN, key)                 a keyed block lost its key: evicted (handed out again) or made private
  (CLEARED,)                       every key forgotten: new weights, sleep, a flush

The loop hands over a step's events at its end with its outputs (`Gateway.notify`), and the signal thread
publishes them here before it delivers those (`Gateway.publish_kv_events`); a rank process's signal thread sends
them to the serving process, whose rank receiver publishes them here.

The log speaks for the server as a whole, since a router routes to servers: a block is stored when its first
loop keys it and removed when its last loop forgets it. Each publish that changes what the server holds is one
`KvBatch`, numbered without gaps from the microsecond the log was made (a server started again never continues
where a reader's cursor on the last one left off). The history is a ring naming at most `max_blocks` blocks;
the live blocks are kept beside it, for a subscriber whose cursor the ring no longer reaches (`snapshot`).
Memory is thus bounded by the KV cache's blocks and the ring, whoever reads or does not.

`_lock` guards all of it and is a leaf. Listeners run after a publish with no lock held, on the publishing thread
(the signal thread, the rank receiver): they must not block.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger(__name__)

KEYED, FORGOTTEN, CLEARED = 0, 1, 2
Key = tuple[bytes, tuple[int, ...]]  # a block's prefix-cache key: its parent's digest (b"": none) and its tokens
RawEvent = tuple  # one of the three above, as a BlockManager records it
MAX_BLOCKS = 1 << 16  # blocks the history names, stored and removed together (a ring)


@dataclass(slots=True)
class Stored:
    """Blocks now cached, each the parent of the next; `parent`: the digest of the block before the first (b""
    where the first begins a sequence)."""

    parent: bytes
    blocks: list[tuple[bytes, tuple[int, ...]]]  # (digest, token ids)


@dataclass(slots=True)
class Removed:
    digests: list[bytes]


@dataclass(slots=True)
class Cleared:
    """The server holds no cached block any more."""


KvEvent = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class KvBatch:
    seq: int  # consecutive
    timestamp: float  # time.time() at publish
    first_event_id: int  # the events are numbered on from it, across batches
    events: list[KvEvent]
    size: int  # blocks named, for the ring's bound


@dataclass(slots=True)
class _Live:
    digest: bytes
    position: int  # the block's index in its sequence: a snapshot lists parents first
    holders: int = 1  # loops that hold the key


class KvEventLog:
    """Written by whoever publishes (the signal thread, the rank receiver), read by subscribers on any thread."""

    def __init__(self, max_blocks: int = MAX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self._lock = threading.Lock()
        self._ring: deque[KvBatch] = deque()
        self._ring_size = 0
        self._start = time.time_ns() // 1000  # the number before the first batch
        self._last = self._start  # the last batch's number
        self._next_event_id = 1
        self._live: dict[Key, _Live] = {}  # what the server holds
        self._held: dict[int, set[Key]] = {}  # loop rank -> the keys it holds
        self._listeners: list[Callable[[], None]] = []
        self.closed = False

    def publish(self, rank: int, events: list[RawEvent]) -> None:
        """Loop `rank`'s events of one step, in the order they happened."""
        with self._lock:
            changes = self._apply(rank, events)
            if changes:
                self._append(changes)
            listeners = list(self._listeners) if changes else []
        self._tell(listeners)

    def read(self, cursor: int) -> list[KvBatch] | None:
        """The batches after `cursor` (the last one a reader has; 0: none, from the first batch on); None where the
        ring no longer holds the one right after it, or the cursor is past the last batch."""
        with self._lock:
            cursor = cursor or self._start
            first = self._ring[0].seq if self._ring else self._last + 1
            if cursor > self._last or cursor + 1 < first:
                return None
            return [self._ring[-n] for n in range(self._last - cursor, 0, -1)]  # from the end: a reader is near it

    def span(self) -> tuple[int, int]:
        """The first batch the ring holds and the last published (first > last: it holds none)."""
        with self._lock:
            return (self._ring[0].seq if self._ring else self._last + 1), self._last

    def snapshot(self) -> tuple[int, list[tuple[bytes, bytes, tuple[int, ...]]]]:
        """The last batch's number and every block the server holds then, as (digest, parent's digest, token
        ids), parents before children."""
        with self._lock:
            live = sorted(self._live.items(), key=lambda item: item[1].position)
            return self._last, [(block.digest, key[0], key[1]) for key, block in live]

    def listen(self, listener: Callable[[], None]) -> Callable[[], None]:
        """`listener()` runs after every publish that adds a batch, and at `close`; returns what stops it."""
        with self._lock:
            self._listeners.append(listener)
        return lambda: self._forget_listener(listener)

    def close(self) -> None:
        """The engine has stopped: no batch follows; readers should end."""
        with self._lock:
            self.closed = True
            listeners = list(self._listeners)
        self._tell(listeners)

    @staticmethod
    def _tell(listeners: list[Callable[[], None]]) -> None:
        for listener in listeners:
            try:
                listener()
            except Exception:  # a reader's failure is no engine loop's
                log.exception("a KV event listener failed")

    def _forget_listener(self, listener: Callable[[], None]) -> None:
        with self._lock:
            self._listeners.remove(listener)

    # under _lock -------------------------------------------------------------------------------------------

    def _apply(self, rank: int, events: list[RawEvent]) -> list[KvEvent]:
        """A loop's events as changes to what the server holds."""
        held = self._held.setdefault(rank, set())
        changes: list[KvEvent] = []
        for event in events:
            if event[0] == KEYED:
                _, digest, key, position = event
                if key in held:
                    continue
                held.add(key)
                live = self._live.get(key)
                if live is not None:
                    live.holders += 1
                    continue
                self._live[key] = _Live(digest, position)
                last = changes[-1] if changes else None
                if isinstance(last, Stored) and last.blocks[-1][0] == key[0]:
                    last.blocks.append((digest, key[1]))
                else:
                    changes.append(Stored(key[0], [(digest, key[1])]))
            elif event[0] == FORGOTTEN:
                if event[1] in held:
                    held.discard(event[1])
                    self._release(event[1], changes)
            else:
                for key in held:
                    self._release(key, changes)
                held.clear()
                if not self._live:  # nothing left anywhere: one event says so (and all that came before)
                    changes[:] = [Cleared()]
        return changes

    def _release(self, key: Key, changes: list[KvEvent]) -> None:
        live = self._live[key]
        live.holders -= 1
        if live.holders:
            return
        del self._live[key]
        if changes and isinstance(changes[-1], Removed):
            changes[-1].digests.append(live.digest)
        else:
            changes.append(Removed([live.digest]))

    def _append(self, events: list[KvEvent]) -> None:
        size = sum(
            len(e.blocks) if isinstance(e, Stored) else len(e.digests) if isinstance(e, Removed) else 1 for e in events
        )
        self._last += 1
        self._ring.append(KvBatch(self._last, time.time(), self._next_event_id, events, size))
        self._next_event_id += len(events)
        self._ring_size += size
        while self._ring_size > self.max_blocks:
            self._ring_size -= self._ring.popleft().size
