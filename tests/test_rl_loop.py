"""examples/rl_loop.py as a real process against a real server, cut to two tiny steps: it exits 0, each step's
weights reach the server under their version ("step-1", "step-2"), and they change what the server computes.
Not that the reward rises: two steps of a few samples prove nothing about learning."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lmgate.client.client import Client
from lmgate.engine.config import EngineConfig
from tests.serving import ServerThread

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "rl_loop.py")
TINY = ["--steps", "2", "--prompts-per-step", "2", "--n", "4", "--max-new-tokens", "8", "--lr", "1e-4"]
PROMPT = [504, 3575, 282, 4649, 314]


# The tensor stream with its bytes in /dev/shm, and the gloo group: the stream in chunks differs from the
# first by the client's one keyword (tests/test_weight_push.py streams both), and a third run costs 22 s here.
SYNCS = ("shm", "gloo")


@pytest.fixture(scope="module")
def servers(checkpoint):
    """A server per sync, as the example's own would be (float weights, float32), in this process: each run
    pushes into its own."""
    started = {
        sync: ServerThread(EngineConfig(dtype="float32", weights="float", kv_cache_tokens=4096), checkpoint)
        for sync in SYNCS
    }
    yield started
    for s in started.values():
        s.stop()


def greedy_logprobs(address: str) -> list[float]:
    """The served model's log-probabilities along a greedy completion: any change of weights moves them."""
    with Client(address) as client:
        deltas = client.generate(token_ids=PROMPT, max_new_tokens=8, ignore_eos=True, logprobs=1)
        return [lp["logprob"] for d in deltas for lp in d.logprobs]


def test_rl_loop_pushes_each_steps_weights_as_its_version(servers):
    """Both syncs at once, each run a process of its own (most of a run is the trainer loading the GGUF in
    transformers, one core's work)."""
    before = {sync: greedy_logprobs(s.address) for sync, s in servers.items()}
    runs = {
        sync: subprocess.Popen(
            [sys.executable, EXAMPLE, "--target", s.address, "--sync", sync, *TINY],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for sync, s in servers.items()
    }
    try:
        for sync, run in runs.items():
            stdout, stderr = run.communicate(timeout=600)  # a guard against a hung run, not a performance bound
            assert run.returncode == 0, (sync, stderr[-4000:])
            assert "Traceback" not in stderr and " ERROR " not in stderr, (sync, stderr[-4000:])
            steps = [line for line in stdout.splitlines() if line.startswith("step ")]
            assert [line.split(":")[0] for line in steps] == ["step 1", "step 2"], (sync, stdout)
            assert "(by step-1)" in steps[1] and "serving step-2" in steps[1], (sync, steps)
            assert servers[sync].info().weight_version == "step-2"
            assert greedy_logprobs(servers[sync].address) != before[sync], sync
    finally:
        for run in runs.values():  # the other run, after a failed assertion
            run.kill()
            run.wait()
