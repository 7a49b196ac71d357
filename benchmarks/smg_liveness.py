"""smg's liveness veto on this machine's CPU: what a long prefill on one replica does to the fleet's routing.

A measurement run by hand: it prints what happened, never asserts. Run on an otherwise idle machine:

    .venv/bin/python benchmarks/smg_liveness.py [--replicas 2] [--long-tokens 2000] [--wedge-secs 3 60]

smg 1.13 stops routing to a worker that has sent no token for --worker-wedge-secs (3 s by default) while requests
pile up on it ("Worker vetoed by liveness ... wedged" in its log). For each --wedge-secs value, a fresh fleet:
`--replicas` `lmgate serve` replicas (the machine's cores split between them) behind deploy/smg-fleet.sh with
that --worker-wedge-secs. Conversations are pinned with x-smg-routing-key until `--conversations` of them sit on
one replica, the busy one. Then the first conversation's next turn pastes a document of `--long-tokens` words,
and while the busy replica prefills it the other pinned conversations go on turn by turn (a client waits for
each reply) and a new stateless request comes every `--every` seconds, for `--seconds`. Printed: each request
(its start, HTTP status, the replica smg routed it to from its x-smg-routed-worker-id header, time to first
token, prompt and cached tokens); smg's liveness, overload and health-probe log lines, stamped as they reach
this script (smg writes them a little late); and a summary: the pinned turns that moved to another replica than
their conversation's turn before (their cached history left behind), the stateless requests per replica, errors.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import grpc
import openai

from lmgate.engine.machine.threads import available_cpus
from lmgate.v1 import lmgate_pb2 as pb
from lmgate.v1 import lmgate_pb2_grpc as pb_grpc

# tests/serving.py, shared with the tests: a module of that directory, as this file is of its own
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from serving import free_port, serve_process  # noqa: E402

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "smg-fleet.sh"
SMG = os.path.join(os.path.dirname(sys.executable), "smg")
MODEL = "SmolLM2-135M-Instruct.Q4_1"  # the embedded model's name behind the gateway
READY_SECONDS = 120  # a guard against a gateway that never serves, not a performance bound
WORDS = "river stone cloud apple window garden silver engine yellow market".split()


@dataclass(slots=True)
class Outcome:
    kind: str  # "long", "pinned", "stateless"
    key: str
    start: float  # seconds since the load began
    status: int = 0
    worker: str = ""
    ttft: float | None = None
    seconds: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""


class Gateway:
    """deploy/smg-fleet.sh in front of `addresses`, its log lines stamped as they arrive."""

    def __init__(self, addresses: list[str], wedge_secs: int, more: list[str]) -> None:
        port = free_port()
        env = {**os.environ, "SMG": SMG, "SMG_PORT": str(port), "SMG_METRICS_PORT": str(free_port())}
        flags = ["--worker-wedge-secs", str(wedge_secs), "--log-json", "--log-level", "info", *more]
        self.proc = subprocess.Popen(
            ["sh", str(DEPLOY), *addresses, "--", *flags], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        self.url = f"http://127.0.0.1:{port}"
        self.lines: list[tuple[float, dict]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                self.lines.append((time.monotonic(), json.loads(raw)))
            except ValueError:  # the start-up banner, or a usage error
                self.lines.append((time.monotonic(), {"message": raw.decode(errors="replace").strip()}))

    def wait_until_served(self) -> None:
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", timeout=READY_SECONDS, max_retries=0)
        deadline = time.monotonic() + READY_SECONDS
        while True:
            try:
                client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
                return
            except openai.APIError:  # not listening yet, or 503 while it registers the workers and the tokenizer
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    said = [line.get("message", "") for _, line in self.lines if line.get("level") != "INFO"]
                    raise RuntimeError(f"the gateway never served ({self.proc.poll()}): {said[-5:]}") from None
                time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def text(seed: int, words: int) -> str:
    """`words` words, different for each seed (about one token each)."""
    return " ".join(WORDS[(seed * 7 + i * (seed % 5 + 1)) % len(WORDS)] for i in range(words))


def chat(url: str, key: str, messages: list[dict], max_tokens: int, t0: float, kind: str) -> tuple[Outcome, str]:
    """One streamed chat completion; its outcome and the reply's text."""
    out = Outcome(kind, key, time.monotonic() - t0)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600, max_retries=0)
    headers = {"x-smg-routing-key": key} if key else {}
    reply = []
    try:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_headers=headers,
        )  # fmt: skip
        out.status, out.worker = raw.http_response.status_code, raw.headers.get("x-smg-routed-worker-id", "")
        for chunk in raw.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                if out.ttft is None:
                    out.ttft = time.monotonic() - t0 - out.start
                reply.append(chunk.choices[0].delta.content)
            if chunk.usage:
                out.prompt_tokens = chunk.usage.prompt_tokens
                details = chunk.usage.prompt_tokens_details
                out.cached_tokens = (details.cached_tokens or 0) if details else 0
    except openai.APIStatusError as err:
        out.status, out.error = err.status_code, str(err)[:160]
    except openai.APIError as err:
        out.error = repr(err)[:160]
    out.seconds = time.monotonic() - t0 - out.start
    return out, "".join(reply)


def pin_conversations(url: str, count: int) -> tuple[str, dict[str, list[dict]]]:
    """Conversations started (one turn each) until `count` of them are pinned to one replica: that replica's
    worker URL and its conversations' messages so far."""
    placed: dict[str, dict[str, list[dict]]] = {}
    for i in range(8 * count):
        messages = [{"role": "user", "content": f"Conversation {i}. " + text(i, 120) + " Summarise that."}]
        out, reply = chat(url, f"conv-{i}", messages, 8, time.monotonic(), "pin")
        placed.setdefault(out.worker, {})[f"conv-{i}"] = [*messages, {"role": "assistant", "content": reply}]
        busy = max(placed, key=lambda w: len(placed[w]))
        if len(placed[busy]) == count:
            return busy, placed[busy]
    raise RuntimeError(f"no replica got {count} of {8 * count} conversations: {placed.keys()}")


def load(url: str, conversations: dict[str, list[dict]], args: argparse.Namespace) -> tuple[list[Outcome], float]:
    """The long turn, the pinned conversations' next turns and the stateless requests; their outcomes and the
    monotonic time the load began."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    t0 = time.monotonic()

    def record(out: Outcome) -> None:
        with lock:
            outcomes.append(out)

    first, *others = conversations
    document = conversations[first] + [{"role": "user", "content": text(99, args.long_tokens) + " Summarise."}]
    threads = [threading.Thread(target=lambda: record(chat(url, first, document, 16, t0, "long")[0]))]

    def converse(key: str, delay: float) -> None:
        time.sleep(delay)  # the conversations' turns spread over the load's time
        messages = conversations[key]
        turn = 0
        while time.monotonic() - t0 < args.seconds:
            turn += 1
            messages = [*messages, {"role": "user", "content": f"Turn {turn}: " + text(turn, 12) + "?"}]
            out, reply = chat(url, key, messages, 12, t0, "pinned")
            record(out)
            messages = [*messages, {"role": "assistant", "content": reply}]
            time.sleep(args.every)

    def stateless(i: int) -> None:
        messages = [{"role": "user", "content": f"Request {i}: " + text(1000 + i, 40)}]
        record(chat(url, "", messages, 12, t0, "stateless")[0])

    threads[0].start()
    time.sleep(0.5)  # the long turn first
    spread = args.seconds / max(1, len(others))
    threads += [threading.Thread(target=converse, args=(key, i * spread)) for i, key in enumerate(others)]
    for t in threads[1:]:
        t.start()
    i = 0
    while time.monotonic() - t0 < args.seconds:
        threads.append(threading.Thread(target=stateless, args=(i,)))
        threads[-1].start()
        i += 1
        time.sleep(args.every)
    for t in threads:
        t.join()
    return sorted(outcomes, key=lambda o: o.start), t0


def report(outcomes: list[Outcome], t0: float, gateway: Gateway, busy: str, names: dict[str, str]) -> None:
    for o in outcomes:
        ttft = "-" if o.ttft is None else f"{o.ttft:5.2f}"
        where = names.get(o.worker, o.worker or "-")
        print(
            f"  {o.start:6.2f}s {o.kind:9} {o.key:8} {o.status or '-':>3} {where:4} ttft {ttft:>5} s"
            f" done {o.start + o.seconds:6.2f}s prompt {o.prompt_tokens:5} cached {o.cached_tokens:5} {o.error}"
        )
    print("  smg's vetoes and failed health probes:")
    for stamp, line in gateway.lines:
        message = line.get("message", "")
        if stamp >= t0 and any(w in message.lower() for w in ("liveness", "overload", "veto", "health probe")):
            fields = {k: v for k, v in line.items() if k in ("worker_url", "reason", "cause", "contact_age_ms")}
            worker = names.get(str(fields.pop("worker_url", "")), "")
            print(f"    {stamp - t0:6.2f}s {worker:4} {message} {fields}")
    pinned = [o for o in outcomes if o.kind == "pinned" and o.status == 200]
    last = dict.fromkeys({o.key for o in pinned}, busy)
    moves = []  # turns that went to another replica than their conversation's previous turn
    for o in sorted(pinned, key=lambda o: o.start):
        if o.worker != last[o.key]:
            moves.append(f"{o.key} at {o.start:.2f}s {names[last[o.key]]}->{names[o.worker]} cached {o.cached_tokens}")
        last[o.key] = o.worker
    spread = {names.get(w, w): sum(o.worker == w for o in outcomes if o.kind == "stateless") for w in names}
    errors = [o for o in outcomes if o.status != 200]
    long = next(o for o in outcomes if o.kind == "long")
    print(
        f"  summary: long turn {long.prompt_tokens} prompt tokens, done after {long.seconds:.2f} s; {len(pinned)}"
        f" pinned turns, {len(moves)} moved {moves}; stateless per replica {spread}; errors {len(errors)};"
        f" longest TTFT {max((o.ttft or 0) for o in outcomes):.2f} s"
    )


def warm_up(address: str, tokens: int) -> None:
    """A prompt as long as the long turn over lmgate.v1, outside the gateway's view: the first steps of each size
    build their buffers and kernels (seconds on a CPU), which would otherwise land in the measured prefill."""
    ids = [100 + (i * 7919) % 40000 for i in range(tokens)]
    with grpc.insecure_channel(address) as channel:
        request = pb.GenerateRequest(tokens=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(max_new_tokens=2))
        for _ in pb_grpc.InferenceStub(channel).Generate(request):
            pass
    with grpc.insecure_channel(address) as channel:  # and out of the prefix cache again
        pb_grpc.AdminStub(channel).Sleep(pb.SleepRequest(level=1))
        pb_grpc.AdminStub(channel).Wakeup(pb.WakeupRequest())


@contextlib.contextmanager
def fleet(args: argparse.Namespace, threads: int, wedge: int) -> Iterator[tuple[Gateway, dict]]:
    """`count` fresh replicas, warmed up, behind a fresh gateway: it and the replicas' names by worker URL."""
    replicas: list[tuple[subprocess.Popen, str]] = []
    gateway = None
    try:
        for i in range(args.replicas):
            replicas.append(serve_process("--replica-id", f"r{i}", "--threads", str(threads), "--kv-cache-tokens",
                                          "16384", "--log-level", "WARNING", *args.serve_flags.split()))  # fmt: skip
            warm_up(replicas[-1][1], args.long_tokens)
        gateway = Gateway([address for _, address in replicas], wedge, args.smg_flags.split())
        gateway.wait_until_served()
        yield gateway, {f"grpc://{address}": f"r{i}" for i, (_, address) in enumerate(replicas)}
    finally:
        if gateway is not None:
            gateway.stop()
        for proc, _ in replicas:
            proc.terminate()
            proc.wait()


def machine() -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    info = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in lscpu)}
    return f"`lscpu` {info.get('Model name', '?')}, {available_cpus()} cores"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--wedge-secs", type=int, nargs="+", default=[3, 60], help="smg --worker-wedge-secs values")
    ap.add_argument("--long-tokens", type=int, default=2000, help="words in the long turn (about one token each)")
    ap.add_argument("--conversations", type=int, default=6, help="pinned to the busy replica, the long one among them")
    ap.add_argument("--seconds", type=float, default=10.0, help="how long new requests come")
    ap.add_argument("--every", type=float, default=0.4, help="seconds between requests (and between turns)")
    ap.add_argument("--serve-flags", default="", help="more `lmgate serve` flags for every replica")
    ap.add_argument("--smg-flags", default="", help="more `smg launch` flags, after deploy/smg-fleet.sh's own")
    args = ap.parse_args()

    threads = max(1, available_cpus() // args.replicas)
    print(f"{machine()}; smg {importlib.metadata.version('smg')}; {args.replicas} replicas of --threads {threads}")
    print(f"a {args.long_tokens}-word turn; a request every {args.every} s for {args.seconds} s; smg {args.smg_flags}")
    print(f"load average before: {os.getloadavg()[0]:.2f} (other work on the machine slows every prefill)")
    for wedge in args.wedge_secs:
        with fleet(args, threads, wedge) as (gateway, names):
            busy, conversations = pin_conversations(gateway.url, args.conversations)
            print(f"\n--worker-wedge-secs {wedge}: conversations {list(conversations)} pinned to {names[busy]}")
            outcomes, t0 = load(gateway.url, conversations, args)
            report(outcomes, t0, gateway, busy, names)


if __name__ == "__main__":
    main()
