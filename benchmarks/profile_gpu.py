"""Where an engine step's device time goes: torch.profiler's kernel table for one model shape of bench_gpu.py,
over three phases of its workload (a benchmark's companion: it prints, never asserts).

    python benchmarks/profile_gpu.py --models qwen2.5-0.5b   # a CUDA machine
    python benchmarks/profile_gpu.py --device cpu --tiny     # every code path on a CPU (figures meaningless)

Phases, each after the warm-up that compiles Triton and captures every CUDA graph bucket:
1. one stream decoding, from its graph: the host's share of a step is its time less the kernels';
2. a batch decoding without CUDA graphs, so that each kernel shows by name;
3. the start of the offline workload, eager too: prefill chunks of max_batched_tokens beside decodes;
4. the offline workload's decode from its graphs (its 256 prompts in, every sequence decoding), over
   --window steps: where bench_gpu.py's device time of a graph's step goes.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import threading
import time

import lmgate.engine  # noqa: F401  before torch, as in bench_gpu.py
import torch
import transformers
from torch.profiler import ProfilerActivity, profile

from bench_gpu import (
    MODELS,
    TINY_SHAPE,
    TINY_WORKLOAD,
    DecodePrompts,
    Workload,
    build_model,
    engine_config,
    kv_cache_tokens,
    offline_requests,
    phase_times,
    run_requests,
)
from lmgate.engine.engine import Engine
from lmgate.engine.loading.loader import read_config
from lmgate.engine.sampling.sampler import SamplingParams


def profiled(engine: Engine, requests: list, device: torch.device, title: str, rows: int) -> None:
    """Runs `requests` under the profiler; prints the steps' host phases and the kernels by device time."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    start = time.perf_counter()
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)  # the engine loop is a thread
    with phase_times() as phases, profile(activities=activities, experimental_config=config) as prof:
        trace = run_requests(engine, requests)
    seconds = time.perf_counter() - start
    steps = max(phases.pop("steps"), 1)
    per_step = ", ".join(f"{name} {sec / steps * 1e3:.2f}" for name, sec in phases.items())
    print(f"\n### {title}: {steps} steps, {trace.tokens} tokens in {seconds:.2f} s (profiled); ms per step: {per_step}")
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=70))


def profiled_decode(engine: Engine, requests: list, device: torch.device, title: str, rows: int, window: int) -> None:
    """`requests` submitted at once; once each has its first token (every prompt in), `window` steps of their
    decode under the profiler: the kernels by device time, and per step."""
    counts = [0] * len(requests)
    done = threading.Semaphore(0)

    def on_output_of(i: int):
        def on_output(out) -> None:
            counts[i] += len(out.token_ids)
            if out.finished:
                done.release()

        return on_output

    for i, (prompt, params) in enumerate(requests):
        engine.submit(prompt, params, on_output=on_output_of(i))
    while min(counts) == 0:
        time.sleep(0.001)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with profile(activities=activities, experimental_config=config) as prof:
        first = min(counts)
        while min(counts) < first + window:
            time.sleep(0.0005)
        steps = min(counts) - first
    for _ in requests:
        done.acquire()
    print(f"\n### {title}: {steps} steps profiled; a step's device time is the table's total / {steps}")
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=70))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--models", default="qwen2.5-0.5b", help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--rows", type=int, default=22, help="kernels listed per phase")
    ap.add_argument("--offline-seqs", type=int, default=64, help="sequences of the offline phase")
    ap.add_argument("--window", type=int, default=32, help="decode steps profiled in phase 4")
    args = ap.parse_args()
    w: Workload = TINY_WORKLOAD if args.tiny else Workload()
    device = torch.device(args.device)
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="profile_gpu_") as root:
        for name in args.models.split(","):
            path = build_model(name, {**MODELS[name], **(TINY_SHAPE if args.tiny else {})}, root, device)
            cfg = read_config(path)
            config = engine_config(path, device, w, kv_cache_tokens(w, cfg, device))
            prompts = DecodePrompts.make(2, w, cfg.vocab_size)
            greedy = SamplingParams(max_new_tokens=32, ignore_eos=True)
            warmup = offline_requests(
                1, w, cfg.vocab_size, min_output=w.warmup_min_output, max_output=w.warmup_max_output
            )
            offline = offline_requests(0, w, cfg.vocab_size)[: args.offline_seqs]
            offline = [(p, dataclasses.replace(s, max_new_tokens=16)) for p, s in offline]
            print(f"\n## {name} on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")
            with Engine(config) as engine:
                run_requests(engine, warmup)
                profiled(engine, [(prompts.single, greedy)], device, "one stream, graphs", args.rows)
                decodes = [
                    (p, dataclasses.replace(s, max_new_tokens=args.window + 16))
                    for p, s in offline_requests(2, w, cfg.vocab_size)
                ]
                profiled_decode(
                    engine,
                    decodes,
                    device,
                    f"the offline workload's decode, {len(decodes)} sequences, graphs",
                    args.rows,
                    args.window,
                )
            with Engine(dataclasses.replace(config, cuda_graphs=False)) as engine:
                run_requests(engine, [(p, greedy) for p in prompts.warm_batch])
                profiled(
                    engine,
                    [(p, greedy) for p in prompts.batch],
                    device,
                    f"a batch of {w.decode_batch} decoding, eager",
                    args.rows,
                )
                profiled(
                    engine,
                    offline,
                    device,
                    f"offline start ({len(offline)} sequences, 16 tokens each), eager",
                    args.rows,
                )


if __name__ == "__main__":
    main()
