"""llama.cpp on a GGUF file, for bench-quant: run by it in a child process, so that llama.cpp's OpenMP threads
keep their own defaults (lmgate's engine sets `OMP_WAIT_POLICY=PASSIVE`, which slows llama.cpp's many
barriers a token more than twofold). One call is one of bench-quant's rounds, on that round's prompts
(`round_prompts`); it prints one JSON line.

    python benchmarks/llama_cpp_bench.py FILE REQUESTS INPUT_LEN OUTPUT_LEN THREADS ROUND
"""

from __future__ import annotations

import json
import random
import sys
import time

import numpy as np

from lmgate.client.bench import random_prompts

SERIAL_SAMPLE = 4  # requests llama-cpp-python serves one after another (each takes as long as the others)


def round_prompts(round_: int, requests: int, input_len: int, vocab: int) -> tuple[list[int], list[list[int]]]:
    """Round `round_`'s prompts, the same for every engine: one for the single stream, `requests` for the batch."""
    return (
        random_prompts(random.Random(200 + round_), 1, input_len, vocab)[0],
        random_prompts(random.Random(100 + round_), requests, input_len, vocab),
    )


def measure(path: str, requests: int, input_len: int, output_len: int, threads: int, round_: int) -> dict:
    """llama.cpp's single-stream decode tok/s (first token to last), its output tok/s serving requests one at a
    time as llama-cpp-python's `Llama` does (prefill included), and with every request in one batch through its
    C API; {} where llama-cpp-python is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return {}
    llm = llama_cpp.Llama(path, n_ctx=input_len + output_len, n_threads=threads, n_threads_batch=threads, verbose=False)
    single_prompt, prompts = round_prompts(round_, requests, input_len, llm.n_vocab())
    llm.eval(random_prompts(random.Random(1), 1, input_len, llm.n_vocab())[0])  # a warm-up
    stamps = []
    for _ in llm.generate(single_prompt, temp=0.0, reset=True):
        stamps.append(time.perf_counter())
        if len(stamps) == output_len:
            break
    single = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    start = time.perf_counter()
    for prompt in prompts[:SERIAL_SAMPLE]:
        for count, _ in enumerate(llm.generate(prompt, temp=0.0, reset=True), start=1):
            if count == output_len:
                break
    serial = SERIAL_SAMPLE * output_len / (time.perf_counter() - start)
    batched = llama_cpp_batched(llama_cpp, llm, prompts, output_len, threads)
    del llm
    return dict(single=single, serial=serial, batched=batched, version=llama_cpp.__version__)


def llama_cpp_batched(llama_cpp, llm, prompts: list[list[int]], output_len: int, threads: int) -> float:
    """Output tok/s of llama.cpp decoding every prompt at once, greedy, through its C API: one context with a
    sequence per prompt, the prompts prefilled in batches of up to 2,048 tokens, then one token of every
    sequence per `llama_decode` (what llama-server's parallel slots do; the Python `Llama` object serves one
    sequence)."""
    params = llama_cpp.llama_context_default_params()
    params.n_seq_max = len(prompts)
    params.n_ctx = len(prompts) * (max(map(len, prompts)) + output_len)
    params.n_batch, params.n_ubatch = 2048, 512
    params.n_threads = params.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(llm.model, params)
    batch = llama_cpp.llama_batch_init(params.n_batch, 0, len(prompts))
    vocab = llm.n_vocab()

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:  # (token, position, sequence, wants logits)
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
            batch.seq_id[i][0] = seq
        batch.n_tokens = len(entries)
        assert llama_cpp.llama_decode(ctx, batch) == 0

    def next_tokens(rows: list[int]) -> list[int]:  # greedy, at these rows of the last decode's batch
        return [
            int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(vocab,)).argmax()) for i in rows
        ]

    start = time.perf_counter()
    entries = [(t, pos, seq, pos == len(p) - 1) for seq, p in enumerate(prompts) for pos, t in enumerate(p)]
    last = []
    for i in range(0, len(entries), params.n_batch):
        chunk = entries[i : i + params.n_batch]
        decode(chunk)
        last += next_tokens([row for row, e in enumerate(chunk) if e[3]])
    lengths = [len(p) for p in prompts]
    for step in range(output_len - 1):
        decode([(t, lengths[seq] + step, seq, True) for seq, t in enumerate(last)])
        last = next_tokens(list(range(len(prompts))))
    elapsed = time.perf_counter() - start
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    return len(prompts) * output_len / elapsed


if __name__ == "__main__":
    path, requests, input_len, output_len, threads, round_ = sys.argv[1], *map(int, sys.argv[2:7])
    print(json.dumps(measure(path, requests, input_len, output_len, threads, round_)))
