"""What the data-parallel `pop` agreement costs per engine step: one `all_reduce` of two ints, on ThreadComm
(ranks are threads) and on GlooComm (ranks are processes, gloo over loopback TCP), and a 64 KiB broadcast.

A benchmark: it prints figures, never asserts.

    make bench-comm ARGS="--ranks 2 --iterations 2000"
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import threading
import time

from lmgate.engine.comm import HostComm, RedOp, ThreadComm
from lmgate.engine.comm.gloo_comm import GlooComm, new_secret

PAYLOAD = bytes(64 * 1024)


def timings(comm: HostComm, iterations: int) -> dict[str, float]:
    """Median microseconds per call, after a warm-up; every rank runs the same calls."""
    out = {}
    for name, call in (
        ("all_reduce [2 ints]", lambda: comm.all_reduce([1, 0], RedOp.SUM)),
        ("broadcast 64 KiB", lambda: comm.broadcast(PAYLOAD if comm.rank == 0 else None)),
        ("sync", comm.sync),
    ):
        for _ in range(iterations // 10):
            call()
        samples = []
        for _ in range(iterations):
            start = time.perf_counter()
            call()
            samples.append(time.perf_counter() - start)
        out[name] = statistics.median(samples) * 1e6
    return out


def on_threads(ranks: int, iterations: int) -> dict[str, float]:
    results = [None] * ranks
    comms = ThreadComm.create_group(ranks)
    threads = [threading.Thread(target=lambda c=c: results.__setitem__(c.rank, timings(c, iterations))) for c in comms]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results[0]


def _gloo_rank(port: int, secret: bytes, rank: int, ranks: int, iterations: int, out) -> None:
    result = timings(GlooComm.connect("127.0.0.1", port, rank, ranks, secret), iterations)
    if rank == 0:
        out.put(result)


def on_processes(ranks: int, iterations: int) -> dict[str, float]:
    ctx = multiprocessing.get_context("spawn")
    store = GlooComm.create_store()
    secret = new_secret()
    out = ctx.Queue()
    procs = [ctx.Process(target=_gloo_rank, args=(store.port, secret, r, ranks, iterations, out)) for r in range(ranks)]
    for p in procs:
        p.start()
    result = out.get()
    for p in procs:
        p.join()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--iterations", type=int, default=2000)
    args = ap.parse_args()
    threads, processes = on_threads(args.ranks, args.iterations), on_processes(args.ranks, args.iterations)
    print(f"{args.ranks} ranks, median of {args.iterations} calls, microseconds (rank 0)")
    print(f"{'':22} {'ThreadComm':>12} {'GlooComm':>12}")
    for name in threads:
        print(f"{name:22} {threads[name]:12.1f} {processes[name]:12.1f}")


if __name__ == "__main__":
    main()
