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
        """Up to `max_infer` generate requests and every kill request before them, in order; None once closed
        and empty. Stops at the first generate that does not fit, so a later kill never overtakes it."""
        with self._cond:
            if blocking:
                self._cond.wait_for(lambda: self._items or self._closed, timeout)
            if self._closed and not self._items:
                return None
            taken: list[Request] = []
            infer = 0
            while self._items:
                if self._items[0].kind is RequestKind.GENERATE:
                    if infer == max_infer:
                        break
                    infer += 1
                taken.append(self._items.popleft())
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
