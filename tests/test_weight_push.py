"""UpdateWeightsFromTensors over a real server on loopback: weights pushed from a transformers model's memory
serve as the same weights saved and loaded by path do; every update names a version, which Info and each
GenerateResponse report; a refused or broken-off push changes nothing."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import uuid

import grpc
import pytest
import torch
from google.protobuf.message import DecodeError

from lmgate.client.client import AsyncClient, Client
from lmgate.client.shared_memory import SharedMemoryFile, shared_memory_id
from lmgate.client.weights import COMMIT, UPLOAD_METHOD, chunk_message, weight_stream
from lmgate.engine.config import EngineConfig
from lmgate.engine.loading.pushed import TensorSpec, host_buffer, release_kept_buffers, tensor_views
from lmgate.engine.ranks import weight_transfer
from lmgate.service import servicer as servicer_module
from lmgate.service import shared_memory as server_shared_memory
from lmgate.service import weight_chunks
from lmgate.service.weight_chunks import CHUNK_TAG, chunk_or_request
from lmgate.v1 import lmgate_pb2 as pb
from lmgate.v1 import lmgate_pb2_grpc as pb_grpc
from tests.serving import ServerThread
from tests.test_weight_transfer import shared_files
from tests.test_sleep import save_hf_dir

PROMPT = [504, 3575, 282, 4649, 314]
GREEDY = pb.SamplingParams(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def saved(trainer, checkpoint, hf_tokenizer_dir, tmp_path_factory):
    """The trainer's weights saved as a Hugging Face directory with the served tokenizer (transformers will not
    save a model it read from a GGUF file itself: the same tensors, saved as safetensors)."""
    weights = {k: v for k, v in trainer.state_dict().items() if k != "lm_head.weight"}  # tied
    return save_hf_dir(tmp_path_factory.mktemp("trained") / "model", checkpoint.config, weights, hf_tokenizer_dir)


@pytest.fixture
def server(checkpoint):
    s = ServerThread(EngineConfig(dtype="float32", kv_cache_tokens=4096), checkpoint)
    yield s
    s.stop()


def bf16_state(model) -> dict[str, torch.Tensor]:
    """The trainer's `state_dict()` in bfloat16 (half the bytes; exact, as its values are); the tied head is the
    embedding's very tensor, as in the state_dict."""
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    return {**state, "lm_head.weight": state["model.embed_tokens.weight"]}


def generate(server) -> list[pb.GenerateResponse]:
    with server.channel() as channel:
        request = pb.GenerateRequest(tokens=pb.TokenIds(ids=PROMPT), sampling=GREEDY)
        return list(pb_grpc.InferenceStub(channel).Generate(request))


def greedy(server) -> list[int]:
    return [t for m in generate(server) for t in m.token_ids]


def push_error(server, messages) -> grpc.RpcError:
    """The refusal of an UpdateWeightsFromTensors call of `messages`: serialized (as `weight_stream` makes them)
    or protobuf messages, each sent as it comes."""
    with server.channel() as channel, pytest.raises(grpc.RpcError) as err:
        call = channel.stream_unary(UPLOAD_METHOD, response_deserializer=pb.UpdateWeightsResponse.FromString)
        call(m if isinstance(m, bytes) else m.SerializeToString() for m in messages)
    return err.value


def parsed(messages) -> list[pb.UpdateWeightsFromTensorsRequest]:
    return [pb.UpdateWeightsFromTensorsRequest.FromString(m) for m in messages]


def test_weight_push_serves_as_the_saved_checkpoint_and_names_its_version(server, trainer, saved, monkeypatch):
    """(Its chunks reach the servicer as views of the received bytes: the server's interceptor is in place.)"""
    before = greedy(server)
    assert server.info().weight_version == "0"
    assert all(m.weight_version == "0" for m in generate(server) if m.token_ids)
    received = []

    def seen(data: bytes):
        received.append(type(chunk_or_request(data)))
        return chunk_or_request(data)

    monkeypatch.setattr(weight_chunks, "chunk_or_request", seen)
    with Client(server.address) as client:
        assert client.update_weights(bf16_state(trainer), version="step-1", shared_memory=False) == "step-1"
        assert client._shared_memory is None  # in chunks
    kinds = [pb.UpdateWeightsFromTensorsRequest, memoryview, pb.UpdateWeightsFromTensorsRequest]
    assert received == kinds[:1] + kinds[1:2] * (len(received) - 2) + kinds[2:] and len(received) > 100
    pushed = generate(server)
    assert [t for m in pushed for t in m.token_ids] != before
    assert all(m.weight_version == "step-1" for m in pushed if m.token_ids)
    assert server.info().weight_version == "step-1"
    with Client(server.address) as client:
        assert client.update_weights(saved) == "2"  # no version named: the count of updates
    assert greedy(server) == [t for m in pushed for t in m.token_ids]
    assert server.info().weight_version == "2"
    assert all(m.weight_version == "2" for m in generate(server) if m.token_ids)


def test_weights_updated_while_paused_are_written_into_the_served_model(server, trainer, saved):
    """Paused, nothing steps: a float model's new values go into the tensors it serves, by push or by path, and
    it answers as a model built from the same weights does."""
    with Client(server.address) as client:
        client.update_weights(bf16_state(trainer), version="built")  # the GGUF's quantized layers: float now
        weights = server.engine.ranks.weights
        served, nbytes, trained = weights.model, server.info().weights_bytes, greedy(server)
        other = bf16_state(trainer)
        other["model.layers.5.mlp.down_proj.weight"] = -other["model.layers.5.mlp.down_proj.weight"]
        with client.pause("abort"):
            client.update_weights(other, version="in-place")
        assert weights.model is served and server.info().weights_bytes == nbytes
        written = greedy(server)
        assert written != trained
        client.update_weights(other, version="built-again")  # not paused: a model built aside
        assert weights.model is not served
        assert greedy(server) == written
        served = weights.model
        with client.pause("keep"):
            client.update_weights(saved, version="by-path")
        assert weights.model is served
        assert greedy(server) == trained and server.info().weight_version == "by-path"


MISSING = "model.layers.3.self_attn.k_proj.weight"  # left out of bad_states' "missing" case


def bad_states(trainer) -> dict[str, dict[str, torch.Tensor]]:
    """Pushes the server must refuse, each by the name its refusal must say ("missing": MISSING's)."""
    state = bf16_state(trainer)
    name = MISSING
    return {
        "model.layers.99.mlp.up_proj.weight": {**state, "model.layers.99.mlp.up_proj.weight": state[name]},
        name: {**state, name: state[name][:-1]},  # a row short
        "model.norm.weight": {**state, "model.norm.weight": state["model.norm.weight"].to(torch.int32)},
        "missing": {k: v for k, v in state.items() if k != name},
    }


def test_weight_push_refuses_a_tensor_the_model_has_not_and_changes_nothing(server, trainer):
    before = greedy(server)
    name = MISSING
    for expected, tensors in bad_states(trainer).items():
        err = push_error(server, weight_stream(tensors, "bad"))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert expected in err.details() if expected != "missing" else name in err.details()
    assert greedy(server) == before
    assert server.info().weight_version == "0"


def test_weight_push_cut_off_or_not_committed_changes_nothing(server, trainer):
    before = greedy(server)
    messages = list(weight_stream(bf16_state(trainer), "partial"))
    header, chunks = messages[0], messages[1:-1]

    def breaks_off():
        yield header
        yield from chunks[: len(chunks) // 2]
        raise RuntimeError("the trainer died")  # the client cancels the call

    # the client's own status for a request iterator that raised: it cancelled the call
    assert push_error(server, breaks_off()).code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)
    for ends_early in ([header, *chunks], [header, *chunks[:-1], messages[-1]], chunks):
        assert push_error(server, ends_early).code() == grpc.StatusCode.INVALID_ARGUMENT
    unparsed = push_error(server, [header, chunks[0], chunk_message(b"abc")[:-1], messages[-1]])  # cut short
    assert (
        unparsed.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "no UpdateWeightsFromTensorsRequest" in unparsed.details()
    )
    assert greedy(server) == before
    assert server.info().weight_version == "0"


def test_a_chunk_is_sent_as_protobuf_serializes_it_and_received_as_a_view_of_its_bytes_alone():
    """The client's chunk messages are protobuf's own bytes (lengths across the varint's byte boundaries); the
    server views a message that is one chunk field and nothing else, and parses every other (a header, a
    commit, a chunk with a field after it); one cut short is refused as protobuf refuses it."""
    for length in (1, 127, 128, 16383, 16384, (2 << 20) + 3):
        data = os.urandom(length)
        message = chunk_message(memoryview(data))
        assert message == pb.UpdateWeightsFromTensorsRequest(chunk=data).SerializeToString()
        received = chunk_or_request(message)
        assert isinstance(received, memoryview) and received == data
    header = pb.UpdateWeightsFromTensorsRequest(header=pb.WeightsHeader(weight_version="v"))
    for other in (header.SerializeToString(), COMMIT, chunk_message(b"abc") + COMMIT):
        assert chunk_or_request(other) == pb.UpdateWeightsFromTensorsRequest.FromString(other)
    assert chunk_or_request(chunk_message(b"abc") + COMMIT).commit
    for cut in (chunk_message(b"abc")[:-1], chunk_message(b"x" * 300)[:2], CHUNK_TAG + b"\x80" * 11 + b"\0"):
        with pytest.raises(DecodeError):
            chunk_or_request(cut)


def test_a_push_named_in_shared_memory_serves_as_one_sent_in_chunks(server, trainer, saved):
    """A client on the server's machine (by default, its Info says so) writes the bytes into a file of /dev/shm
    the stream names: served as the same weights loaded by path, the file written again (its pages kept) by
    the next push and removed when
    the client closes (no file made after); chunks and file ranges mixed in one stream; both clients paused for
    the commit. Each push by a file is received into new memory (`release_kept_buffers`), so that one whose
    bytes were not read from the file could not answer as the weights it names."""
    other = bf16_state(trainer)
    other["model.layers.5.mlp.down_proj.weight"] = -other["model.layers.5.mlp.down_proj.weight"]
    with Client(server.address) as client:
        client.update_weights(saved, version="by-path")
        by_path = greedy(server)
        assert client.info().shared_memory_id == shared_memory_id() != ""
        assert client.update_weights(other, version="other") == "other"
        pushed_other = greedy(server)
        assert pushed_other != by_path
        file = client._shared_memory
        assert file is not None
        inode = os.stat(file.path).st_ino
        release_kept_buffers()
        assert client.update_weights(bf16_state(trainer), "shm", pause="keep", shared_memory=True) == "shm"
        assert greedy(server) == by_path and server.info().weight_version == "shm"
        assert client._shared_memory is file and os.stat(file.path).st_ino == inode
        assert os.stat(file.path).st_mode & 0o777 == 0o600
        with pytest.raises(ValueError, match="shared_memory"):
            client.update_weights(saved, shared_memory=True)
    assert not os.path.exists(file.path)
    files = push_files()
    with pytest.raises(ValueError, match="closed"):
        client.update_weights(other, shared_memory=True)
    assert push_files() == files

    messages = parsed(weight_stream(other, "mixed"))  # sent by the generated stub, which serializes them itself
    header, chunks, commit = messages[0], [m.chunk for m in messages[1:-1]], messages[-1]
    sent, named = chunks[: len(chunks) // 2], b"".join(chunks[len(chunks) // 2 :])
    with shared_memory_file(b"\0" * 100 + named) as name:
        ranged = pb.SharedMemoryBytes(name=name, offset=100, length=len(named))
        mixed = [header, *messages[1 : 1 + len(sent)], pb.UpdateWeightsFromTensorsRequest(shared_memory=ranged), commit]
        release_kept_buffers()
        with server.channel() as channel:
            assert pb_grpc.AdminStub(channel).UpdateWeightsFromTensors(iter(mixed)).weight_version == "mixed"
    assert greedy(server) == pushed_other

    async def push_async() -> str:
        async with AsyncClient(server.address) as client:
            version = await client.update_weights(bf16_state(trainer), "async", pause="keep")  # this machine's
            assert os.path.exists(client._shared_memory.path)
            return version

    release_kept_buffers()
    assert asyncio.run(push_async()) == "async"
    assert greedy(server) == by_path and not server.engine.pause_mode

    # a refused push has been read no more: its file is kept; one past its deadline may be read on: it goes
    with Client(server.address) as client:
        with pytest.raises(grpc.RpcError) as refused:
            client.update_weights(bad_states(trainer)["missing"], shared_memory=True)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and client._shared_memory is not None
    with Client(server.address, timeout=1e-3) as client:
        with pytest.raises(grpc.RpcError) as late:
            client.update_weights(other, shared_memory=True)
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and client._shared_memory is None


def test_a_push_goes_in_chunks_to_a_server_of_another_shared_memory_or_where_it_has_no_room(
    server, trainer, saved, checkpoint, monkeypatch, tmp_path
):
    """By default a client names its bytes in /dev/shm only where the server's Info says it reads that very
    /dev/shm as this user, and it has room for them: a server reading another (another machine's, another
    container's), one whose Info this client may not call (an api key it lacks), and a client whose file
    cannot grow (a 1 MiB file size limit, as a container's small /dev/shm refuses the room) push in chunks;
    a push refused as a file the server cannot read, though its Info said it could (a proxy's two servers),
    goes again in chunks. Each serves as the same weights loaded by path, no file left."""
    with Client(server.address) as client:
        client.update_weights(saved, version="by-path")
        by_path = greedy(server)
        monkeypatch.setattr(server_shared_memory, "SHM_DIR", str(tmp_path))  # the server reads another
        assert "" != client.info().shared_memory_id != shared_memory_id()
        assert client.update_weights(bf16_state(trainer), "elsewhere") == "elsewhere"
        assert client._shared_memory is None and greedy(server) == by_path
    monkeypatch.setattr(servicer_module, "shared_memory_id", shared_memory_id)  # yet says it reads this one
    with Client(server.address) as client:
        assert client.update_weights(bf16_state(trainer), "retried") == "retried"
        assert client._server_shares_memory is False and greedy(server) == by_path
    monkeypatch.undo()
    keyed = ServerThread(EngineConfig(dtype="float32", kv_cache_tokens=4096), checkpoint, api_key="key")
    try:
        with Client(keyed.address) as client:
            assert client.update_weights(bf16_state(trainer), "no-info") == "no-info"
            assert client._shared_memory is None and client._server_shares_memory is False
        with Client(keyed.address, api_key="key") as client:
            deltas = client.generate(token_ids=PROMPT, max_new_tokens=12, ignore_eos=True)
            assert [t for d in deltas for t in d.token_ids] == by_path
    finally:
        keyed.stop()
    torch.save(bf16_state(trainer), tmp_path / "state.pt")
    files = push_files()
    client_ = subprocess.run(
        [sys.executable, "-c", PUSHES_WITHOUT_ROOM, server.address, str(tmp_path / "state.pt")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert client_.returncode == 0, client_.stderr
    assert client_.stdout.split() == ["tight", "chunks"]
    assert server.info().weight_version == "tight" and greedy(server) == by_path
    assert push_files() == files


def test_a_shared_memory_file_asked_to_spare_room_takes_none_where_it_cannot():
    """By default a client's file must leave /dev/shm room for as many bytes more (a server with rank processes
    receives the push into a file there): where it cannot, OSError before a page is taken."""
    file = SharedMemoryFile()
    try:
        free = os.statvfs("/dev/shm")
        half = free.f_bavail * free.f_frsize // 2
        with pytest.raises(OSError, match="shared_memory=False"):
            file.write([], half + (1 << 20), spare=True)
        assert os.fstat(file._fd).st_blocks == 0
        file.write([memoryview(b"\1" * 4096)], 4096, spare=True)
        assert os.path.getsize(file.path) == 4096
    finally:
        file.close()


PUSHES_WITHOUT_ROOM = """
import resource, signal, sys
import torch
from lmgate.client import Client
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file grown past the limit: EFBIG, not a killed process
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
with Client(sys.argv[1]) as client:
    print(client.update_weights(torch.load(sys.argv[2]), "tight"), "file" if client._shared_memory else "chunks")
"""


def test_a_killed_clients_shared_memory_file_is_removed_by_the_next_one_made():
    """A client killed while it holds its file leaves it in /dev/shm; the next file made on the machine removes
    it (its lock is free), never a live client's."""
    holders = [
        subprocess.Popen(
            [sys.executable, "-c", HOLDS_A_FILE], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    try:
        killed, alive = (holder.stdout.readline().strip() for holder in holders)
        holders[0].kill()
        holders[0].wait()
        assert os.path.exists(killed) and os.path.exists(alive)
        mine = SharedMemoryFile()
        assert not os.path.exists(killed) and os.path.exists(alive)
        mine.close()
        assert not os.path.exists(mine.path)
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()
        SharedMemoryFile().close()  # removes the second one's, killed now
    assert not os.path.exists(alive)


def push_files() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("lmgate-push-")}


def test_removing_stale_shared_memory_files_never_waits_on_a_fifo():
    """A FIFO (or a link) by a stale file's name, which any local user may make: the client's and the server's
    sweeps pass it by, without waiting on its open."""
    made = []
    for prefix in ("lmgate-push-", weight_transfer.PREFIX):
        made += [os.path.join("/dev/shm", f"{prefix}{kind}-{uuid.uuid4().hex}") for kind in ("fifo", "link")]
        os.mkfifo(made[-2])
        os.symlink("/dev/null", made[-1])
    swept = threading.Thread(target=lambda: (SharedMemoryFile().close(), weight_transfer.remove_stale()))
    try:
        swept.start()
        swept.join(timeout=120)  # a guard against the hang this tests for, not a bound on its time
        assert not swept.is_alive()
        assert all(os.path.lexists(path) for path in made)
    finally:
        for path in made:
            if "fifo" in path and swept.is_alive():  # a sweep waiting on a FIFO's open: a writer lets it go
                with contextlib.suppress(OSError):
                    os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            os.unlink(path)


HOLDS_A_FILE = """
import sys, time
from lmgate.client.shared_memory import SharedMemoryFile
file = SharedMemoryFile()
print(file.path, flush=True)
time.sleep(600)
"""


@contextlib.contextmanager
def shared_memory_file(data: bytes, make=None):
    """A file of /dev/shm holding `data` (or what `make(path)` makes there), its name given, removed after."""
    name = f"lmgate-test-{uuid.uuid4().hex}"
    path = os.path.join("/dev/shm", name)
    if make is None:
        with open(path, "wb") as f:
            f.write(data)
    else:
        make(path)
    try:
        yield name
    finally:
        os.unlink(path)


def test_shared_memory_the_server_cannot_read_is_refused_and_changes_nothing(server, trainer, tmp_path):
    """A name that is no file of the server's /dev/shm (another directory's, a link, a FIFO, none), a range past
    the file's end or past the header's bytes: INVALID_ARGUMENT naming why, nothing served changes (and the
    FIFO's open does not block the server)."""
    before = greedy(server)
    header = pb.UpdateWeightsFromTensorsRequest.FromString(next(weight_stream(bf16_state(trainer), "bad")))
    total = sum(t.nbytes for t in tensor_views_specs(header))
    outside = tmp_path / "weights"
    outside.write_bytes(b"\0" * total)

    def refused(name: str, offset: int = 0, length: int = total) -> str:
        part = pb.UpdateWeightsFromTensorsRequest(
            shared_memory=pb.SharedMemoryBytes(name=name, offset=offset, length=length)
        )
        err = push_error(server, [header, part, pb.UpdateWeightsFromTensorsRequest(commit=True)])
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        return err.details()

    assert "name alone" in refused(str(outside))
    assert "name alone" in refused("../" + outside.name)
    assert "another machine" in refused(f"lmgate-test-absent-{uuid.uuid4().hex}")
    with shared_memory_file(b"", make=lambda path: os.symlink(outside, path)) as name:
        assert "cannot be read" in refused(name)
    with shared_memory_file(b"", make=os.mkfifo) as name:
        assert "not a regular file" in refused(name)
    with shared_memory_file(b"\0" * total) as name:
        assert "past its end" in refused(name, offset=1)
        assert "more bytes than" in refused(name, length=total + 1)
        half = pb.UpdateWeightsFromTensorsRequest(
            shared_memory=pb.SharedMemoryBytes(name=name, offset=0, length=total // 2)
        )
        rest = pb.UpdateWeightsFromTensorsRequest(
            shared_memory=pb.SharedMemoryBytes(name=name, offset=total, length=total - total // 2)
        )
        err = push_error(server, [header, half, rest, pb.UpdateWeightsFromTensorsRequest(commit=True)])
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "past its end" in err.details()
    assert greedy(server) == before
    assert server.info().weight_version == "0"


def tensor_views_specs(header: pb.UpdateWeightsFromTensorsRequest) -> list[TensorSpec]:
    return [TensorSpec(t.name, t.dtype, tuple(t.shape)) for t in header.header.tensors]


def test_a_kept_buffer_is_received_into_again_once_nothing_views_it():
    """A push's buffer keeps its pages when its tensors go: the next push of its size is received into them (the
    values the last one left there still in them), never while a tensor, or a view of one, still reads them."""
    specs = [TensorSpec("w", "float32", (1021, 7))]  # a size no other push in this process has
    nbytes = specs[0].nbytes
    first = tensor_views(specs, host_buffer(nbytes))["w"]
    first.fill_(7.0)
    row, at = first[3], first.data_ptr()
    del first
    second = tensor_views(specs, host_buffer(nbytes))["w"]  # a row of the first still viewed: other memory
    assert second.data_ptr() != at
    del second, row
    kept = [tensor_views(specs, host_buffer(nbytes))["w"] for _ in range(2)]
    again = next(t for t in kept if t.data_ptr() == at)
    assert bool((again == 7.0).all())


def test_kept_buffers_let_go_are_not_received_into_again(monkeypatch):
    """After `release_kept_buffers` (a level-2 sleep, shutdown) the next push's buffer is new memory; before it,
    the kept one (whose address alone cannot tell: the C library may hand freed memory out again)."""
    made = []
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: made.append(args) or empty(*args, **kwargs))
    nbytes = 1_003 * 4  # a size no other push in this process has
    for _ in range(2):
        host_buffer(nbytes)  # dropped at once: free
    assert len(made) == 1  # the second was the first, kept
    release_kept_buffers()
    host_buffer(nbytes)
    assert len(made) == 2


def test_a_push_is_never_received_into_memory_the_served_model_reads(server, trainer):
    """A model built on a push's own tensors (woken from a level-2 sleep: float32 into a float32 engine, the
    embedding and the norms are served from the received bytes) keeps that buffer from later pushes: pushes
    that are not committed, more of them than buffers are kept, change nothing it answers."""
    state = {k: v.detach().clone() for k, v in trainer.state_dict().items() if k != "lm_head.weight"}
    with Client(server.address) as client:
        client.update_weights(state, version="float32")
        client.sleep(2)
        client.wakeup()
    assert not server.engine.ranks.weights.model.owns_memory
    served = greedy(server)
    messages = list(weight_stream({k: -v for k, v in state.items()}, "never"))
    for _ in range(3):
        assert push_error(server, messages[:-1]).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert greedy(server) == served
    assert server.info().weight_version == "float32"


def test_weight_push_needs_the_admin_credential(checkpoint, trainer):
    s = ServerThread(EngineConfig(dtype="float32", kv_cache_tokens=4096), checkpoint, admin_token="secret")
    try:
        err = push_error(s, weight_stream(bf16_state(trainer)))
        assert err.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
        assert s.info().weight_version == "0"
    finally:
        s.stop()


def test_weight_push_reaches_every_rank_process(checkpoint, trainer, saved):
    """Two data-parallel ranks in processes of their own: each gets the pushed tensors (through one file in
    /dev/shm), and both serve them as they serve the same weights loaded by path (requests alternate between
    the ranks). The file is kept: once both ranks have let go of it (the weights loaded by path replaced those
    they served from it), the next push is received into it again; at shutdown it goes."""
    s = ServerThread(
        EngineConfig(dtype="float32", kv_cache_tokens=4096, engine_loops=2, dp_backend="process"), checkpoint
    )
    files = shared_files()
    try:
        before = greedy(s)
        with Client(s.address) as client:
            assert client.update_weights(bf16_state(trainer), version="pushed") == "pushed"
        pushed, held = [greedy(s) for _ in range(4)], s.info().weights_bytes
        assert pushed[0] != before and all(p == pushed[0] for p in pushed)
        kept = shared_files() - files
        assert len(kept) == (1 if os.path.isdir(weight_transfer.SHM_DIR) else 0)
        with Client(s.address) as client:
            client.update_weights(saved, version="by-path")
            assert [greedy(s) for _ in range(4)] == pushed
            assert s.info().weight_version == "by-path"
            assert s.info().weights_bytes == 2 * held  # each rank keeps the pushed model as its spare
            with client.pause("keep"):  # each rank checks, then writes them into the model it serves
                client.update_weights(bf16_state(trainer), version="paused")
        assert [greedy(s) for _ in range(4)] == pushed and s.info().weight_version == "paused"
        assert shared_files() - files == kept
    finally:
        s.stop()
    assert shared_files() == files


def test_weight_push_reaches_a_rank_process_in_its_message_without_shared_memory(
    checkpoint, trainer, saved, monkeypatch, tmp_path
):
    """Where /dev/shm is missing or too small, the tensors travel in the rank's message, as to another
    node's ranks: served as the same weights loaded by path."""
    monkeypatch.setattr(weight_transfer, "SHM_DIR", str(tmp_path / "no-shm"))
    s = ServerThread(EngineConfig(dtype="float32", kv_cache_tokens=4096, dp_backend="process"), checkpoint)
    try:
        with Client(s.address) as client:
            client.update_weights(saved, version="by-path")
            by_path = greedy(s)
            assert client.update_weights(bf16_state(trainer), version="pushed") == "pushed"
        assert greedy(s) == by_path and s.info().weight_version == "pushed"
    finally:
        s.stop()
