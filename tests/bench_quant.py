"""GGUF weights kept quantized against float weights and llama.cpp, on the same file and machine, in one run
(a benchmark: it prints, never asserts).

    make bench-quant ARGS="--requests 64 --input-len 128 --output-len 128"

For the embedded SmolLM2 (Q4_1 and Q8_0 blocks): the weights' resident bytes, single-stream decode, the
throughput of all requests at once and the perplexity of a passage (tests/perplexity.py), for lmgate with
`--weights quantized` (alone, with `--int8-activations on`, and with a float16 KV cache as well: what llama.cpp
does by default) and `--weights float`, and for
llama.cpp through llama-cpp-python where it is installed (`pip install llama-cpp-python` builds it on the
machine). The memory-bound limit of a single stream is the quantized weights' bytes per token over the copy
bandwidth measured in the same run (and, printed beside it, over the rate a sum reads a large tensor: decoding
only reads the weights). Single streams are measured in rounds, every engine once a round, llama.cpp included:
this machine's speed drifts by 10-20% within minutes, so each ratio is taken between samples seconds apart.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import gguf
import numpy as np

USER_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY")  # before lmgate.engine sets its own
import lmgate.engine  # noqa: F401  (before torch: it sets OpenMP's wait policy, engine/__init__.py)
import torch

from lmgate.client.bench import random_prompts
from lmgate.engine.config import EngineConfig
from lmgate.engine.engine import Engine
from lmgate.engine.hardware import cpu_features
from lmgate.engine.loader import embedded_model_path
from lmgate.engine.sampling import SamplingParams
from lmgate.engine.threads import available_cpus, on_fresh_thread
from bench_engine import engine_single_stream, read_bandwidth, run_engine  # beside this file: all run as scripts
from perplexity import PASSAGE, perplexity

VOCAB = 49152  # the embedded tokenizer's
QUANT_ROW = "lmgate --weights quantized"
INT8_ROW = QUANT_ROW + " --int8-activations on"
INT8_F16_ROW = INT8_ROW + " --kv-cache-dtype float16"  # llama.cpp's own defaults: int8 activations, an f16 KV cache
FLOAT_ROW = "lmgate --weights float"
ROWS = {QUANT_ROW: dict(weights="quantized"), INT8_ROW: dict(weights="quantized", int8_activations=True),
        INT8_F16_ROW: dict(weights="quantized", int8_activations=True, kv_cache_dtype="float16"),
        FLOAT_ROW: dict(weights="float")}
LLAMA = "llama.cpp"
SINGLE_ROUNDS = 5  # single-stream samples of each engine, one a round; the median kept


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


def engine_of(args, row: str) -> Engine:
    return Engine(EngineConfig(dtype="float32", max_batch_size=max(64, args.requests),
                               max_batched_tokens=args.max_batched_tokens, **ROWS[row]))


def measure_lmgate(args, row: str) -> tuple[float, float, float]:
    """Weights' bytes, all requests at once in tok/s, and perplexity over the passage of tests/perplexity.py
    (its KV cache of the engine's dtype)."""
    with engine_of(args, row) as engine:
        prompts, warmup = (random_prompts(random.Random(seed), args.requests, args.input_len, engine.vocab_size)
                           for seed in (0, 1))
        run_engine(engine, warmup, args.output_len)  # other prompts: the prefix cache must not serve the measured
        batch = run_engine(engine, prompts, args.output_len)
        ppl = perplexity(engine.loops[0].runner.model, engine.tokenizer.encode(PASSAGE), kv_dtype=engine.kv_dtype)
        return engine.weights_bytes, batch, ppl


def single_streams(args, path: str) -> dict[str, list[float]]:
    """One stream's decode tok/s, SINGLE_ROUNDS samples of every row and of llama.cpp (where installed), taken
    in rounds: round r decodes prompt r on each engine in turn, a few seconds apart."""
    samples: dict[str, list[float]] = {name: [] for name in (*ROWS, LLAMA)}
    with contextlib.ExitStack() as stack:
        engines = {row: stack.enter_context(engine_of(args, row)) for row in ROWS}
        prompts = random_prompts(random.Random(0), SINGLE_ROUNDS, args.input_len, VOCAB)
        for engine in engines.values():
            engine_single_stream(engine, prompts[0][::-1], 8)  # a warm-up
        for r, prompt in enumerate(prompts):
            for row, engine in engines.items():
                samples[row].append(engine_single_stream(engine, prompt, args.output_len))
            llama = run_llama_cpp(args, path, "--single", str(r))
            if llama is not None:
                samples[LLAMA].append(llama["single"])
    return samples


def run_llama_cpp(args, path: str, *extra: str) -> dict | None:
    """llama.cpp's figures (tests/llama_cpp_bench.py), measured in a child process with llama.cpp's own OpenMP
    defaults: this process's `OMP_WAIT_POLICY=PASSIVE` (engine/__init__.py) put its threads to sleep at each of
    its many barriers a token, and cut its single stream from 99 to 39 tok/s on a Zen 4. None where
    llama-cpp-python is not installed."""
    env = dict(os.environ)
    if USER_WAIT_POLICY is None:
        env.pop("OMP_WAIT_POLICY", None)
    child = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "llama_cpp_bench.py"), path,
                            str(args.requests), str(args.input_len), str(args.output_len), str(available_cpus()),
                            *extra], capture_output=True, text=True, env=env)
    if child.returncode != 0:
        print(child.stderr.strip().splitlines()[-1] if child.stderr.strip() else f"llama.cpp: exit {child.returncode}")
        return None
    result = json.loads(child.stdout.strip().splitlines()[-1])
    return result or None


# Llama-3.2-1B and Llama-3.1-8B as llama.cpp's Q4_K_M files lay them out (Q4_K matrices, a Q6_K embedding
# shared with the LM head), with the embedded tokenizer's 49,152-token vocabulary instead of their 128,256.
BIG_SHAPES = {
    "1B": dict(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192),
    "8B": dict(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336),
}


def write_big_gguf(path: str, shape: dict, tokenizer_source: str) -> None:
    """A Llama-shaped GGUF of random blocks (small fp16 scales, so activations stay finite), written tensor by
    tensor: the 8B file is 4.6 GB and is never held in memory whole."""
    reader = gguf.GGUFReader(tokenizer_source)
    hidden, inter, head_dim = shape["hidden"], shape["intermediate"], shape["hidden"] // shape["heads"]
    kv = shape["kv_heads"] * head_dim
    w = gguf.GGUFWriter(path, "llama")
    for key, value in {"vocab_size": VOCAB, "context_length": 8192, "embedding_length": hidden,
                       "block_count": shape["layers"], "feed_forward_length": inter,
                       "attention.head_count": shape["heads"], "attention.head_count_kv": shape["kv_heads"],
                       "rope.dimension_count": head_dim}.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.rope.freq_base", 500000.0)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            w.add_key_value(key, field.contents(), vtype, field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None)
    Q4_K, Q6_K = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K
    tensors = [("token_embd.weight", (VOCAB, hidden), Q6_K), ("output_norm.weight", (hidden,), None)]
    for i in range(shape["layers"]):
        tensors += [(f"blk.{i}.attn_norm.weight", (hidden,), None), (f"blk.{i}.ffn_norm.weight", (hidden,), None),
                    (f"blk.{i}.attn_q.weight", (hidden, hidden), Q4_K), (f"blk.{i}.attn_k.weight", (kv, hidden), Q4_K),
                    (f"blk.{i}.attn_v.weight", (kv, hidden), Q4_K), (f"blk.{i}.attn_output.weight", (hidden, hidden), Q4_K),
                    (f"blk.{i}.ffn_gate.weight", (inter, hidden), Q4_K), (f"blk.{i}.ffn_up.weight", (inter, hidden), Q4_K),
                    (f"blk.{i}.ffn_down.weight", (hidden, inter), Q4_K)]
    data = {}  # one array per (shape, type), written again for every layer: the bytes' values do not matter
    for name, dims, qtype in tensors:
        if (dims, qtype) not in data:
            data[dims, qtype] = random_blocks(dims, qtype) if qtype else np.ones(dims, dtype=np.float32)
        arr = data[dims, qtype]
        w.add_tensor_info(name, arr.shape, arr.dtype, arr.nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, dims, qtype in tensors:
        w.write_tensor_data(data[dims, qtype])
    w.close()


def random_blocks(dims: tuple[int, int], qtype) -> np.ndarray:
    weights, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = dims
    blocks = np.random.default_rng(rows * cols).integers(0, 256, (rows, cols // weights, nbytes), dtype=np.uint8)
    scales = np.full((rows, cols // weights, 2), 2e-4, dtype=np.float16).view(np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q6_K:
        blocks[..., 208:210] = scales[..., :2]  # d, after ql, qh and the int8 scales
    else:
        blocks[..., 0:4] = scales  # d and dmin
    return blocks.reshape(rows, -1)


def measure_big(path: str, output_len: int) -> dict:
    """In a fresh process (`--one-big`): load time, resident memory after load and at its peak, one stream's
    decode tok/s and the answer's length."""
    start = time.perf_counter()
    with Engine(EngineConfig(dtype="float32", model=path, weights="quantized", kv_cache_tokens=2048,
                             max_batch_size=8)) as engine:
        load = time.perf_counter() - start
        rss = resident_bytes()
        prompt = random_prompts(random.Random(0), 1, 32, engine.vocab_size)[0]
        answer = engine.generate(prompt, SamplingParams(max_new_tokens=4, ignore_eos=True)).token_ids
        single = engine_single_stream(engine, prompt[::-1], output_len)
        return dict(load_s=load, rss=rss, peak=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                    weights=engine.weights_bytes, single=single, answered=len(answer))


def resident_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-batched-tokens", type=int, default=512, help="tokens per step (lmgate serve's default)")
    ap.add_argument("--big", default="1B,8B", help="Llama shapes written as Q4_K GGUF files and served ('' for none)")
    ap.add_argument("--big-dir", default=tempfile.gettempdir(), help="where the big files are written (and removed)")
    ap.add_argument("--one-big", help=argparse.SUPPRESS)  # a child process measuring one file
    args = ap.parse_args()
    torch.set_num_threads(available_cpus())
    if args.one_big:
        print(json.dumps(measure_big(args.one_big, args.output_len // 16)))
        return
    path = path_of_embedded = embedded_model_path()
    bandwidth, reading = on_fresh_thread(copy_bandwidth), on_fresh_thread(read_bandwidth)
    cpu = cpu_features()
    dot = "vpdpbusd (AVX512-VNNI)" if cpu.int8_vnni else "vpmaddubsw (AVX2)"
    print(f"cpu: {cpu.name} ({cpu.vector_isa}; int8 dot products by {dot}), {available_cpus()} threads; "
          f"copy bandwidth {bandwidth / 1e9:.1f} GB/s, read {reading / 1e9:.1f} GB/s; "
          f"workload: {args.requests} x ({args.input_len} prompt + {args.output_len} new), greedy, ignore_eos", flush=True)
    rows = {}
    for row in ROWS:
        rows[row] = measure_lmgate(args, row)
        print(f"{row}: {rows[row]}", flush=True)
    singles = single_streams(args, path)
    for name, samples in singles.items():
        print(f"{name} single stream, round by round: {', '.join(f'{x:.1f}' for x in samples)}", flush=True)
    single = {name: statistics.median(samples) for name, samples in singles.items() if samples}
    quant_bytes = rows[QUANT_ROW][0]
    limit = bandwidth / quant_bytes
    llama = run_llama_cpp(args, path)
    print(f"\nsingle-stream limit: {quant_bytes / 1e6:.1f} MB of weights per token at {bandwidth / 1e9:.1f} GB/s "
          f"= {limit:.1f} tok/s (at the read rate, {reading / 1e9:.1f} GB/s: {reading / quant_bytes:.1f} tok/s)\n")
    print(f"| engine | weights MB | 1 stream tok/s (median of {SINGLE_ROUNDS}) | of limit | all at once tok/s | perplexity |")
    print("|---|---|---|---|---|---|")
    for name, (nbytes, batch, ppl) in rows.items():
        print(f"| {name} | {nbytes / 1e6:.0f} | {single[name]:.1f} | {single[name] / limit:.0%} | {batch:.1f} | {ppl:.2f} |")
    if llama is None:
        print("| llama.cpp | — | not installed (pip install llama-cpp-python) | | | |")
    else:
        serial, batched = llama["serial"], llama["batched"]
        print(f"| llama.cpp (llama-cpp-python {llama['version']}), one request at a time | the file's | {single[LLAMA]:.1f} | "
              f"{single[LLAMA] / limit:.0%} | {serial:.1f} | |")
        print(f"| llama.cpp, all requests in one batch (its C API) | the file's | | | {batched:.1f} | |")
        print()
        for name in (QUANT_ROW, INT8_ROW):
            ratios = [ours / theirs for ours, theirs in zip(singles[name], singles[LLAMA])]
            print(f"{name}: single stream against llama.cpp, round by round {', '.join(f'{r:.2f}' for r in ratios)}: "
                  f"median {statistics.median(ratios):.2f}x (goal 1.2x)")
        quant = rows[QUANT_ROW]
        print(f"{QUANT_ROW}: all at once against one at a time {quant[1]:.1f} / {serial:.1f} = {quant[1] / serial:.2f}x, "
              f"against its batch {quant[1]:.1f} / {batched:.1f} = {quant[1] / batched:.2f}x (goal 3x)")
        for name in (INT8_ROW, INT8_F16_ROW):
            print(f"{name.removeprefix(QUANT_ROW + ' ')}: all at once against llama.cpp's batch "
                  f"{rows[name][1]:.1f} / {batched:.1f} = {rows[name][1] / batched:.2f}x (goal 3x); perplexity "
                  f"{rows[name][2]:.2f} against {quant[2]:.2f} with float activations")
    big = [name for name in args.big.split(",") if name]
    if big:
        print(f"\n| Llama shape, Q4_K random weights | file GB | load s | weights GB | resident GB (peak) | 1 stream tok/s |")
        print("|---|---|---|---|---|---|")
    for name in big:
        path = os.path.join(args.big_dir, f"lmgate-bench-{name}-q4_k.gguf")
        try:
            write_big_gguf(path, BIG_SHAPES[name], path_of_embedded)
            child = subprocess.run([sys.executable, __file__, "--one-big", path, "--output-len", str(args.output_len)],
                                   capture_output=True, text=True, check=True)
            r = json.loads(child.stdout.strip().splitlines()[-1])
            print(f"| {name} | {os.path.getsize(path) / 1e9:.2f} | {r['load_s']:.1f} | {r['weights'] / 1e9:.2f} | "
                  f"{r['rss'] / 1e9:.2f} ({r['peak'] / 1e9:.2f}) | {r['single']:.2f} |", flush=True)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)


if __name__ == "__main__":
    main()
