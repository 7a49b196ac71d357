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


@pytest.fixture(scope="module")
def server(checkpoint):
    """The server the example's own would be (float weights, float32), in this process: each run pushes into it."""
    s = ServerThread(EngineConfig(dtype="float32", weights="float", kv_cache_tokens=4096), checkpoint)
    yield s
    s.stop()


def greedy_logprobs(address: str) -> list[float]:
    """The served model's log-probabilities along a greedy completion: any change of weights moves them."""
    with Client(address) as client:
        deltas = client.generate(token_ids=PROMPT, max_new_tokens=8, ignore_eos=True, logprobs=1)
        return [lp["logprob"] for d in deltas for lp in d.logprobs]


@pytest.mark.parametrize("sync", ["tensors", "gloo"])
def test_rl_loop_pushes_each_steps_weights_as_its_version(server, sync):
    before = greedy_logprobs(server.address)
    run = subprocess.run(
        [sys.executable, EXAMPLE, "--target", server.address, "--sync", sync, *TINY],
        capture_output=True,
        text=True,
        timeout=600,  # a guard against a hung run, not a performance bound
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert "Traceback" not in run.stderr and " ERROR " not in run.stderr, run.stderr[-4000:]
    steps = [line for line in run.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in steps] == ["step 1", "step 2"], run.stdout
    assert "(by step-1)" in steps[1] and "serving step-2" in steps[1], steps
    assert server.info().weight_version == "step-2"
    assert greedy_logprobs(server.address) != before
