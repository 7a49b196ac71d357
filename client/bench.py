"""`lmgate bench`: a serving load generator in the manner of vLLM's `bench serve`, over AsyncClient.

Per request: TTFT is send → first token-carrying message; ITL is the gap between successive token-carrying
messages (one sample per message: when the server merges k tokens into one message, that gap counts once);
TPOT is (latency - TTFT) / (output tokens - 1); latency is send → last message. A request counts as sent once
it holds a concurrency slot, so queueing behind `concurrency` is not part of its TTFT.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import grpc
import numpy as np

from .client import AsyncClient


@dataclass
class RequestResult:
    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def random_prompts(rng: random.Random, num_prompts: int, input_len: int, vocab_size: int) -> list[list[int]]:
    """Token ids drawn from [100, vocab_size): past the low ids, where models keep most special tokens."""
    return [[rng.randrange(100, vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]


async def _one(client: AsyncClient, prompt: list[int], sampling: dict[str, Any]) -> RequestResult:
    result = RequestResult()
    finish = None
    sent = last = time.perf_counter()
    try:
        async for delta in client.generate(token_ids=prompt, **sampling):
            now = time.perf_counter()
            if delta.token_ids:
                if result.output_tokens == 0:
                    result.ttft = now - sent
                else:
                    result.itl.append(now - last)
                last = now
                result.output_tokens += len(delta.token_ids)
            if delta.usage is not None:
                result.prompt_tokens = delta.usage["prompt_tokens"]
                result.output_tokens = delta.usage["completion_tokens"]
            finish = delta.finish_reason
        result.latency = time.perf_counter() - sent
        result.ok = finish in ("stop", "length")
        result.error = "" if result.ok else f"finish_reason {finish}"
    except grpc.RpcError as exc:
        result.error = f"{exc.code().name}: {exc.details()}"
    return result


async def run(
    client: AsyncClient,
    prompts: Sequence[list[int]],
    *,
    concurrency: int,
    request_rate: float,
    rng: random.Random,
    **sampling: Any,
) -> tuple[list[RequestResult], float]:
    """Sends every prompt (Poisson arrivals at `request_rate` per second; inf: all at once), at most
    `concurrency` in flight. Returns the results in prompt order and the duration in seconds."""
    slots = asyncio.Semaphore(concurrency)

    async def limited(prompt: list[int]) -> RequestResult:
        async with slots:
            return await _one(client, prompt, sampling)

    started = time.perf_counter()
    tasks = []
    for i, prompt in enumerate(prompts):
        if i and math.isfinite(request_rate):
            await asyncio.sleep(rng.expovariate(request_rate))
        tasks.append(asyncio.create_task(limited(prompt)))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - started


def _stats_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    ms = np.asarray(values) * 1000
    return {"mean": float(ms.mean()), "median": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99))}


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """The metrics of a run, JSON-ready; latency percentiles over successful requests, in milliseconds."""
    ok = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok}),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "ttft_ms": _stats_ms([r.ttft for r in ok if r.output_tokens]),
        "tpot_ms": _stats_ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": _stats_ms([gap for r in ok for gap in r.itl]),
        "e2el_ms": _stats_ms([r.latency for r in ok]),
    }


def report(summary: dict[str, Any]) -> str:
    """The summary as vLLM's `bench serve` prints it."""
    rows = [
        "{:=^50}".format(" Serving Benchmark Result "),
        f"{'Successful requests:':<40}{summary['completed']:<10}",
        f"{'Failed requests:':<40}{summary['failed']:<10}",
        f"{'Benchmark duration (s):':<40}{summary['duration_s']:<10.2f}",
        f"{'Total input tokens:':<40}{summary['total_input_tokens']:<10}",
        f"{'Total generated tokens:':<40}{summary['total_output_tokens']:<10}",
        f"{'Request throughput (req/s):':<40}{summary['request_throughput']:<10.2f}",
        f"{'Output token throughput (tok/s):':<40}{summary['output_throughput']:<10.2f}",
        f"{'Total token throughput (tok/s):':<40}{summary['total_token_throughput']:<10.2f}",
    ]
    for key, name, title in (
        ("ttft_ms", "TTFT", "Time to First Token"),
        ("tpot_ms", "TPOT", "Time per Output Token (excl. 1st token)"),
        ("itl_ms", "ITL", "Inter-token Latency"),
        ("e2el_ms", "E2EL", "End-to-end Latency"),
    ):
        rows.append("{:-^50}".format(title))
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            rows.append(f"{f'{label} {name} (ms):':<40}{summary[key][stat]:<10.2f}")
    rows.append("=" * 50)
    return "\n".join(rows)
