"""Scale-out on one machine, in one run: DP=1, DP=2 as threads, DP=2 as processes, TP=2, on the
workload of bench-engine, against the GEMM-bound limit measured in the same run (a benchmark: it prints,
never asserts).

    make bench-scale ARGS="--requests 64 --input-len 128 --output-len 128"

Per step it reports the time each rank spent in `Gateway.pop` (the ranks' all_reduce agreement, including
waits for the slower rank), and gloo's all_reduce latency on its own (bench_comm.py).
"""

from __future__ import annotations

import argparse
import random

import lmgate.engine  # noqa: F401  (before torch: it sets OpenMP's wait policy, engine/__init__.py)
import torch

from lmgate.client.bench import random_prompts
from lmgate.engine.config import EngineConfig
from lmgate.engine.engine import Engine
from lmgate.engine.machine.hardware import cpu_features
from lmgate.engine.loading.loader import embedded_model_path, read_config
from lmgate.engine.machine.threads import available_cpus, on_fresh_thread
from bench_comm import on_processes  # beside this file: all run as scripts
from bench_engine import gemm_bound, matmul_flops, run_engine

# label, data-parallel ranks, backend, tensor-parallel ranks
CONFIGS = (
    ("DP=1", 1, "thread", 1),
    ("DP=2 threads", 2, "thread", 1),
    ("DP=2 processes", 2, "process", 1),
    ("TP=2", 1, "process", 2),
)


def measure(args, loops: int, backend: str, tp: int) -> tuple[float, float, float, str]:
    """Output tokens/s; milliseconds per step and in `pop` per step, averaged over ranks."""
    engine = Engine(
        EngineConfig(
            model=args.model,
            dtype="float32",
            weights="float",
            engine_loops=loops,
            dp_backend=backend,
            tensor_parallel=tp,
            max_batched_tokens=args.max_batched_tokens,
            max_batch_size=max(64, args.requests),
        )
    )
    try:
        prompts, warmup = (
            random_prompts(random.Random(seed), args.requests, args.input_len, engine.tokenizer.vocab_size)
            for seed in (0, 1)
        )
        run_engine(engine, warmup, args.output_len)  # a full-size wave of other prompts, as bench-engine does
        before = engine.ranks.stats()
        tps = run_engine(engine, prompts, args.output_len)
        after = engine.ranks.stats()
        elapsed = args.requests * args.output_len / tps
        steps = sum(a.steps - b.steps for a, b in zip(after, before)) / loops
        pop = sum(a.pop_seconds - b.pop_seconds for a, b in zip(after, before)) / loops
        return tps, elapsed / steps * 1e3, pop / steps * 1e3, f"{engine.threads_per_loop} torch threads per rank"
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded SmolLM2)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-batched-tokens", type=int, default=512)
    args = ap.parse_args()
    flops = max(on_fresh_thread(lambda: matmul_flops(torch.float32)))
    results = {}
    for label, loops, backend, tp in CONFIGS:
        results[label] = measure(args, loops, backend, tp)
        print(f"{label}: {results[label][0]:.1f} tok/s", flush=True)
    gloo = on_processes(2, 2000)["all_reduce [2 ints]"]
    # The limit is the best matmul rate seen, before and after the configurations ran (see bench_engine.py).
    flops = max(flops, *on_fresh_thread(lambda: matmul_flops(torch.float32)))
    cpu = cpu_features()
    num_params = read_config(args.model or embedded_model_path()).num_params
    limit = gemm_bound(args, num_params, flops)
    print(
        f"\ncpu: {cpu.name}; flags {' '.join(sorted(f for f in cpu.flags if f.startswith(('avx', 'amx', 'fma'))))}; "
        f"{available_cpus()} CPUs; torch {torch.__version__}"
    )
    print(
        f"workload: {args.requests} requests x {args.input_len} prompt + {args.output_len} new tokens, float32, "
        f"greedy; best linear {flops / 1e9:.1f} GFLOP/s, so at most {limit:.1f} output tok/s on this machine"
    )
    print(f"{'':16} {'tok/s':>8} {'of limit':>9} {'vs DP=1':>8} {'ms/step':>8} {'ms in pop':>10}   threads")
    base = results["DP=1"][0]
    for label, (tps, step_ms, pop_ms, threads) in results.items():
        print(f"{label:16} {tps:8.1f} {tps / limit:9.1%} {tps / base:7.2f}x {step_ms:8.1f} {pop_ms:10.2f}   {threads}")
    print(
        f"gloo all_reduce of [2 ints] between 2 processes over loopback: {gloo:.0f} us median "
        f"(the agreement makes two of them per step: a shape check, then the values)"
    )
    print(
        f"\nWhat this predicts: the agreement costs about {2 * gloo / 1e3:.2f} ms per step against steps of "
        f"{results['DP=2 processes'][1]:.0f} ms here, so DP ranks on N GPUs (each with its own device, NCCL only "
        f"for TP) scale with N until a GPU step nears a millisecond; on this {available_cpus()}-CPU machine the ranks "
        f"share the same cores, so DP=2 can only match DP=1."
    )


if __name__ == "__main__":
    main()
