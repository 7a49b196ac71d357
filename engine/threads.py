"""Where torch work runs: one-off heavy work on a thread that ends with it."""
from __future__ import annotations

import threading
from typing import Callable, TypeVar

T = TypeVar("T")


def on_fresh_thread(fn: Callable[[], T], name: str = "lmgate-setup") -> T:
    """`fn()` on a new thread, joined; its result, or its exception raised here.

    Every thread that runs parallel torch work keeps an OpenMP thread pool for life. Once a long-lived
    thread (the server's main thread, an executor thread) had run such work, the engine loops' decode
    steps, thousands of small parallel regions each, ran 40% or more slower on a 2-core machine; likely
    because its idle pool brings the process's OpenMP threads above the core count and libgomp then
    shortens every pool's spin-wait. A thread that has ended leaves no such pool behind, so loading,
    building and allocating run here.
    """
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # handed to the caller, who re-raises it
            error.append(exc)

    t = threading.Thread(target=target, name=name)
    t.start()
    t.join()
    if error:
        raise error[0]
    return result[0]
