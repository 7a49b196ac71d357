"""OutputRelay (service/relay.py): outputs from other threads reach their queues on the event loop, each
producer's in order, and a burst wakes the loop once."""

from __future__ import annotations

import asyncio
import threading

from lmgate.service.relay import OutputRelay


class CountingLoop(asyncio.SelectorEventLoop):
    """A real event loop that counts its wake-ups from other threads."""

    def __init__(self) -> None:
        super().__init__()
        self.wakeups = 0

    def call_soon_threadsafe(self, *args, **kwargs):
        self.wakeups += 1
        return super().call_soon_threadsafe(*args, **kwargs)


def running_loop() -> tuple[CountingLoop, threading.Thread]:
    loop = CountingLoop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    return loop, thread


def stop(loop: CountingLoop, thread: threading.Thread) -> None:
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()


def on_loop(loop: asyncio.AbstractEventLoop, fn):
    async def call():
        return fn()

    return asyncio.run_coroutine_threadsafe(call(), loop).result()


def drained(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, n: int) -> list:
    async def take():
        return [await queue.get() for _ in range(n)]

    return asyncio.run_coroutine_threadsafe(asyncio.wait_for(take(), 30), loop).result()


def test_each_producers_outputs_arrive_in_order():
    loop, thread = running_loop()
    try:
        relay = OutputRelay(loop)
        shared = on_loop(loop, asyncio.Queue)
        own = [on_loop(loop, asyncio.Queue) for _ in range(4)]

        def produce(p: int) -> None:
            for i in range(2000):
                relay.put(own[p], i)
                relay.put(shared, (p, i))

        producers = [threading.Thread(target=produce, args=(p,)) for p in range(4)]
        for t in producers:
            t.start()
        for t in producers:
            t.join()
        for q in own:
            assert drained(loop, q, 2000) == list(range(2000))
        got = drained(loop, shared, 8000)
        for p in range(4):
            assert [i for q, i in got if q == p] == list(range(2000))
    finally:
        stop(loop, thread)


def test_a_burst_wakes_the_loop_once():
    """What one engine step of 256 streams hands over while the loop is busy: one wake-up, every output."""
    loop, thread = running_loop()
    try:
        relay = OutputRelay(loop)
        queues = [on_loop(loop, asyncio.Queue) for _ in range(256)]
        busy, release = threading.Event(), threading.Event()
        loop.call_soon_threadsafe(lambda: (busy.set(), release.wait()))
        busy.wait()
        before = loop.wakeups
        for i, q in enumerate(queues):
            relay.put(q, i)
        assert loop.wakeups - before == 1
        release.set()
        assert [drained(loop, q, 1)[0] for q in queues] == list(range(256))
        before = loop.wakeups
        relay.put(queues[0], "next")  # the drain ran: the next output wakes the loop again
        assert loop.wakeups - before == 1
        assert drained(loop, queues[0], 1) == ["next"]
    finally:
        stop(loop, thread)
