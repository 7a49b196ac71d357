"""The three ways into one lmgate server, measured per sample as a client sees them: lmgate.v1 and the
VllmEngine service over grpc.aio (token ids in), the OpenAI API through smg with the openai SDK's async client
(text in). For bench_openai.py beside it.

TTFT is send -> a sample's first token-carrying message; inter-token latency the gap between its successive
token-carrying messages (a message of k tokens counts once), as `lmgate bench` counts them. A request's clock
starts once it holds a concurrency slot.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from typing import Awaitable, TypeVar

import grpc
import numpy as np
import openai
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from lmgate.v1 import lmgate_pb2 as pb
from lmgate.v1 import lmgate_pb2_grpc as pb_grpc

T = TypeVar("T")
READY_SECONDS = 120  # a guard against a gateway that never serves, not a performance bound
V1_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_CANCELLED: "abort"}


@dataclass(frozen=True, slots=True)
class Prompt:
    ids: list[int]
    text: str  # tokenizes back to exactly `ids`


@dataclass(frozen=True, slots=True)
class Params:
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    n: int = 1


class Sample:
    """One sample's stream as the client saw it."""

    def __init__(self, sent: float) -> None:
        self.sent = sent
        self.arrivals: list[float] = []  # of its token-carrying messages
        self.token_ids: list[int] = []
        self.usage = (0, 0, 0)  # prompt, completion, cached tokens
        self.finish = ""

    def arrive(self, token_ids: list[int] | None = None) -> None:
        self.arrivals.append(time.perf_counter())
        self.token_ids += token_ids or []


class Outcome:
    """One request: its samples by index, or the error that ended it."""

    def __init__(self) -> None:
        self.sent = time.perf_counter()
        self.samples: dict[int, Sample] = {}
        self.error = ""

    def sample(self, index: int) -> Sample:
        return self.samples.setdefault(index, Sample(self.sent))

    def ok(self, n: int) -> bool:
        return (
            not self.error
            and len(self.samples) == n
            and all(s.finish in ("stop", "length") for s in self.samples.values())
        )


async def v1_request(stub: pb_grpc.InferenceStub, prompt: Prompt, p: Params) -> Outcome:
    out = Outcome()
    sampling = pb.SamplingParams(max_new_tokens=p.max_tokens, temperature=p.temperature, seed=p.seed, ignore_eos=True)
    if p.n > 1:
        sampling.n = p.n
    try:
        async for r in stub.Generate(pb.GenerateRequest(tokens=pb.TokenIds(ids=prompt.ids), sampling=sampling)):
            sample = out.sample(r.index)
            if r.token_ids:
                sample.arrive(list(r.token_ids))
            if r.finish_reason:
                sample.finish = V1_FINISH[r.finish_reason]
                sample.usage = (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.cached_tokens)
    except grpc.aio.AioRpcError as exc:
        out.error = f"{exc.code().name}: {exc.details()}"
    return out


async def vllm_request(stub: vllm_engine_pb2_grpc.VllmEngineStub, prompt: Prompt, p: Params) -> Outcome:
    out = Outcome()
    sampling = vllm.SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, seed=p.seed, n=p.n, ignore_eos=True
    )
    request = vllm.GenerateRequest(
        request_id=os.urandom(8).hex(),
        tokenized=vllm.TokenizedInput(input_ids=prompt.ids),
        sampling_params=sampling,
        stream=True,
    )
    try:
        async for r in stub.Generate(request):
            if r.HasField("chunk") and r.chunk.token_ids:
                out.sample(r.chunk.index).arrive(list(r.chunk.token_ids))
            elif r.HasField("complete"):
                c = r.complete
                sample = out.sample(c.index)
                sample.finish = c.finish_reason
                sample.usage = (c.prompt_tokens, c.completion_tokens, c.cached_tokens)
    except grpc.aio.AioRpcError as exc:
        out.error = f"{exc.code().name}: {exc.details()}"
    return out


async def openai_request(client: openai.AsyncOpenAI, model: str, prompt: Prompt, p: Params) -> Outcome:
    """/v1/completions streamed; usage comes once for the request (prompt counted once), so n = 1 only."""
    out = Outcome()
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt.text, max_tokens=p.max_tokens, temperature=p.temperature, seed=p.seed,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        async for chunk in stream:
            for choice in chunk.choices:
                sample = out.sample(choice.index)
                if choice.text:
                    sample.arrive()
                sample.finish = choice.finish_reason or sample.finish
            if chunk.usage:
                details = chunk.usage.prompt_tokens_details
                cached = details.cached_tokens if details and details.cached_tokens else 0
                out.sample(0).usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens, cached)
    except openai.APIError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def wave(send, jobs: list[tuple[Prompt, Params]], concurrency: int) -> tuple[list[Outcome], float]:
    """Every job, at most `concurrency` in flight (a request's clock starts once it holds a slot)."""
    slots = asyncio.Semaphore(concurrency)

    async def limited(prompt: Prompt, params: Params) -> Outcome:
        async with slots:
            return await send(prompt, params)

    start = time.perf_counter()
    outcomes = await asyncio.gather(*(limited(*job) for job in jobs))
    return outcomes, time.perf_counter() - start


def summarize(outcomes: list[Outcome], duration: float, n: int = 1) -> dict:
    """Figures over the requests that ended well: output tokens/s, TTFT and ITL p50 / p99 in ms, and the usage;
    a request's prompt counted once (from its first sample), as OpenAI's usage counts it, its samples' outputs
    each."""
    ok = [o for o in outcomes if o.ok(n)]
    samples = [s for o in ok for s in o.samples.values()]
    firsts = [o.samples[min(o.samples)] for o in ok]
    output = sum(s.usage[1] for s in samples)

    def ms(values: list[float]) -> tuple[float, float]:
        return tuple(float(np.percentile(np.asarray(values) * 1000, q)) for q in (50, 99)) if values else (0.0, 0.0)

    return {
        "failed": len(outcomes) - len(ok),
        "errors": sorted({o.error for o in outcomes if o.error}),
        "tps": output / duration,
        "prompt": sum(s.usage[0] for s in firsts),
        "cached": sum(s.usage[2] for s in firsts),
        "output": output,
        "per_message": output / max(sum(len(s.arrivals) for s in samples), 1),  # tokens a token-carrying message
        "ttft": ms([s.arrivals[0] - s.sent for s in samples if s.arrivals]),
        "itl": ms([b - a for s in samples for a, b in zip(s.arrivals, s.arrivals[1:])]),
    }


def word_prompts(tokenizer, rng: random.Random, count: int, length: int) -> list[Prompt]:
    """Random lower-case words, one token each, whose text tokenizes back to exactly their ids."""
    tokens = tokenizer.convert_ids_to_tokens(range(tokenizer.vocab_size))
    words = [
        i for i, t in enumerate(tokens) if t and t[0] == "Ġ" and t[1:].isascii() and t[1:].isalpha() and t[1:].islower()
    ]
    prompts: list[Prompt] = []
    while len(prompts) < count:
        ids = [rng.choice(words) for _ in range(length)]
        text = tokenizer.decode(ids)
        if tokenizer.encode(text, add_special_tokens=True) == ids:
            prompts.append(Prompt(ids, text))
    return prompts


async def engine_held(
    stub: pb_grpc.InferenceStub, work: Awaitable[T], every: float = 0.25
) -> tuple[T, list[tuple[int, int]]]:
    """`work`'s result, and what the engine held every `every` s meanwhile: (running sequences, waiting sequences
    and queued requests). What a path lets through to the engine, and how many it batches."""
    held: list[tuple[int, int]] = []

    async def poll() -> None:
        while True:
            i = await stub.Info(pb.InfoRequest())
            held.append((i.running_requests, i.waiting_requests + i.queued_requests))
            await asyncio.sleep(every)

    poller = asyncio.create_task(poll())
    try:
        return await work, held
    finally:
        poller.cancel()


def wait_until_served(url: str, proc: subprocess.Popen) -> str:
    """The model's name once a completion goes through the gateway (it lists the model before it is ready)."""
    deadline = time.monotonic() + READY_SECONDS
    while True:
        try:
            model = json.load(urllib.request.urlopen(f"{url}/v1/models", timeout=10))["data"][0]["id"]
            probe = json.dumps({"model": model, "prompt": "Hi", "max_tokens": 1}).encode()
            request = urllib.request.Request(f"{url}/v1/completions", probe, {"content-type": "application/json"})
            if json.load(urllib.request.urlopen(request, timeout=READY_SECONDS))["choices"]:
                return model
        except (OSError, LookupError, ValueError):  # not listening yet, no model yet, or 503 while it registers
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the gateway never served the model")
        time.sleep(0.2)
