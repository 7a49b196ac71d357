"""GRPO on the embedded SmolLM2-135M-Instruct, with lmgate as the rollout server: a whole RL loop in one file.

The task has a verifiable reward: small sums ("What is 3 + 4? Answer with the number only."). A completion whose
first integer is the sum earns 1; one that names the sum later, 0.2 (partial credit); anything else 0. Each step:

1. rollout: `--prompts-per-step` prompts, `--n` samples each, drawn by lmgate at temperature 1 with the raw
   log-probability of every sampled token (the model's own distribution: what the trainer recomputes);
2. rewards, and advantages normalized within each prompt's group of samples (GRPO);
3. the PPO-clip loss with the rollout's log-probabilities as the old policy's, ratio = exp(trainer - rollout),
   and one AdamW step;
4. the new weights into the server, as version "step-<k>", inside a pause that keeps what runs: the tensor
   stream as the client sends it by default (`--sync tensors`: its bytes handed over in /dev/shm where the
   server's Info says it reads this machine's, else in chunks over gRPC), always through /dev/shm (`--sync
   shm`), or broadcast over a torch.distributed gloo group (`--sync gloo`).

The trainer is transformers on the CPU, loaded from the same GGUF as the server. The server is `lmgate serve
--dtype float32 --weights float`, started here as a child process, or the one at `--target host:port`. Each
step prints the mean reward, the mean |trainer - rollout| log-prob gap on the sampled tokens (both hold the
same weights then, so it stays below 1e-5; more means the ratio is off), the sync's seconds and the version served.

    .venv/bin/python examples/rl_loop.py                 # 10 steps, about two minutes on 2 CPU cores
    .venv/bin/python examples/rl_loop.py --sync gloo --target 127.0.0.1:50051
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import transformers

from lmgate.client import Client
from lmgate.client.weight_group import WeightGroup
from lmgate.engine.loading.loader import embedded_model_path

# float weights: step 0's rollouts then match the trainer's float copy of the GGUF (pushed ones serve in float anyway)
SERVE = [sys.executable, "-m", "lmgate.client.cli", "serve", "--port", "0", "--dtype", "float32", "--weights", "float"]
QUESTION = "What is {a} + {b}? Answer with the number only."
CLIP = 0.2  # PPO's clip range on the importance ratio


@dataclass(frozen=True, slots=True)
class Problem:
    question: str
    prompt_ids: list[int]  # the chat-templated question, tokenized here: the trainer and the server see the same ids
    answer: int


@dataclass(slots=True)
class Sample:
    token_ids: list[int]
    logprobs: list[float]  # the rollout's (old policy's) log-probability of each sampled token
    text: str = ""
    reward: float = 0.0
    weight_version: str = ""  # the version that drew it


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt: one GRPO group")
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument(
        "--sync",
        choices=("tensors", "shm", "gloo"),
        default="tensors",
        help="the tensor stream (the client's choice of chunks or /dev/shm); through /dev/shm; a gloo group",
    )
    ap.add_argument(
        "--target", default=None, help="host:port of a server of the embedded model, --dtype float32 --weights float"
    )
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def start_server() -> tuple[subprocess.Popen, str]:
    """`lmgate serve` on a free port, its KV cache sized for this loop's few short sequences."""
    proc = subprocess.Popen(
        [*SERVE, "--kv-cache-tokens", "8192", "--log-level", "WARNING"], stdout=subprocess.PIPE, text=True
    )
    line = proc.stdout.readline()  # "lmgate serving <model> on <host>:<port> (ready in ...)"
    if " on " not in line:
        proc.kill()
        raise RuntimeError(f"lmgate serve did not start: {line!r}")
    return proc, line.split(" on ")[1].split()[0]


def load_trainer(lr: float) -> tuple[torch.nn.Module, transformers.PreTrainedTokenizerBase, torch.optim.Optimizer]:
    """The policy as the trainer holds it: the server's GGUF, dequantized to float32 by transformers."""
    path = embedded_model_path()
    where = {"pretrained_model_name_or_path": os.path.dirname(path), "gguf_file": os.path.basename(path)}
    tokenizer = transformers.AutoTokenizer.from_pretrained(**where)
    model = transformers.AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)
    return model.train(), tokenizer, torch.optim.AdamW(model.parameters(), lr=lr)


def make_problems(rng: random.Random, tokenizer, count: int) -> list[Problem]:
    """Fresh sums each step, tokenized by the trainer's chat template and sent as token ids: both sides then
    score the very same prompt."""
    problems = []
    for _ in range(count):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        question = QUESTION.format(a=a, b=b)
        messages = [{"role": "user", "content": question}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        problems.append(Problem(question, list(ids), a + b))
    return problems


def reward(text: str, answer: int) -> float:
    """1 if the first integer is the sum; 0.2 if the sum comes later (a dense signal for a small model); else 0."""
    numbers = [int(x) for x in re.findall(r"-?\d+", text)]
    if numbers and numbers[0] == answer:
        return 1.0
    return 0.2 if answer in numbers else 0.0


def rollout(client: Client, problem: Problem, n: int, max_new_tokens: int, seed: int) -> list[Sample]:
    """One group: `n` samples of one prompt in one request (lmgate computes the prompt once). Temperature 1 and
    no filters, so the raw log-probabilities are those of the distribution the tokens were drawn from."""
    samples = [Sample([], []) for _ in range(n)]
    deltas = client.generate(
        token_ids=problem.prompt_ids,
        n=n,
        temperature=1.0,
        max_new_tokens=max_new_tokens,
        logprobs=1,
        logprobs_mode="raw",
        seed=seed,
    )
    for delta in deltas:
        s = samples[delta.index]
        s.token_ids += delta.token_ids
        s.logprobs += [lp["logprob"] for lp in delta.logprobs]
        s.text += delta.text
        s.weight_version = delta.weight_version or s.weight_version
    for s in samples:
        s.reward = reward(s.text, problem.answer)
    return samples


def advantages(group: list[Sample]) -> torch.Tensor:
    """GRPO: each sample's reward against its group's mean, in units of the group's spread. A group whose
    rewards are all equal teaches nothing (all zero)."""
    r = torch.tensor([s.reward for s in group])
    return (r - r.mean()) / (r.std() + 1e-4)


def token_logprobs(model, problem: Problem, group: list[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's log-probability of each sampled token, [n, longest], and the mask of real tokens. Rows are
    padded on the right: causal attention keeps padding out of every real position."""
    width = max(len(s.token_ids) for s in group)
    ids = torch.zeros(len(group), len(problem.prompt_ids) + width, dtype=torch.long)
    mask = torch.zeros(len(group), width)
    for i, s in enumerate(group):
        ids[i, : len(problem.prompt_ids) + len(s.token_ids)] = torch.tensor(problem.prompt_ids + s.token_ids)
        mask[i, : len(s.token_ids)] = 1
    logits = model(ids).logits[:, len(problem.prompt_ids) - 1 : -1].float()
    targets = ids[:, len(problem.prompt_ids) :]
    return torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0], mask


def grpo_loss(new: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """PPO-clip per token, averaged over each sample's tokens, then over the samples (GRPO's sequence mean)."""
    ratio = torch.exp(new - old)
    clipped = torch.clamp(ratio, 1 - CLIP, 1 + CLIP)
    per_token = -torch.minimum(ratio * adv[:, None], clipped * adv[:, None])
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()


def train_step(model, optimizer, problems: list[Problem], groups: list[list[Sample]]) -> float:
    """One optimizer step over every group (their gradients accumulated, one group in memory at a time); returns
    the mean |trainer - rollout| log-prob gap on the sampled tokens, measured on the way."""
    optimizer.zero_grad()
    gaps, tokens = 0.0, 0
    for problem, group in zip(problems, groups):
        new, mask = token_logprobs(model, problem, group)
        old = torch.zeros_like(new)
        for i, s in enumerate(group):
            old[i, : len(s.logprobs)] = torch.tensor(s.logprobs)
        gaps += ((new.detach() - old).abs() * mask).sum().item()
        tokens += int(mask.sum().item())
        (grpo_loss(new, old, advantages(group), mask) / len(groups)).backward()
    optimizer.step()
    return gaps / max(tokens, 1)


class Sync:
    """Brings the trainer's weights into the server: the tensor stream (its bytes in chunks, or in a file of
    /dev/shm it names: the client's choice, or that file always), or a gloo group made once for the run."""

    def __init__(self, client: Client, how: str, stack: contextlib.ExitStack) -> None:
        self.client = client
        self.shared_memory = True if how == "shm" else None
        self.group = stack.enter_context(WeightGroup(client, "127.0.0.1", 0)) if how == "gloo" else None

    def push(self, model: torch.nn.Module, version: str) -> str:
        """Under a KEEP pause: anything still running is frozen, then goes on with the new weights."""
        state = model.state_dict()
        with self.client.pause("keep"):
            if self.group is not None:
                return self.group.push(state, version)
            return self.client.update_weights(state, version=version, shared_memory=self.shared_memory)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    with contextlib.ExitStack() as stack:
        address = args.target
        if address is None:
            proc, address = start_server()
            stack.callback(proc.wait)
            stack.callback(proc.terminate)
        model, tokenizer, optimizer = load_trainer(args.lr)
        client = stack.enter_context(Client(address))
        client.wait_ready(120)
        sync = Sync(client, args.sync, stack)
        print(f"server {address} serving version {client.info().weight_version!r}; sync by {args.sync}", flush=True)
        pool = stack.enter_context(ThreadPoolExecutor(args.prompts_per_step))
        for step in range(1, args.steps + 1):
            started = time.perf_counter()
            problems = make_problems(rng, tokenizer, args.prompts_per_step)
            seeds = [args.seed * 1_000_000 + step * 1_000 + i * args.n for i in range(len(problems))]
            groups = list(
                pool.map(lambda p, s: rollout(client, p, args.n, args.max_new_tokens, s), problems, seeds)
            )  # every group at once: the server batches them
            rolled = time.perf_counter()
            gap = train_step(model, optimizer, problems, groups)
            trained = time.perf_counter()
            sync.push(model, f"step-{step}")
            seconds = {"rollout": rolled - started, "train": trained - rolled, "sync": time.perf_counter() - trained}
            report(step, problems, groups, gap, seconds, client.info().weight_version)


def report(step: int, problems: list[Problem], groups: list[list[Sample]], gap: float, seconds: dict, served: str):
    """One line a step, and one sample to read; `by` names the version that drew the step's samples."""
    rewards = [s.reward for g in groups for s in g]
    drawn_by = ",".join(sorted({s.weight_version for g in groups for s in g}))
    print(
        f"step {step}: reward {sum(rewards) / len(rewards):.3f}  |logprob gap| {gap:.1e}  "
        f"rollout {seconds['rollout']:.1f}s (by {drawn_by})  train {seconds['train']:.1f}s  "
        f"sync {seconds['sync']:.2f}s  serving {served}",
        flush=True,
    )
    print(f"  {problems[0].question} {groups[0][0].text!r}: reward {groups[0][0].reward}", flush=True)


if __name__ == "__main__":
    main()
