"""Weights from a trainer over a torch.distributed group (Admin.InitWeightUpdateGroup, UpdateWeightsFromDistributed,
DestroyWeightUpdateGroup), with real processes and gloo on loopback: the broadcast weights serve as the same
weights saved and loaded do, on every rank process and shard; a trainer that never joins, or dies mid-broadcast,
or sends a tensor the model has not, leaves the old weights serving and nobody waiting."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lmgate.client import weight_group as trainer_side
from lmgate.client.client import Client
from lmgate.client.weight_group import WeightGroup
from lmgate.client.weights import sent_tensors, tensor_specs
from lmgate.engine.config import EngineConfig
from lmgate.engine.loading import weight_group as server_side
from lmgate.v1 import lmgate_pb2 as pb
from lmgate.v1 import lmgate_pb2_grpc as pb_grpc
from tests.serving import ServerThread, free_port, serve_process
from tests.test_weight_push import GREEDY, MISSING, PROMPT, bad_states, bf16_state, saved  # noqa: F401  (fixtures)

PROCESS_SERVERS = {
    "dp-process": ("--engine-loops", "2", "--dp-backend", "process"),
    "tp2": ("--tensor-parallel", "2"),
}
ODD_BUCKET = (48 << 20) + 7  # buckets that cut tensors, and elements, anywhere; the last shorter


@pytest.fixture(scope="module")
def server(checkpoint):
    s = ServerThread(EngineConfig(dtype="float32", kv_cache_tokens=4096), checkpoint)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def expected(saved):
    """The greedy tokens of a server started from the trainer's weights, saved as a checkpoint."""
    s = ServerThread(EngineConfig(dtype="float32", kv_cache_tokens=4096, model=saved))
    try:
        return greedy(s.address)
    finally:
        s.stop()


@pytest.fixture(scope="module", params=list(PROCESS_SERVERS))
def process_server(request):
    """`lmgate serve` as a process whose ranks are processes too: data-parallel ones, or tensor-parallel shards."""
    proc, address = serve_process(*PROCESS_SERVERS[request.param], "--dtype", "float32", "--kv-cache-tokens", "4096")
    yield address
    proc.terminate()
    proc.wait()


def generate(address: str) -> list[pb.GenerateResponse]:
    with grpc.insecure_channel(address) as channel:
        request = pb.GenerateRequest(tokens=pb.TokenIds(ids=PROMPT), sampling=GREEDY)
        return list(pb_grpc.InferenceStub(channel).Generate(request))


def greedy(address: str) -> list[int]:
    return [t for m in generate(address) for t in m.token_ids]


def info(address: str) -> pb.InfoResponse:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.InferenceStub(channel).Info(pb.InfoRequest())


def serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status
        return status == health_pb2.HealthCheckResponse.SERVING


def push(address: str, tensors, version: str = "", **kw) -> str:
    with Client(address) as client, WeightGroup(client, "127.0.0.1", 0) as group:
        return group.push(tensors, version, **kw)


def rpc_error(call, *args, **kw) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call(*args, **kw)
    return err.value


def test_weight_group_keys_are_the_same_on_both_sides():
    assert trainer_side.GROUP_PREFIX == server_side.GROUP_PREFIX
    assert trainer_side.DEFAULT_BUCKET_BYTES == server_side.DEFAULT_BUCKET_BYTES
    assert [trainer_side.joined_key(3), trainer_side.ready_key(3)] == [
        server_side.joined_key(3),
        server_side.ready_key(3),
    ]


def test_weight_group_push_serves_as_a_server_started_from_the_saved_checkpoint(server, trainer, expected):
    before = greedy(server.address)
    assert before != expected
    with Client(server.address) as client, WeightGroup(client, "127.0.0.1", 0) as group:
        assert group.push(bf16_state(trainer), "step-1", bucket_bytes=ODD_BUCKET) == "step-1"
        pushed = generate(server.address)
        assert [t for m in pushed for t in m.token_ids] == expected
        assert all(m.weight_version == "step-1" for m in pushed if m.token_ids)
        assert info(server.address).weight_version == "step-1"
        # Again over the same group: float32 this time, the tied head left out, no version named (a count).
        version = group.push(trainer.state_dict())
        assert version.isdigit() and info(server.address).weight_version == version
        assert all(m.weight_version == version for m in generate(server.address) if m.token_ids)
        assert greedy(server.address) == expected


def test_weight_group_push_reaches_every_rank_process_and_shard(process_server, trainer, saved, gguf_path):
    """Both pushes, over a group and as a tensor stream in chunks, serve on every rank (requests alternate between the
    data-parallel ones) as the same weights loaded by path do."""
    before = greedy(process_server)
    assert push(process_server, bf16_state(trainer), "group", bucket_bytes=ODD_BUCKET) == "group"
    pushed = [greedy(process_server) for _ in range(4)]
    assert pushed[0] != before and all(p == pushed[0] for p in pushed)
    assert info(process_server).weight_version == "group"
    with Client(process_server) as client:
        client.update_weights(gguf_path, version="original")
        assert [greedy(process_server) for _ in range(4)] == [before] * 4
        assert client.update_weights(bf16_state(trainer), version="stream", shared_memory=False) == "stream"
        assert [greedy(process_server) for _ in range(4)] == pushed
        client.update_weights(saved, version="by-path")
    assert [greedy(process_server) for _ in range(4)] == pushed
    assert info(process_server).weight_version == "by-path"


def test_weight_group_a_trainer_that_never_joins_is_deadline_exceeded_and_the_next_join_succeeds(server):
    """Nothing at the trainer's address, then a store whose group the trainer never makes: each Init ends at
    its timeout; the server serves on, and joins the next trainer that comes."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with Client(server.address) as client:
        for port in (free_port(), store.port):
            err = rpc_error(client.init_weight_group, "127.0.0.1", port, timeout_seconds=2)
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.details()
            assert serving(server.address)
        with WeightGroup(client, "127.0.0.1", 0, timeout=30):
            assert serving(server.address)


@pytest.mark.parametrize("end", ["killed", "destroyed-then-killed", "silent"])
def test_weight_group_trainer_gone_mid_broadcast_leaves_the_old_weights_serving(server, trainer, expected, end):
    """The trainer (a process of its own, tests/dying_trainer.py) is killed after its first bucket, or falls
    silent: the update is ABORTED, the old weights and version serve on, and a new group is made and used.
    Destroyed first: the Destroy returns while the receive still waits, which ends as the trainer goes. Silent:
    the receive ends at the group's timeout."""
    before, version = greedy(server.address), info(server.address).weight_version
    tensors = sent_tensors(bf16_state(trainer))
    bucket_bytes = 1 << 20
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.dying_trainer", str(bucket_bytes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(child.stdout.readline())
        with Client(server.address) as client, ThreadPoolExecutor(1) as pool:
            client.init_weight_group("127.0.0.1", port, timeout_seconds=2 if end == "silent" else 60)
            update = pool.submit(client.update_weights_from_distributed, tensor_specs(tensors), "never", bucket_bytes)
            assert child.stdout.readline().strip() == "sent"
            if end == "destroyed-then-killed":
                client.destroy_weight_group()
            if end != "silent":
                child.kill()
            err = update.exception()
            assert isinstance(err, grpc.RpcError)
            assert err.code() in (grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED), err.details()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert serving(server.address)
    assert greedy(server.address) == before
    assert info(server.address).weight_version == version
    assert push(server.address, tensors, "after") == "after"
    assert greedy(server.address) == expected


def test_weight_group_refuses_a_tensor_the_model_has_not_and_the_trainer_goes_on(server, trainer, expected):
    """Refused before any byte is broadcast: INVALID_ARGUMENT naming it, raised at once by the trainer's push,
    nothing served changes, and the group stays in step for the next push."""
    before, version = greedy(server.address), info(server.address).weight_version
    with Client(server.address) as client, WeightGroup(client, "127.0.0.1", 0) as group:
        for named, tensors in bad_states(trainer).items():
            err = rpc_error(group.push, tensors, "bad", bucket_bytes=ODD_BUCKET)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (MISSING if named == "missing" else named) in err.details()
        assert greedy(server.address) == before
        assert info(server.address).weight_version == version
        assert group.push(bf16_state(trainer), "good", bucket_bytes=ODD_BUCKET) == "good"
    assert greedy(server.address) == expected


def test_weight_group_is_one_at_a_time_and_destroy_is_idempotent(server):
    with Client(server.address) as client:
        spec = [pb.TensorSpec(name="model.norm.weight", dtype="float32", shape=[576])]
        err = rpc_error(client.update_weights_from_distributed, spec)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        client.destroy_weight_group()
        with WeightGroup(client, "127.0.0.1", 0):
            err = rpc_error(client.init_weight_group, "127.0.0.1", free_port(), timeout_seconds=2)
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        client.destroy_weight_group()
        for backend in ("mpi", "nccl"):  # nccl: this server runs on the CPU
            err = rpc_error(client.init_weight_group, "127.0.0.1", free_port(), backend=backend)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and backend in err.details()
    assert serving(server.address)


def test_weight_group_needs_the_admin_credential(checkpoint):
    s = ServerThread(EngineConfig(dtype="float32", kv_cache_tokens=1024), checkpoint, admin_token="secret")
    try:
        denied = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
        with Client(s.address) as client:
            assert rpc_error(client.init_weight_group, "127.0.0.1", free_port()).code() in denied
            assert rpc_error(client.destroy_weight_group).code() in denied
            with pytest.raises(grpc.RpcError) as err:  # at once: the trainer never waits for a refused join
                with WeightGroup(client, "127.0.0.1", 0):
                    pass
            assert err.value.code() in denied
        with Client(s.address, admin_token="secret") as admin, WeightGroup(admin, "127.0.0.1", 0):
            assert serving(s.address)
    finally:
        s.stop()
