"""Where torch work runs and on how many threads: one-off heavy work on a thread that ends with it, and
the CPUs this process may really use.

Torch work that is not a step (loading, building, allocating) runs on a short-lived thread
(`threads.on_fresh_thread`): an OpenMP pool left behind on a long-lived thread slows every step. The loops split
`EngineConfig.threads` (default: `threads.available_cpus()`, the affinity mask capped by a cgroup quota) between
them (`Engine.threads_per_loop`). Importing the engine sets `OMP_WAIT_POLICY=PASSIVE` unless the environment
chose, before torch loads libgomp (engine/__init__.py says what it measured).
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
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


def in_shares(work: Callable[[int], None], shares: int) -> None:
    """`work(0)` to `work(shares - 1)` at once, for copies one core cannot make as fast as two: the first on
    this thread, the others on threads that end with them (no OpenMP pool left behind), all joined; an
    exception of any raised here."""
    with ThreadPoolExecutor(max(1, shares - 1), thread_name_prefix="lmgate-share") as pool:
        others = [pool.submit(work, share) for share in range(1, shares)]
        work(0)
        for other in others:
            other.result()


def available_cpus(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup CPU quota (a container on a big host
    sees every host core in `os.cpu_count()`, but may run on only a few)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota(cgroup_root)
    return max(1, min(cpus, math.ceil(quota))) if quota else cpus


def cgroup_cpu_quota(root: str) -> float | None:
    """CPUs' worth of time per period the cgroup allows (v2 `cpu.max`, else v1's CFS files); None: no limit."""
    v2, v1 = os.path.join(root, "cpu.max"), os.path.join(root, "cpu", "cpu.cfs_quota_us")
    try:
        if os.path.exists(v2):
            quota, period = _read(v2).split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        if os.path.exists(v1):
            quota_us, period_us = int(_read(v1)), int(_read(os.path.join(root, "cpu", "cpu.cfs_period_us")))
            return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        pass
    return None


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()
