"""Replicas behind nginx against one replica alone, on the same workload (`lmgate bench`'s random prompts).

A benchmark: it prints figures, never asserts. Run on an otherwise idle machine:

    make bench-fleet ARGS="--concurrency 32 --num-prompts 96 --input-len 64 --output-len 64"

1. One `lmgate serve` replica, called directly: output tokens per second, TTFT and inter-token latency.
2. The same replica through nginx (deploy/nginx.conf): what the proxy adds to each token.
3. `--replicas` replicas through nginx, the machine's threads split between them (`--threads`): the
   throughput of the fleet on this machine. Replicas on one machine share its cores, so this shows the
   proxy's spread and its cost, not a speed-up: on separate machines each replica adds its own cores.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from lmgate.client import bench
from lmgate.engine.machine.threads import available_cpus

from bench_serve import grpc_bench, start_server  # beside this file: both run as scripts

# tests/proxies.py, shared with the fleet tests: a module of that directory, as this file is of its own
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from proxies import running_proxy  # noqa: E402


def replicas(count: int, threads: int) -> dict[str, tuple[subprocess.Popen, str]]:
    """`count` replicas named f0, f1, ...: replica id -> (process, address)."""
    started = {}
    for i in range(count):
        proc, address, _ = start_server("--replica-id", f"f{i}", "--threads", str(threads), "--log-level", "WARNING")
        started[f"f{i}"] = proc, address
    return started


def stop(started: dict[str, tuple[subprocess.Popen, str]]) -> None:
    for proc, _ in started.values():
        proc.terminate()
        proc.wait()


def line(name: str, s: dict) -> str:
    return (
        f"{name:34} {s['output_throughput']:8.1f} tok/s   TTFT p50 {s['ttft_ms']['median']:7.1f} "
        f"p99 {s['ttft_ms']['p99']:7.1f} ms   ITL p50 {s['itl_ms']['median']:6.1f} p99 {s['itl_ms']['p99']:6.1f} ms"
        f"   ({s['failed']} failed)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()

    from lmgate.engine.loading.loader import load_checkpoint

    cpus = available_cpus()
    vocab = load_checkpoint().config.vocab_size
    prompts = bench.random_prompts(random.Random(0), args.num_prompts, args.input_len, vocab)

    def run(address: str) -> dict:
        """The workload, after one full-size wave that warms every replica it reaches (the first steps at each
        batch and context size allocate buffers and build oneDNN primitives: seconds of TTFT otherwise)."""
        grpc_bench(address, prompts[: args.concurrency], args.output_len, args.concurrency)
        return grpc_bench(address, prompts, args.output_len, args.concurrency)

    with tempfile.TemporaryDirectory() as tmp:
        one = replicas(1, cpus)
        try:
            with running_proxy("nginx", {k: a for k, (_, a) in one.items()}, Path(tmp)) as address:
                proxied = run(address)
            direct = run(one["f0"][1])
        finally:
            stop(one)
        many = replicas(args.replicas, max(1, cpus // args.replicas))
        try:
            os.makedirs(Path(tmp) / "fleet")
            with running_proxy("nginx", {k: a for k, (_, a) in many.items()}, Path(tmp) / "fleet") as address:
                fleet = run(address)
        finally:
            stop(many)

    print(
        f"workload: {args.num_prompts} requests x {args.input_len} prompt + {args.output_len} new tokens, "
        f"ignore_eos, concurrency {args.concurrency}; {cpus} CPUs"
    )
    print(line("one replica, direct", direct))
    print(line("one replica, through nginx", proxied))
    print(line(f"{args.replicas} replicas through nginx", fleet))
    for name in ("ttft_ms", "itl_ms"):
        added = {q: proxied[name][q] - direct[name][q] for q in ("median", "p99")}
        print(f"nginx adds to {name[:-3].upper():4}: p50 {added['median']:+.2f} ms, p99 {added['p99']:+.2f} ms")


if __name__ == "__main__":
    main()
