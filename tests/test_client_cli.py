"""The Python client and the `lmgate` command: request building and argument parsing (pure), then every
call against a real server with the embedded model on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import math
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable

import grpc
import pytest

from lmgate.client import AsyncClient, Client, Delta, Session, Tls
from lmgate.client import bench
from lmgate.client.cli import SAMPLING_FLAGS, _sampling, build_parser, main
from lmgate.client.wire import SAMPLING_FIELDS, bearer_metadata, generate_request, sampling_params, to_delta
from lmgate.engine.config import EngineConfig
from lmgate.engine.sampling.sampler import SamplingParams
from lmgate.v1 import lmgate_pb2 as pb
from tests.serving import ServerThread
from tests.test_service import assert_idle as settled

GUARD = 300  # seconds: a guard against a hang, never a performance bound

# --------------------------------------------------------------------------- request building


def test_prompt_messages_and_token_ids_fill_the_oneof():
    r = generate_request("Hello", session_id=7, request_id="r1")
    assert (r.WhichOneof("input"), r.prompt, r.session_id, r.request_id) == ("prompt", "Hello", 7, "r1")

    r = generate_request(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert r.WhichOneof("input") == "messages"
    assert [(m.role, m.content) for m in r.messages.messages] == [("system", "Be brief."), ("user", "Hi")]

    r = generate_request(token_ids=[5, 6, 7])
    assert (r.WhichOneof("input"), list(r.tokens.ids)) == ("tokens", [5, 6, 7])


def test_empty_inputs_are_still_sent_for_the_server_to_refuse():
    assert generate_request("").WhichOneof("input") == "prompt"
    assert generate_request(messages=[]).WhichOneof("input") == "messages"
    assert generate_request(token_ids=[]).WhichOneof("input") == "tokens"


@pytest.mark.parametrize("inputs", [{}, {"prompt": "a", "token_ids": [1]}, {"prompt": "a", "messages": []}])
def test_exactly_one_input(inputs):
    with pytest.raises(TypeError, match="exactly one of"):
        generate_request(**inputs)


def test_every_sampling_field_is_a_keyword():
    values = dict(
        max_new_tokens=16,
        min_new_tokens=2,
        temperature=0.5,
        top_p=0.75,
        top_k=40,
        min_p=0.125,
        repetition_penalty=1.25,
        presence_penalty=-0.5,
        frequency_penalty=0.5,
        seed=0,
        stop=["\n\n", "END"],
        stop_token_ids=[2, 3],
        ignore_eos=True,
        logprobs=5,
        include_special_tokens=True,
        n=3,
        logit_bias={5: 1.5},
        prompt_logprobs=0,
        keep_kv_on_update=True,
    )
    constraints = dict(json_schema="{}", regex="a+", grammar="root ::= 'a'", json_object=True, structural_tag="{}")
    assert set(values) | set(constraints) | {"choice", "logprobs_mode"} == SAMPLING_FIELDS
    s = generate_request("x", **values).sampling
    for name, value in values.items():
        got = getattr(s, name)
        assert (list(got) if isinstance(value, list) else dict(got) if isinstance(value, dict) else got) == value, name
    assert s.HasField("seed") and s.HasField("prompt_logprobs")  # 0 is a value, not "unset"
    for name, value in constraints.items():  # a oneof: one at a time
        assert getattr(generate_request("x", **{name: value}).sampling, name) == value
    choice = generate_request("x", choice=["yes", "no"]).sampling  # a list of strings will do
    assert choice.WhichOneof("constraint") == "choice" and list(choice.choice.choices) == ["yes", "no"]
    processed = generate_request("x", logprobs_mode="processed").sampling  # by name, not number
    assert processed.logprobs_mode == pb.LOGPROBS_MODE_PROCESSED


def test_sampling_none_means_unset_and_a_string_is_one_stop():
    s = sampling_params(seed=None, temperature=None, stop="\n", stop_token_ids=None)
    assert not s.HasField("seed") and s.temperature == 0
    assert list(s.stop) == ["\n"]
    assert generate_request("x").sampling == pb.SamplingParams()


def test_unknown_sampling_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="max_tokens"):
        generate_request("x", max_tokens=3)
    with pytest.raises(TypeError, match="max_tokens"):  # before anything is sent: no server listens here
        Client("127.0.0.1:1").generate("x", max_tokens=3)


def test_wrong_sampling_type_is_a_type_error():
    with pytest.raises(TypeError):
        sampling_params(temperature="hot")


@pytest.mark.parametrize(
    "name, value, limits",
    [
        ("seed", -1, "0..18446744073709551615"),
        ("seed", 2**64, "0..18446744073709551615"),
        ("max_new_tokens", 2**32, "0..4294967295"),
        ("top_k", 2**31, "-2147483648..2147483647"),
        ("logprobs", -1, "0..4294967295"),
        ("stop_token_ids", [2, 2**32], "0..4294967295"),
    ],
)
def test_an_out_of_range_sampling_integer_is_a_value_error_naming_it(name, value, limits):
    """Not protobuf's bare "Value out of range": the parameter and its range, before anything is sent."""
    bad = value[-1] if isinstance(value, list) else value
    message = f"^{name} must be in {limits}, got {bad}$"
    with pytest.raises(ValueError, match=message):
        sampling_params(**{name: value})
    with pytest.raises(ValueError, match=message):  # no server listens here
        Client("127.0.0.1:1").generate("x", **{name: value})

    async def from_the_async_client() -> None:
        async with AsyncClient("127.0.0.1:1") as client:
            client.generate("x", **{name: value})

    with pytest.raises(ValueError, match=message):
        asyncio.run(from_the_async_client())


def test_sampling_integers_at_their_fields_limits_are_kept():
    s = sampling_params(seed=2**64 - 1, max_new_tokens=2**32 - 1, top_k=-(2**31), stop_token_ids=[0, 2**32 - 1])
    assert (s.seed, s.max_new_tokens, s.top_k, list(s.stop_token_ids)) == (
        2**64 - 1,
        2**32 - 1,
        -(2**31),
        [0, 2**32 - 1],
    )


def test_to_delta_mid_stream_and_last():
    mid = to_delta(
        pb.GenerateResponse(
            request_id="r",
            session_id=3,
            token_ids=[1, 2],
            text="ab",
            logprobs=[
                pb.TokenLogprob(
                    token_id=1, token="a", logprob=-0.5, top=[pb.TopLogprob(token_id=1, token="a", logprob=-0.5)]
                ),
                pb.TokenLogprob(token_id=2, token="b", logprob=-1.0),
            ],
        )
    )
    assert mid == Delta(
        request_id="r",
        session_id=3,
        token_ids=[1, 2],
        text="ab",
        logprobs=[
            {"token_id": 1, "token": "a", "logprob": -0.5, "top": [{"token_id": 1, "token": "a", "logprob": -0.5}]},
            {"token_id": 2, "token": "b", "logprob": -1.0, "top": []},
        ],
        finish_reason=None,
        usage=None,
    )
    for reason, name in (
        (pb.FINISH_REASON_STOP, "stop"),
        (pb.FINISH_REASON_LENGTH, "length"),
        (pb.FINISH_REASON_CANCELLED, "cancelled"),
    ):
        last = to_delta(pb.GenerateResponse(finish_reason=reason, usage=pb.Usage(prompt_tokens=4, completion_tokens=2)))
        assert last.finish_reason == name
        assert last.usage == {"prompt_tokens": 4, "completion_tokens": 2, "cached_tokens": 0}


def test_bearer_metadata_carries_the_token():
    assert bearer_metadata(None) == ()
    assert bearer_metadata("s3cret") == (("authorization", "Bearer s3cret"),)


# --------------------------------------------------------------------------- argument parsing

SUBCOMMANDS = ("generate", "chat", "info", "tokenize", "sleep", "wakeup", "pause", "resume", "update-weights", "bench")


@pytest.mark.parametrize("command", ("--help",) + tuple(f"{c} --help" for c in SUBCOMMANDS))
def test_help_exits_zero(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main(command.split())
    assert exc.value.code == 0
    assert "usage: lmgate" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["nope"],
        ["generate"],
        ["generate", "x", "--bogus"],
        ["tokenize"],
        ["update-weights"],
        ["sleep", "--level", "3"],
        ["wakeup", "--tags", "everything"],
        ["generate", "x", "--seed", "-1"],
        ["bench", "--concurrency", "0"],
        ["bench", "--num-prompts", "0"],
        ["bench", "--request-rate", "0"],
        ["bench", "--input-len", "0"],
        ["bench", "--temperature", "nan"],
        ["generate", "x", "--max-new-tokens", str(2**32)],
        ["generate", "x", "--seed", str(2**64)],
        ["chat", "--top-k", str(2**31)],
        ["generate", "x", "--logprobs", str(2**32)],
        ["info", "--tls-cert", "c.pem"],
        ["info", "--tls-key", "k.pem"],  # grpc aborts the process on a lone cert
        ["generate", "x", "--prompt-file", "p.txt"],
        ["generate", "--prompt-file"],
    ],
)
def test_bad_arguments_exit_two(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_common_flags_on_every_subcommand_with_environment_defaults(monkeypatch):
    monkeypatch.setenv("LMGATE_TARGET", "10.0.0.1:6000")
    monkeypatch.setenv("LMGATE_ADMIN_TOKEN", "tok")
    parser = build_parser()
    required = {"generate": ["x"], "tokenize": ["x"], "update-weights": ["/m"]}
    for command in SUBCOMMANDS:
        args = parser.parse_args([command, *required.get(command, [])])
        assert (args.target, args.admin_token) == ("10.0.0.1:6000", "tok"), command
        args = parser.parse_args([command, *required.get(command, []), "--target", "h:1", "--admin-token", "t2"])
        assert (args.target, args.admin_token) == ("h:1", "t2"), command


@pytest.mark.parametrize(
    "value, tls", [("", False), ("0", False), ("false", False), ("No", False), ("1", True), ("true", True)]
)
def test_lmgate_tls_is_read_as_a_yes_or_no(monkeypatch, value, tls):
    monkeypatch.setenv("LMGATE_TLS", value)
    assert build_parser().parse_args(["info"]).tls is tls


def test_the_servers_own_certificate_variables_are_not_the_clients(monkeypatch):
    """An operator runs `lmgate sleep` where the server's LMGATE_TLS_CERT / _KEY are set: the CLI does not
    present the server's certificate as its own; its own are LMGATE_CLIENT_CERT / _KEY."""
    monkeypatch.setenv("LMGATE_TLS_CERT", "server.pem")
    monkeypatch.setenv("LMGATE_TLS_KEY", "server-key.pem")
    args = build_parser().parse_args(["info"])
    assert (args.tls_cert, args.tls_key) == (None, None)
    monkeypatch.setenv("LMGATE_CLIENT_CERT", "client.pem")
    monkeypatch.setenv("LMGATE_CLIENT_KEY", "client-key.pem")
    args = build_parser().parse_args(["info"])
    assert (args.tls_cert, args.tls_key) == ("client.pem", "client-key.pem")


@pytest.mark.parametrize("cert, key", [("c.pem", None), (None, "k.pem")])
def test_a_client_certificate_without_its_key_is_refused(cert, key):
    with pytest.raises(ValueError, match="cert and key go together"):
        Tls(cert=cert, key=key)


def test_sampling_flags_are_sampling_fields():
    assert set(SAMPLING_FLAGS) <= SAMPLING_FIELDS
    args = build_parser().parse_args(
        "generate hi --max-new-tokens 9 --temperature 0.7 --top-p 0.9 --top-k 5 --seed 1 --stop a --stop b --stop c --ignore-eos".split()
    )
    s = sampling_params(**{name: getattr(args, name) for name in SAMPLING_FLAGS})
    assert (s.max_new_tokens, s.top_k, s.seed, list(s.stop), s.ignore_eos) == (9, 5, 1, ["a", "b", "c"], True)
    assert s.temperature == pytest.approx(0.7) and s.top_p == pytest.approx(0.9)
    choice = sampling_params(**_sampling(build_parser().parse_args("generate hi --choice a --choice b".split())))
    assert list(choice.choice.choices) == ["a", "b"]
    assert sampling_params(**_sampling(build_parser().parse_args(["generate", "hi", "--regex", "x+"]))).regex == "x+"


def test_bench_defaults():
    args = build_parser().parse_args(["bench"])
    assert args.request_rate == math.inf and not args.ignore_eos and args.json is None
    assert build_parser().parse_args(["bench", "--request-rate", "inf"]).request_rate == math.inf


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("lmgate ")


def test_serve_forwards_its_flags_to_the_server(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "lmgate serve" in out and "--engine-loops" in out


# --------------------------------------------------------------------------- against the real server

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def guarded(checkpoint):
    """A server of its own with an admin token: these tests put it to sleep."""
    s = ServerThread(EngineConfig(dtype="float32", kv_cache_tokens=4096), checkpoint, admin_token="s3cret")
    yield s
    s.stop()


def engine_text(server, prompt: str, n: int) -> tuple[list[int], str]:
    out = server.engine.generate(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True))
    return out.token_ids, server.engine.tokenizer.decode(out.token_ids)


def assert_idle(server) -> None:
    info = server.info()
    assert info.kv_blocks_free == info.kv_blocks_total and info.active_sessions == 0


def test_client_generate_tokenize_info(server):
    ids, text = engine_text(server, PROMPT, 12)
    with Client(server.address) as client:
        deltas = list(client.generate(PROMPT, request_id="mine", max_new_tokens=12, ignore_eos=True))
        assert [t for d in deltas for t in d.token_ids] == ids
        assert "".join(d.text for d in deltas) == text
        assert {d.request_id for d in deltas} == {"mine"}
        assert all(d.finish_reason is None and d.usage is None for d in deltas[:-1])
        last = deltas[-1]
        assert last.finish_reason == "length"
        assert last.usage == {
            "prompt_tokens": len(client.tokenize(PROMPT)),
            "completion_tokens": 12,
            "cached_tokens": 0,
        }
        assert client.tokenize(PROMPT) == server.engine.tokenizer.encode(PROMPT)
        assert client.info().vocab_size == server.engine.model_config.vocab_size
        with pytest.raises(grpc.RpcError) as exc:
            list(client.generate(PROMPT, session_id=404))
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    assert_idle(server)


def test_session_two_turns_cancel_and_end_on_exit(server):
    with Client(server.address) as client:
        with client.start() as session:
            assert isinstance(session, Session) and session.id > 0
            first = list(session.generate(messages=[{"role": "user", "content": "Hi"}], max_new_tokens=6))
            second = list(session.generate("Tell me more.", max_new_tokens=6))
            assert second[-1].usage["cached_tokens"] >= first[-1].usage["prompt_tokens"]
            long = session.generate("Count to a thousand.", max_new_tokens=500, ignore_eos=True)
            next(long)
            assert session.cancel()
            assert list(long)[-1].finish_reason == "cancelled"
            sid = session.id
        with pytest.raises(grpc.RpcError) as exc:  # the context manager ended it
            list(client.generate("Hi", session_id=sid))
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    assert_idle(server)


def test_a_session_turn_left_early_lets_the_next_follow_at_once(server):
    """Leaving a turn's stream early cancels the turn (by a Cancel call, then the stream): the next turn,
    sent at once, runs instead of being refused because the session is still generating."""
    with Client(server.address) as client:
        with client.start() as session:
            for _ in range(3):
                stream = session.generate("Count to a thousand.", max_new_tokens=500, ignore_eos=True)
                next(stream)
                stream.close()
                assert list(session.generate(" Go on.", max_new_tokens=4))[-1].finish_reason == "length"
            for _ in range(3):  # left by a `break` that keeps the stream: the next turn closes it first
                stream = session.generate("Count to a thousand.", max_new_tokens=500, ignore_eos=True)
                for _ in stream:
                    break
                assert list(session.generate(" Go on.", max_new_tokens=4))[-1].finish_reason == "length"
            # A turn not yet read is not yet sent: the next one does not close it, and it runs when read.
            unread = session.generate(" One.", max_new_tokens=2, ignore_eos=True)
            assert list(session.generate(" Two.", max_new_tokens=2))[-1].finish_reason == "length"
            assert list(unread)[-1].finish_reason == "length"
            # A turn whose last delta was read, its stream closed only once the next turn runs: that close
            # must not cancel the next turn.
            done = session.generate(" Two words.", max_new_tokens=2, ignore_eos=True)
            assert [next(done).finish_reason, next(done).finish_reason] == [None, "length"]
            running = session.generate(" Go on.", max_new_tokens=50, ignore_eos=True)
            next(running)
            done.close()
            assert list(running)[-1].finish_reason == "length"

    async def scenario() -> list[str | None]:
        reasons = []
        async with AsyncClient(server.address) as client:
            async with await client.start() as session:
                for _ in range(3):
                    stream = session.generate("Count to a thousand.", max_new_tokens=500, ignore_eos=True)
                    await anext(stream)
                    await stream.aclose()
                    reasons.append([d async for d in session.generate(" Go on.", max_new_tokens=4)][-1].finish_reason)
                for _ in range(3):  # asyncio closes a generator left by `break` only later, in a task of its own
                    async for _ in session.generate("Count to a thousand.", max_new_tokens=500, ignore_eos=True):
                        break
                    reasons.append([d async for d in session.generate(" Go on.", max_new_tokens=4)][-1].finish_reason)
                for _ in range(3):  # left by an exception thrown in while it waits (here a timeout's)
                    stream = session.generate("Count to a thousand.", max_new_tokens=500, ignore_eos=True)
                    await anext(stream)
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(0.01):  # the trigger, not a bound: 499 tokens take far longer
                            async for _ in stream:
                                pass
                    reasons.append([d async for d in session.generate(" Go on.", max_new_tokens=4)][-1].finish_reason)
        return reasons

    assert asyncio.run(scenario()) == ["length"] * 9
    assert_idle(server)


def test_a_resumable_sessions_history_leaves_out_a_turn_the_server_dropped(server, monkeypatch):
    """A step that fails mid-turn ends the turn INTERNAL. The client's history leaves the turn out, and the
    session ends (a proxy that breaks a call can leave the turn in the server's), so its next turn replays
    the history: it gets the tokens of a stateless request over the history."""
    runner = server.engine.ranks.loops[0].runner
    forward, failing = runner.forward, threading.Event()

    def forward_or_fail(*args, **kwargs):
        if failing.is_set():
            raise RuntimeError("injected step failure")
        return forward(*args, **kwargs)

    monkeypatch.setattr(runner, "forward", forward_or_fail)
    turn = dict(max_new_tokens=6, ignore_eos=True)
    with Client(server.address) as client:
        session = client.start(resume=True)
        list(session.generate("Tell me about the sea.", **turn))
        kept = session.history.text
        stream = session.generate(" And then?", max_new_tokens=400, ignore_eos=True)
        next(stream)
        failing.set()
        with pytest.raises(grpc.RpcError) as err:
            list(stream)
        failing.clear()
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert session.history.text == kept
        epoch = session.epoch
        following = [t for d in session.generate(" Why?", **turn) for t in d.token_ids]
        assert following == [t for d in client.generate(kept + " Why?", **turn) for t in d.token_ids]
        assert session.epoch != epoch  # started again, and replayed
        session.end()
    assert_idle(server)


def test_a_refused_turn_leaves_a_resumable_session_as_it_was(server):
    """A turn refused before its first message never ran: the session keeps its copy on the server (its KV
    cache and epoch) instead of starting again and replaying its conversation."""
    turn = dict(max_new_tokens=6, ignore_eos=True)
    with Client(server.address) as client:
        session = client.start(resume=True)
        list(session.generate("Tell me about the sea.", **turn))
        kept, epoch = session.history.text, session.epoch
        for bad in (dict(temperature=-1.0), dict(max_new_tokens=10**6)):
            with pytest.raises(grpc.RpcError) as err:
                list(session.generate(" And then?", **bad))
            assert err.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE)
        following = [t for d in session.generate(" Why?", **turn) for t in d.token_ids]
        assert session.epoch == epoch and session.history.text.startswith(kept)
        assert following == [t for d in client.generate(kept + " Why?", **turn) for t in d.token_ids]
        session.end()
    assert_idle(server)


def test_a_session_turn_left_before_its_first_token_is_cancelled_by_its_id(server):
    """A turn left while the server still reads its prompt (a timeout around the first token) is cancelled by
    a Cancel call naming its request id, which the client picked (dropping the stream alone reaches the
    server in no fixed order with the next turn, which could find the session still busy)."""
    sent = []

    async def scenario() -> None:
        async with AsyncClient(server.address) as client:
            cancel = client._inference.Cancel

            def recording_cancel(request, **options):
                sent.append(request.request_id)
                return cancel(request, **options)

            client._inference.Cancel = recording_cancel
            async with await client.start() as session:
                for _ in range(3):
                    left = session.generate("word " * 1500, max_new_tokens=4)
                    with pytest.raises(asyncio.TimeoutError):
                        await asyncio.wait_for(anext(left), 0.05)
                    deltas = [d async for d in session.generate("Hi.", max_new_tokens=2, ignore_eos=True)]
                    assert deltas[-1].finish_reason == "length"
                    assert deltas[-1].usage["prompt_tokens"] < 1500  # the turn left never joined the history

    asyncio.run(scenario())
    assert len(sent) == len(set(sent)) == 3 and all(sent)
    assert_idle(server)


def test_async_client_concurrent_streams_and_session(server):
    _, text = engine_text(server, PROMPT, 8)

    async def collect(deltas) -> str:
        return "".join([d.text async for d in deltas])

    async def scenario():
        async with AsyncClient(server.address) as client:
            texts = await asyncio.gather(
                *[collect(client.generate(PROMPT, max_new_tokens=8, ignore_eos=True)) for _ in range(4)]
            )
            async with await client.start() as session:
                turn = await collect(
                    session.generate(token_ids=await client.tokenize(PROMPT), max_new_tokens=8, ignore_eos=True)
                )
            return texts, turn, await client.tokenize("a")

    texts, turn, ids = asyncio.run(scenario())
    assert texts == [text] * 4 and turn == text and ids == server.engine.tokenizer.encode("a")
    assert_idle(server)


def test_admin_token_sleep_and_wakeup(guarded):
    with Client(guarded.address) as anonymous, Client(guarded.address, admin_token="wrong") as wrong:
        with pytest.raises(grpc.RpcError) as exc:
            anonymous.sleep(1)
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as exc:
            wrong.sleep(1)
        assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
    _, text = engine_text(guarded, PROMPT, 6)
    with Client(guarded.address, admin_token="s3cret") as client:
        client.sleep(1)
        assert client.info().sleeping
        with pytest.raises(grpc.RpcError) as exc:
            list(client.generate(PROMPT))
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        client.wakeup(["weights"])
        assert list(client.info().sleeping_tags) == ["kv_cache"]
        client.wakeup()
        assert "".join(d.text for d in client.generate(PROMPT, max_new_tokens=6, ignore_eos=True)) == text


def test_cli_generate_info_tokenize(server, capsys):
    _, text = engine_text(server, PROMPT, 5)
    assert main(["generate", PROMPT, "--target", server.address, "--max-new-tokens", "5", "--ignore-eos"]) == 0
    out, err = capsys.readouterr()
    assert out == text + "\n"
    assert "finish_reason=length" in err and "completion_tokens=5" in err
    assert main(["info", "--target", server.address]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["sleeping_tags"] == [] and info["vocab_size"] == server.engine.model_config.vocab_size
    assert main(["tokenize", "hi", "--target", server.address]) == 0
    assert json.loads(capsys.readouterr().out) == server.engine.tokenizer.encode("hi")


def test_cli_generate_logprobs_min_p_and_repetition_penalty(server, capsys):
    flags = [
        "--max-new-tokens",
        "4",
        "--ignore-eos",
        "--logprobs",
        "2",
        "--min-p",
        "0.05",
        "--repetition-penalty",
        "1.2",
    ]
    assert main(["generate", PROMPT, "--target", server.address, *flags]) == 0
    printed = capsys.readouterr()
    lines = [json.loads(line) for line in printed.err.splitlines() if line.startswith("{")]
    assert len(lines) == 4 and all(len(lp["top"]) == 2 and lp["logprob"] <= 0 for lp in lines)
    assert "".join(lp["token"] for lp in lines) + "\n" == printed.out  # each token named by its text
    assert all(alt["token"] for lp in lines for alt in lp["top"])
    # Processed: of the distribution drawn from (penalized, filtered), so other values for the same tokens
    assert main(["generate", PROMPT, "--target", server.address, *flags, "--logprobs-mode", "processed"]) == 0
    processed = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    assert [lp["token_id"] for lp in processed] == [lp["token_id"] for lp in lines]
    assert [lp["logprob"] for lp in processed] != [lp["logprob"] for lp in lines]


def test_cli_chat_keeps_one_session(server, capsys, monkeypatch):
    registry, model = server.server.metrics.registry, {"model_name": server.server.metrics.model_name}

    def counts() -> tuple[float, ...]:
        turns = sum(
            registry.get_sample_value("lmgate_requests_total", {**model, "reason": r}) or 0 for r in ("stop", "length")
        )
        return turns, *(
            registry.get_sample_value(f"lmgate_sessions_{e}_total", model) or 0 for e in ("started", "ended")
        )

    before = counts()
    too_long = "word " * server.engine.max_context_length
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"Hi\n\n{too_long}\nWhat is 2+2?\n"))
    assert main(["chat", "--target", server.address, "--system", "Be brief.", "--max-new-tokens", "8"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and err.startswith("error: OUT_OF_RANGE: ")
    # Two turns (the blank line is skipped, the one too long refused and reported) on one session, which the
    # chat ended.
    assert tuple(a - b for a, b in zip(counts(), before)) == (2, 1, 1)
    assert_idle(server)


def test_cli_chat_goes_on_after_its_session_expired(checkpoint, capsys, monkeypatch):
    """A chat that pauses past the server's --session-idle-timeout: the server ends its session, and the
    chat's next line starts it again with the conversation so far instead of ending on NOT_FOUND."""
    s = ServerThread(EngineConfig(dtype="float32", kv_cache_tokens=4096), checkpoint, session_idle_timeout=1.0)
    lines = iter(["Hi, I am Ana.\n", "What is my name?\n"])

    class PausingStdin(io.StringIO):
        def readline(self, *args) -> str:
            line = next(lines, "")
            if line.startswith("What"):  # the user comes back once the session has expired
                guard = time.monotonic() + GUARD  # a guard against a hang, not a timing
                while s.info().active_sessions and time.monotonic() < guard:
                    time.sleep(0.1)
            return line

    try:
        monkeypatch.setattr(sys, "stdin", PausingStdin())
        assert main(["chat", "--target", s.address, "--max-new-tokens", "4"]) == 0
        out, err = capsys.readouterr()
        assert out.strip() and "error" not in err
        registry, model = s.server.metrics.registry, {"model_name": s.server.metrics.model_name}
        assert registry.get_sample_value("lmgate_sessions_expired_total", model) == 1
        assert registry.get_sample_value("lmgate_sessions_started_total", model) == 2
        assert_idle(s)
    finally:
        s.stop()


def test_cli_wait_ready_waits_for_a_server_to_serve(guarded, capsys):
    """`make serve & lmgate bench --wait-ready N`: a command waits for a server still starting or asleep; a
    refused connection or an asleep server would fail it at once (UNAVAILABLE)."""
    base = ["--target", guarded.address, "--admin-token", "s3cret"]
    assert main(["sleep", "--level", "1", *base]) == 0
    capsys.readouterr()
    codes: list[int] = []
    waiting = threading.Thread(
        target=lambda: codes.append(
            main(["generate", PROMPT, "--wait-ready", "120", "--max-new-tokens", "3", "--ignore-eos", *base])
        )
    )
    waiting.start()
    try:
        assert main(["generate", PROMPT, *base]) == 1  # without waiting: refused while asleep
        assert "UNAVAILABLE" in capsys.readouterr().err
    finally:
        assert main(["wakeup", *base]) == 0
        waiting.join(120)  # a guard against a hang
    assert codes == [0] and "finish_reason=length" in capsys.readouterr().err
    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    assert main(["info", "--target", f"127.0.0.1:{port}", "--wait-ready", "0.5"]) == 1
    assert capsys.readouterr().err == f"error: 127.0.0.1:{port} was not serving within 0.5 s\n"


def test_cli_admin_commands(guarded, capsys):
    base = ["--target", guarded.address, "--admin-token", "s3cret"]
    assert main(["sleep", "--level", "1", *base]) == 0
    assert "asleep at level 1" in capsys.readouterr().out
    # What the server restored, not what was asked for: on the CPU, level 1 frees the KV cache alone.
    assert list(guarded.info().sleeping_tags) == ["kv_cache"]
    assert main(["wakeup", *base]) == 0
    assert capsys.readouterr().out == "woke kv_cache\n"
    assert main(["wakeup", "--tags", "weights", "kv_cache", *base]) == 0
    assert capsys.readouterr().out == "nothing was asleep\n"
    assert main(["sleep", "--level", "2", *base]) == 0
    capsys.readouterr()
    still = "still asleep: weights; requests are refused until nothing sleeps\n"
    assert main(["wakeup", "--tags", "kv_cache", *base]) == 0
    assert capsys.readouterr().out == "woke kv_cache\n" + still
    assert main(["wakeup", "--tags", "kv_cache", *base]) == 0
    assert capsys.readouterr().out == "kv_cache was not asleep\n" + still
    assert main(["wakeup", *base]) == 0
    assert capsys.readouterr().out == "woke weights\n"
    assert main(["sleep", "--target", guarded.address]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert main(["info", "--target", guarded.address]) == 0
    assert json.loads(capsys.readouterr().out)["sleeping"] is False
    assert main(["pause", "--mode", "keep", *base]) == 0
    assert capsys.readouterr().out == "paused (keep): new requests are refused until `lmgate resume`\n"
    assert guarded.info().pause_mode == pb.PAUSE_MODE_KEEP
    assert main(["generate", PROMPT, *base]) == 1
    assert "paused" in capsys.readouterr().err
    assert main(["resume", *base]) == 0
    assert capsys.readouterr().out == "resumed\n" and not guarded.info().paused


def test_cli_generate_reads_the_prompt_from_stdin_or_a_file(server, capsys, monkeypatch, tmp_path):
    """`lmgate generate -` and --prompt-file PATH (`-`: stdin) send the text read, not "-"."""
    _, text = engine_text(server, PROMPT, 3)
    path = tmp_path / "prompt.txt"
    path.write_text(PROMPT)
    flags = ["--target", server.address, "--max-new-tokens", "3", "--ignore-eos"]
    for argv in (["-"], ["--prompt-file", "-"], ["--prompt-file", str(path)]):
        monkeypatch.setattr(sys, "stdin", io.StringIO(PROMPT))
        assert main(["generate", *argv, *flags]) == 0, argv
        assert capsys.readouterr().out == text + "\n", argv


def test_cli_unreadable_prompt_file_is_an_error_line(capsys, tmp_path):
    """Exit 1 with `error: <path>: <why>`, as for other files, before any call (no server listens here)."""
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café!".encode("latin-1"))
    for path, why in (
        (tmp_path / "missing.txt", "No such file or directory"),
        (tmp_path, "Is a directory"),
        (latin1, "not UTF-8 text (invalid continuation byte at byte 3)"),
    ):
        assert main(["generate", "--prompt-file", str(path), "--target", "127.0.0.1:1"]) == 1
        assert capsys.readouterr().err == f"error: {path}: {why}\n"


def metric(server, name: str, **labels: str) -> float:
    """A sample of the server's Prometheus registry (0 before its first count)."""
    metrics = server.server.metrics
    return metrics.registry.get_sample_value(name, {"model_name": metrics.model_name, **labels}) or 0


def test_cli_chat_exit_quit_and_reset_are_commands(server, capsys, monkeypatch):
    """/reset ends the session and starts another; /exit (or /quit) ends the chat; none is sent to the model."""
    with pytest.raises(SystemExit):
        main(["chat", "--help"])
    help_text = capsys.readouterr().out
    assert all(command in help_text for command in ("/exit", "/quit", "/reset"))

    def counts() -> tuple[float, ...]:
        return (
            sum(metric(server, "lmgate_requests_total", reason=r) for r in ("stop", "length", "cancelled")),
            metric(server, "lmgate_sessions_started_total"),
            metric(server, "lmgate_sessions_ended_total"),
        )

    for end in ("/exit", " /quit "):
        before = counts()
        monkeypatch.setattr(sys, "stdin", io.StringIO(f"Hi\n/reset\nHello\n{end}\nNever sent\n"))
        assert main(["chat", "--target", server.address, "--max-new-tokens", "2"]) == 0
        assert capsys.readouterr().err == "new conversation\n"
        assert tuple(a - b for a, b in zip(counts(), before)) == (2, 2, 2)  # a turn on each of two sessions
    assert_idle(server)


def test_cli_chat_ctrl_c_stops_the_reply_and_the_chat_goes_on(server):
    """Ctrl-C during a reply cancels that turn on the server and the chat takes the next line, on the same
    session; /exit then ends it with status 0."""

    def wait_for(condition: Callable[[], bool]) -> None:
        guard = time.monotonic() + GUARD  # a guard against a hang, not a timing
        while not condition() and proc.poll() is None and time.monotonic() < guard:
            time.sleep(0.01)
        assert condition(), proc.poll()

    cancelled, started = (
        metric(server, "lmgate_requests_total", reason="cancelled"),
        metric(server, "lmgate_sessions_started_total"),
    )
    # SIGINT raises KeyboardInterrupt in the child as in a shell's foreground, even where this test runs with
    # it ignored (a background job, whose children inherit that).
    child = (
        "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "from lmgate.client.cli import main; sys.exit(main())"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            child,
            "chat",
            "--target",
            server.address,
            "--ignore-eos",
            "--max-new-tokens",
            str(server.engine.max_context_length // 2),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        for n, line in enumerate((b"Count to a thousand.\n", b"Go on.\n"), 1):
            streamed = metric(server, "lmgate_output_tokens_total")
            proc.stdin.write(line)
            proc.stdin.flush()
            wait_for(lambda: metric(server, "lmgate_output_tokens_total") > streamed)  # the reply is under way
            proc.send_signal(signal.SIGINT)
            wait_for(lambda: metric(server, "lmgate_requests_total", reason="cancelled") == cancelled + n)
        out, err = proc.communicate(b"/exit\n", timeout=GUARD)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert err.decode().count("reply stopped") == 2 and b"Traceback" not in err
    assert out.strip()
    assert metric(server, "lmgate_sessions_started_total") == started + 1  # one session throughout
    assert_idle(server)


def test_cli_stop_takes_one_string_per_flag_and_leaves_the_prompt():
    args = build_parser().parse_args(["generate", "--stop", "END", "--stop", "\n\n", "Hello"])
    assert args.stop == ["END", "\n\n"] and args.prompt == "Hello"


def test_cli_timeout_bounds_a_reply_and_is_checked_like_a_flag(server, capsys, monkeypatch):
    """A reply longer than --timeout ends DEADLINE_EXCEEDED (exit 1) and the server cancels it; a bad
    LMGATE_TIMEOUT is a bad argument (exit 2)."""
    assert (
        main(
            [
                "generate",
                PROMPT,
                "--target",
                server.address,
                "--timeout",
                "0.5",
                "--ignore-eos",
                "--max-new-tokens",
                str(server.engine.max_context_length // 2),
            ]
        )
        == 1
    )
    assert "error: DEADLINE_EXCEEDED" in capsys.readouterr().err
    settled(server)  # the cancel lands on the server after the client has given up
    monkeypatch.setenv("LMGATE_TIMEOUT", "soon")
    with pytest.raises(SystemExit) as exit_:
        main(["info", "--target", server.address])
    assert exit_.value.code == 2 and "--timeout" in capsys.readouterr().err


def test_cli_rpc_error_exit_one(capsys):
    assert main(["info", "--target", "127.0.0.1:1"]) == 1
    assert capsys.readouterr().err.startswith("error: UNAVAILABLE: ")


def test_cli_unreadable_tls_file_is_an_error_line(capsys, tmp_path):
    missing = str(tmp_path / "ca.pem")
    assert main(["info", "--target", "127.0.0.1:1", "--tls-ca", missing]) == 1
    assert capsys.readouterr().err == f"error: {missing}: No such file or directory\n"


def test_cli_generate_into_a_closed_pipe_stops_quietly(server):
    """`lmgate generate ... | head -c1`: the reader leaves; no traceback on stderr."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lmgate.client.cli",
            "generate",
            PROMPT,
            "--target",
            server.address,
            "--max-new-tokens",
            "200",
            "--ignore-eos",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.read(1)
    proc.stdout.close()
    _, err = proc.communicate(timeout=GUARD)
    assert proc.returncode == 1 and b"Traceback" not in err, err


def test_cli_bench(server, capsys, tmp_path):
    path = tmp_path / "bench.json"
    argv = [
        "bench",
        "--target",
        server.address,
        "--num-prompts",
        "6",
        "--concurrency",
        "3",
        "--input-len",
        "10",
        "--output-len",
        "4",
        "--ignore-eos",
        "--request-rate",
        "1000",
        "--json",
        str(path),
        "--api-key",
        "S3CRET",
    ]
    assert main(argv) == 0
    report = capsys.readouterr().out
    assert "Successful requests:" in report and "P99 ITL (ms):" in report
    results = json.loads(path.read_text())
    assert (results["completed"], results["failed"], results["total_input_tokens"], results["total_output_tokens"]) == (
        6,
        0,
        60,
        24,
    )
    assert results["config"]["request_rate"] == "1000.0" and results["tpot_ms"]["mean"] > 0
    assert "S3CRET" not in path.read_text()  # the results file may be shared: no credentials in it
    big = server.engine.max_context_length
    assert main(["bench", "--target", server.address, "--input-len", str(big), "--output-len", "10"]) == 1
    assert f"beyond the server's context of {big}" in capsys.readouterr().err
    assert_idle(server)


def test_bench_metrics():
    results = [
        bench.RequestResult(ok=True, prompt_tokens=10, output_tokens=5, ttft=0.1, latency=0.5, itl=[0.1, 0.2, 0.1]),
        bench.RequestResult(ok=True, prompt_tokens=10, output_tokens=1, ttft=0.3, latency=0.3),
        bench.RequestResult(error="UNAVAILABLE: asleep"),
    ]
    s = bench.summarize(results, duration=2.0)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["UNAVAILABLE: asleep"])
    assert (s["request_throughput"], s["output_throughput"], s["total_token_throughput"]) == (1.0, 3.0, 13.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(200) and s["ttft_ms"]["median"] == pytest.approx(200)
    assert s["tpot_ms"]["mean"] == pytest.approx(100)  # (0.5 - 0.1) / 4; one-token requests have no TPOT
    assert s["itl_ms"]["median"] == pytest.approx(100)
    assert "Mean TTFT (ms):" in bench.report(s)
