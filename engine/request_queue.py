"""One engine loop's inbox of generate and kill requests, in arrival order."""
from __future__ import annotations

import threading
from collections import deque

from .request import Request, RequestKind


class RequestQueue:
    """Filled by any thread through the Gateway, emptied by one engine loop.

    `_cond` guards `_items` and `_closed`; it is a leaf lock: nothing is called out while it is held.
    """

    def __init__(self) -> None:
        self._items: deque[Request] = deque()
        self._cond = threading.Condition()
        self._closed = False

    def push(self, request: Request) -> bool:
        """False once the queue is closed; the caller then refuses the request itself."""
        with self._cond:
            if self._closed:
                return False
            self._items.append(request)
            self._cond.notify()
            return True

    def pop(self, max_infer: int, blocking: bool, timeout: float | None = None) -> list[Request] | None:
        """Every kill and control request, and up to `max_infer` generate requests, in arrival order; None
        once closed and empty. Generates that do not fit stay queued; kills and controls never wait behind
        them (the engine loop handles a generate whose session ended meanwhile)."""
        with self._cond:
            if blocking:
                self._cond.wait_for(lambda: self._items or self._closed, timeout)
            if self._closed and not self._items:
                return None
            taken: list[Request] = []
            left: deque[Request] = deque()
            for r in self._items:
                if r.kind is RequestKind.GENERATE and max_infer == 0:
                    left.append(r)
                    continue
                max_infer -= r.kind is RequestKind.GENERATE
                taken.append(r)
            self._items = left
            return taken

    def has_items(self) -> bool:
        with self._cond:
            return bool(self._items)

    def close(self) -> list[Request]:
        """Refuse new requests and hand back those still waiting."""
        with self._cond:
            self._closed = True
            left = list(self._items)
            self._items.clear()
            self._cond.notify_all()
            return left
