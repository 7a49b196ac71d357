"""One engine loop's inbox of generate and kill requests, in arrival order."""

from __future__ import annotations

import threading
from collections import deque
from typing import Protocol

from ..errors import ResourceExhausted
from .request import CancelFlag, Request, RequestKind


class QueueEnd(Protocol):
    """What the Gateway pushes requests to and closes, one per data-parallel rank: the rank's `RequestQueue`,
    or, for a rank in another process, a stand-in that sends them there (ranks/process_ranks.py)."""

    def push(self, request: Request) -> bool: ...

    def close(self) -> list[Request]: ...


class RequestQueue:
    """Filled by any thread through the Gateway, emptied by one engine loop; the Gateway wakes idle loops.

    `_lock` guards `_items` and `_closed`; it is a leaf lock: nothing is called out while it is held.
    """

    def __init__(self, max_generates: int) -> None:
        self.max_generates = max_generates
        self._num_generates = 0
        self._items: deque[Request] = deque()
        self._lock = threading.Lock()
        self._closed = False

    def push(self, request: Request) -> bool:
        """False once the queue is closed; the caller then refuses the request itself. A generate beyond
        `max_generates` waiting is refused (those cancelled while waiting no longer count); kills and
        controls always get in."""
        with self._lock:
            if self._closed:
                return False
            if request.kind is RequestKind.GENERATE:
                if self._num_generates >= self.max_generates:
                    self._drop_cancelled()
                if self._num_generates >= self.max_generates:
                    raise ResourceExhausted(
                        f"this engine loop's queue is full ({self._num_generates} waiting); retry later"
                    )
                self._num_generates += 1
            self._items.append(request)
            return True

    def pop(self, max_infer: int) -> list[Request] | None:
        """Every kill and control request, and up to `max_infer` generate requests, in arrival order; None
        once closed and empty. Never waits. Generates that do not fit stay queued; kills and controls never
        wait behind them (the engine loop handles a generate whose session ended meanwhile). Generates
        cancelled while waiting are dropped: their streams have ended, and they take no place in the batch."""
        with self._lock:
            if self._closed and not self._items:
                return None
            taken: list[Request] = []
            left: deque[Request] = deque()
            for r in self._items:
                if r.kind is RequestKind.GENERATE:
                    if r.cancel_flag.value == CancelFlag.CANCELLED:
                        self._num_generates -= 1
                        continue
                    if max_infer == 0:
                        left.append(r)
                        continue
                    max_infer -= 1
                    self._num_generates -= 1
                taken.append(r)
            self._items = left
            return taken

    def take_generates(self) -> list[Request]:
        """Every generate still waiting (those cancelled dropped), in arrival order; kills and controls stay."""
        with self._lock:
            self._drop_cancelled()
            taken = [r for r in self._items if r.kind is RequestKind.GENERATE]
            self._items = deque(r for r in self._items if r.kind is not RequestKind.GENERATE)
            self._num_generates = 0
            return taken

    def _drop_cancelled(self) -> None:
        """Under `_lock`. A generate is CANCELLED here only by `Gateway.cancel`, which has ended its stream."""
        kept = deque(
            r for r in self._items if r.kind is not RequestKind.GENERATE or r.cancel_flag.value != CancelFlag.CANCELLED
        )
        self._num_generates -= len(self._items) - len(kept)
        self._items = kept

    @property
    def num_generates(self) -> int:
        """Generate requests waiting; a single int read, possibly stale."""
        return self._num_generates

    def state(self) -> tuple[bool, bool]:
        """(has queued requests, is closed)."""
        with self._lock:
            return bool(self._items), self._closed

    def close(self) -> list[Request]:
        """Refuse new requests and hand back those still waiting."""
        with self._lock:
            self._closed = True
            left = list(self._items)
            self._items.clear()
            self._num_generates = 0
            return left
