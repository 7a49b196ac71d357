"""lmgate on a GPU against the published figures, transformers and the device's own limits, in one run (a
benchmark: it prints, never asserts).

    make bench-gpu                                         # a CUDA machine: all three model shapes
    make bench-gpu ARGS="--models qwen2.5-0.5b --skip-hf"
    make bench-gpu ARGS="--device cpu --tiny"              # every code path on a CPU, tiny shapes (figures meaningless)

Each model is built on the spot in its published shape with random bf16 weights (random weights cost what
trained ones do), written as a Hugging Face directory with a tokenizer of the model's vocabulary, and measured:

1. offline throughput on nano-vllm's bench.py workload: 256 sequences, prompt and output lengths each uniform
   in 100..1024, ignore_eos, temperature 0.6, all submitted at once; output tokens over the time to the last;
2. decode at 512 tokens of context: one stream (ms per token), and a batch of 64 (ms per step), with CUDA
   graphs and without;
3. transformers `generate` on the batch's prompts: greedy, every sequence to the same length;
4. the offline workload again through `lmgate serve` over gRPC, every stream at once (`--grpc-runs`): with the
   engine loop a process of its own (`--dp-backend process`, the default on CUDA), whose GIL the server's
   threads do not share, streaming each token and then every 4 (`--stream-interval 4`); then with the loop a
   thread of the server.

The limits are measured in the same run: HBM bandwidth by a device-to-device copy, bf16 matmul FLOP/s at the
model's largest prefill GEMM. A decode step cannot beat reading the weights and its KV once; the offline
workload cannot beat the larger of its FLOPs and its decode steps' bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import gc
import json
import math
import multiprocessing
import os
import queue
import random
import shutil
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import lmgate.engine  # noqa: F401  before torch: the OMP_WAIT_POLICY it sets counts only before libgomp loads
import torch
import transformers

from lmgate.client import AsyncClient
from lmgate.client.bench import random_prompts
from lmgate.engine.config import EngineConfig, ModelConfig
from lmgate.engine.engine import Engine
from lmgate.engine.step.engine_loop import EngineLoop
from lmgate.engine.machine.hardware import cpu_features
from lmgate.engine.step.kv_cache import kv_bytes_per_token
from lmgate.engine.loading.loader import read_config
from lmgate.engine.step.model_runner import ModelRunner
from lmgate.engine.sampling.sampler import SampleFuture, SamplingParams
from lmgate.engine.scheduling.scheduler import Scheduler
from lmgate.engine.machine.threads import on_fresh_thread

# tests/gpu_models.py and tests/serving.py, shared with the tests: modules of that directory, as this file is of
# its own (all run as scripts)
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from gpu_models import write_model  # noqa: E402
from serving import serve_process  # noqa: E402

# The published config.json of each model.
MODELS: dict[str, dict] = {
    "qwen2.5-0.5b": dict(
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        attention_bias=True,
        max_position_embeddings=32768,
    ),
    "llama-3.2-1b": dict(
        model_type="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        rope_scaling=dict(
            rope_type="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ),
    "smollm2-135m": dict(
        model_type="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        tie_word_embeddings=True,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
    ),
}
TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=1024,
)

OFFLINE_GOALS = {"qwen2.5-0.5b": 25_000, "llama-3.2-1b": 15_000}  # output tok/s
SINGLE_STREAM_GOALS = {"qwen2.5-0.5b": 500}  # tok/s
# Published on nano-vllm's bench.py workload, one A800: vLLM 0.10.2 and the nano-vllm Triton fork.
PUBLISHED = {"qwen2.5-0.5b": (17_711, 24_121), "llama-3.2-1b": (12_627, 15_068)}
GRPC_GOAL = 0.9  # of the engine alone
# Clients of the gRPC runs, each a process: one Python client (asyncio, one channel) took a whole core at
# about 26,000 tokens/s on the H200 machine, which then measured the client rather than the server.
CLIENT_PROCESSES = 4

DTYPE = torch.bfloat16
TEMPERATURE = 0.6  # nano-vllm's bench.py samples at 0.6
MAX_CONTEXT = 4096  # nano-vllm's bench.py max_model_len
KV_RESERVE = 4 << 30  # device memory kept beside weights and KV for activations, graphs and Triton


@dataclass(frozen=True)
class Workload:
    """Sizes of every measurement; TINY_WORKLOAD runs each code path on a CPU in a few minutes."""

    num_seqs: int = 256
    min_len: int = 100  # offline prompt and output lengths, each uniform in [min_len, max_len]
    max_len: int = 1024
    # Warm-up outputs uniform in [min, max]: every sequence outlives the prefill steps, then they finish a few per
    # step, so that every graph bucket is captured before the measured run.
    warmup_min_output: int = 32
    warmup_max_output: int = 96
    context: int = 512  # prompt tokens of the decode measurements
    decode_tokens: int = 128
    decode_batch: int = 64
    max_batched_tokens: int = 8192
    copy_bytes: int = 1 << 30


TINY_WORKLOAD = Workload(
    num_seqs=16,
    min_len=8,
    max_len=32,
    warmup_min_output=4,
    warmup_max_output=12,
    context=32,
    decode_tokens=16,
    decode_batch=8,
    max_batched_tokens=256,
    copy_bytes=64 << 20,
)

Requests = list[tuple[list[int], SamplingParams]]


# ------------------------------------------------------------------------------------------------ the device
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_device_memory(device: torch.device) -> None:
    """Collect what the last model left, so the next one has the device to itself."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_features().name


def triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "not installed"
    return triton.__version__


def best_seconds(fn: Callable[[], object], device: torch.device, inner: int = 5, reps: int = 5) -> float:
    """Seconds per call of `fn`, the best of `reps` timings of `inner` calls after a warm-up: the device's own
    rate, with the synchronization's cost spread thin."""
    fn()
    best = math.inf
    for _ in range(reps):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        synchronize(device)
        best = min(best, (time.perf_counter() - start) / inner)
    return best


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second a device-to-device copy moves, read plus written: what a decode step can stream."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / best_seconds(lambda: dst.copy_(src), device)


def matmul_flops(device: torch.device, m: int, k: int, n: int) -> float:
    """bf16 FLOP/s of one [m, k] x [k, n] matmul: the model's largest GEMM at a full prefill step."""
    a = torch.randn(m, k, dtype=DTYPE, device=device)
    b = torch.randn(k, n, dtype=DTYPE, device=device)
    return 2 * m * k * n / best_seconds(lambda: a @ b, device)


# ------------------------------------------------------------------------------------------------ the models
def build_model(name: str, shape: dict, root: str, device: torch.device) -> str:
    """A Hugging Face directory of `shape` with random bf16 weights and a tokenizer of exactly the model's ids
    (tests/gpu_models.py: the lent GPU machine has no embedded model). Built on `device`: on a GPU that takes
    seconds, not minutes."""
    path = os.path.join(root, name)
    with torch.device(device):
        write_model(path, transformers.AutoConfig.for_model(**shape), DTYPE)
    free_device_memory(device)
    return path


def kv_cache_tokens(w: Workload, cfg: ModelConfig, device: torch.device) -> int:
    """Enough KV for every offline sequence at its longest (no preemption, as on nano-vllm's 80 GB card), capped by
    what fits in the device's free memory beside the weights and KV_RESERVE."""
    block = EngineConfig().block_size
    need = max(w.num_seqs * (2 * w.max_len + block), w.decode_batch * (w.context + w.decode_tokens + block))
    if device.type != "cuda":
        return need
    free = torch.cuda.mem_get_info(device)[0] - weight_bytes(cfg) - KV_RESERVE
    return max(block, min(need, free // kv_bytes_per_token(cfg, DTYPE)))  # 0 would ask for an automatic size


def weight_bytes(cfg: ModelConfig) -> int:
    """Bytes of the weights a token's matmuls read: every linear layer and the LM head (the embedding is a lookup)."""
    return cfg.num_params * DTYPE.itemsize


def engine_config(path: str, device: torch.device, w: Workload, kv_tokens: int) -> EngineConfig:
    """The engine alone: its loop a thread of this process, outputs handed to callbacks (the gRPC runs name
    their backend)."""
    return EngineConfig(
        model=path,
        device=str(device),
        dtype="bfloat16",
        kv_cache_tokens=kv_tokens,
        dp_backend="thread",
        max_batch_size=max(w.num_seqs, w.decode_batch),
        max_batched_tokens=w.max_batched_tokens,
        max_context_length=MAX_CONTEXT,
    )


def serve_flags(config: EngineConfig) -> list[str]:
    """`lmgate serve` flags for the engine settings of `config`, so the server runs the engine measured alone."""
    return [
        "--model",
        config.model,
        "--device",
        config.device,
        "--dtype",
        config.dtype,
        "--kv-cache-tokens",
        str(config.kv_cache_tokens),
        "--max-batch-size",
        str(config.max_batch_size),
        "--max-batched-tokens",
        str(config.max_batched_tokens),
        "--max-context-length",
        str(config.max_context_length),
        "--cuda-graphs",
        "on" if config.cuda_graphs else "off",
        "--dp-backend",
        config.dp_backend,
        "--overlap-scheduling",
        config.overlap_scheduling,
        "--stream-interval",
        str(config.stream_interval),
        "--log-level",
        "WARNING",
    ]


# ------------------------------------------------------------------------------------------------ workloads
def offline_requests(seed: int, w: Workload, vocab: int, min_output: int = 0, max_output: int = 0) -> Requests:
    """nano-vllm's bench.py: prompt and output lengths each uniform in [min_len, max_len] (outputs in
    [min_output, max_output] for a warm-up), random ids past the low ones where models keep special tokens."""
    rng = random.Random(seed)
    requests = []
    for _ in range(w.num_seqs):
        prompt = [rng.randrange(100, vocab) for _ in range(rng.randint(w.min_len, w.max_len))]
        output = rng.randint(min_output, max_output) if max_output else rng.randint(w.min_len, w.max_len)
        requests.append((prompt, SamplingParams(max_new_tokens=output, temperature=TEMPERATURE, ignore_eos=True)))
    return requests


@dataclass
class DecodePrompts:
    """Prompts of `context` tokens: each measured set has a warm-up set of its own, so that no measured prompt
    finds its KV in the prefix cache."""

    warm_single: list[int]
    single: list[int]
    warm_batch: list[list[int]]
    batch: list[list[int]]

    @classmethod
    def make(cls, seed: int, w: Workload, vocab: int) -> "DecodePrompts":
        p = random_prompts(random.Random(seed), 2 + 2 * w.decode_batch, w.context, vocab)
        return cls(p[0], p[1], p[2 : 2 + w.decode_batch], p[2 + w.decode_batch :])


# ------------------------------------------------------------------------------------------------ the engine
@dataclass
class Trace:
    """When each request's token-carrying outputs arrived (perf_counter seconds), from one common start."""

    start: float
    stamps: list[list[float]]
    tokens: int

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / (max(s[-1] for s in self.stamps) - self.start)


def run_requests(engine: Engine, requests: Requests, **submit: Any) -> Trace:
    """Submits every request at once (`submit`: more of `Engine.submit`'s arguments) and waits for the last; the
    engine delivers one output per step."""
    stamps: list[list[float]] = [[] for _ in requests]
    tokens = [0] * len(requests)
    errors = []
    done = threading.Semaphore(0)

    def on_output_of(i: int) -> Callable:
        def on_output(out) -> None:
            if out.token_ids:
                stamps[i].append(time.perf_counter())
                tokens[i] += len(out.token_ids)
            if out.error is not None:
                errors.append(out.error)
            if out.finished:
                done.release()

        return on_output

    start = time.perf_counter()
    for i, (prompt, params) in enumerate(requests):
        engine.submit(prompt, params, on_output=on_output_of(i), **submit)
    for _ in requests:
        done.acquire()
    if errors:
        raise errors[0]
    return Trace(start, stamps, sum(tokens))


def lockstep_ms_per_step(trace: Trace) -> float:
    """Milliseconds per step while every sequence decodes: from the last one's first token to the first finish,
    counted on the sequence that finished first (the earlier ones decoded beside later prefill chunks)."""
    all_started = max(s[0] for s in trace.stamps)
    first_done = min(trace.stamps, key=lambda s: s[-1])
    steps = sum(1 for t in first_done if t > all_started)
    return (first_done[-1] - all_started) / steps * 1e3 if steps else math.nan


def decode_figures(engine: Engine, w: Workload, prompts: DecodePrompts) -> dict[str, float]:
    """One stream's ms per token, the batch's ms per step and its tokens/s prefill included; greedy, each
    measurement after a warm-up on other prompts of the same shape."""
    greedy = SamplingParams(max_new_tokens=w.decode_tokens, ignore_eos=True)
    run_requests(engine, [(prompts.warm_single, greedy)])
    stamps = run_requests(engine, [(prompts.single, greedy)]).stamps[0]
    run_requests(engine, [(p, greedy) for p in prompts.warm_batch])
    batch = run_requests(engine, [(p, greedy) for p in prompts.batch])
    return {
        "single_ms": (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3,
        "batch_ms_step": lockstep_ms_per_step(batch),
        "batch_tps": batch.tokens_per_second,
    }


# The parts of an engine step, timed by `phase_times`. On a GPU `forward` and `sample` only queue work (a graph
# replay, or the eager kernels) and `result` (kFetch) waits for the device: the host's work is the rest.
PHASES = (
    (Scheduler, "schedule"),
    (ModelRunner, "setup"),
    (ModelRunner, "forward"),
    (ModelRunner, "sample"),
    (SampleFuture, "result"),
    (EngineLoop, "_update"),
    (EngineLoop, "step"),
)


@contextlib.contextmanager
def phase_times() -> Iterator[dict[str, float]]:
    """Seconds spent in each of PHASES (and calls of `step`) while the block runs, by wrapping the methods:
    where a step's time goes, host or device, from the one run a lent GPU allows."""
    totals = {name: 0.0 for _, name in PHASES} | {"steps": 0}

    def timed(fn: Callable, name: str) -> Callable:
        @functools.wraps(fn)
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[name] += time.perf_counter() - start
                totals["steps"] += name == "step"

        return call

    # On CUDA, each step's device time too: events recorded on the stream before its forward and after its
    # sample, [start, end, a graph's decode step]. Exact for a graph's step (two replays); for an eager step it
    # also counts the device waiting for the host's launches.
    marks: list[list] = []

    def marked(fn: Callable, first: bool) -> Callable:
        @functools.wraps(fn)
        def call(runner, inputs, *args, **kwargs):
            if first:
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                marks.append([start, None, bool(inputs.bucket)])
            out = fn(runner, inputs, *args, **kwargs)
            if marks:
                marks[-1][1] = torch.cuda.Event(enable_timing=True)
                marks[-1][1].record()
            return out

        return call

    originals = [(owner, name, owner.__dict__[name]) for owner, name in PHASES]
    for owner, name, fn in originals:
        setattr(owner, name, timed(fn, name))
    if torch.cuda.is_available():
        ModelRunner.forward = marked(ModelRunner.forward, first=True)
        ModelRunner.sample = marked(ModelRunner.sample, first=False)
    try:
        yield totals
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)
        if marks:
            torch.cuda.synchronize()
            graphs = [start.elapsed_time(end) / 1e3 for start, end, graph in marks if graph]
            totals["device"] = sum(start.elapsed_time(end) / 1e3 for start, end, _ in marks)
            totals["graph_steps"], totals["graph_device"] = len(graphs), sum(graphs)


def offline_figures(engine: Engine, warmup: Requests, offlines: list[Requests]) -> dict:
    """Output tokens/s of the offline workload after the warm-up, and where its steps' time went: the better of
    a run of each set (sets of other seeds: the same prompts would come from the prefix cache). On the H200,
    one engine's runs of this workload read 31,844 to 36,704 tokens/s in turn: one run alone says less."""
    run_requests(engine, warmup)  # Triton compiles, every CUDA graph bucket is captured
    runs = []
    for requests in offlines:
        with phase_times() as phases:
            tps = run_requests(engine, requests).tokens_per_second
        steps = max(phases.pop("steps"), 1)
        graph_steps = phases.pop("graph_steps", 0)
        if graph_steps:  # a graph step's own device time, beside the step's host time
            phases["graph_device"] *= steps / graph_steps
        runs.append(
            {
                "offline_tps": tps,
                "offline_steps": steps,
                "offline_graph_steps": graph_steps,
                "offline_ms_per_step": {name: sec / steps * 1e3 for name, sec in phases.items()},
            }
        )
    best = max(runs, key=lambda r: r["offline_tps"])
    return {**best, "overlap": engine.loops[0].overlap, "offline_tps_runs": [r["offline_tps"] for r in runs]}


def engine_figures(
    config: EngineConfig, w: Workload, warmup: Requests, offlines: list[Requests], prompts: DecodePrompts, figures: dict
) -> None:
    """Into `figures`, as each is measured: the offline workload (where its steps' time went, per phase) and the
    decode figures on one engine, then the decode figures again without CUDA graphs (on a CPU the flag changes
    nothing: both take the same path)."""
    with Engine(config) as engine:
        figures.update(offline_figures(engine, warmup, offlines))
        print(f"engine: {runs(figures['offline_tps_runs'])} tok/s offline", flush=True)
        figures.update(decode_figures(engine, w, prompts))
        print(f"engine: {figures['single_ms']:.2f} ms/token single stream", flush=True)
    with Engine(dataclasses.replace(config, overlap_scheduling="off")) as engine:
        figures["sequential"] = offline_figures(engine, warmup, offlines)
        print(f"engine, overlap off: {runs(figures['sequential']['offline_tps_runs'])} tok/s offline", flush=True)
    with Engine(dataclasses.replace(config, cuda_graphs=False)) as engine:
        eager = decode_figures(engine, w, prompts)
    figures.update(single_ms_eager=eager["single_ms"], batch_ms_step_eager=eager["batch_ms_step"])
    # The engine's default on CUDA: its loop in a rank process, whose interpreter lock the callbacks here and
    # the signal thread do not share (the phases above cannot be timed there).
    # Its threads' CPU use says whether the loop's thread (the busiest) is the bottleneck.
    with Engine(dataclasses.replace(config, dp_backend="process")) as engine:
        run_requests(engine, warmup)
        figures["process_tps_runs"], figures["process_thread_cores"] = [], []
        for offline in offlines:
            before, start = thread_seconds(os.getpid()), time.perf_counter()
            figures["process_tps_runs"].append(run_requests(engine, offline).tokens_per_second)
            after, seconds = thread_seconds(os.getpid()), time.perf_counter() - start
            cores = sorted(((after[t] - before.get(t, 0.0)) / seconds for t in after), reverse=True)
            figures["process_thread_cores"].append(cores[:3])
        figures["process_tps"] = max(figures["process_tps_runs"])
    busiest = ", ".join("/".join(f"{c:.2f}" for c in cores) for cores in figures["process_thread_cores"])
    print(
        f"engine, rank process: {runs(figures['process_tps_runs'])} tok/s offline; its busiest threads' cores "
        f"{busiest}",
        flush=True,
    )


# ------------------------------------------------------------------------------------------------ references
def transformers_tps(path: str, device: torch.device, prompts: list[list[int]], new_tokens: int) -> float:
    """Output tokens/s of transformers' `generate` on one batch (equal lengths: no padding), greedy, every
    sequence to `new_tokens`, prefill included, as the engine's batch figure."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=DTYPE).to(device).eval()
    batch = torch.tensor(prompts, device=device)

    def generate(n: int) -> None:
        with torch.inference_mode():
            model.generate(
                batch,
                attention_mask=torch.ones_like(batch),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )

    generate(2)  # warm-up
    synchronize(device)
    start = time.perf_counter()
    generate(new_tokens)
    synchronize(device)
    seconds = time.perf_counter() - start
    model = None  # the closure's reference too: the memory can go
    free_device_memory(device)
    return len(prompts) * new_tokens / seconds


async def stream_all(address: str, requests: Requests) -> tuple[int, float]:
    """Every request as a Generate stream at once over one channel; output tokens and seconds to the last."""
    async with AsyncClient(address) as client:

        async def one(prompt: list[int], p: SamplingParams) -> int:
            stream = client.generate(
                token_ids=prompt, max_new_tokens=p.max_new_tokens, temperature=p.temperature, ignore_eos=p.ignore_eos
            )
            return sum([len(delta.token_ids) async for delta in stream])

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(prompt, p) for prompt, p in requests))
        return sum(counts), time.perf_counter() - start


def stream_share(address: str, requests: Requests, barrier, results) -> None:
    """A client process's share of the streams, begun together with the others'; puts (tokens, start, end,
    CPU seconds) on `results`."""
    barrier.wait()
    cpu, start = time.process_time(), time.time()
    tokens, _ = asyncio.run(stream_all(address, requests))
    results.put((tokens, start, time.time(), time.process_time() - cpu))


def stream_from_processes(address: str, requests: Requests, processes: int) -> tuple[int, float, float]:
    """Every request as a Generate stream at once, shared out over client processes (each with its own GIL and
    channel): output tokens, seconds from the first stream's start to the last one's end, and the clients'
    CPU use in cores."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    clients = [
        ctx.Process(target=stream_share, args=(address, requests[i::processes], barrier, results), daemon=True)
        for i in range(processes)
    ]
    for client in clients:
        client.start()
    shares = []
    while len(shares) < processes:
        try:
            shares.append(results.get(timeout=1))
        except queue.Empty:
            if any(c.exitcode not in (None, 0) for c in clients):
                raise RuntimeError("a client process failed") from None
    for client in clients:
        client.join()
    seconds = max(end for _, _, end, _ in shares) - min(start for _, start, _, _ in shares)
    return sum(s[0] for s in shares), seconds, sum(s[3] for s in shares) / seconds


def thread_seconds(pid: int) -> dict[int, float]:
    """CPU seconds used so far by each thread of the children of `pid` (its rank processes), by thread id, from
    /proc; empty where the kernel does not list children (a thread gone meanwhile is left out)."""
    seconds = {}
    try:
        tasks = [f"/proc/{pid}/task/{task}/children" for task in os.listdir(f"/proc/{pid}/task")]
        children = [int(c) for path in tasks for c in _read(path).split()]
        threads = [f"/proc/{c}/task/{t}" for c in children for t in os.listdir(f"/proc/{c}/task")]
    except OSError:
        return seconds
    for thread in threads:
        try:
            fields = _read(f"{thread}/stat").rsplit(")", 1)[1].split()
        except OSError:
            continue
        seconds[int(thread.rsplit("/", 1)[1])] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return seconds


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds used so far by process `pid` itself and by its children (a server's rank processes), from
    /proc: user and system time."""

    def used(p: int) -> float:
        with open(f"/proc/{p}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    children = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += [int(c) for c in f.read().split()]
    except OSError:  # a kernel without CONFIG_PROC_CHILDREN: the rank processes' share is unknown
        return used(pid), math.nan
    return used(pid), sum(used(c) for c in children)


def grpc_figures(config: EngineConfig, warmup: Requests, offline: Requests) -> dict[str, float]:
    """The offline workload through `lmgate serve` (a child process with the engine's settings, its engine loop
    a thread of the server or, with `dp_backend="process"`, a process of its own with its own GIL), after the
    same warm-up, from CLIENT_PROCESSES clients; and the CPU use, in cores, of the clients, the serving process
    and its rank process: which of them, if any, was the bottleneck."""
    proc, address = serve_process(*serve_flags(config))
    try:
        asyncio.run(stream_all(address, warmup))
        before = cpu_seconds(proc.pid)
        tokens, seconds, cores = stream_from_processes(address, offline, CLIENT_PROCESSES)
        server, ranks = (b - a for a, b in zip(before, cpu_seconds(proc.pid)))
    finally:
        proc.terminate()
        proc.wait()
    return {
        "grpc_tps": tokens / seconds,
        "grpc_client_cores": cores,
        "grpc_client_processes": CLIENT_PROCESSES,
        "grpc_server_cores": server / seconds,
        "grpc_rank_cores": ranks / seconds,
        "grpc_server_us_per_token": server / tokens * 1e6,
    }


# ------------------------------------------------------------------------------------------------ limits
def decode_limit_ms(cfg: ModelConfig, contexts: list[int], bandwidth: float) -> float:
    """The fastest a decode step can be: the weights and each sequence's KV read once at `bandwidth`."""
    nbytes = weight_bytes(cfg) + sum(contexts) * kv_bytes_per_token(cfg, DTYPE)
    return nbytes / bandwidth * 1e3


def offline_bound(cfg: ModelConfig, offline: Requests, bandwidth: float, flops: float) -> tuple[float, str]:
    """Output tokens/s no engine passes on this workload, and what binds it: every token costs 2 x params FLOP;
    decode steps, at least as many as the longest output, each read the weights, and every sequence reads its
    context's KV at each of its decode steps."""
    prompt_lens = [len(prompt) for prompt, _ in offline]
    output_lens = [p.max_new_tokens for _, p in offline]
    flop_seconds = 2 * cfg.num_params * (sum(prompt_lens) + sum(output_lens)) / flops
    kv_tokens_read = sum((o - 1) * p + (o - 1) * o // 2 for p, o in zip(prompt_lens, output_lens))
    byte_seconds = (weight_bytes(cfg) * max(output_lens) + kv_tokens_read * kv_bytes_per_token(cfg, DTYPE)) / bandwidth
    return sum(output_lens) / max(flop_seconds, byte_seconds), "FLOP/s" if flop_seconds > byte_seconds else "bandwidth"


# ------------------------------------------------------------------------------------------------ one model
def measure_model(
    name: str, args: argparse.Namespace, w: Workload, root: str, device: torch.device, bandwidth: float, result: dict
) -> None:
    """Every figure of one model, its limits first, into `result` as each is measured: a run stopped at its
    time limit (SIGINT) or by a failure keeps what it had. The model's directory is removed after."""
    shape = {**MODELS[name], **(TINY_SHAPE if args.tiny else {})}
    path = on_fresh_thread(lambda: build_model(name, shape, root, device))
    try:
        cfg = read_config(path)
        offline = offline_requests(0, w, cfg.vocab_size)
        warmup = offline_requests(1, w, cfg.vocab_size, min_output=w.warmup_min_output, max_output=w.warmup_max_output)
        prompts = DecodePrompts.make(2, w, cfg.vocab_size)
        config = engine_config(path, device, w, args.kv_cache_tokens or kv_cache_tokens(w, cfg, device))
        print(f"{name}: {cfg.num_params / 1e6:.1f}M params, KV cache {config.kv_cache_tokens} tokens", flush=True)

        flops = on_fresh_thread(
            lambda: matmul_flops(device, w.max_batched_tokens, cfg.hidden_size, 2 * cfg.intermediate_size)
        )
        bound, bound_by = offline_bound(cfg, offline, bandwidth, flops)
        mid = w.context + w.decode_tokens // 2  # the mean context over the decode steps
        published = PUBLISHED.get(name, (None, None))
        result.update(
            {
                "shape": shape,
                "params": cfg.num_params,
                "weight_bytes": weight_bytes(cfg),
                "kv_bytes_per_token": kv_bytes_per_token(cfg, DTYPE),
                "kv_cache_tokens": config.kv_cache_tokens,
                "matmul_flops": flops,
                "offline_bound_tps": bound,
                "offline_bound_by": bound_by,
                "single_limit_ms": decode_limit_ms(cfg, [mid], bandwidth),
                "batch_limit_ms": decode_limit_ms(cfg, [mid] * w.decode_batch, bandwidth),
                "goal_offline_tps": OFFLINE_GOALS.get(name),
                "goal_single_tps": SINGLE_STREAM_GOALS.get(name),
                "vllm_a800_tps": published[0],
                "nano_vllm_a800_tps": published[1],
            }
        )

        engine_figures(config, w, warmup, [offline, offline_requests(3, w, cfg.vocab_size)], prompts, result)
        free_device_memory(device)
        if not args.skip_hf:
            result["hf_tps"] = on_fresh_thread(lambda: transformers_tps(path, device, prompts.batch, w.decode_tokens))
        result["grpc"] = {}
        for run in args.grpc_runs.split(",") if args.grpc_runs else []:
            backend, _, interval = run.partition(":")
            served = dataclasses.replace(config, dp_backend=backend, stream_interval=int(interval or 1))
            result["grpc"][run] = grpc_figures(served, warmup, offline)
            print(f"gRPC, {run}: {result['grpc'][run]['grpc_tps']:,.0f} tok/s", flush=True)
    finally:
        shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ report
def runs(values: list[float]) -> str:
    return " and ".join(f"{v:,.0f}" for v in values)


def fmt(value: float | None, spec: str = ",.0f") -> str:
    return "—" if value is None or math.isnan(value) else format(value, spec)


def ratio(value: float | None, reference: float | None, unit: str = "%") -> str:
    if value is None or not reference:
        return "—"
    return f"{value / reference:.0%}" if unit == "%" else f"{value / reference:.1f}{unit}"


def with_figure(results: dict[str, dict], key: str) -> list[tuple[str, dict]]:
    """The models whose run got as far as measuring `key` (a run stopped at its limit keeps what it had)."""
    return [(name, r) for name, r in results.items() if key in r]


def report(meta: dict, results: dict[str, dict], w: Workload) -> None:
    """Two markdown tables: the offline workload and serving over gRPC; decode against the bandwidth limit."""
    print(f"\n## lmgate on {meta['device_name']} (torch {meta['torch']}, triton {meta['triton']})\n")
    print(
        f"copy bandwidth {meta['bandwidth'] / 1e9:,.0f} GB/s (read + write, {w.copy_bytes >> 20} MiB copied); "
        f"offline: {w.num_seqs} sequences, prompt and output lengths each uniform in {w.min_len}..{w.max_len}, "
        f"ignore_eos, temperature {TEMPERATURE}; decode: {w.context} prompt tokens + {w.decode_tokens} new, greedy; "
        f"max_batched_tokens {w.max_batched_tokens}, max_context_length {MAX_CONTEXT}, bf16"
    )
    for name, r in with_figure(results, "stopped"):
        print(f"{name}: STOPPED ({r['stopped']}); its tables hold what was measured before")
    for name, r in with_figure(results, "params"):
        print(
            f"{name}: {r['params'] / 1e6:.1f}M params ({r['weight_bytes'] / 2**20:,.0f} MiB read per step), "
            f"KV {r['kv_bytes_per_token']:,} B/token, cache {r['kv_cache_tokens']:,} tokens; bf16 matmul "
            f"[{w.max_batched_tokens}x{r['shape']['hidden_size']}]x[{r['shape']['hidden_size']}x"
            f"{2 * r['shape']['intermediate_size']}] {r['matmul_flops'] / 1e12:.3g} TFLOP/s"
        )

    print(
        "\nOffline throughput, output tokens/s, the better of two runs on prompts of two seeds (published: nano-vllm's "
        "workload on one A800)\n"
    )
    print(
        "lmgate's engine loop in a rank process (--dp-backend process, the default on CUDA) and as a thread of the "
        "caller's process (--dp-backend thread)\n"
    )
    print(
        "| model | lmgate, rank process | of bound | lmgate, thread | of bound | goal | vLLM 0.10.2 | nano-vllm Triton "
        "| bound (bound by) |"
    )
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|")
    for name, r in with_figure(results, "offline_tps"):
        process = r.get("process_tps")
        print(
            f"| {name} | {fmt(process)} | {ratio(process, r['offline_bound_tps'])} | {fmt(r['offline_tps'])} | "
            f"{ratio(r['offline_tps'], r['offline_bound_tps'])} | {fmt(r['goal_offline_tps'])} | "
            f"{fmt(r['vllm_a800_tps'])} | {fmt(r['nano_vllm_a800_tps'])} | "
            f"{fmt(r['offline_bound_tps'])} ({r['offline_bound_by']}) |"
        )

    print(
        f"\nThe same workload through gRPC, every stream at once (goal: {GRPC_GOAL:.0%} of the engine alone, on the "
        f"same backend); the engine loop a process of its own (--dp-backend process) or a thread of the server; tokens per message "
        f"(--stream-interval); the streams shared "
        f"out over {CLIENT_PROCESSES} client processes; the CPU use, in cores, of the clients, the serving process "
        f"(with the thread backend, its engine loop too) and its rank process\n"
    )
    print(
        "| model | backend | stream interval | gRPC tok/s | of the engine | client cores | server cores | rank cores "
        "| server CPU µs/token |"
    )
    print("|---|---|--:|--:|--:|--:|--:|--:|--:|")
    for name, r in with_figure(results, "offline_tps"):
        for run, g in r.get("grpc", {}).items():
            backend, _, interval = run.partition(":")
            alone = r.get("process_tps") if backend == "process" else r["offline_tps"]
            print(
                f"| {name} | {backend} | {interval or 1} | {fmt(g['grpc_tps'])} | "
                f"{ratio(g['grpc_tps'], alone)} | {g['grpc_client_cores']:.2f} | {g['grpc_server_cores']:.2f} | "
                f"{g['grpc_rank_cores']:.2f} | {g['grpc_server_us_per_token']:.1f} |"
            )

    print(
        "\nWhere an offline step's time went, ms per step (mean over the run's steps), with overlap scheduling "
        "(the engine's default on CUDA; a CPU runs one step at a time either way) and without: forward and sample only queue work on a GPU, fetch waits for "
        "the device; host = step - fetch; device: the device's time from a step's forward to the end of its "
        "sample (an eager step's with the host's launches between), of every step and of a graph's decode step\n"
    )
    print(
        "| model | overlap | tok/s | steps | step | schedule | setup | forward | sample | fetch | update | host | "
        "device | graph steps | device a graph step |"
    )
    print("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for name, r in with_figure(results, "offline_ms_per_step"):
        for f in (r, r.get("sequential")):
            if f is None:
                continue
            ms = f["offline_ms_per_step"]
            print(
                f"| {name} | {'on' if f['overlap'] else 'off'} | {fmt(f['offline_tps'])} | {f['offline_steps']} | "
                + " | ".join(
                    f"{ms[k]:.2f}" for k in ("step", "schedule", "setup", "forward", "sample", "result", "_update")
                )
                + f" | {ms['step'] - ms['result']:.2f} | {fmt(ms.get('device'), '.2f')} | "
                f"{f.get('offline_graph_steps', '—')} | {fmt(ms.get('graph_device'), '.2f')} |"
            )

    b = w.decode_batch
    print(
        f"\nDecode at {w.context}..{w.context + w.decode_tokens} tokens of context (limit: weights and KV read once "
        f"per step at the copy bandwidth); eager = cuda_graphs=False\n"
    )
    print(
        f"| model | 1 stream ms/token | tok/s | goal tok/s | limit ms | of limit | eager ms | batch {b} ms/step | "
        f"limit ms | of limit | eager ms | batch {b} tok/s | transformers tok/s | vs transformers |"
    )
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for name, r in with_figure(results, "single_ms"):
        g = r.get  # the eager and transformers figures may be missing from a stopped run
        print(
            f"| {name} | {fmt(r['single_ms'], '.3f')} | {fmt(1e3 / r['single_ms'])} | {fmt(r['goal_single_tps'])} | "
            f"{fmt(r['single_limit_ms'], '.3f')} | {ratio(r['single_limit_ms'], r['single_ms'])} | "
            f"{fmt(g('single_ms_eager'), '.3f')} | {fmt(r['batch_ms_step'], '.3f')} | {fmt(r['batch_limit_ms'], '.3f')} | "
            f"{ratio(r['batch_limit_ms'], r['batch_ms_step'])} | {fmt(g('batch_ms_step_eager'), '.3f')} | "
            f"{fmt(r['batch_tps'])} | {fmt(g('hf_tps'))} | {ratio(r['batch_tps'], g('hf_tps'), 'x')} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and workload: every code path in minutes on a CPU")
    ap.add_argument("--skip-hf", action="store_true", help="no transformers generate")
    ap.add_argument(
        "--grpc-runs",
        default="process,process:4,thread",
        help="the runs through lmgate serve, each its --dp-backend and, after a colon, its --stream-interval "
        "(comma-separated; '' for none)",
    )
    ap.add_argument("--num-seqs", type=int, default=0, help="offline sequences (0: 256, or 16 with --tiny)")
    ap.add_argument(
        "--max-batched-tokens", type=int, default=0, help="tokens per engine step (0: 8192, or 256 with --tiny)"
    )
    ap.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=0,
        help="KV cache size (0: every offline sequence at its longest, capped by free device memory)",
    )
    ap.add_argument("--json", default="bench_gpu.json", help="where the results go, as JSON")
    args = ap.parse_args()
    names = args.models.split(",")
    unknown = set(names) - set(MODELS)
    if unknown:
        ap.error(f"unknown models {sorted(unknown)}; known: {', '.join(MODELS)}")
    w = TINY_WORKLOAD if args.tiny else Workload()
    w = dataclasses.replace(
        w, num_seqs=args.num_seqs or w.num_seqs, max_batched_tokens=args.max_batched_tokens or w.max_batched_tokens
    )
    device = torch.device(args.device)
    transformers.utils.logging.disable_progress_bar()

    bandwidth = on_fresh_thread(lambda: copy_bandwidth(device, w.copy_bytes))
    free_device_memory(device)
    meta = {
        "device_name": device_name(device),
        "torch": torch.__version__,
        "triton": triton_version(),
        "bandwidth": bandwidth,
    }
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench_gpu_") as root:
        for name in names:
            results[name] = {}
            try:
                measure_model(name, args, w, root, device, bandwidth, results[name])
            except KeyboardInterrupt:  # the time limit (gpu_check.sh): report what was measured
                results[name]["stopped"] = "interrupted"
                print(f"{name}: interrupted; the report has what was measured", flush=True)
                break
            except Exception as exc:  # noqa: BLE001 - one model's failure must not lose the others' figures
                results[name]["stopped"] = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
            free_device_memory(device)
    report(meta, results, w)
    with open(args.json, "w") as f:
        json.dump(
            {
                **meta,
                "workload": dataclasses.asdict(w),
                "temperature": TEMPERATURE,
                "max_context_length": MAX_CONTEXT,
                "models": results,
            },
            f,
            indent=2,
        )
    print(f"\nresults written to {args.json}")


if __name__ == "__main__":
    main()
