"""Structured outputs: a JSON schema's cost against the same requests unconstrained, in one run (a benchmark: it
prints figures, never asserts). Run on an otherwise idle machine:

    make bench-structured ARGS="--requests 64 --max-new-tokens 256"

One in-process engine with `lmgate serve`'s settings (the embedded model, --max-batched-tokens 512), the prefix
cache emptied (a level-1 sleep and wake-up) before each wave:
1. `--requests` chat requests, all at once, each asking for a customer record (nested object, arrays, enums,
   integer ranges, string patterns), temperature 0.7, seed 1000 + i, constrained by that JSON schema. A row ends
   when its JSON closes (or at `--max-new-tokens`), so rows have lengths of their own.
2. The same prompts and seeds unconstrained, `ignore_eos`, each row's max_new_tokens its constrained row's length:
   the same tokens in the same batch shapes, step by step, so the two waves' output tokens/s compare the steps
   and nothing else (their ratio is the issue's goal, >= 0.9).
3. (with `--full-side`) the same unconstrained at `--max-new-tokens` for every row, `ignore_eos`: a full batch
   to the end.
Output tokens/s counts the tokens each wave generated over its wall time. The step's own time at all rows is read
on the engine loop itself (its `step` and `_launch` wrapped on the instance, to time each step and see its batch),
over the steps that decoded one token for every row: the masks' cost is inside the constrained wave's.

Then, the engine idle: TTFT of one request whose schema is first seen (a description of its own, so the grammar
cache misses), of one whose schema is cached (the same text again) and of one unconstrained, each with a prompt of
its own; the compile alone. Last, the mask a step needs at all rows: `TokenMasks.fill` and `apply_token_mask` (on
a clone of the logits, as the sampler does; the clone timed apart) for matchers replayed into the constrained
wave's own outputs at 0, 25, 50 and 75% of their lengths, against the step's time measured in the waves.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import statistics
import subprocess
import threading
import time
import uuid

import lmgate.engine  # noqa: F401  (before torch: it sets OpenMP's wait policy, engine/__init__.py)
import jsonschema
import torch

from lmgate.engine.config import EngineConfig
from lmgate.engine.engine import Engine
from lmgate.engine.gateway.request import FinishReason
from lmgate.engine.machine.hardware import cpu_features
from lmgate.engine.machine.threads import available_cpus
from lmgate.engine.sampling.constraints import Constraint, ConstraintKind, TokenMasks, apply_token_mask
from lmgate.engine.sampling.sampler import SamplingParams

SERVE_BATCHED_TOKENS = 512  # `lmgate serve`'s default --max-batched-tokens
FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_bf16")
NAMES = ["Ana Ruiz", "Bo Chen", "Chloe Martin", "Dev Patel", "Emma Weber", "Femi Okafor", "Goro Sato", "Hana Novak"]
CITIES = ["Lyon", "Osaka", "Austin", "Leipzig", "Recife", "Porto", "Denver", "Kyoto"]


def record_schema(description: str) -> dict:
    """A customer record: nested object, arrays of enums and of objects, integer ranges, string patterns."""
    text = {"type": "string", "minLength": 1, "maxLength": 32}
    address = {
        "type": "object",
        "properties": {"street": text, "city": text, "country": {"enum": ["FR", "DE", "US", "JP", "BR", "PT"]}},
        "required": ["street", "city", "country"],
        "additionalProperties": False,
    }
    order = {
        "type": "object",
        "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
            "quantity": {"type": "integer", "minimum": 1, "maximum": 20},
        },
        "required": ["sku", "quantity"],
        "additionalProperties": False,
    }
    properties = {
        "id": {"type": "string", "pattern": "^C-[0-9]{4}$"},
        "name": text,
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org|net)$"},
        "status": {"enum": ["active", "suspended", "closed"]},
        "address": address,
        "tags": {"type": "array", "items": {"enum": ["new", "vip", "wholesale", "overdue"]}, "maxItems": 3},
        "orders": {"type": "array", "items": order, "minItems": 1, "maxItems": 3},
    }
    return {
        "description": description,
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def ask(i: int) -> list[dict]:
    name, city = NAMES[i % len(NAMES)], CITIES[i // len(NAMES) % len(CITIES)]
    return [
        {
            "role": "user",
            "content": f"Customer {i}: {name} from {city}. Reply with their record as JSON: id, name, age, email, "
            "status, address, tags and recent orders.",
        }
    ]


def json_schema(description: str) -> Constraint:
    return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(record_schema(description)))


class Row:
    """One request as its on_output callbacks saw it (the signal thread writes, the main thread reads after)."""

    def __init__(self) -> None:
        self.sent = time.perf_counter()
        self.ttft = 0.0
        self.token_ids: list[int] = []
        self.text = ""
        self.finish: FinishReason | None = None


def submit_all(engine: Engine, jobs: list[tuple[list[dict], SamplingParams]]) -> tuple[list[Row], float]:
    """Every job at once; each request's clock starts just before its own submit (a first-seen schema compiles
    there). The rows and the wall time until the last one ends."""
    rows, done = [], threading.Semaphore(0)

    def handler(row: Row):
        def handle(out) -> None:
            if out.token_ids and not row.token_ids:
                row.ttft = time.perf_counter() - row.sent
            row.token_ids += out.token_ids
            row.text += out.text
            if out.finished:
                row.finish = out.finish_reason
                done.release()

        return handle

    start = time.perf_counter()
    for prompt, params in jobs:
        row = Row()
        rows.append(row)
        engine.submit(prompt, params, on_output=handler(row))
    for _ in jobs:
        done.acquire()
    return rows, time.perf_counter() - start


class StepTimer:
    """Times an engine loop's steps and records each one's batch: (seconds, sequences, tokens computed). It wraps
    the loop's `step` and `_launch` on the instance; the loop's thread appends, the main thread reads between waves
    (the loop idle)."""

    def __init__(self, loop) -> None:
        self.steps: list[tuple[float, int, int]] = []
        step, launch = loop.step, loop._launch
        batch_shape = [0, 0]

        def timed_launch(batch, previous) -> None:
            batch_shape[:] = [len(batch.seqs), sum(seq.num_scheduled for seq in batch.seqs)]
            launch(batch, previous)

        def timed_step(requests) -> None:
            batch_shape[:] = [0, 0]
            start = time.perf_counter()
            step(requests)
            self.steps.append((time.perf_counter() - start, *batch_shape))

        loop.step, loop._launch = timed_step, timed_launch

    def full_batch(self, since: int, rows: int) -> tuple[float, int]:
        """Mean seconds of the steps after `since` that decoded one token for each of `rows` sequences, and their
        count."""
        times = [t for t, seqs, tokens in self.steps[since:] if seqs == tokens == rows]
        return (statistics.mean(times) if times else float("nan")), len(times)


def wave(engine: Engine, timer: StepTimer, jobs: list[tuple[list[dict], SamplingParams]]) -> dict:
    """One measured wave, the prefix cache emptied first."""
    engine.sleep(1)
    engine.wakeup()
    since = len(timer.steps)
    rows, seconds = submit_all(engine, jobs)
    output = sum(len(r.token_ids) for r in rows)
    return {
        "rows": rows,
        "seconds": seconds,
        "output": output,
        "tps": output / seconds,
        "ttft": sorted(r.ttft for r in rows),
        "step": timer.full_batch(since, len(jobs)),
        "stop": sum(r.finish is FinishReason.STOP for r in rows),
    }


def valid(rows: list[Row], schema: dict) -> int:
    count = 0
    for row in rows:
        try:
            jsonschema.validate(json.loads(row.text), schema)
            count += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return count


def ttft_probes(engine: Engine, probes: int, params: SamplingParams) -> dict[str, list[float]]:
    """The engine idle, one request at a time, a prompt of its own each (nothing from the prefix cache beyond the
    chat template's header): a first-seen schema, the same schema again, and no constraint."""
    found: dict[str, list[float]] = {"first-seen schema": [], "cached schema": [], "unconstrained": []}
    for k in range(probes):
        fresh = json_schema(f"A customer record, probe {uuid.uuid4()}")
        for j, (name, constraint) in enumerate(zip(found, (fresh, fresh, None))):
            rows, _ = submit_all(
                engine, [(ask(10_000 + 3 * k + j), dataclasses.replace(params, constraint=constraint))]
            )
            found[name].append(rows[0].ttft)
    return found


def compile_times(engine: Engine, count: int) -> tuple[list[float], list[float]]:
    """`GrammarCompiler.compile` of a first-seen schema, then of the same one again (a cache lookup), seconds."""
    grammars, first, again = engine.tokenizer.grammars, [], []
    for _ in range(count):
        constraint = json_schema(f"A customer record, compile {uuid.uuid4()}")
        for times in (first, again):
            start = time.perf_counter()
            grammars.compile(constraint)
            times.append(time.perf_counter() - start)
    return first, again


def mask_times(engine: Engine, constraint: Constraint, rows: list[Row], repeats: int) -> dict[float, tuple]:
    """At each fraction of the outputs' lengths: the median seconds of `TokenMasks.fill` for one matcher a row,
    replayed into that row's own tokens, of the clone of [rows, vocab] float logits the sampler makes, and of
    `apply_token_mask` on it; and how many matchers took their replay."""
    compiled = engine.tokenizer.grammars.compile(constraint)
    masks = TokenMasks(engine.tokenizer.grammars.vocab_size, rows=len(rows), threads=engine.threads_per_loop)
    logits = torch.randn(len(rows), engine.vocab_size)
    at = list(range(len(rows)))
    found = {}
    for fraction in (0.0, 0.25, 0.5, 0.75):
        matchers = [compiled.matcher() for _ in rows]
        replayed = sum(m.replay(r.token_ids[: int(fraction * len(r.token_ids))]) for m, r in zip(matchers, rows))
        times = []
        apply_token_mask(logits.clone(), masks.fill(matchers), at)  # unmeasured: first calls set up
        for _ in range(repeats):
            start = time.perf_counter()
            bitmask = masks.fill(matchers)
            filled = time.perf_counter()
            cloned = logits.clone()
            copied = time.perf_counter()
            apply_token_mask(cloned, bitmask, at)
            times.append((filled - start, copied - filled, time.perf_counter() - copied))
        found[fraction] = (*(statistics.median(column) for column in zip(*times)), replayed)
    return found


def machine() -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    info = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in lscpu)}
    flags = [f for f in FLAGS if f in cpu_features().flags]
    return (
        f"`lscpu` {info.get('Model name', cpu_features().name)} family {info.get('CPU family', '?')} model "
        f"{info.get('Model', '?')}, {available_cpus()} cores, {' '.join(flags) or 'none of ' + '/'.join(FLAGS)}"
    )


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def percentile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def report(args, engine: Engine, load: tuple, waves: dict, probes: dict, compiles: tuple, masks: dict) -> None:
    print(f"\nmachine: {machine()}; load average (1 min) {load[0]:.2f} before, {load[1]:.2f} after")
    print(
        f"engine: in-process, lmgate serve's settings ({engine.dtype}, KV {engine.kv_dtype}, max batched tokens "
        f"{SERVE_BATCHED_TOKENS}, {engine.threads_per_loop} threads), "
        f"llguidance {importlib.metadata.version('llguidance')}"
    )
    print(
        f"workload: {args.requests} chat requests for a customer record, all at once, temperature "
        f"{args.temperature}, seeds {args.seed}.., max_new_tokens {args.max_new_tokens}"
    )
    print(
        f"{'wave':<34} {'out tokens':>10} {'wall s':>7} {'out tok/s':>9} {'TTFT p50':>9} {'p99':>7} "
        f"{'step ms at all rows':>19} {'stop':>5} {'valid':>5}"
    )
    for name, w in waves.items():
        step, steps = w["step"]
        print(
            f"{name:<34} {w['output']:10} {w['seconds']:7.1f} {w['tps']:9.1f} {ms(percentile(w['ttft'], 0.5)):>9} "
            f"{ms(percentile(w['ttft'], 0.99)):>7} {ms(step):>11} ({steps:3} steps) {w['stop']:5} {w.get('valid', '-'):>5}"
        )
    print("  (ms; stop: rows ended by their grammar or EOS, the rest by max_new_tokens; valid: parse and validate)")
    print(f"  a constrained output: {waves['json_schema']['rows'][0].text[:240]!r}")
    held, free = waves["json_schema"], waves["free, lengths matched"]
    print(
        f"output tok/s json_schema / free (same tokens): {held['tps']:.1f} / {free['tps']:.1f} = "
        f"{held['tps'] / free['tps']:.1%} (goal >= 90%)"
        + (f"; free at full length {waves['free, full length']['tps']:.1f}" if "free, full length" in waves else "")
    )
    line = ", ".join(f"{k} {ms(statistics.median(v))}" for k, v in probes.items())
    print(f"TTFT of one request alone, median of {args.probes} (ms): {line}")
    first, again = compiles
    print(
        f"compile alone: first-seen schema median {ms(statistics.median(first))} ms (max {ms(max(first))}), "
        f"cached {statistics.median(again) * 1e6:.0f} us"
    )
    n = args.requests
    for fraction, (fill, clone, apply, replayed) in masks.items():
        print(
            f"masks for {n} rows at {fraction:.0%} of their outputs: fill {ms(fill)} + clone {ms(clone)} + apply "
            f"{ms(apply)} = {ms(fill + clone + apply)} ms ({replayed} of {n} matchers replayed)"
        )
    mean = statistics.mean(sum(m[:3]) for m in masks.values())
    step_free, step_held = free["step"][0], held["step"][0]
    print(
        f"mask per step at {n} rows, mean over the positions: {ms(mean)} ms against a step of {ms(step_free)} ms "
        f"unconstrained ({mean / step_free:.1%}); the constrained wave's step {ms(step_held)} ms "
        f"({(step_held - step_free) * 1000:+.1f} ms)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64, help="concurrent requests a wave (and rows a mask)")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="enough for most records to close")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=1000, help="request i's seed is this + i")
    ap.add_argument("--full-side", action="store_true", help="also unconstrained at --max-new-tokens for every row")
    ap.add_argument("--probes", type=int, default=5, help="TTFT probes of each kind")
    ap.add_argument("--mask-repeats", type=int, default=20)
    args = ap.parse_args()

    load_before = os.getloadavg()[0]
    engine = Engine(EngineConfig(max_batched_tokens=SERVE_BATCHED_TOKENS))
    timer = StepTimer(engine.ranks.loops[0])
    try:
        constraint = json_schema("A customer record")
        warm = [
            (ask(20_000 + i), SamplingParams(max_new_tokens=16, constraint=json_schema("warm-up"))) for i in range(4)
        ]
        submit_all(engine, warm + [(p, SamplingParams(max_new_tokens=16)) for p, _ in warm])

        def params(i: int, **kw) -> SamplingParams:
            return SamplingParams(temperature=args.temperature, seed=args.seed + i, **kw)

        held = [
            (ask(i), params(i, max_new_tokens=args.max_new_tokens, constraint=constraint)) for i in range(args.requests)
        ]
        waves = {"json_schema": wave(engine, timer, held)}
        waves["json_schema"]["valid"] = valid(waves["json_schema"]["rows"], record_schema("A customer record"))
        lengths = [max(len(r.token_ids), 1) for r in waves["json_schema"]["rows"]]
        matched = [(ask(i), params(i, max_new_tokens=lengths[i], ignore_eos=True)) for i in range(args.requests)]
        waves["free, lengths matched"] = wave(engine, timer, matched)
        if args.full_side:
            full = [
                (ask(i), params(i, max_new_tokens=args.max_new_tokens, ignore_eos=True)) for i in range(args.requests)
            ]
            waves["free, full length"] = wave(engine, timer, full)
        probes = ttft_probes(engine, args.probes, SamplingParams(max_new_tokens=1))
        compiles = compile_times(engine, 20)
        masks = mask_times(engine, constraint, waves["json_schema"]["rows"], args.mask_repeats)
    finally:
        engine.shutdown()
    report(args, engine, (load_before, os.getloadavg()[0]), waves, probes, compiles, masks)


if __name__ == "__main__":
    main()
