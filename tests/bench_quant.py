"""GGUF weights kept quantized against float weights and llama.cpp, on the same file and machine, in one run
(a benchmark: it prints, never asserts).

    make bench-quant ARGS="--requests 64 --input-len 128 --output-len 128"

For the embedded SmolLM2 (Q4_1 and Q8_0 blocks): the weights' resident bytes, single-stream decode and the
throughput of all requests at once, for lmgate with `--weights quantized` and `--weights float`, and for
llama.cpp through llama-cpp-python where it is installed (`pip install llama-cpp-python` builds it on the
machine). The memory-bound limit of a single stream is the quantized weights' bytes per token over the copy
bandwidth measured in the same run.
"""
from __future__ import annotations

import argparse
import random
import time

import lmgate.engine  # noqa: F401  (before torch: it sets OpenMP's wait policy, engine/__init__.py)
import torch

from lmgate.client.bench import random_prompts
from lmgate.engine.config import EngineConfig
from lmgate.engine.engine import Engine
from lmgate.engine.hardware import cpu_features
from lmgate.engine.loader import embedded_model_path
from lmgate.engine.threads import available_cpus, on_fresh_thread
from bench_engine import engine_single_stream, run_engine  # beside this file: all run as scripts


def copy_bandwidth(nbytes: int = 1 << 28) -> float:
    """Bytes read per second by a large copy on this process's threads (read and written: counted once)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < 1.0:
        dst.copy_(src)
        runs += 1
    return nbytes * runs / (time.perf_counter() - start)


def measure_lmgate(args, weights: str) -> tuple[float, float, float]:
    """Weights' bytes, single-stream decode tok/s, and all requests at once in tok/s."""
    with Engine(EngineConfig(dtype="float32", weights=weights, max_batch_size=max(64, args.requests))) as engine:
        prompts, warmup = (random_prompts(random.Random(seed), args.requests, args.input_len, engine.vocab_size)
                           for seed in (0, 1))
        run_engine(engine, warmup, args.output_len)  # other prompts: the prefix cache must not serve the measured
        batch = run_engine(engine, prompts, args.output_len)
        single = engine_single_stream(engine, prompts[0], args.output_len)
        return engine.weights_bytes, single, batch


def measure_llama_cpp(args, path: str) -> float | None:
    """llama.cpp's single-stream decode tok/s (its Python binding serves one sequence at a time), or None where
    llama-cpp-python is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    threads = available_cpus()
    llm = llama_cpp.Llama(path, n_ctx=args.input_len + args.output_len, n_threads=threads, n_threads_batch=threads,
                          verbose=False)
    prompt = random_prompts(random.Random(0), 1, args.input_len, llm.n_vocab())[0]
    llm.eval(prompt)  # a warm-up
    stamps = []
    for token in llm.generate(prompt, temp=0.0, reset=True):
        stamps.append(time.perf_counter())
        if len(stamps) == args.output_len:
            break
    single = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    del llm
    return single


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(available_cpus())
    path = embedded_model_path()
    bandwidth = on_fresh_thread(copy_bandwidth)
    cpu = cpu_features()
    print(f"cpu: {cpu.name} ({cpu.vector_isa}), {available_cpus()} threads; copy bandwidth {bandwidth / 1e9:.1f} GB/s; "
          f"workload: {args.requests} x ({args.input_len} prompt + {args.output_len} new), greedy, ignore_eos", flush=True)
    rows = {}
    for weights in ("quantized", "float"):
        rows[f"lmgate --weights {weights}"] = measure_lmgate(args, weights)
        print(f"lmgate --weights {weights}: {rows[f'lmgate --weights {weights}']}", flush=True)
    quant_bytes = rows["lmgate --weights quantized"][0]
    limit = bandwidth / quant_bytes
    llama = measure_llama_cpp(args, path)
    print(f"\nsingle-stream limit: {quant_bytes / 1e6:.1f} MB of weights per token at {bandwidth / 1e9:.1f} GB/s "
          f"= {limit:.1f} tok/s\n")
    print("| engine | weights MB | 1 stream tok/s | of limit | all at once tok/s |")
    print("|---|---|---|---|---|")
    for name, (nbytes, single, batch) in rows.items():
        print(f"| {name} | {nbytes / 1e6:.0f} | {single:.1f} | {single / limit:.0%} | {batch:.1f} |")
    if llama is None:
        print("| llama.cpp | — | not installed (pip install llama-cpp-python) | | |")
    else:
        print(f"| llama.cpp (llama-cpp-python) | the file's | {llama:.1f} | {llama / limit:.0%} | one at a time |")
        print(f"\nlmgate quantized against llama.cpp: single stream {rows['lmgate --weights quantized'][1] / llama:.2f}x "
              "(goal 1.2x)")


if __name__ == "__main__":
    main()
