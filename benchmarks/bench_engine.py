"""Engine throughput against transformers on the same model, in one run (a benchmark: it prints, never asserts).

    make bench-engine ARGS="--requests 64 --input-len 128 --output-len 128 --dtypes float32,bfloat16"

Each dtype runs lmgate and transformers on the same prompts; the ratios are printed against transformers in
the same dtype and, for other dtypes, against transformers' float32 (its default on a CPU).

lmgate's throughput is set against two limits measured in the same run: the GEMM-bound one (every token's
matmuls at the best linear layer's FLOP/s) and the GEMM + KV-read bound, which adds the time decode attention
needs to read every sequence's K and V once a layer at the memory's read rate (a float32 cache at 64 streams
reads about 70 GB in this workload: seconds that no FLOP rate shortens).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import lmgate.engine  # noqa: F401  (before torch: it sets OpenMP's wait policy, engine/__init__.py)
import torch

from lmgate.client.bench import random_prompts
from lmgate.engine.config import KV_CACHE_DTYPES, EngineConfig
from lmgate.engine.engine import Engine
from lmgate.engine.machine.hardware import choose_dtype, cpu_features
from lmgate.engine.step.kv_cache import kv_bytes_per_token
from lmgate.engine.models.packed_linear import pack_linears
from lmgate.engine.models.panel_linear import cpu_linears
from lmgate.engine.sampling.sampler import SamplingParams
from lmgate.engine.machine.threads import on_fresh_thread


def matmul_flops(dtype: torch.dtype) -> tuple[float, float]:
    """FLOP/s of the model's own shapes (M=256, K=576, N=1536): through the linear layer the engine uses
    (`cpu_linears`), and through oneDNN's packed matmul; the limit is the better of the two."""
    rates = []
    for swap in (cpu_linears, pack_linears):
        holder = torch.nn.Sequential(torch.nn.Linear(576, 1536, bias=False, dtype=dtype))
        swap(holder, batch_hint=256)
        a = torch.randn(256, 576, dtype=dtype)
        for _ in range(5):
            holder(a)
        n, start = 50, time.perf_counter()
        for _ in range(n):
            holder(a)
        rates.append(2 * 256 * 576 * 1536 * n / (time.perf_counter() - start))
    return rates[0], rates[1]


def read_bandwidth(nbytes: int = 1 << 29) -> float:
    """Bytes per second a sum over a tensor far larger than the caches reads on this thread's pool: the rate
    that bounds decode attention, which reads every sequence's K and V once a layer."""
    data = torch.ones(nbytes // 4)
    data.sum()
    runs, start = 5, time.perf_counter()
    for _ in range(runs):
        data.sum()
    return nbytes * runs / (time.perf_counter() - start)


def run_engine(engine: Engine, prompts: list[list[int]], output_len: int, concurrency: int = 0) -> float:
    """Output tokens per second until the last request finishes: every prompt submitted at once, or at most
    `concurrency` in flight (as `lmgate bench` sends them)."""
    slots = threading.Semaphore(concurrency or len(prompts))
    done = threading.Semaphore(0)

    def on_output(out) -> None:
        if out.finished:
            slots.release()
            done.release()

    params = SamplingParams(max_new_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for p in prompts:
        slots.acquire()
        engine.submit(p, params, on_output=on_output)
    for _ in prompts:
        done.acquire()
    return len(prompts) * output_len / (time.perf_counter() - start)


def engine_single_stream(engine: Engine, prompt: list[int], output_len: int) -> float:
    """Decode tokens per second of one stream: first token to last."""
    stamps = []
    for out in engine.submit(prompt, SamplingParams(max_new_tokens=output_len, ignore_eos=True)):
        if out.token_ids:
            stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def hf_generate(model, batch: torch.Tensor, output_len: int, mask: torch.Tensor | None = None) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            batch,
            attention_mask=mask,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=0,
        )
    return time.perf_counter() - start


@dataclass
class Figures:
    """Tokens per second of one dtype: lmgate and transformers on the same prompts."""

    engine: float
    engine_single: float
    hf_serial: float
    hf_single: float
    hf_batch: float
    matmul_flops: float
    read_bandwidth: float
    kv_bytes_per_token: int


def measure_engine(args, dtype: str, prompts_for) -> tuple[Engine, float, float, float, float]:
    engine = Engine(
        EngineConfig(
            model=args.model,
            dtype=dtype,
            max_batched_tokens=args.max_batched_tokens,
            max_batch_size=max(64, args.requests),
            weights=args.weights,
            kv_cache_dtype=args.kv_cache_dtype,
        )
    )
    prompts = prompts_for(engine)
    before = on_fresh_thread(
        lambda: matmul_flops(engine.dtype)
    )  # see engine/machine/threads.py: keep the main thread clear
    # Warm-up with one full-size wave: the first steps at each batch and context size allocate buffers and
    # build oneDNN primitives (measured here: 154 tok/s for the first wave, 200 for the next). Other prompts
    # than the measured ones: the prefix cache would otherwise serve the measured wave's prefills.
    run_engine(engine, prompts_for(engine, seed=1), args.output_len)
    # A shared VM's speed wanders (this one's matmul rate has read 74 and 152 GFLOP/s in one hour, and one
    # wave of the engine 199 and 259 tok/s): both sides of the share are the best the machine showed, the
    # limit measured before and after every wave, the engine over `--waves` waves of fresh prompts (fresh, so
    # that the prefix cache serves none of their prefills).
    waves, rates, reads = [], [before], [on_fresh_thread(read_bandwidth)]
    for wave in range(args.waves):
        waves.append(run_engine(engine, prompts if wave == 0 else prompts_for(engine, seed=wave + 1), args.output_len))
        rates.append(on_fresh_thread(lambda: matmul_flops(engine.dtype)))
        reads.append(on_fresh_thread(read_bandwidth))
    tps = max(waves)
    single = engine_single_stream(engine, prompts[0], args.output_len)
    flops = max(max(r) for r in rates)
    print(
        f"{dtype}: lmgate waves {', '.join(f'{w:.1f}' for w in waves)} tok/s; linear M=256 before and after each "
        f"wave {', '.join(f'{r[0] / 1e9:.1f}' for r in rates)} GFLOP/s (the engine's layer), "
        f"{', '.join(f'{r[1] / 1e9:.1f}' for r in rates)} (oneDNN packed); memory read "
        f"{', '.join(f'{r / 1e9:.1f}' for r in reads)} GB/s",
        flush=True,
    )
    if args.noisy_neighbour:
        with busy_neighbour():
            noisy, noisy_single = (
                run_engine(engine, prompts, args.output_len),
                engine_single_stream(engine, prompts[0], args.output_len),
            )
        print(
            f"{dtype} with one busy process beside it: lmgate {noisy:.1f} tok/s (alone {tps:.1f}), single stream "
            f"{noisy_single:.1f} (alone {single:.1f}); {engine.num_threads} threads, "
            f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}",
            flush=True,
        )
    if args.gil_neighbour:
        with gil_neighbour():
            held = run_engine(engine, prompts, args.output_len)
        print(
            f"{dtype} with a busy Python thread in its process: lmgate {held:.1f} tok/s (alone {tps:.1f})", flush=True
        )
    engine.shutdown()
    return engine, tps, single, flops, max(reads)


@contextlib.contextmanager
def busy_neighbour() -> Iterator[None]:
    """A process spinning on one core, as a noisy neighbour on a shared machine would."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        yield
    finally:
        hog.kill()
        hog.wait()


@contextlib.contextmanager
def gil_neighbour() -> Iterator[None]:
    """A thread of this process running Python without pause, as the server's event loop does when the engine
    loop is a thread beside it and every step hands it hundreds of outputs to stream: each time the loop lets
    go of the GIL (every torch call does), it may wait a switch interval (5 ms) to get it back."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    try:
        yield
    finally:
        stop.set()
        spinner.join()


def measure_transformers(args, path: str, dtype: torch.dtype, prompts: list[list[int]]) -> tuple[float, float, float]:
    """One request at a time (a sample), single-stream decode, and one padded batch."""
    from transformers import AutoModelForCausalLM

    kw = {"gguf_file": os.path.basename(path)} if os.path.isfile(path) else {}
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path) if kw else path, dtype=dtype, **kw).eval()
    hf_generate(hf, torch.tensor(prompts[:1]), 4)  # warm-up
    one_at_a_time = sum(hf_generate(hf, torch.tensor([p]), args.output_len) for p in prompts[: args.hf_sample])
    serial = args.hf_sample * args.output_len / one_at_a_time
    t1 = hf_generate(hf, torch.tensor(prompts[:1]), 1)
    single = (args.output_len - 1) / (hf_generate(hf, torch.tensor(prompts[:1]), args.output_len) - t1)
    n = args.hf_batch or args.requests
    batch = (
        n
        * args.output_len
        / hf_generate(hf, torch.tensor(prompts[:n]), args.output_len, torch.ones(n, args.input_len, dtype=torch.long))
    )
    return serial, single, batch


def gemm_bound(args, params: int, flops: float) -> float:
    """Output tokens/s no engine can pass at `flops`: every prompt and output token costs 2 x params FLOP."""
    return flops / (2 * params) * args.output_len / (args.input_len + args.output_len)


def decode_kv_bytes(args, kv_bytes_per_token: int) -> int:
    """K and V bytes the workload's decode steps read: the step that makes output token i (from the second
    on) reads input_len + i - 1 tokens of every layer, once."""
    tokens = sum(args.input_len + i - 1 for i in range(2, args.output_len + 1))
    return args.requests * tokens * kv_bytes_per_token


def gemm_and_kv_bound(args, params: int, f: Figures) -> tuple[float, float, float]:
    """Output tokens/s of an engine that runs each step's matmuls at `f.matmul_flops` and then its decode
    attention at the memory's read rate, the two in turn as every lmgate step does (one that overlapped them
    could pass it; none can pass `gemm_bound`); with the seconds of each part."""
    gemm = args.requests * (args.input_len + args.output_len) * 2 * params / f.matmul_flops
    kv = decode_kv_bytes(args, f.kv_bytes_per_token) / f.read_bandwidth
    return args.requests * args.output_len / (gemm + kv), gemm, kv


def report(args, params: int, figures: dict[str, Figures]) -> None:
    base = figures.get("float32") or next(iter(figures.values()))
    cpu = cpu_features()
    auto, why = choose_dtype("auto", torch.device("cpu"))
    print(
        f"cpu: {cpu.name}; {cpu.arch}; vector ISA {cpu.vector_isa}; native bf16: {cpu.native_bf16}; "
        f"oneDNN bf16: {cpu.onednn_bf16}"
    )
    print(f"cpu flags: {' '.join(sorted(f for f in cpu.flags if f.startswith(('avx', 'amx', 'fma', 'f16c'))))}")
    print(f"--dtype auto chooses {str(auto).removeprefix('torch.')} ({why})")
    print(
        f"workload: {args.requests} requests x {args.input_len} prompt + {args.output_len} new tokens, ignore_eos, "
        f"greedy; threads {torch.get_num_threads()}; {params / 1e6:.1f}M params; KV cache {args.kv_cache_dtype}"
    )
    for dtype, f in figures.items():
        limit = gemm_bound(args, params, f.matmul_flops)
        print(
            f"\n== lmgate {dtype} (best linear M=256,K=576,N=1536: {f.matmul_flops / 1e9:.1f} GFLOP/s, "
            f"so at most {limit:.1f} output tok/s on this workload)"
        )
        both, gemm, kv = gemm_and_kv_bound(args, params, f)
        print(
            f"GEMM + KV-read bound: {both:.1f} output tok/s ({gemm:.1f} s of matmuls, then "
            f"{decode_kv_bytes(args, f.kv_bytes_per_token) / 1e9:.1f} GB of K and V read by decode attention at "
            f"{f.read_bandwidth / 1e9:.1f} GB/s: {kv:.1f} s)"
        )
        print(
            f"lmgate engine, all {args.requests} at once (best of {args.waves} waves):  {f.engine:8.1f} tok/s   "
            f"{f.engine / limit:.1%} of the GEMM-bound limit, {f.engine / both:.1%} of the GEMM + KV-read bound"
        )
        print(f"lmgate single-stream decode:       {f.engine_single:8.1f} tok/s")
        for label, ref in [(f"transformers {dtype}", f)] + ([("transformers float32", base)] if f is not base else []):
            print(
                f"  vs {label}: one at a time ({args.hf_sample} sampled) {ref.hf_serial:6.1f} tok/s -> "
                f"{f.engine / ref.hf_serial:5.1f}x;  padded batch {ref.hf_batch:6.1f} -> "
                f"{f.engine / ref.hf_batch:4.1f}x;  single stream {ref.hf_single:5.1f} -> "
                f"{f.engine_single / ref.hf_single:4.1f}x"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded SmolLM2)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument(
        "--dtypes",
        default="float32,bfloat16",
        help="comma-separated; each runs lmgate and transformers "
        "(bfloat16 on a CPU without native bf16 runs emulated, several times slower)",
    )
    ap.add_argument("--max-batched-tokens", type=int, default=512)
    ap.add_argument(
        "--weights",
        default="float",
        choices=["float", "quantized", "auto"],
        help="float: a GGUF expanded at load, the GEMM-bound limit's own path; quantized: kept as blocks",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="auto: the model's dtype; float16 or bfloat16: a 16-bit cache under float32 (rounds K and V)",
    )
    ap.add_argument("--hf-sample", type=int, default=4, help="requests that measure transformers one at a time")
    ap.add_argument("--waves", type=int, default=3, help="waves of all requests through lmgate; the best one counts")
    ap.add_argument("--noisy-neighbour", action="store_true", help="also run lmgate with one busy process beside it")
    ap.add_argument(
        "--gil-neighbour", action="store_true", help="also run lmgate with a busy Python thread in its process"
    )
    ap.add_argument("--hf-batch", type=int, default=0, help="padded batch size for transformers (0: all requests)")
    args = ap.parse_args()

    def prompts_for(engine: Engine, seed: int = 0) -> list[list[int]]:
        return random_prompts(random.Random(seed), args.requests, args.input_len, engine.tokenizer.vocab_size)

    figures: dict[str, Figures] = {}
    for dtype in args.dtypes.split(","):
        engine, tps, single, flops, read = measure_engine(args, dtype, prompts_for)
        # Off the main thread, like all torch work here: an OpenMP pool left on a live thread slows the next engine.
        serial, hf_single, batch = on_fresh_thread(
            lambda: measure_transformers(args, engine.model_path, engine.dtype, prompts_for(engine))
        )
        figures[dtype] = Figures(
            tps, single, serial, hf_single, batch, flops, read, kv_bytes_per_token(engine.model_config, engine.kv_dtype)
        )
        print(
            f"{dtype}: lmgate {tps:.1f} tok/s, transformers one at a time {serial:.1f}, padded {batch:.1f}", flush=True
        )
    print(f"\nmodel {os.path.basename(engine.model_path)}")
    report(args, engine.model_config.num_params, figures)


if __name__ == "__main__":
    main()
