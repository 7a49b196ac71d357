"""`OutputRelay`: the engine's outputs, from its signal thread onto the gRPC event loop, one wake-up a burst."""

from __future__ import annotations

import asyncio
import threading

from lmgate.engine.gateway.request import RequestOutput


class OutputRelay:
    """An engine step of a few hundred streams hands over a few hundred outputs at once. Waking the event loop
    for each (`call_soon_threadsafe` writes to the loop's self-pipe every time, and schedules a callback)
    costs more than the outputs themselves; here they wait in one list, and the loop is woken once until it
    has taken them. Each stream's outputs stay in the order they came.

    `_lock` guards the list and the flag only, held for an append or a swap, never while calling out.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue[RequestOutput], RequestOutput]] = []
        self._woken = False  # a drain is scheduled and has not swapped the list yet

    def put(self, queue: asyncio.Queue[RequestOutput], output: RequestOutput) -> None:
        """From any thread: `output` into `queue`, on the loop."""
        with self._lock:
            self._pending.append((queue, output))
            if self._woken:
                return
            self._woken = True
        self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            pending, self._pending, self._woken = self._pending, [], False
        for queue, output in pending:
            queue.put_nowait(output)
