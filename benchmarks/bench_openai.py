"""One server, three ways in: lmgate.v1, the VllmEngine service and the OpenAI API behind smg; then `n` samples.

A benchmark: it prints figures, never asserts. Run on an otherwise idle machine:

    make bench-openai ARGS="--num-prompts 64 --concurrency 64 --input-len 128 --output-len 128 --rounds 1"

`lmgate serve --openai-port` as a child process (its defaults; smg its child), then, each path after a warm-up
wave (`--rounds` measured waves each, the paths taking turns; stream_paths.py measures them):
1. lmgate.v1 Generate (the generated stub over grpc.aio, token ids in);
2. vllm.grpc.engine.VllmEngine Generate on the same port (the stub smg itself calls, token ids in);
3. the OpenAI API through smg: /v1/completions streamed by the openai SDK's async client, the same kind of
   prompts as text (smg takes no token ids there; each prompt is words that tokenize back to exactly its ids).
Every wave sends prompts of its own (random words), so none finds another's in the prefix cache. Output tokens/s,
TTFT and inter-token latency p50 / p99, the requests the engine held (what a path lets through to it), and the
CPU seconds of this client, of lmgate and of smg during each wave.

Then over lmgate.v1, the prefix cache emptied (a level-1 sleep and wake-up) before each side: `--n-prompts`
prompts with `n = --n` against the same prompts each sent n times as requests of their own, copy i with seed +
i (sample i of n draws as that request would). Prompt tokens computed (prompt - cached from the usage, a
request's prompt counted once; and from Info: the KV computed less the generated tokens), output tokens/s, and
how many samples equal their separate request.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.metadata
import os
import random
import subprocess
import sys
import time

import grpc
import numpy as np
import openai
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from lmgate.engine.loading.loader import load_checkpoint
from lmgate.engine.machine.hardware import cpu_features
from lmgate.engine.machine.threads import available_cpus
from lmgate.v1 import lmgate_pb2 as pb
from lmgate.v1 import lmgate_pb2_grpc as pb_grpc

import stream_paths as paths  # beside this file: both run as scripts

# tests/serving.py, shared with the tests: a module of that directory, as this file is of its own
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from serving import free_port, serve_process  # noqa: E402


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def machine() -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    info = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in lscpu)}
    return (
        f"`lscpu` {info.get('Model name', cpu_features().name)} family {info.get('CPU family', '?')} model "
        f"{info.get('Model', '?')}, {available_cpus()} cores, vector ISA {cpu_features().vector_isa}"
    )


def descendants(pid: int) -> list[int]:
    """smg below `lmgate serve` (its threads come and go as we read)."""
    found = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except FileNotFoundError:
            continue
        for kid in kids:
            found += [kid, *descendants(kid)]
    return found


def cpu_now(server: int) -> np.ndarray:
    """CPU seconds so far: this client, lmgate, smg."""
    return np.array([time.process_time(), cpu_seconds(server), sum(map(cpu_seconds, descendants(server)))])


async def three_paths(args, address: str, url: str, model: str, server: int, prompts: list[paths.Prompt]) -> dict:
    """Each path a warm-up wave, then `--rounds` measured waves taking turns with the other paths'; every wave
    on prompts no other wave sent. Per path, the figures of its median round (by tok/s), and every round's tok/s."""
    channel = grpc.aio.insecure_channel(address)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=3600)
    v1 = pb_grpc.InferenceStub(channel)
    senders = {
        "lmgate.v1": functools.partial(paths.v1_request, v1),
        "VllmEngine (gRPC)": functools.partial(paths.vllm_request, vllm_engine_pb2_grpc.VllmEngineStub(channel)),
        "OpenAI API via smg": functools.partial(paths.openai_request, client, model),
    }
    unused = iter(prompts)

    def jobs(count: int, max_tokens: int) -> list[tuple[paths.Prompt, paths.Params]]:
        return [(next(unused), paths.Params(max_tokens)) for _ in range(count)]

    rounds: dict[str, list[dict]] = {name: [] for name in senders}
    for send in senders.values():
        await paths.wave(send, jobs(args.warmup_prompts, args.warmup_output_len), args.concurrency)
    for _ in range(args.rounds):
        for name, send in senders.items():
            cpu = cpu_now(server)
            work = paths.wave(send, jobs(args.num_prompts, args.output_len), args.concurrency)
            (outcomes, duration), held = await paths.engine_held(v1, work)
            figures = paths.summarize(outcomes, duration) | {"cpu": cpu_now(server) - cpu, "held": held}
            rounds[name].append(figures)
    await channel.close()
    await client.close()
    median = (args.rounds - 1) // 2
    return {
        name: sorted(figures, key=lambda f: f["tps"])[median] | {"rounds": [f["tps"] for f in figures]}
        for name, figures in rounds.items()
    }


async def n_against_separate(args, address: str, prompts: list[paths.Prompt]) -> dict:
    """Over lmgate.v1, sampled (temperature 1): each prompt once with n, then n times alone with the samples' seeds."""
    channel = grpc.aio.insecure_channel(address)
    v1, admin = pb_grpc.InferenceStub(channel), pb_grpc.AdminStub(channel)
    send = functools.partial(paths.v1_request, v1)

    async def side(jobs: list[tuple[paths.Prompt, paths.Params]], n: int) -> tuple[list[paths.Outcome], dict]:
        await admin.Sleep(pb.SleepRequest(level=1))  # frees the KV cache: an empty prefix cache for each side
        await admin.Wakeup(pb.WakeupRequest())
        before = await v1.Info(pb.InfoRequest())
        (outcomes, duration), held = await paths.engine_held(v1, paths.wave(send, jobs, len(jobs)))
        after = await v1.Info(pb.InfoRequest())
        queried = after.prefix_cache_queried_tokens - before.prefix_cache_queried_tokens
        hit = after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
        figures = paths.summarize(outcomes, duration, n) | {"queried": queried, "hit": hit, "kv_computed": None}
        figures["batch"] = max((running for running, _ in held), default=0)
        if getattr(after, "computed_tokens", 0):  # a server that counts them
            # KV computed: prompts once each, then a token a step for every sample's tokens but its last
            decoded = sum(len(s.token_ids) - 1 for o in outcomes for s in o.samples.values() if s.token_ids)
            figures["kv_computed"] = after.computed_tokens - before.computed_tokens - decoded
        return outcomes, figures

    n = args.n
    together = [(p, paths.Params(args.n_output_len, 1.0, 1000 + k * n, n)) for k, p in enumerate(prompts)]
    alone = [(p, paths.Params(args.n_output_len, 1.0, params.seed + i)) for p, params in together for i in range(n)]
    n_outcomes, n_figures = await side(together, n)
    alone_outcomes, alone_figures = await side(alone, 1)
    await channel.close()
    pairs = [
        (o.samples.get(i), alone_outcomes[k * n + i].samples.get(0)) for k, o in enumerate(n_outcomes) for i in range(n)
    ]
    equal = [a is not None and b is not None and a.token_ids == b.token_ids for a, b in pairs]
    unequal = [(j // n, j % n, first_difference(*pairs[j])) for j, same in enumerate(equal) if not same]
    samples = sorted({len(o.samples) for o in n_outcomes if not o.error})
    return {
        "n": n_figures,
        "alone": alone_figures,
        "equal": sum(equal),
        "unequal": unequal,
        "samples_per_request": samples,
    }


def first_difference(together: paths.Sample | None, alone: paths.Sample | None) -> int:
    """The first token position where a sample and its separate request part (-1: one of them is missing)."""
    if together is None or alone is None:
        return -1
    a, b = together.token_ids, alone.token_ids
    return next((t for t, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def row(name: str, f: dict, base: float) -> str:
    held = [sum(h) for h in f["held"]]
    held = f"{np.mean(held):.1f}/{max(held)}" if held else "-"
    cpu = "/".join(f"{seconds:.1f}" for seconds in f["cpu"])
    per_cpu = f["output"] / max(sum(f["cpu"]), 1e-9)
    return (
        f"{name:<19} {f['tps']:9.1f} {f['tps'] / base:7.1%} {f['ttft'][0]:9.0f} {f['ttft'][1]:7.0f} {f['itl'][0]:8.1f} "
        f"{f['itl'][1]:7.1f} {f['per_message']:7.2f} {held:>9} {cpu:>18} {per_cpu:8.1f} {f['prompt']:>6}/{f['output']:<6} "
        f"{f['failed']:6}"
    )


def report(args, info: pb.InfoResponse, figures: dict, n_part: dict | None) -> None:
    print(f"machine: {machine()}")
    print(
        f"server: lmgate serve --openai-port (its defaults: {info.dtype} on {info.device}, KV {info.kv_cache_dtype}, "
        f"{info.kv_blocks_total * info.kv_block_size} KV tokens), smg {importlib.metadata.version('smg')}"
    )
    print(
        f"workload: {args.num_prompts} requests x {args.input_len} prompt + {args.output_len} new tokens, "
        f"{args.concurrency} at a time, greedy, ignore_eos; each path after a warm-up of {args.warmup_prompts} "
        f"requests (+{args.warmup_output_len} new); {args.rounds} round(s), the paths in turn, each its median"
    )
    print(
        f"{'path':<19} {'out tok/s':>9} {'of v1':>7} {'TTFT p50':>9} {'p99':>7} {'ITL p50':>8} {'p99':>7} "
        f"{'tok/msg':>7} {'held':>9} {'CPU s client/lmg/smg':>18} {'tok/CPUs':>8} {'in/out tokens':>13} {'failed':>6}"
    )
    base = figures["lmgate.v1"]["tps"] or 1.0
    for name, f in figures.items():
        print(row(name, f, base))
        for error in f["errors"][:3]:
            print(f"    error: {error}")
    print(
        "  (ms; tok/msg: tokens a token-carrying message; held: requests the engine held, mean/max, Info polled every "
        "0.25 s; CPU s during the wave; tok/CPUs: output tokens a CPU second of the three)"
    )
    if args.rounds > 1:
        print(
            "  rounds, out tok/s: "
            + "; ".join(f"{k} {'/'.join(f'{t:.1f}' for t in f['rounds'])}" for k, f in figures.items())
        )
    ours, theirs = figures["OpenAI API via smg"], figures["lmgate.v1"]
    print(
        f"OpenAI API / lmgate.v1: {ours['tps']:.1f} / {theirs['tps']:.1f} output tok/s = "
        f"{ours['tps'] / (theirs['tps'] or 1):.1%} (goal >= 90%); by CPU seconds of the three processes for the same "
        f"tokens {sum(theirs['cpu']):.1f} against {sum(ours['cpu']):.1f}: "
        f"{sum(theirs['cpu']) / max(sum(ours['cpu']), 1e-9):.1%}"
    )
    if n_part is not None:
        report_n(args, n_part)


def report_n(args, part: dict) -> None:
    n, together, alone = args.n, part["n"], part["alone"]
    print(
        f"\nn: {args.n_prompts} prompts x n={n} against {args.n_prompts * n} requests (each prompt {n} times, the "
        f"samples' seeds), {args.input_len} prompt + {args.n_output_len} new tokens, temperature 1, all at once, over "
        f"lmgate.v1, the prefix cache emptied before each side; computed = prompt - cached (the usage, a request's "
        f"prompt once), and from Info (the KV computed less one a generated token)"
    )
    print(
        f"{'side':<18} {'prompt':>7} {'cached':>7} {'computed':>8} {'(Info)':>7} {'cache queried/hit':>17} "
        f"{'out tok/s':>9} {'TTFT p50':>9} {'p99':>7} {'batch':>5} {'failed':>6}"
    )
    for name, f in ((f"n={n}", together), ("separate requests", alone)):
        info = "-" if f["kv_computed"] is None else f["kv_computed"]
        print(
            f"{name:<18} {f['prompt']:7} {f['cached']:7} {f['prompt'] - f['cached']:8} {info:>7} "
            f"{f['queried']:>8}/{f['hit']:<8} {f['tps']:9.1f} {f['ttft'][0]:9.0f} {f['ttft'][1]:7.0f} {f['batch']:5} "
            f"{f['failed']:6}"
        )
    print("  (ms; batch: the most sequences the engine ran at once, Info polled every 0.25 s)")
    if together["failed"]:
        why = together["errors"][0] if together["errors"] else f"samples per request: {part['samples_per_request']}"
        print(f"n={n} is not served yet: {why}")
        return
    print(
        f"prompt tokens computed: n={n} {together['prompt'] - together['cached']} against separate "
        f"{alone['prompt'] - alone['cached']} (goal {args.n_prompts} x {args.input_len} = "
        f"{args.n_prompts * args.input_len}); output tok/s {together['tps']:.1f} against {alone['tps']:.1f} "
        f"({together['tps'] / (alone['tps'] or 1):.2f}x); samples equal to their separate request: {part['equal']} "
        f"of {args.n_prompts * n}"
    )
    for prompt, sample, token in part["unequal"][:4]:
        print(f"  prompt {prompt} sample {sample} parts from its separate request at token {token}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64, help="measured requests per path and round")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1, help="measured waves per path, the paths taking turns")
    ap.add_argument("--warmup-prompts", type=int, default=64, help="per path, before its first measured wave")
    ap.add_argument("--warmup-output-len", type=int, default=16)
    ap.add_argument("--n-prompts", type=int, default=16, help="0: no n part")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--n-output-len", type=int, default=64)
    args = ap.parse_args()

    tokenizer = load_checkpoint(weights=False).tokenizer
    first_part = 3 * (args.warmup_prompts + args.rounds * args.num_prompts)
    prompts = paths.word_prompts(tokenizer, random.Random(0), first_part + args.n_prompts, args.input_len)
    port = free_port()
    proc, address = serve_process("--openai-port", str(port))
    try:
        url = f"http://127.0.0.1:{port}"
        model = paths.wait_until_served(url, proc)
        with grpc.insecure_channel(address) as channel:
            info = pb_grpc.InferenceStub(channel).Info(pb.InfoRequest())
        figures = asyncio.run(three_paths(args, address, url, model, proc.pid, prompts[:first_part]))
        n_part = asyncio.run(n_against_separate(args, address, prompts[first_part:])) if args.n_prompts else None
    finally:
        proc.terminate()
        proc.wait()
    report(args, info, figures, n_part)


if __name__ == "__main__":
    main()
