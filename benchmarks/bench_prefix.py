"""Prefix caching on a shared system prompt, with and without the cache in one run (a benchmark: it prints).

    make bench-prefix ARGS="--requests 64 --system-len 1024 --question-len 64 --output-len 32"

Every request is the same system prompt followed by its own question, all submitted at once: time to first
token (p50 / p99) and output throughput, lmgate with --prefix-caching on and off.
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time

import lmgate.engine  # noqa: F401  (before torch: it sets OpenMP's wait policy, engine/__init__.py)
import torch

from lmgate.client.bench import random_prompts
from lmgate.engine.config import EngineConfig
from lmgate.engine.engine import Engine
from lmgate.engine.machine.hardware import cpu_features
from lmgate.engine.sampling.sampler import SamplingParams


def run(engine: Engine, prompts: list[list[int]], output_len: int) -> tuple[list[float], float, int]:
    """TTFT of every request (seconds from submission), output tokens/s until the last one finishes, and the
    prompt tokens served from the cache."""
    first: dict[int, float] = {}
    cached: list[int] = []
    done = threading.Semaphore(0)
    lock = threading.Lock()

    def on_output(i: int, start: float):
        def handle(out) -> None:
            with lock:
                if out.token_ids and i not in first:
                    first[i] = time.perf_counter() - start
                if out.finished:
                    cached.append(out.usage.cached_tokens if out.usage else 0)
            if out.finished:
                done.release()

        return handle

    params = SamplingParams(max_new_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.submit(p, params, on_output=on_output(i, time.perf_counter()))
    for _ in prompts:
        done.acquire()
    elapsed = time.perf_counter() - start
    return sorted(first.values()), len(prompts) * output_len / elapsed, sum(cached)


def percentile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--system-len", type=int, default=1024)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-batched-tokens", type=int, default=512)
    args = ap.parse_args()

    results = {}
    for caching in (True, False):
        engine = Engine(
            EngineConfig(
                dtype="float32",
                prefix_caching=caching,
                max_batch_size=args.requests,
                max_batched_tokens=args.max_batched_tokens,
                kv_cache_tokens=args.requests * (args.system_len + args.question_len + args.output_len + 16),
            )
        )
        vocab = engine.tokenizer.vocab_size
        system = random_prompts(random.Random(1), 1, args.system_len, vocab)[0]
        prompts = [system + q for q in random_prompts(random.Random(2), args.requests, args.question_len, vocab)]
        run(engine, [random_prompts(random.Random(3), 1, 32, vocab)[0]], 2)  # warm-up, shares nothing
        results[caching] = run(engine, prompts, args.output_len)
        engine.shutdown()
        ttft, tps, cached = results[caching]
        print(
            f"prefix caching {'on ' if caching else 'off'}: TTFT p50 {percentile(ttft, 0.5):7.3f}s  "
            f"p99 {percentile(ttft, 0.99):7.3f}s  mean {statistics.mean(ttft):7.3f}s  "
            f"throughput {tps:7.1f} output tok/s  cached prompt tokens {cached}",
            flush=True,
        )
    cpu = cpu_features()
    (on, tps_on, _), (off, tps_off, _) = results[True], results[False]
    print(f"\nmachine: {cpu.name} ({cpu.vector_isa}), torch threads {torch.get_num_threads()}")
    print(
        f"workload: {args.requests} requests x ({args.system_len} shared + {args.question_len} own) prompt "
        f"tokens + {args.output_len} new, all at once, float32"
    )
    print(
        f"TTFT p50: {percentile(off, 0.5):.3f}s off / {percentile(on, 0.5):.3f}s on = "
        f"{percentile(off, 0.5) / percentile(on, 0.5):.1f}x;  p99: {percentile(off, 0.99):.3f}s / "
        f"{percentile(on, 0.99):.3f}s = {percentile(off, 0.99) / percentile(on, 0.99):.1f}x;  "
        f"throughput {tps_on:.1f} / {tps_off:.1f} tok/s = {tps_on / tps_off:.1f}x"
    )


if __name__ == "__main__":
    main()
