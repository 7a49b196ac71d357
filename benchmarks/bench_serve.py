"""Serving over gRPC against the engine alone on the same workload, and wake-up against a cold start.

A benchmark: it prints figures, never asserts. Run on an otherwise idle machine:

    make bench-serve ARGS="--concurrency 32 --num-prompts 128 --input-len 128 --output-len 128"

1. The engine alone (same settings as `lmgate serve`): the prompts `lmgate bench` sends, at most
   `--concurrency` in flight, output tokens per second.
2. `lmgate serve` as a child process: its cold start, from process start to health SERVING.
3. `lmgate bench` against it, in this process: output tokens per second, TTFT / TPOT / ITL.
4. Sleep and wake-up, levels 1 and 2, `--cycles` times each: the Wakeup call's duration.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time

from lmgate.client import AsyncClient, Client
from lmgate.client import bench
from lmgate.engine.config import EngineConfig
from lmgate.engine.engine import Engine
from lmgate.engine.sampling.sampler import SamplingParams

from bench_engine import run_engine  # beside this file: both run as scripts

# tests/serving.py, shared with the tests: a module of that directory, as this file is of its own
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from serving import serve_process  # noqa: E402

SERVE_BATCHED_TOKENS = 512  # `lmgate serve`'s default --max-batched-tokens


def engine_alone(prompts: list[list[int]], output_len: int, concurrency: int) -> float:
    """The engine with `lmgate serve`'s settings, on the prompts `lmgate bench` sends."""
    engine = Engine(EngineConfig(max_batched_tokens=SERVE_BATCHED_TOKENS))
    list(engine.submit(prompts[0][:8], SamplingParams(max_new_tokens=2)))  # warm-up
    tps = run_engine(engine, prompts, output_len, concurrency)
    engine.shutdown()
    return tps


def start_server(*flags: str) -> tuple[subprocess.Popen, str, float]:
    """`lmgate serve` on a free port; the process, its address and its cold start in seconds."""
    started = time.perf_counter()
    proc, address = serve_process(*flags)
    return proc, address, time.perf_counter() - started


def grpc_bench(address: str, prompts: list[list[int]], output_len: int, concurrency: int) -> dict:
    async def go():
        async with AsyncClient(address) as client:
            return await bench.run(
                client,
                prompts,
                concurrency=concurrency,
                request_rate=float("inf"),
                rng=random.Random(0),
                max_new_tokens=output_len,
                ignore_eos=True,
            )

    results, duration = asyncio.run(go())
    return bench.summarize(results, duration)


def wakeup_times(address: str, level: int, cycles: int) -> list[float]:
    times = []
    with Client(address) as client:
        for _ in range(cycles):
            client.sleep(level)
            start = time.perf_counter()
            client.wakeup()
            times.append(time.perf_counter() - start)
            list(client.generate("Hello", max_new_tokens=2))  # it serves again
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--cycles", type=int, default=3, help="sleep / wake-up cycles per level")
    args = ap.parse_args()

    from lmgate.engine.loading.loader import load_checkpoint

    vocab = load_checkpoint().config.vocab_size
    prompts = bench.random_prompts(random.Random(0), args.num_prompts, args.input_len, vocab)
    engine_tps = engine_alone(prompts, args.output_len, args.concurrency)

    proc, address, cold = start_server()
    try:
        served = grpc_bench(address, prompts, args.output_len, args.concurrency)
        wake = {level: wakeup_times(address, level, args.cycles) for level in (1, 2)}
    finally:
        proc.terminate()
        proc.wait()

    print(
        f"workload: {args.num_prompts} requests x {args.input_len} prompt + {args.output_len} new tokens, "
        f"ignore_eos, concurrency {args.concurrency}"
    )
    print(f"engine alone:            {engine_tps:8.1f} output tok/s")
    print(
        f"through gRPC (bench):    {served['output_throughput']:8.1f} output tok/s   "
        f"{served['output_throughput'] / engine_tps:6.1%} of the engine's  ({served['failed']} failed)"
    )
    for name in ("ttft_ms", "tpot_ms", "itl_ms"):
        s = served[name]
        print(f"  {name[:-3].upper():5} ms  mean {s['mean']:8.1f}  p50 {s['median']:8.1f}  p99 {s['p99']:8.1f}")
    print(f"cold start (process start to SERVING): {cold:.2f} s")
    for level, times in wake.items():
        mean = statistics.mean(times)
        print(
            f"wake-up after level {level}: mean {mean:.3f} s over {len(times)} (min {min(times):.3f}, "
            f"max {max(times):.3f})  = {mean / cold:.1%} of a cold start"
        )


if __name__ == "__main__":
    main()
