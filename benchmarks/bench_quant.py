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
only reads the weights). Everything is measured in rounds, every engine once a round, llama.cpp included, on
the round's prompts: this machine's speed drifts by 10-20% within minutes, so each ratio is taken within a
round (and the median of the rounds' ratios kept).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
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
from lmgate.engine.machine.hardware import cpu_features
from lmgate.engine.loading.loader import embedded_model_path
from lmgate.engine.sampling.sampler import SamplingParams
from lmgate.engine.machine.threads import available_cpus, on_fresh_thread
from bench_engine import engine_single_stream, read_bandwidth, run_engine  # beside this file: all run as scripts
from llama_cpp_bench import round_prompts

# tests/perplexity.py, shared with tests/test_int8_activations.py: a module of that directory, as this file is
# of its own
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from perplexity import PASSAGE, perplexity  # noqa: E402

VOCAB = 49152  # the embedded tokenizer's
QUANT_ROW = "lmgate --weights quantized"
INT8_ROW = QUANT_ROW + " --int8-activations on"
INT8_F16_ROW = INT8_ROW + " --kv-cache-dtype float16"  # llama.cpp's own defaults: int8 activations, an f16 KV cache
FLOAT_ROW = "lmgate --weights float"
ROWS = {
    QUANT_ROW: dict(weights="quantized"),
    INT8_ROW: dict(weights="quantized", int8_activations=True),
    INT8_F16_ROW: dict(weights="quantized", int8_activations=True, kv_cache_dtype="float16"),
    FLOAT_ROW: dict(weights="float"),
}
LLAMA = "llama.cpp"
ROUNDS = 3  # samples of each engine, one a round; medians kept


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
    return Engine(
        EngineConfig(
            dtype="float32",
            max_batch_size=max(64, args.requests),
            max_batched_tokens=args.max_batched_tokens,
            **ROWS[row],
        )
    )


def measure_rounds(args, path: str) -> tuple[dict[str, list[dict | None]], dict[str, tuple[int, float]]]:
    """ROUNDS rounds of every row, then llama.cpp (where installed): one stream's decode tok/s ("single") and
    all requests at once ("batched"; llama.cpp's also one at a time, "serial"), a round's samples minutes apart
    at most. Also each row's weights' bytes and perplexity over the passage of tests/perplexity.py (its KV
    cache of the engine's dtype)."""
    samples: dict[str, list[dict | None]] = {name: [] for name in (*ROWS, LLAMA)}  # llama.cpp's: None where it failed
    with contextlib.ExitStack() as stack:
        engines = {row: stack.enter_context(engine_of(args, row)) for row in ROWS}
        warmup = random_prompts(random.Random(1), args.requests, args.input_len, VOCAB)
        for engine in engines.values():
            run_engine(engine, warmup, 16)
        for r in range(ROUNDS):
            single, prompts = round_prompts(r, args.requests, args.input_len, VOCAB)
            for row, engine in engines.items():
                samples[row].append(
                    dict(
                        single=engine_single_stream(engine, single, args.output_len),
                        batched=run_engine(engine, prompts, args.output_len),
                    )
                )
            samples[LLAMA].append(run_llama_cpp(args, path, str(r)))
            print(
                f"round {r + 1}: "
                + "; ".join(
                    f"{name} {', '.join(f'{k} {v:.1f}' for k, v in got[-1].items() if k != 'version')}"
                    for name, got in samples.items()
                    if got[-1]
                ),
                flush=True,
            )
        facts = {
            row: (
                engine.weights_bytes,
                perplexity(engine.loops[0].runner.model, engine.tokenizer.encode(PASSAGE), kv_dtype=engine.kv_dtype),
            )
            for row, engine in engines.items()
        }
    return samples, facts


def run_llama_cpp(args, path: str, round_: str) -> dict | None:
    """llama.cpp's figures (benchmarks/llama_cpp_bench.py), measured in a child process with llama.cpp's own OpenMP
    defaults: this process's `OMP_WAIT_POLICY=PASSIVE` (engine/__init__.py) put its threads to sleep at each of
    its many barriers a token, and cut its single stream from 99 to 39 tok/s on a Zen 4. None where
    llama-cpp-python is not installed."""
    env = dict(os.environ)
    if USER_WAIT_POLICY is None:
        env.pop("OMP_WAIT_POLICY", None)
    child = subprocess.run(
        [
            sys.executable,
            os.path.join(os.path.dirname(__file__), "llama_cpp_bench.py"),
            path,
            str(args.requests),
            str(args.input_len),
            str(args.output_len),
            str(available_cpus()),
            round_,
        ],
        capture_output=True,
        text=True,
        env=env,
    )
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
    for key, value in {
        "vocab_size": VOCAB,
        "context_length": 8192,
        "embedding_length": hidden,
        "block_count": shape["layers"],
        "feed_forward_length": inter,
        "attention.head_count": shape["heads"],
        "attention.head_count_kv": shape["kv_heads"],
        "rope.dimension_count": head_dim,
    }.items():
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
        tensors += [
            (f"blk.{i}.attn_norm.weight", (hidden,), None),
            (f"blk.{i}.ffn_norm.weight", (hidden,), None),
            (f"blk.{i}.attn_q.weight", (hidden, hidden), Q4_K),
            (f"blk.{i}.attn_k.weight", (kv, hidden), Q4_K),
            (f"blk.{i}.attn_v.weight", (kv, hidden), Q4_K),
            (f"blk.{i}.attn_output.weight", (hidden, hidden), Q4_K),
            (f"blk.{i}.ffn_gate.weight", (inter, hidden), Q4_K),
            (f"blk.{i}.ffn_up.weight", (inter, hidden), Q4_K),
            (f"blk.{i}.ffn_down.weight", (hidden, inter), Q4_K),
        ]
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
    with Engine(
        EngineConfig(dtype="float32", model=path, weights="quantized", kv_cache_tokens=2048, max_batch_size=8)
    ) as engine:
        load = time.perf_counter() - start
        rss = resident_bytes()
        prompt = random_prompts(random.Random(0), 1, 32, engine.vocab_size)[0]
        answer = engine.generate(prompt, SamplingParams(max_new_tokens=4, ignore_eos=True)).token_ids
        single = engine_single_stream(engine, prompt[::-1], output_len)
        return dict(
            load_s=load,
            rss=rss,
            peak=resident_bytes("VmHWM"),
            weights=engine.weights_bytes,
            single=single,
            answered=len(answer),
        )


def resident_bytes(field: str = "VmRSS") -> int:
    """This process's resident memory now, or at its peak ("VmHWM": this program's own, where `ru_maxrss` counts
    the parent's resident memory at the fork too, 7.6 GB for the 1B shape after the rounds' four engines)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))


def report(
    samples: dict[str, list[dict | None]], facts: dict[str, tuple[int, float]], bandwidth: float, reading: float
) -> None:
    """The table of medians, then each ratio to llama.cpp round by round."""
    done = {name: [round_ for round_ in got if round_] for name, got in samples.items()}
    median = {
        name: {key: statistics.median(round_[key] for round_ in got) for key in got[0] if key != "version"}
        for name, got in done.items()
        if got
    }
    quant_bytes = facts[QUANT_ROW][0]
    limit = bandwidth / quant_bytes
    print(
        f"\nsingle-stream limit: {quant_bytes / 1e6:.1f} MB of weights per token at {bandwidth / 1e9:.1f} GB/s "
        f"= {limit:.1f} tok/s (at the read rate, {reading / 1e9:.1f} GB/s: {reading / quant_bytes:.1f} tok/s)\n"
    )
    print(
        f"| engine (medians of {ROUNDS} rounds) | weights MB | 1 stream tok/s | of limit | all at once tok/s | perplexity |"
    )
    print("|---|---|---|---|---|---|")
    for name, (nbytes, ppl) in facts.items():
        single, batched = median[name]["single"], median[name]["batched"]
        print(f"| {name} | {nbytes / 1e6:.0f} | {single:.1f} | {single / limit:.0%} | {batched:.1f} | {ppl:.2f} |")
    if LLAMA not in median:
        print("| llama.cpp | — | not installed (pip install llama-cpp-python) | | | |")
    else:
        llama = median[LLAMA]
        print(
            f"| llama.cpp (llama-cpp-python {done[LLAMA][0]['version']}), one request at a time | the file's | "
            f"{llama['single']:.1f} | {llama['single'] / limit:.0%} | {llama['serial']:.1f} | |"
        )
        print(f"| llama.cpp, all requests in one batch (its C API) | the file's | | | {llama['batched']:.1f} | |")
        print("\nagainst llama.cpp, round by round (the median of the rounds' ratios):")

        def ratios(name: str, key: str, theirs: str, goal: str) -> None:
            each = [ours[key] / them[theirs] for ours, them in zip(samples[name], samples[LLAMA]) if them]
            print(
                f"{name}: {key} / llama.cpp's {theirs}: {', '.join(f'{x:.2f}' for x in each)}: "
                f"{statistics.median(each):.2f}x{goal}"
            )

        for name in (QUANT_ROW, INT8_ROW, INT8_F16_ROW):
            ratios(name, "single", "single", " (goal 1.2x)")
        ratios(QUANT_ROW, "batched", "serial", "")
        for name in (QUANT_ROW, INT8_ROW, INT8_F16_ROW):
            ratios(name, "batched", "batched", " (goal 3x)")
        for name in (INT8_ROW, INT8_F16_ROW):
            print(f"{name}: perplexity {facts[name][1]:.2f} against {facts[QUANT_ROW][1]:.2f} with float activations")


def big_shapes(args, names: list[str], tokenizer_source: str) -> None:
    """Each Llama shape written as a Q4_K file and served in a fresh process (`--one-big`), then removed."""
    if names:
        print(
            "\n| Llama shape, Q4_K random weights | file GB | load s | weights GB | resident GB (peak) | 1 stream tok/s |"
        )
        print("|---|---|---|---|---|---|")
    for name in names:
        path = os.path.join(args.big_dir, f"lmgate-bench-{name}-q4_k.gguf")
        try:
            write_big_gguf(path, BIG_SHAPES[name], tokenizer_source)
            child = subprocess.run(
                [sys.executable, __file__, "--one-big", path, "--output-len", str(args.output_len)],
                capture_output=True,
                text=True,
                check=True,
            )
            r = json.loads(child.stdout.strip().splitlines()[-1])
            print(
                f"| {name} | {os.path.getsize(path) / 1e9:.2f} | {r['load_s']:.1f} | {r['weights'] / 1e9:.2f} | "
                f"{r['rss'] / 1e9:.2f} ({r['peak'] / 1e9:.2f}) | {r['single']:.2f} |",
                flush=True,
            )
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)


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
    path = embedded_model_path()
    bandwidth, reading = on_fresh_thread(copy_bandwidth), on_fresh_thread(read_bandwidth)
    cpu = cpu_features()
    dot = "vpdpbusd (AVX512-VNNI)" if cpu.int8_vnni else "vpmaddubsw (AVX2)"
    print(
        f"cpu: {cpu.name} ({cpu.vector_isa}; int8 dot products by {dot}), {available_cpus()} threads; "
        f"copy bandwidth {bandwidth / 1e9:.1f} GB/s, read {reading / 1e9:.1f} GB/s; "
        f"workload: {args.requests} x ({args.input_len} prompt + {args.output_len} new), greedy, ignore_eos",
        flush=True,
    )
    report(*measure_rounds(args, path), bandwidth, reading)
    big_shapes(args, [name for name in args.big.split(",") if name], path)


if __name__ == "__main__":
    main()
