"""Two nodes on one machine: node 1 runs in a network namespace of its own, joined to this one (node 0's) by a
veth pair, so every request, output, collective and pushed weight between them crosses a real link between two
network stacks. Needs root and `ip`; skipped with the reason where the machine forbids it."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time

import grpc
import pytest

from lmgate.client.client import Client
from lmgate.v1 import lmgate_pb2 as pb
from lmgate.v1 import lmgate_pb2_grpc as pb_grpc
from tests.serving import LMGATE, StreamEnds, free_port, serve_process
from tests.test_rank_processes import rank_pids
from tests.test_engine import hf_greedy
from tests.test_weight_push import bf16_state

NEW = 24
GUARD = 300  # seconds: a guard against a hang, far above what any run takes, never a performance bound
NODE0, NODE1 = "10.231.7.1", "10.231.7.2"
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Water boils at", "My favourite colour is")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def node1_netns():
    """A network namespace for node 1, its end of a veth pair at NODE1, this namespace's end at NODE0."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("two nodes on one machine need root and iproute2's `ip` (network namespaces)")
    _remove_stale()
    tag = f"lmg{os.getpid()}"
    netns, here, there = f"{tag}-node1", f"{tag}a", f"{tag}b"
    try:
        _ip("netns", "add", netns)
        _ip("link", "add", here, "type", "veth", "peer", "name", there, "netns", netns)
        _ip("addr", "add", f"{NODE0}/24", "dev", here)
        _ip("link", "set", here, "up")
        _ip("-n", netns, "addr", "add", f"{NODE1}/24", "dev", there)
        _ip("-n", netns, "link", "set", there, "up")
        _ip("-n", netns, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as exc:
        _remove(netns, here)
        pytest.skip(f"this machine forbids network namespaces: {exc.stderr.strip()}")
    try:
        yield netns
    finally:
        _remove(netns, here)


def _remove_stale() -> None:
    """The namespaces of earlier runs killed before their teardown (their pid is gone): their links hold the
    addresses every run uses, and would take this run's traffic."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for name in listed:
        match = re.fullmatch(r"lmg(\d+)-node1", name)
        if match and not os.path.exists(f"/proc/{match[1]}"):
            _remove(name, f"lmg{match[1]}a")


def _remove(netns: str, link: str) -> None:
    subprocess.run(["ip", "link", "del", link], capture_output=True)  # takes its peer with it
    subprocess.run(["ip", "netns", "del", netns], capture_output=True)


def _common_flags(*flags: str) -> tuple[str, ...]:
    port = str(free_port(NODE0))
    return ("--nnodes", "2", "--master-addr", NODE0, "--master-port", port, "--kv-cache-tokens", "2048", *flags)


def _start_node1(netns: str, common: tuple[str, ...]) -> subprocess.Popen:
    """Node 1 in `netns`; it waits for node 0. A session of its own: its ranks share its process group, which
    the tests stop and kill as one node."""
    return subprocess.Popen(
        ["ip", "netns", "exec", netns, *LMGATE, "serve", "--node-rank", "1", *common], start_new_session=True
    )


def start_nodes(netns: str, *flags: str) -> tuple[subprocess.Popen, subprocess.Popen, str]:
    """Node 1 in `netns` (it waits for node 0), then node 0 here; both processes and node 0's gRPC address."""
    common = _common_flags(*flags)
    node1 = _start_node1(netns, common)
    try:
        node0, address = serve_process("--node-rank", "0", *common)
    except BaseException:
        _kill(node1)
        raise
    return node0, node1, address


def _kill(node1: subprocess.Popen, node0: subprocess.Popen | None = None) -> None:
    """All of node 1's processes, and node 0 (its ranks follow it)."""
    if node0 is not None and node0.poll() is None:
        node0.kill()
        node0.wait()
    try:
        os.killpg(node1.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    node1.wait()


def greedy(stub: pb_grpc.InferenceStub, prompt: str) -> list[int]:
    sampling = pb.SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    return [
        t
        for m in stub.Generate(pb.GenerateRequest(prompt=prompt, sampling=sampling), timeout=GUARD)
        for t in m.token_ids
    ]


def pushed_reach_node_1(address: str, stub: pb_grpc.InferenceStub, tokenizer, trainer, requests: int) -> None:
    """Weights pushed from the trainer's memory (a tensor stream to node 0, whose ranks on node 1 get the bytes
    in their messages) serve on every rank (`requests` reach each of them) as transformers' own model does."""
    with Client(address) as client:
        assert client.update_weights(bf16_state(trainer), version="pushed") == "pushed"
    expected = hf_greedy(trainer, tokenizer.encode(PROMPTS[0]), NEW)
    assert [greedy(stub, PROMPTS[0]) for _ in range(requests)] == [expected] * requests
    assert stub.Info(pb.InfoRequest()).weight_version == "pushed"


def test_data_parallel_ranks_on_two_nodes_answer_as_one_node_and_stop_together(
    node1_netns, hf_model, tokenizer, trainer
):
    """One rank per node; requests one at a time go to each rank in turn; pushed weights reach both; SIGTERM
    to node 0 closes node 1's rank too, and both exit 0."""
    node0, node1, address = start_nodes(node1_netns, "--engine-loops", "2")
    try:
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.InferenceStub(channel)
            assert stub.Info(pb.InfoRequest()).engine_loops == 2
            got = [greedy(stub, p) for p in PROMPTS]
            assert got == [hf_greedy(hf_model, tokenizer.encode(p), NEW) for p in PROMPTS]
            pushed_reach_node_1(address, stub, tokenizer, trainer, requests=2)  # data-parallel ranks take turns
        node0.send_signal(signal.SIGTERM)
        assert node0.wait(timeout=GUARD) == 0
        assert node1.wait(timeout=GUARD) == 0
    finally:
        _kill(node1, node0)


def test_tensor_parallel_across_two_nodes_and_a_hung_node_ends_every_stream(node1_netns, hf_model, tokenizer, trainer):
    """The model split over the two nodes (all-reduces over the veth); pushed weights reach both shards; then
    node 1 stops dead (SIGSTOP: no connection closes, only its silence tells): every stream ends UNAVAILABLE
    and node 0 exits 1."""
    node0, node1, address = start_nodes(node1_netns, "--tensor-parallel", "2")
    try:
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.InferenceStub(channel)
            got = [greedy(stub, p) for p in PROMPTS[:2]]
            assert got == [hf_greedy(hf_model, tokenizer.encode(p), NEW) for p in PROMPTS[:2]]
            pushed_reach_node_1(address, stub, tokenizer, trainer, requests=1)
            long = pb.SamplingParams(max_new_tokens=2000, ignore_eos=True)  # within the 2048-token context
            streams = [
                stub.Generate(pb.GenerateRequest(prompt=f"Story {i}:", sampling=long), timeout=GUARD) for i in range(3)
            ]
            for s in streams:
                assert next(m for m in s if m.token_ids)
            ends = StreamEnds(streams)
            os.killpg(node1.pid, signal.SIGSTOP)
            statuses = ends.join()
        assert len(statuses) == 3
        for status in statuses:
            assert status[0] == grpc.StatusCode.UNAVAILABLE and "engine rank 1 on node 1" in status[1], status
        assert node0.wait(timeout=GUARD) == 1
    finally:
        _kill(node1, node0)


def test_a_node_whose_server_died_stops_its_ranks_and_exits_non_zero(node1_netns):
    node0, node1, _ = start_nodes(node1_netns, "--engine-loops", "2")
    try:
        node0.kill()
        node0.wait()
        assert node1.wait(timeout=GUARD) == 1  # its rank heard nothing for the heartbeat timeout
    finally:
        _kill(node1, node0)


def _ranks_of(pid: int) -> list[int]:
    """The rank processes a node's `lmgate serve` has spawned, once it has them (a guard against a hang)."""
    deadline = time.monotonic() + GUARD
    while not (ranks := rank_pids(pid)):
        assert time.monotonic() < deadline, "the node never started its ranks"
        time.sleep(0.05)
    return ranks


def test_a_rank_of_node_1_that_dies_while_starting_stops_node_0(node1_netns):
    """A remote rank says nothing before it is ready: node 1 reports its death in node 0's store, and node 0
    gives up starting (and exits non-zero) instead of waiting for it for ever."""
    common = _common_flags("--engine-loops", "2")
    node1 = _start_node1(node1_netns, common)
    node0 = subprocess.Popen([*LMGATE, "serve", "--node-rank", "0", "--port", "0", *common])
    try:
        os.kill(_ranks_of(node1.pid)[0], signal.SIGKILL)
        assert node1.wait(timeout=GUARD) == 1
        assert node0.wait(timeout=GUARD) != 0
    finally:
        _kill(node1, node0)


def test_node_0_killed_while_starting_leaves_no_rank_of_node_1_behind(node1_netns):
    """Node 1's ranks have not yet heard from node 0 (which would time out a silence): node 0's store going
    away tells node 1 to kill them and exit."""
    common = _common_flags("--engine-loops", "2")
    node1 = _start_node1(node1_netns, common)
    node0 = subprocess.Popen([*LMGATE, "serve", "--node-rank", "0", "--port", "0", *common])
    try:
        ranks = _ranks_of(node1.pid)
        node0.kill()
        node0.wait()
        assert node1.wait(timeout=GUARD) == 1
        assert not any(os.path.exists(f"/proc/{pid}") for pid in ranks)
    finally:
        _kill(node1, node0)
