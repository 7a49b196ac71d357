"""Engine throughput against transformers on the same model, in one run (a benchmark: it prints, never asserts).

    make bench-engine ARGS="--requests 64 --input-len 128 --output-len 128"
"""
from __future__ import annotations

import argparse
import os
import random
import threading
import time

import torch

from lmgate.client.bench import random_prompts
from lmgate.engine.config import EngineConfig
from lmgate.engine.engine import Engine
from lmgate.engine.sampling import SamplingParams
from lmgate.engine.threads import on_fresh_thread


def matmul_flops(dtype: torch.dtype) -> float:
    """FLOP/s torch reaches on the model's own shapes (M=256, K=576, N=1536) on this machine."""
    a, w = torch.randn(256, 576, dtype=dtype), torch.randn(1536, 576, dtype=dtype)
    for _ in range(5):
        torch.nn.functional.linear(a, w)
    n, start = 50, time.perf_counter()
    for _ in range(n):
        torch.nn.functional.linear(a, w)
    return 2 * 256 * 576 * 1536 * n / (time.perf_counter() - start)


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
        model.generate(batch, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                       do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded SmolLM2)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-batched-tokens", type=int, default=512)
    ap.add_argument("--hf-sample", type=int, default=4, help="requests that measure transformers one at a time")
    ap.add_argument("--hf-batch", type=int, default=0, help="padded batch size for transformers (0: all requests)")
    args = ap.parse_args()

    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, max_batched_tokens=args.max_batched_tokens,
                                 max_batch_size=max(64, args.requests)))
    prompts = random_prompts(random.Random(0), args.requests, args.input_len, engine.tokenizer.vocab_size)
    flops = on_fresh_thread(lambda: matmul_flops(engine.dtype))  # see engine/threads.py: keep the main thread clear
    params = engine.model_config.num_params
    run_engine(engine, prompts[:2], 4)  # warm-up
    eng_tps = run_engine(engine, prompts, args.output_len)
    eng_single = engine_single_stream(engine, prompts[0], args.output_len)
    engine.shutdown()

    from transformers import AutoModelForCausalLM

    path = engine.model_path
    kw = {"gguf_file": os.path.basename(path)} if os.path.isfile(path) else {}
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path) if kw else path, dtype=engine.dtype, **kw).eval()
    hf_generate(hf, torch.tensor(prompts[:1]), 4)  # warm-up
    one_at_a_time = sum(hf_generate(hf, torch.tensor([p]), args.output_len) for p in prompts[: args.hf_sample])
    hf_serial_tps = args.hf_sample * args.output_len / one_at_a_time
    t1 = hf_generate(hf, torch.tensor(prompts[:1]), 1)
    hf_single = (args.output_len - 1) / (hf_generate(hf, torch.tensor(prompts[:1]), args.output_len) - t1)
    n_batch = args.hf_batch or args.requests
    hf_batch_tps = n_batch * args.output_len / hf_generate(hf, torch.tensor(prompts[:n_batch]), args.output_len,
                                                          torch.ones(n_batch, args.input_len, dtype=torch.long))

    print(f"model {os.path.basename(path)}  {params / 1e6:.1f}M params  dtype {args.dtype}  threads {torch.get_num_threads()}")
    print(f"workload: {args.requests} requests x {args.input_len} prompt + {args.output_len} new tokens, ignore_eos, greedy")
    print(f"torch matmul (M=256,K=576,N=1536): {flops / 1e9:.1f} GFLOP/s")
    print(f"lmgate engine, all {args.requests} at once:      {eng_tps:8.1f} tok/s")
    print(f"transformers one at a time ({args.hf_sample} sampled):  {hf_serial_tps:8.1f} tok/s   ratio {eng_tps / hf_serial_tps:5.1f}x")
    print(f"transformers padded batch of {n_batch}:       {hf_batch_tps:8.1f} tok/s   ratio {eng_tps / hf_batch_tps:5.1f}x")
    print(f"single-stream decode: lmgate {eng_single:.1f} tok/s, transformers {hf_single:.1f} tok/s   ratio {eng_single / hf_single:4.1f}x")
    print(f"lmgate model-FLOP utilisation: {2 * params * eng_tps / flops:.1%} of measured matmul FLOP/s")


if __name__ == "__main__":
    main()
