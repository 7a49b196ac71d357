"""The Python client and the `lmgate` command, without a model.

Request building and argument parsing are pure. What goes over the wire is checked against a scripted server:
real gRPC on loopback that records each call and answers with canned replies (end-to-end tests against the
real server live beside the other serving tests).
"""
from __future__ import annotations

import asyncio
import io
import json
import math
import sys
from concurrent import futures

import grpc
import pytest

from lmgate.client import AsyncClient, Client, Delta, Session
from lmgate.client import bench
from lmgate.client.cli import SAMPLING_FLAGS, build_parser, main
from lmgate.client.wire import SAMPLING_FIELDS, admin_metadata, generate_request, sampling_params, to_delta
from lmgate.v1 import lmgate_pb2 as pb
from lmgate.v1 import lmgate_pb2_grpc as pb_grpc

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
        max_new_tokens=16, min_new_tokens=2, temperature=0.5, top_p=0.75, top_k=40, min_p=0.125,
        repetition_penalty=1.25, presence_penalty=-0.5, frequency_penalty=0.5, seed=0, stop=["\n\n", "END"],
        stop_token_ids=[2, 3], ignore_eos=True, logprobs=5, include_special_tokens=True,
    )
    assert set(values) == SAMPLING_FIELDS
    s = generate_request("x", **values).sampling
    for name, value in values.items():
        got = getattr(s, name)
        assert (list(got) if isinstance(value, list) else got) == value, name
    assert s.HasField("seed")  # seed 0 is a seed, not "random"


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


def test_to_delta_mid_stream_and_last():
    mid = to_delta(pb.GenerateResponse(request_id="r", session_id=3, token_ids=[1, 2], text="ab", logprobs=[
        pb.TokenLogprob(token_id=1, logprob=-0.5, top=[pb.TopLogprob(token_id=1, logprob=-0.5)]),
        pb.TokenLogprob(token_id=2, logprob=-1.0),
    ]))
    assert mid == Delta(
        request_id="r", session_id=3, token_ids=[1, 2], text="ab",
        logprobs=[{"token_id": 1, "logprob": -0.5, "top": [(1, -0.5)]}, {"token_id": 2, "logprob": -1.0, "top": []}],
        finish_reason=None, usage=None,
    )
    for reason, name in ((pb.FINISH_REASON_STOP, "stop"), (pb.FINISH_REASON_LENGTH, "length"),
                         (pb.FINISH_REASON_CANCELLED, "cancelled")):
        last = to_delta(pb.GenerateResponse(finish_reason=reason, usage=pb.Usage(prompt_tokens=4, completion_tokens=2)))
        assert last.finish_reason == name
        assert last.usage == {"prompt_tokens": 4, "completion_tokens": 2, "cached_tokens": 0}


def test_admin_metadata_carries_the_bearer_token():
    assert admin_metadata(None) == ()
    assert admin_metadata("s3cret") == (("authorization", "Bearer s3cret"),)


# --------------------------------------------------------------------------- argument parsing

SUBCOMMANDS = ("generate", "chat", "info", "tokenize", "sleep", "wakeup", "update-weights", "bench")


@pytest.mark.parametrize("command", ("--help",) + tuple(f"{c} --help" for c in SUBCOMMANDS))
def test_help_exits_zero(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main(command.split())
    assert exc.value.code == 0
    assert "usage: lmgate" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    [], ["nope"], ["generate"], ["generate", "x", "--bogus"], ["tokenize"], ["update-weights"],
    ["sleep", "--level", "3"], ["wakeup", "--tags", "everything"], ["generate", "x", "--seed", "-1"],
    ["bench", "--concurrency", "0"], ["bench", "--num-prompts", "0"], ["bench", "--request-rate", "0"],
    ["bench", "--input-len", "0"], ["bench", "--temperature", "nan"],
])
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


def test_sampling_flags_are_sampling_fields():
    assert set(SAMPLING_FLAGS) <= SAMPLING_FIELDS
    args = build_parser().parse_args(
        "generate hi --max-new-tokens 9 --temperature 0.7 --top-p 0.9 --top-k 5 --seed 1 --stop a b --stop c --ignore-eos".split()
    )
    s = sampling_params(**{name: getattr(args, name) for name in SAMPLING_FLAGS})
    assert (s.max_new_tokens, s.top_k, s.seed, list(s.stop), s.ignore_eos) == (9, 5, 1, ["a", "b", "c"], True)
    assert s.temperature == pytest.approx(0.7) and s.top_p == pytest.approx(0.9)


def test_bench_defaults():
    args = build_parser().parse_args(["bench"])
    assert args.request_rate == math.inf and not args.ignore_eos and args.json is None
    assert build_parser().parse_args(["bench", "--request-rate", "inf"]).request_rate == math.inf


def test_serve_forwards_its_flags_to_the_server(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "lmgate serve" in out and "--engine-loops" in out


# --------------------------------------------------------------------------- over the wire (scripted server)

REPLY = [("Hel", [11]), ("lo", [12, 13])]


class ScriptedServer(pb_grpc.InferenceServicer, pb_grpc.AdminServicer):
    """Records (method, request, metadata) per call; Generate streams REPLY, session 404 is NOT_FOUND."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object, dict[str, str]]] = []

    def _record(self, name, request, context):
        self.calls.append((name, request, dict(context.invocation_metadata())))

    def Start(self, request, context):
        self._record("Start", request, context)
        return pb.StartResponse(session_id=request.session_id or 42)

    def Generate(self, request, context):
        self._record("Generate", request, context)
        if request.session_id == 404:
            context.abort(grpc.StatusCode.NOT_FOUND, "unknown session 404")
        rid = request.request_id or "srv-1"
        for text, ids in REPLY:
            yield pb.GenerateResponse(request_id=rid, session_id=request.session_id, token_ids=ids, text=text)
        yield pb.GenerateResponse(
            request_id=rid, session_id=request.session_id, finish_reason=pb.FINISH_REASON_STOP,
            usage=pb.Usage(prompt_tokens=len(request.tokens.ids) or 1, completion_tokens=3),
        )

    def Cancel(self, request, context):
        self._record("Cancel", request, context)
        return pb.CancelResponse(cancelled=True)

    def End(self, request, context):
        self._record("End", request, context)
        return pb.EndResponse()

    def Tokenize(self, request, context):
        self._record("Tokenize", request, context)
        return pb.TokenizeResponse(token_ids=[ord(c) for c in request.text])

    def Info(self, request, context):
        self._record("Info", request, context)
        return pb.InfoResponse(model="scripted", vocab_size=1000, max_context_length=256)

    def Sleep(self, request, context):
        self._record("Sleep", request, context)
        return pb.SleepResponse()

    def Wakeup(self, request, context):
        self._record("Wakeup", request, context)
        return pb.WakeupResponse()

    def UpdateWeights(self, request, context):
        self._record("UpdateWeights", request, context)
        return pb.UpdateWeightsResponse()


@pytest.fixture(scope="module")
def scripted():
    servicer = ScriptedServer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_InferenceServicer_to_server(servicer, server)
    pb_grpc.add_AdminServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None)


@pytest.fixture
def calls(scripted):
    servicer, _ = scripted
    servicer.calls.clear()
    return servicer.calls


@pytest.fixture
def target(scripted):
    return scripted[1]


def test_token_only_on_admin_calls(target, calls):
    with Client(target, admin_token="s3cret") as client:
        client.info()
        client.tokenize("ab")
        list(client.generate("hi"))
        client.cancel("r1")
        client.end(5)
        client.start().end()
        client.sleep(2)
        client.wakeup(["weights"])
        client.update_weights("/models/new")
    admin = {"Sleep", "Wakeup", "UpdateWeights"}
    assert {name for name, _, _ in calls} >= admin | {"Info", "Generate", "Start"}
    for name, _, metadata in calls:
        assert metadata.get("authorization") == ("Bearer s3cret" if name in admin else None), name
    requests = {name: request for name, request, _ in calls}
    assert requests["Sleep"].level == 2 and list(requests["Wakeup"].tags) == ["weights"]
    assert requests["UpdateWeights"].path == "/models/new"


def test_client_calls(target, calls):
    with Client(target) as client:
        deltas = list(client.generate("hi", request_id="mine", max_new_tokens=4))
        assert "".join(d.text for d in deltas) == "Hello"
        assert [d.request_id for d in deltas] == ["mine"] * 3
        assert deltas[-1].finish_reason == "stop" and deltas[-1].usage["completion_tokens"] == 3
        assert all(d.finish_reason is None and d.usage is None for d in deltas[:-1])
        assert client.tokenize("ab") == [97, 98]
        assert client.info().model == "scripted"
        assert client.cancel(session_id=9) is True
        with pytest.raises(grpc.RpcError) as exc:
            list(client.generate("hi", session_id=404))
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    assert [name for name, _, _ in calls] == ["Generate", "Tokenize", "Info", "Cancel", "Generate"]
    assert calls[0][1].sampling.max_new_tokens == 4
    assert (calls[3][1].session_id, calls[3][1].request_id) == (9, "")


def test_session_turns_and_end_on_exit(target, calls):
    with Client(target) as client:
        with client.start() as session:
            assert isinstance(session, Session) and session.id == 42
            list(session.generate(messages=[{"role": "user", "content": "Hi"}], temperature=0.5))
            list(session.generate("more"))
            assert session.cancel()
        with client.start(7) as session:
            assert session.id == 7
    assert [name for name, _, _ in calls] == ["Start", "Generate", "Generate", "Cancel", "End", "Start", "End"]
    assert [r.session_id for _, r, _ in calls] == [0, 42, 42, 42, 42, 7, 7]


def test_async_client(target, calls):
    async def scenario():
        async with AsyncClient(target, admin_token="t") as client:
            texts = await asyncio.gather(*[_collect(client.generate(f"p{i}")) for i in range(3)])
            async with await client.start() as session:
                assert await session.cancel()
                text = await _collect(session.generate(token_ids=[1, 2]))
            await client.sleep()
            return texts, text, await client.tokenize("a"), (await client.info()).vocab_size

    async def _collect(deltas):
        return "".join([d.text async for d in deltas])

    assert asyncio.run(scenario()) == (["Hello"] * 3, "Hello", [97], 1000)
    assert [name for name, _, _ in calls][3:] == ["Start", "Cancel", "Generate", "End", "Sleep", "Tokenize", "Info"]
    assert [md.get("authorization") for _, _, md in calls] == [None] * 7 + ["Bearer t"] + [None] * 2


def test_cli_generate_streams_and_reports_usage(target, calls, capsys):
    assert main(["generate", "Hi there", "--target", target, "--max-new-tokens", "5", "--stop", "\n"]) == 0
    out, err = capsys.readouterr()
    assert out == "Hello\n"
    assert "finish_reason=stop" in err and "completion_tokens=3" in err
    request = calls[0][1]
    assert (request.prompt, request.sampling.max_new_tokens, list(request.sampling.stop)) == ("Hi there", 5, ["\n"])

    assert main(["generate", "Hi", "--chat", "--system", "Be brief.", "--target", target]) == 0
    assert [(m.role, m.content) for m in calls[1][1].messages.messages] == [("system", "Be brief."), ("user", "Hi")]


def test_cli_chat_one_session_system_first_then_end(target, calls, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n\nAgain\n"))
    assert main(["chat", "--target", target, "--system", "Be brief.", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == "Hello\nHello\n"
    assert [name for name, _, _ in calls] == ["Start", "Generate", "Generate", "End"]
    first, second = calls[1][1], calls[2][1]
    assert [m.role for m in first.messages.messages] == ["system", "user"]
    assert [(m.role, m.content) for m in second.messages.messages] == [("user", "Again")]
    assert first.session_id == second.session_id == calls[3][1].session_id == 42


def test_cli_info_tokenize_admin(target, calls, capsys):
    assert main(["info", "--target", target]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["model"] == "scripted" and info["sleeping_tags"] == [] and info["vocab_size"] == 1000
    assert main(["tokenize", "hi", "--target", target]) == 0
    assert json.loads(capsys.readouterr().out) == [104, 105]
    assert main(["sleep", "--level", "2", "--target", target, "--admin-token", "x"]) == 0
    assert main(["wakeup", "--tags", "weights", "kv_cache", "--target", target]) == 0
    assert main(["update-weights", "/m", "--target", target]) == 0
    assert [(name, md.get("authorization")) for name, _, md in calls[-3:]] == [
        ("Sleep", "Bearer x"), ("Wakeup", None), ("UpdateWeights", None)]
    assert list(calls[-2][1].tags) == ["weights", "kv_cache"]


def test_cli_rpc_error_exit_one(target, capsys):
    assert main(["info", "--target", "127.0.0.1:1"]) == 1
    assert capsys.readouterr().err.startswith("error: UNAVAILABLE: ")


def test_cli_bench(target, calls, capsys, tmp_path):
    path = tmp_path / "bench.json"
    argv = ["bench", "--target", target, "--num-prompts", "6", "--concurrency", "2", "--input-len", "10",
            "--output-len", "4", "--ignore-eos", "--request-rate", "1000", "--json", str(path)]
    assert main(argv) == 0
    report = capsys.readouterr().out
    assert "Successful requests:" in report and "P99 ITL (ms):" in report
    generates = [r for name, r, _ in calls if name == "Generate"]
    assert len(generates) == 6
    for r in generates:
        assert len(r.tokens.ids) == 10 and all(100 <= t < 1000 for t in r.tokens.ids)
        assert (r.sampling.max_new_tokens, r.sampling.ignore_eos, r.session_id) == (4, True, 0)
    results = json.loads(path.read_text())
    assert (results["completed"], results["failed"], results["total_input_tokens"], results["total_output_tokens"]) == (6, 0, 60, 18)
    assert results["config"]["request_rate"] == "1000.0" and results["model"] == "scripted"
    assert results["tpot_ms"]["mean"] > 0

    assert main(["bench", "--target", target, "--input-len", "250", "--output-len", "10"]) == 1
    assert "beyond the server's context of 256" in capsys.readouterr().err


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
