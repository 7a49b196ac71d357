"""deploy/smg-fleet.sh for real: the Shepherd Model Gateway (the `smg` binary) in front of two lmgate replicas, called
through the OpenAI SDK. Sticky routing on x-smg-routing-key, and a sleeping replica out of routing until it wakes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc

from lmgate.engine.config import EngineConfig
from lmgate.v1 import lmgate_pb2 as pb
from lmgate.v1 import lmgate_pb2_grpc as pb_grpc
from tests.serving import ServerThread, free_port

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "smg-fleet.sh"
SMG = os.path.join(os.path.dirname(sys.executable), "smg")  # the venv's, beside its python
GUARD = 120  # seconds: a guard against a hang, never a timing
MODEL = "SmolLM2-135M-Instruct.Q4_1"  # the embedded model's name to the gateway's clients


@pytest.fixture(scope="module")
def replicas(checkpoint):
    """Two replicas of their own, small KV caches: these tests put one to sleep."""
    started = [ServerThread(EngineConfig(dtype="float32", kv_cache_tokens=2048), checkpoint) for _ in range(2)]
    yield started
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def fleet(replicas):
    """deploy/smg-fleet.sh in front of the replicas, with its own flags, once both serve through it: its URL and its
    metrics URL."""
    if not os.path.exists(SMG):
        pytest.skip("the smg gateway is not installed (its wheel exists for Linux x86_64 only)")
    port = free_port()
    env = {**os.environ, "SMG": SMG, "SMG_PORT": str(port), "SMG_METRICS_PORT": str(free_port())}
    proc = subprocess.Popen(
        ["sh", str(DEPLOY), *(r.address for r in replicas), "--", "--log-level", "warn"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: all(workers(url).values()) and len(workers(url)) == 2 and completes(url), proc)
        yield url, f"http://127.0.0.1:{env['SMG_METRICS_PORT']}"
    finally:
        proc.kill()  # SIGTERM would wait out smg's 5 s settle window for load balancers: not under test here
        proc.wait(GUARD)


def workers(url: str) -> dict[str, bool]:
    """The gateway's workers (grpc://host:port) and whether it routes to them now."""
    listing = json.load(urllib.request.urlopen(f"{url}/workers", timeout=GUARD))
    return {w["url"]: w["is_healthy"] and w["status"] == "ready" for w in listing["workers"]}


def completes(url: str) -> bool:
    """Whether a completion goes through: the gateway lists the model before its tokenizer has come."""
    probe = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 1}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", probe, {"content-type": "application/json"})
    return bool(json.load(urllib.request.urlopen(request, timeout=GUARD))["choices"])


def wait_until(condition, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + GUARD
    while True:
        try:
            if condition():
                return
        except OSError:  # not listening yet, or 503 while it registers the workers and their tokenizer
            pass
        assert proc is None or proc.poll() is None, "the gateway exited"
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.2)


def worker_requests(metrics: str, worker: str) -> float:
    """smg_worker_requests_total of one worker: the requests the gateway sent it, retried ones too."""
    text = urllib.request.urlopen(f"{metrics}/metrics", timeout=GUARD).read().decode()
    prefix = "smg_worker_requests_total{"
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(prefix) and f'worker="{worker}"' in line
    )


@pytest.fixture(scope="module")
def openai_client(fleet):
    import openai

    return openai.OpenAI(base_url=f"{fleet[0]}/v1", api_key="unused", timeout=GUARD, max_retries=0)


def chat(client, messages: list[dict], key: str | None = None):
    """A greedy chat completion: the reply and the worker the gateway routed it to (grpc://host:port)."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0,
        extra_headers={"x-smg-routing-key": key} if key else None,
    )  # fmt: skip
    return raw.parse(), raw.headers["x-smg-routed-worker-id"]


def test_sticky_routing_keeps_a_conversations_turns_on_its_replica(replicas, openai_client):
    """Each turn of a conversation goes where its key's first request went and finds the earlier turns there in
    the prefix cache (every full block of the previous prompt, not only the chat template's system prompt)."""
    block = replicas[0].engine.config.block_size
    messages = [{"role": "user", "content": "rivers " * 60 + "Tell me about rivers."}]
    reply, home = chat(openai_client, messages, "conversation-1")
    for _ in range(2):
        messages += [{"role": "assistant", "content": reply.choices[0].message.content}]
        messages += [{"role": "user", "content": "And why?"}]
        previous = reply.usage.prompt_tokens
        reply, there = chat(openai_client, messages, "conversation-1")
        assert there == home
        assert reply.usage.prompt_tokens_details.cached_tokens >= previous // block * block > block


def test_the_routing_key_wins_over_cache_aware_routing(openai_client):
    """Without the key, prompts spread over both replicas; with it, each goes to the key's replica, the same
    prompt too: prompts until one without the key went to the other replica, so the header is what decided."""
    _, home = chat(openai_client, [{"role": "user", "content": "mountains " * 40}], "conversation-2")
    for i in range(16):
        prompt = f"{i * 7919} apples and {i} pears"
        unkeyed = openai_client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=2)
        keyed = openai_client.completions.with_raw_response.create(
            model=MODEL, prompt=prompt, max_tokens=2, extra_headers={"x-smg-routing-key": "conversation-2"}
        )
        assert keyed.headers["x-smg-routed-worker-id"] == home
        if unkeyed.headers["x-smg-routed-worker-id"] != home:
            return
    pytest.fail("cache-aware routing sent no prompt to the other replica: nothing shown")


def test_a_sleeping_replica_is_unhealthy_and_gets_no_work_until_it_wakes(replicas, fleet, openai_client):
    """Asleep (Admin.Sleep), a replica answers HealthCheck unhealthy; the gateway's health checks take it out of
    routing, every completion is served by the other replica and the gateway sends it nothing, not even a try
    (its request counter stands still); after Wakeup it is back in routing and takes work again."""
    url, metrics = fleet
    awake, sleeper = (f"grpc://{r.address}" for r in replicas)
    admin = pb_grpc.AdminStub(replicas[1].channel())
    admin.Sleep(pb.SleepRequest(level=1))  # over lmgate.v1 on loopback: no admin token needed
    try:
        health = vllm_grpc.VllmEngineStub(replicas[1].channel()).HealthCheck(vllm.HealthCheckRequest())
        assert not health.healthy
        wait_until(lambda: workers(url) == {awake: True, sleeper: False})
        sent = worker_requests(metrics, sleeper)
        for i in range(6):  # all served by the other replica; the gateway does not even try the sleeping one
            reply, worker = chat(openai_client, [{"role": "user", "content": f"Question {i}: name a color."}])
            assert worker == awake and reply.choices[0].message.content
        assert worker_requests(metrics, sleeper) == sent
    finally:
        admin.Wakeup(pb.WakeupRequest())
    wait_until(lambda: workers(url) == {awake: True, sleeper: True})
    routed = []
    for i in range(12):  # prompts that share no prefix, so cache-aware routing is free to pick either replica
        prompt = f"{i * 104729 + 13} oranges"
        raw = openai_client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=2)
        routed.append(raw.headers["x-smg-routed-worker-id"])
    assert sleeper in routed  # back in service


def test_the_fleet_file_says_how_to_use_it():
    """Run with no replica, it prints its usage instead of starting a gateway with no workers."""
    done = subprocess.run(["sh", str(DEPLOY)], env={**os.environ, "SMG": SMG}, capture_output=True, text=True)
    assert done.returncode == 2 and "usage:" in done.stderr and "HOST:PORT" in done.stderr
