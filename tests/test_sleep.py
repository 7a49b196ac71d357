"""Sleep, wake-up and weight updates over real gRPC: safe under load, memory really released, Admin protected."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import random
import resource
import shutil
import socket
import sys
import threading
import time
import urllib.request
import weakref
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
import torch
from prometheus_client import start_http_server
from safetensors.torch import save_file

from lmgate.engine.config import DP_BACKENDS, EngineConfig
from lmgate.engine.engine import Engine
from lmgate.engine.loading.pushed import PushedWeights
from lmgate.engine.models import expand_blocks
from lmgate.engine.sampling.sampler import SamplingParams
from lmgate.engine.step.weights import LocalWeights
from lmgate.service.auth import is_loopback_peer
from lmgate.v1 import lmgate_pb2 as pb
from lmgate.v1 import lmgate_pb2_grpc as pb_grpc
from tests.serving import ServerThread, serve_process, status_bytes
from tests.test_service import assert_idle
from tests.test_shutdown import start_server

PROMPT = pb.TokenIds(ids=[504, 3575, 282, 4649, 314])
GREEDY = pb.SamplingParams(max_new_tokens=16, ignore_eos=True)
LONG = pb.SamplingParams(max_new_tokens=4000, ignore_eos=True)


@pytest.fixture(scope="module", params=DP_BACKENDS)
def sleepy(checkpoint, request):
    """A server of its own, two ranks as threads, then as processes: these tests put it to sleep."""
    s = ServerThread(
        EngineConfig(dtype="float32", kv_cache_tokens=8192, engine_loops=2, dp_backend=request.param), checkpoint
    )
    yield s
    s.stop()


def admin(server, token: str | None = None) -> pb_grpc.AdminStub:
    return pb_grpc.AdminStub(server.channel())


def greedy(stub) -> list[int]:
    return [t for m in stub.Generate(pb.GenerateRequest(tokens=PROMPT, sampling=GREEDY)) for t in m.token_ids]


def code_of(call) -> grpc.StatusCode | None:
    try:
        call()
    except grpc.RpcError as err:
        return err.code()
    return None


def test_sleep_under_load_cancels_streams_and_refuses_new_work(sleepy):
    stub, adm = sleepy.stub(), admin(sleepy)
    sid = stub.Start(pb.StartRequest()).session_id
    streams = [stub.Generate(pb.GenerateRequest(tokens=PROMPT, sampling=LONG)) for _ in range(15)]
    streams.append(stub.Generate(pb.GenerateRequest(session_id=sid, tokens=PROMPT, sampling=LONG)))
    for s in streams:
        assert next(m for m in s if m.token_ids)
    adm.Sleep(pb.SleepRequest(level=1))
    for s in streams:
        assert [m.finish_reason for m in s][-1] == pb.FINISH_REASON_CANCELLED
    assert code_of(lambda: stub.Start(pb.StartRequest())) == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError) as err:
        greedy(stub)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "asleep" in err.value.details()
    assert not stub.Cancel(pb.CancelRequest(request_id="nothing")).cancelled
    stub.End(pb.EndRequest(session_id=sid))
    info = stub.Info(pb.InfoRequest())
    assert info.sleeping and list(info.sleeping_tags) == ["kv_cache"]  # on the CPU the weights stay where they are
    assert info.kv_cache_bytes == 0 and info.active_sessions == 0
    assert stub.Tokenize(pb.TokenizeRequest(text="still here")).token_ids
    adm.Wakeup(pb.WakeupRequest())
    assert not stub.Info(pb.InfoRequest()).sleeping


@pytest.mark.parametrize("level", [1, 2])
def test_wakeup_weights_only_keeps_admission_closed_then_output_unchanged(sleepy, level):
    stub, adm = sleepy.stub(), admin(sleepy)
    before = greedy(stub)
    adm.Sleep(pb.SleepRequest(level=level))
    adm.Sleep(pb.SleepRequest(level=level))  # sleeping again is harmless
    if level == 2:
        assert stub.Info(pb.InfoRequest()).weights_bytes == 0
    adm.Wakeup(pb.WakeupRequest(tags=["weights"]))
    info = stub.Info(pb.InfoRequest())
    assert list(info.sleeping_tags) == ["kv_cache"] and info.weights_bytes > 0
    assert code_of(lambda: greedy(stub)) == grpc.StatusCode.UNAVAILABLE
    adm.Wakeup(pb.WakeupRequest(tags=["weights"]))  # awake already: no-op
    adm.Wakeup(pb.WakeupRequest(tags=["kv_cache"]))
    assert greedy(stub) == before
    assert_idle(sleepy)


def test_a_sleep_that_fails_part_way_is_woken_whole(sleepy, monkeypatch):
    """One loop cannot free its KV cache: the Sleep fails INTERNAL, after the other loop slept. A Sleep again
    (level 2: on the CPU level 1 leaves the weights be) frees it, though the weights then cannot be offloaded. Wakeup still wakes every part, and no session lives
    on: a turn of a session from before is NOT_FOUND (its loop ended it), never run over an empty history."""
    if sleepy.engine.config.dp_backend != "thread":
        pytest.skip("a loop's runner is replaced in this process: ranks as threads only")
    stub, adm, engine = sleepy.stub(), admin(sleepy), sleepy.engine
    sessions = [stub.Start(pb.StartRequest()).session_id for _ in range(4)]  # both loops hold some
    for sid in sessions:
        list(stub.Generate(pb.GenerateRequest(session_id=sid, tokens=PROMPT, sampling=GREEDY)))

    def fails() -> None:
        raise RuntimeError("injected failure")

    restored = []
    try:
        monkeypatch.setattr(engine.ranks.loops[1].runner, "release_kv_cache", fails)
        assert code_of(lambda: adm.Sleep(pb.SleepRequest(level=1))) == grpc.StatusCode.INTERNAL
        monkeypatch.undo()
        assert set(stub.Info(pb.InfoRequest()).sleeping_tags) == {"kv_cache"}
        monkeypatch.setattr(engine.ranks, "offload_weights", fails)
        monkeypatch.setattr(
            engine.ranks, "restore_weights", lambda real=engine.ranks.restore_weights: restored.append(real())
        )
        assert code_of(lambda: adm.Sleep(pb.SleepRequest(level=2))) == grpc.StatusCode.INTERNAL
        assert stub.Info(pb.InfoRequest()).kv_cache_bytes == 0  # the Sleep again freed what the first could not
    finally:
        adm.Wakeup(pb.WakeupRequest())  # the module's server awake again, whatever failed
        monkeypatch.undo()
    assert restored and not stub.Info(pb.InfoRequest()).sleeping
    for sid in sessions:
        assert (
            code_of(lambda: list(stub.Generate(pb.GenerateRequest(session_id=sid, tokens=PROMPT, sampling=GREEDY))))
            == grpc.StatusCode.NOT_FOUND
        )
        stub.End(pb.EndRequest(session_id=sid))
    assert len(greedy(stub)) == GREEDY.max_new_tokens
    assert_idle(sleepy)


def test_sleep_and_wakeup_reject_bad_arguments(sleepy):
    adm = admin(sleepy)
    for level in (0, 3):
        assert code_of(lambda: adm.Sleep(pb.SleepRequest(level=level))) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: adm.Wakeup(pb.WakeupRequest(tags=["gpu"]))) == grpc.StatusCode.INVALID_ARGUMENT
    assert not sleepy.info().sleeping


def test_fifty_sleep_cycles_under_load(sleepy):
    stub, adm = sleepy.stub(), admin(sleepy)
    reference = greedy(stub)
    stop = threading.Event()
    rng = random.Random(7)

    def client(seed: int) -> int:
        """Generates until told to stop; every stream must end with tokens, CANCELLED, or UNAVAILABLE."""
        local, done = random.Random(seed), 0
        while not stop.is_set():
            try:
                msgs = list(
                    stub.Generate(
                        pb.GenerateRequest(
                            tokens=PROMPT,
                            sampling=pb.SamplingParams(max_new_tokens=local.randint(1, 16), ignore_eos=True),
                        )
                    )
                )
                ids = [t for m in msgs for t in m.token_ids]
                assert ids == reference[: len(ids)]
                assert msgs[-1].finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_CANCELLED)
                done += 1
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE, err
                time.sleep(0.01)
        return done

    with ThreadPoolExecutor(8) as pool:
        clients = [pool.submit(client, i) for i in range(8)]
        for _ in range(50):
            time.sleep(rng.uniform(0, 0.3))
            adm.Sleep(pb.SleepRequest(level=2 if rng.random() < 0.1 else 1))  # level 2 reloads the weights
            if rng.random() < 0.5:
                adm.Wakeup(pb.WakeupRequest(tags=["weights"]))
            adm.Wakeup(pb.WakeupRequest())
        stop.set()
        assert sum(f.result(timeout=300) for f in clients) > 0
    assert_idle(sleepy)
    info = sleepy.info()
    assert not info.sleeping and info.active_sessions == 0
    assert greedy(stub) == reference


def save_hf_dir(path, config, weights: dict[str, torch.Tensor], tokenizer_dir: str) -> str:
    """A Hugging Face model directory: config.json, model.safetensors and the tokenizer files."""
    path.mkdir()
    (path / "config.json").write_text(
        json.dumps(
            {
                "architectures": [config.architecture],
                "vocab_size": config.vocab_size,
                "hidden_size": config.hidden_size,
                "intermediate_size": config.intermediate_size,
                "num_hidden_layers": config.num_layers,
                "num_attention_heads": config.num_heads,
                "num_key_value_heads": config.num_kv_heads,
                "head_dim": config.head_dim,
                "rms_norm_eps": config.rms_norm_eps,
                "rope_theta": config.rope_theta,
                "max_position_embeddings": config.max_position_embeddings,
                "tie_word_embeddings": config.tie_word_embeddings,
            }
        )
    )
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), path / name)
    return str(path)


def changed_checkpoints(root, gguf_path: str, checkpoint, tokenizer_dir: str) -> dict[str, str]:
    """The embedded model as a HF directory with some weights changed, and a model of another shape, under
    `root` (the session's `checkpoints` fixture, tests/conftest.py)."""
    weights = expand_blocks(checkpoint.weights)  # the GGUF's blocks as float32, to save as safetensors
    changed = dict(weights)
    for i in range(4):
        name = f"model.layers.{i}.mlp.down_proj.weight"
        changed[name] = -changed[name]
    small_config = dataclasses.replace(
        checkpoint.config, hidden_size=64, intermediate_size=128, num_layers=2, head_dim=16
    )
    generator = torch.Generator().manual_seed(0)
    small = {
        k: torch.randn(_small_shape(k, v.shape, small_config), generator=generator)
        for k, v in weights.items()
        if not k.startswith("model.layers.") or k.startswith(("model.layers.0.", "model.layers.1."))
    }
    return {
        "changed": save_hf_dir(root / "changed", checkpoint.config, changed, tokenizer_dir),
        "other_shape": save_hf_dir(root / "other_shape", small_config, small, tokenizer_dir),
        # the same weights run with other settings, as Mistral 7B v0.1 and v0.2 share their shapes
        "other_rope": save_hf_dir(
            root / "other_rope", dataclasses.replace(checkpoint.config, rope_theta=500.0), weights, tokenizer_dir
        ),
        "short_context": save_hf_dir(
            root / "short_context",
            dataclasses.replace(checkpoint.config, max_position_embeddings=1024),
            weights,
            tokenizer_dir,
        ),
        "original": gguf_path,
    }


def _small_shape(name: str, shape: torch.Size, cfg) -> tuple[int, ...]:
    """The shape `name` has in a model of config `cfg`, scaled down from the embedded model's."""
    big = {576: cfg.hidden_size, 1536: cfg.intermediate_size, 192: cfg.num_kv_heads * cfg.head_dim}
    return tuple(big.get(d, d) for d in shape)


def test_update_weights_changes_output_and_back(sleepy, checkpoints):
    stub, adm = sleepy.stub(), admin(sleepy)
    original = greedy(stub)
    adm.UpdateWeights(pb.UpdateWeightsRequest(path=checkpoints["changed"]))
    changed = greedy(stub)
    assert changed != original
    adm.UpdateWeights(pb.UpdateWeightsRequest(path=checkpoints["original"]))
    assert greedy(stub) == original


def test_frozen_startup_heap_still_frees_replaced_weights_at_once(checkpoint, checkpoints):
    """A running engine keeps what it loaded out of the collector's full passes (gc.freeze, thawed at
    shutdown), which never collect a frozen reference cycle: the weights an UpdateWeights replaces must be
    freed by their last reference going, or an accelerator would keep each old copy."""
    config = EngineConfig(dtype="float32", kv_cache_tokens=1024, dp_backend="thread")
    with Engine(config, checkpoint) as engine:
        assert gc.get_freeze_count() > 0
        old = weakref.ref(next(engine.ranks.weights.model.parameters()))
        gc.disable()
        try:
            engine.update_weights(checkpoints["changed"])
            assert old() is None
        finally:
            gc.enable()
    assert gc.get_freeze_count() == 0


def test_update_weights_runs_the_new_checkpoint_with_its_own_settings(sleepy, checkpoints):
    """A checkpoint of the same shapes with another rope_theta runs with its own: its tokens are those of an
    engine that served it from the start (it ran with the served model's). One whose context is shorter than
    the server's is refused."""
    stub, adm = sleepy.stub(), admin(sleepy)
    original = greedy(stub)
    with Engine(
        EngineConfig(
            model=checkpoints["other_rope"],
            dtype="float32",
            kv_cache_tokens=1024,
            threads=sleepy.engine.threads_per_loop,
        )
    ) as alone:  # summing as each loop does
        want = alone.generate(
            list(PROMPT.ids), SamplingParams(max_new_tokens=GREEDY.max_new_tokens, ignore_eos=True)
        ).token_ids
    try:
        adm.UpdateWeights(pb.UpdateWeightsRequest(path=checkpoints["other_rope"]))
        assert greedy(stub) == want != original
        assert stub.Info(pb.InfoRequest()).model == checkpoints["other_rope"]
        with pytest.raises(grpc.RpcError) as err:
            adm.UpdateWeights(pb.UpdateWeightsRequest(path=checkpoints["short_context"]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "context" in err.value.details()
        assert greedy(stub) == want
    finally:
        adm.UpdateWeights(pb.UpdateWeightsRequest(path=checkpoints["original"]))
    assert greedy(stub) == original


def test_update_weights_one_rank_cannot_load_leaves_every_rank_on_the_old_weights(sleepy, checkpoints):
    """Rank processes each load the new weights; one runs out of memory doing so (its address space capped):
    the call fails and no rank switches, or requests would answer differently by the rank they reach."""
    if sleepy.engine.config.dp_backend != "process":
        pytest.skip("engine loops as threads share one model")
    stub, adm = sleepy.stub(), admin(sleepy)
    original = greedy(stub)
    pid = max(p.pid for p in sleepy.engine.ranks._procs.values())  # this server's ranks, not another test's
    size = status_bytes(pid, "VmSize")
    _, hard = resource.prlimit(pid, resource.RLIMIT_AS)
    resource.prlimit(pid, resource.RLIMIT_AS, (size + (64 << 20), hard))  # far less than a copy of the weights
    try:
        with pytest.raises(grpc.RpcError) as err:
            adm.UpdateWeights(pb.UpdateWeightsRequest(path=checkpoints["changed"]))
    finally:
        resource.prlimit(pid, resource.RLIMIT_AS, (hard, hard))
    assert err.value.code() == grpc.StatusCode.INTERNAL, err.value
    assert [greedy(stub) for _ in range(4)] == [original] * 4  # round robin: each rank twice
    assert_idle(sleepy)


def test_a_load_staged_while_the_weights_are_dropped_is_undone_by_its_discard(checkpoint):
    """A rank asleep at level 2 only names a load's weights; when another rank fails to stage the same load,
    the discard names the old ones again, or this rank alone would wake up on the refused weights."""
    weights = LocalWeights(checkpoint, torch.float32, torch.device("cpu"), batch_hint=8)
    weights.drop()
    weights.load("/elsewhere/model", "refused", version=1)
    weights.discard_staged(1)
    assert (weights.path, weights.weight_version) == (checkpoint.path, "0")


def test_an_install_hands_back_the_source_it_replaced_for_its_caller_to_let_go_of(checkpoint):
    """A rank answers an install before the weights' former source goes (unmapping a pushed 2.47 GB took
    0.4-0.5 s, paused requests waiting): `install_staged` returns it, and nothing else holds it any more."""
    floats = expand_blocks(checkpoint.weights)
    weights = LocalWeights(checkpoint, torch.float32, torch.device("cpu"), batch_hint=8)
    first = PushedWeights(checkpoint.config, {name: t.clone() for name, t in floats.items()})
    weights.load(first, "first", version=1, in_place=True)
    weights.install_staged(1)
    weights.load(PushedWeights(checkpoint.config, floats), "second", version=2, in_place=True)
    first_norm = weakref.ref(first.tensors["model.norm.weight"])
    del first
    replaced = weights.install_staged(2)
    assert weights.weight_version == "second" and first_norm() is not None
    del replaced
    assert first_norm() is None


@pytest.fixture(scope="module")
def not_checkpoints(tmp_path_factory) -> dict[str, str]:
    """Paths an operator could pass by mistake, each with words its refusal must say."""
    root = tmp_path_factory.mktemp("not_ckpt")
    (root / "notes.gguf").write_text("not a model")
    (root / "empty").mkdir()
    (root / "bad_json").mkdir()
    (root / "bad_json" / "config.json").write_text("{not json")
    (root / "no_fields").mkdir()
    (root / "no_fields" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    readme = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
    return {
        "/nonexistent/model": "does not exist",
        readme: "not a readable GGUF file",
        str(root / "notes.gguf"): "not a readable GGUF file",
        str(root / "empty"): "has no config.json",
        str(root / "bad_json"): "not a readable Hugging Face model directory",
        str(root / "no_fields"): "not a readable Hugging Face model directory",
        "": "path is required",
    }


def test_update_weights_refuses_mismatch_and_keeps_serving(sleepy, checkpoints, not_checkpoints):
    stub, adm = sleepy.stub(), admin(sleepy)
    original = greedy(stub)
    refusals = {checkpoints["other_shape"]: "does not match the served model", **not_checkpoints}
    for path, words in refusals.items():
        with pytest.raises(grpc.RpcError) as err:
            adm.UpdateWeights(pb.UpdateWeightsRequest(path=path))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details(), path
    assert greedy(stub) == original
    assert_idle(sleepy)


def health_of(server, service: str) -> int:
    with server.channel() as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service)).status


def test_health_not_serving_while_asleep_serving_after_full_wakeup(sleepy):
    adm = admin(sleepy)
    inference, admin_service = "lmgate.v1.Inference", "lmgate.v1.Admin"
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert [health_of(sleepy, s) for s in ("", inference, admin_service)] == [serving] * 3
    adm.Sleep(pb.SleepRequest(level=1))
    assert [health_of(sleepy, s) for s in ("", inference, admin_service)] == [not_serving, not_serving, serving]
    adm.Wakeup(pb.WakeupRequest(tags=["weights"]))  # partly awake: Generate is still refused
    assert health_of(sleepy, inference) == not_serving
    adm.Wakeup(pb.WakeupRequest(tags=["kv_cache"]))
    assert [health_of(sleepy, s) for s in ("", inference, admin_service)] == [serving] * 3
    assert code_of(lambda: adm.Sleep(pb.SleepRequest(level=3))) == grpc.StatusCode.INVALID_ARGUMENT
    assert health_of(sleepy, inference) == serving  # a refused Sleep changes nothing


def in_an_admin_call(engine) -> bool:
    """Whether some thread is inside `Engine._admin` (waiting for its lock, when the test holds it)."""
    for frame in sys._current_frames().values():
        while frame is not None:
            if frame.f_code is engine._admin.__wrapped__.__code__:
                return True
            frame = frame.f_back
    return False


def test_health_follows_an_admin_call_whose_caller_left(sleepy):
    """A Sleep or Wakeup whose caller leaves (a deadline, a cancel) still runs to its end, and health follows
    what the engine did: else a load balancer keeps sending work to a sleeping replica, or never again to an
    awake one."""
    adm = admin(sleepy)
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    for call, request, health, tags in (
        (adm.Sleep, pb.SleepRequest(level=1), not_serving, ["kv_cache"]),
        (adm.Wakeup, pb.WakeupRequest(), serving, []),
    ):
        with sleepy.engine._admin_lock:  # the engine call waits here until its caller has gone
            future = call.future(request)
            guard = time.monotonic() + 60  # a hang guard, not a timing
            while not in_an_admin_call(sleepy.engine):
                assert time.monotonic() < guard, "the admin call never reached the engine"
                time.sleep(0.01)
            future.cancel()
            time.sleep(0.5)  # for the cancel to reach the server first (without it the test could miss the bug)
        while sorted(sleepy.info().sleeping_tags) != tags or health_of(sleepy, "lmgate.v1.Inference") != health:
            assert time.monotonic() < guard, f"health says {health_of(sleepy, 'lmgate.v1.Inference')} after {call}"
            time.sleep(0.05)
    assert len(greedy(sleepy.stub())) == 16


def test_health_stays_not_serving_while_a_sleep_waits_behind_another_admin_call(sleepy):
    """From the moment Sleep is called, health says NOT_SERVING and new work is refused: another admin call
    that ends meanwhile (here one refused at once) must not turn it back to SERVING while the Sleep has still
    to run."""
    adm = admin(sleepy)
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    try:
        with sleepy.engine._admin_lock:  # the Sleep waits here
            sleeping = adm.Sleep.future(pb.SleepRequest(level=1))
            guard = time.monotonic() + 60  # a hang guard, not a timing
            while not in_an_admin_call(sleepy.engine):
                assert time.monotonic() < guard, "the Sleep never reached the engine"
                time.sleep(0.01)
            assert health_of(sleepy, "lmgate.v1.Inference") == not_serving
            assert code_of(lambda: greedy(sleepy.stub())) == grpc.StatusCode.UNAVAILABLE  # admission closed already
            assert (
                code_of(lambda: adm.UpdateWeights(pb.UpdateWeightsRequest(path=""))) == grpc.StatusCode.INVALID_ARGUMENT
            )
            assert health_of(sleepy, "lmgate.v1.Inference") == not_serving
    finally:
        sleeping.result(timeout=60)
        adm.Wakeup(pb.WakeupRequest())  # the module's server awake again, whatever failed
    assert health_of(sleepy, "lmgate.v1.Inference") == health_pb2.HealthCheckResponse.SERVING


def test_rl_loop_sleep_wake_weights_update_wake_kv(sleepy, checkpoints):
    """The trainer's loop: sleep, wake the weights, load new ones, wake the KV cache; or load them while the
    weights sleep at level 2 (only named then: the wake-up builds them)."""
    stub, adm = sleepy.stub(), admin(sleepy)
    original = greedy(stub)
    adm.Sleep(pb.SleepRequest(level=2))
    adm.Wakeup(pb.WakeupRequest(tags=["weights"]))
    adm.UpdateWeights(pb.UpdateWeightsRequest(path=checkpoints["changed"]))
    adm.Wakeup(pb.WakeupRequest(tags=["kv_cache"]))
    changed = greedy(stub)
    assert changed != original
    adm.Sleep(pb.SleepRequest(level=2))
    adm.UpdateWeights(pb.UpdateWeightsRequest(path=checkpoints["original"]))
    adm.Wakeup(pb.WakeupRequest())
    assert greedy(stub) == original
    adm.UpdateWeights(pb.UpdateWeightsRequest(path=checkpoints["changed"]))
    assert greedy(stub) == changed
    adm.UpdateWeights(pb.UpdateWeightsRequest(path=checkpoints["original"]))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc to read a process's RSS")
def test_level2_sleep_releases_weights_memory():
    proc, address = start_server("--kv-cache-tokens", "1024")
    try:
        channel = grpc.insecure_channel(address)
        stub, adm = pb_grpc.InferenceStub(channel), pb_grpc.AdminStub(channel)
        weights = stub.Info(pb.InfoRequest()).weights_bytes
        before = status_bytes(proc.pid)
        adm.Sleep(pb.SleepRequest(level=2))
        after = status_bytes(proc.pid)
        assert before - after >= 0.8 * weights, (before, after, weights)
        adm.Wakeup(pb.WakeupRequest())
        assert len(greedy(stub)) == 16
    finally:
        proc.kill()


def test_admin_auth_with_token(checkpoint):
    server = ServerThread(EngineConfig(dtype="float32", kv_cache_tokens=1024), checkpoint, admin_token="s3cret")
    try:
        adm = pb_grpc.AdminStub(server.channel())
        wake = pb.WakeupRequest(tags=["kv_cache"])
        assert code_of(lambda: adm.Wakeup(wake)) == grpc.StatusCode.UNAUTHENTICATED
        assert (
            code_of(lambda: adm.Wakeup(wake, metadata=[("authorization", "Bearer nope")]))
            == grpc.StatusCode.PERMISSION_DENIED
        )
        assert code_of(lambda: adm.Wakeup(wake, metadata=[("authorization", "Bearer s3cret")])) is None
        assert code_of(lambda: adm.Wakeup(wake, metadata=[("authorization", "bearer s3cret")])) is None  # RFC 7235
        assert (
            code_of(lambda: adm.Wakeup(wake, metadata=[("authorization", "Basic s3cret")]))
            == grpc.StatusCode.UNAUTHENTICATED
        )
        assert server.info().vocab_size  # Inference needs no token
    finally:
        server.stop()


def test_admin_without_token_accepts_loopback(sleepy):
    assert code_of(lambda: admin(sleepy).Wakeup(pb.WakeupRequest(tags=["kv_cache"]))) is None


@pytest.mark.parametrize(
    "peer, local",
    [
        ("ipv4:127.0.0.1:50051", True),
        ("ipv4:127.8.9.1:1", True),
        ("ipv6:[::1]:50051", True),
        ("ipv6:%5B::1%5D:50051", True),  # as grpcio 1.85 writes it
        ("unix:/tmp/lmgate.sock", True),
        ("ipv4:10.1.2.3:50051", False),
        ("ipv4:192.168.1.20:4000", False),
        ("ipv6:[2001:db8::1]:443", False),
        ("ipv6:%5B2001:db8::1%5D:443", False),
        ("ipv6:[::ffff:10.0.0.1]:80", False),
        ("garbage", False),
    ],
)
def test_loopback_rule_on_peer_strings(peer, local):
    assert is_loopback_peer(peer) is local


def _ipv6_loopback() -> bool:
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback")
@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_serves_on_ipv6_loopback_and_takes_admin_calls_from_there(host):
    proc, address = serve_process("--host", host, "--kv-cache-tokens", "1024")
    try:
        assert address.startswith("[::1]:")
        with grpc.insecure_channel(address) as channel:
            assert len(greedy(pb_grpc.InferenceStub(channel))) == 16
            pb_grpc.AdminStub(channel).Wakeup(pb.WakeupRequest())  # loopback, no token: allowed
    finally:
        proc.kill()
        proc.wait()


def test_metrics_endpoint_exports_sleep_state(sleepy):
    httpd, thread = start_http_server(0, addr="127.0.0.1", registry=sleepy.server.metrics.registry)
    try:
        greedy(sleepy.stub())
        admin(sleepy).Sleep(pb.SleepRequest(level=1))
        url = f"http://127.0.0.1:{httpd.server_port}/metrics"
        text = urllib.request.urlopen(url).read().decode()
        model = sleepy.server.metrics.model_name
        assert f'lmgate_sleeping{{model_name="{model}",tag="kv_cache"}} 1.0' in text
        assert f'lmgate_sleep_transitions_total{{model_name="{model}",transition="sleep_level_1"}}' in text
        assert "lmgate_output_tokens_total" in text and "lmgate_time_to_first_token_seconds_count" in text
        admin(sleepy).Wakeup(pb.WakeupRequest(tags=["weights", "kv_cache", "weights"]))  # a tag named twice once
        text = urllib.request.urlopen(url).read().decode()
        assert f'lmgate_sleeping{{model_name="{model}",tag="kv_cache"}} 0.0' in text
        assert 'transition="wakeup_kv_cache_weights"} 1.0' in text
        assert "weights_weights" not in text
    finally:
        httpd.shutdown()
