"""The gateway's worker protocol (`vllm.grpc.engine.VllmEngine`) on lmgate's port: called directly, and behind
the real Shepherd Model Gateway (the `smg` binary) through the OpenAI SDK."""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
import zipfile

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc
from tokenizers import Tokenizer as Backend

from lmgate.engine.config import EngineConfig
from lmgate.v1 import lmgate_pb2 as pb
from lmgate.v1 import lmgate_pb2_grpc as pb_grpc
from tests.serving import ServerThread, serve_process

SMG = os.path.join(os.path.dirname(sys.executable), "smg")  # the venv's, beside its python
GUARD = 120  # seconds: a guard against a hang, never a timing
MESSAGES = [{"role": "user", "content": "Name three colors."}]
MODEL = "SmolLM2-135M-Instruct.Q4_1"  # the embedded model's name to the gateway's clients


@pytest.fixture(scope="module")
def worker(checkpoint):
    """A server of its own: these tests put it to sleep."""
    s = ServerThread(EngineConfig(dtype="float32", kv_cache_tokens=8192), checkpoint)
    yield s
    s.stop()


def stub(server) -> vllm_grpc.VllmEngineStub:
    return vllm_grpc.VllmEngineStub(server.channel())


def generate(server, ids: list[int], stream: bool, **sampling) -> list[vllm.GenerateResponse]:
    request = vllm.GenerateRequest(
        tokenized=vllm.TokenizedInput(input_ids=ids), stream=stream, sampling_params=vllm.SamplingParams(**sampling)
    )
    return list(stub(server).Generate(request, timeout=GUARD))


def lmgate_v1(server, **request) -> list[pb.GenerateResponse]:
    return list(pb_grpc.InferenceStub(server.channel()).Generate(pb.GenerateRequest(**request), timeout=GUARD))


def assert_idle(server) -> None:
    info = server.engine.info()
    assert info.kv_blocks_free == info.kv_blocks_total and info.running_sequences == info.waiting_sequences == 0


# ------------------------------------------------------------------------------------------- called directly
def test_model_server_and_load_info_say_what_the_gateway_reads(worker):
    engine = worker.engine
    model = stub(worker).GetModelInfo(vllm.GetModelInfoRequest())
    assert model.is_generation and model.served_model_name == "SmolLM2-135M-Instruct.Q4_1"
    assert (model.max_context_length, model.vocab_size) == (engine.max_context_length, engine.vocab_size)
    assert list(model.eos_token_ids) == sorted(engine.tokenizer.eos_token_ids) and model.model_type == "llama"
    assert model.architectures == ["LlamaForCausalLM"] and model.tokenizer_path == ""  # a GGUF: GetTokenizer
    server = stub(worker).GetServerInfo(vllm.GetServerInfoRequest())
    assert server.max_num_seqs == engine.config.max_batch_size and server.block_size == engine.config.block_size
    assert server.constrained_decoding_start == "first_token" and server.engine_reasoning_parser == ""
    loads = stub(worker).GetLoads(vllm.GetLoadsRequest())
    assert loads.dp_rank_count == 1 and loads.loads[0].token_usage == 0.0 and loads.loads[0].num_waiting_reqs == 0


def test_the_tokenizer_bundle_tokenizes_and_renders_as_lmgate_does(worker):
    """The gateway cannot read a GGUF's tokenizer: it asks for this zip, checks its sha256, and from then on
    tokenizes and renders chat templates itself."""
    chunks = list(stub(worker).GetTokenizer(common_pb2.GetTokenizerRequest()))
    data = b"".join(c.data for c in chunks)
    assert [c.sha256 for c in chunks[:-1]] == [""] * (len(chunks) - 1)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    bundle = zipfile.ZipFile(io.BytesIO(data))
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(bundle.namelist())
    theirs = Backend.from_str(bundle.read("tokenizer.json").decode())
    ours = worker.engine.tokenizer
    text = "Party time 🎉 with 日本語 and <|im_start|>user\nhi<|im_end|>"
    assert theirs.encode(text, add_special_tokens=False).ids == ours.encode(text, add_special_tokens=False)
    config = json.loads(bundle.read("tokenizer_config.json"))
    assert config["chat_template"] == ours.chat_template and config["eos_token"] == "<|im_end|>"


@pytest.mark.parametrize("stream", [True, False])
def test_generate_equals_lmgate_v1_with_its_logprobs(worker, stream):
    ids = worker.engine.tokenizer.encode("The capital of France is")
    messages = generate(worker, ids, stream, temperature=0, max_tokens=12, logprobs=3)
    *chunks, last = messages
    assert all(m.HasField("chunk") for m in chunks) and last.HasField("complete")
    done = last.complete
    tokens = [t for m in chunks for t in m.chunk.token_ids] if stream else list(done.output_ids)
    logprobs = [m.chunk.output_logprobs for m in chunks] if stream else [done.output_logprobs]
    reference = lmgate_v1(
        worker, tokens=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(max_new_tokens=12, logprobs=3)
    )
    assert tokens == [t for m in reference for t in m.token_ids]
    assert [v for lp in logprobs for v in lp.token_logprobs] == [lp.logprob for m in reference for lp in m.logprobs]
    assert [list(top.token_ids) for lp in logprobs for top in lp.top_logprobs] == [
        [t.token_id for t in lp.top] for m in reference for lp in m.logprobs
    ]
    assert (done.finish_reason, done.prompt_tokens, done.completion_tokens) == ("length", len(ids), 12)


def test_a_stop_token_or_string_ends_the_stream_as_stop_and_names_it(worker):
    tokenizer = worker.engine.tokenizer
    prompt = tokenizer.apply_chat_template(MESSAGES)
    done = generate(worker, tokenizer.encode(prompt, add_special_tokens=False), True, temperature=0, max_tokens=64)[-1]
    assert done.complete.finish_reason == "stop" and done.complete.matched_token_id in tokenizer.eos_token_ids
    ids = tokenizer.encode("The capital of France is")
    text = tokenizer.decode(list(generate(worker, ids, False, temperature=0, max_tokens=8)[-1].complete.output_ids))
    cut = text[4:7]
    done = generate(worker, ids, True, temperature=0, max_tokens=8, stop=["@@", cut])[-1].complete
    assert (done.finish_reason, done.WhichOneof("matched_stop"), done.matched_stop_str) == (
        "stop",
        "matched_stop_str",
        cut,
    )


@pytest.mark.parametrize(
    "sampling, words",
    [
        ({"n": 200}, "n must be"),
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"prompt_logprobs": -1}, "whole vocabulary"),
        ({"truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
        ({"json_schema": "{not json"}, "invalid json_schema constraint"),
        ({"logprobs": -1}, "whole vocabulary"),
        ({"temperature": -1}, "temperature"),
    ],
)
def test_what_is_not_served_or_wrong_is_invalid_argument_naming_it(worker, sampling, words):
    with pytest.raises(grpc.RpcError) as err:
        generate(worker, [1, 2, 3], True, **sampling)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details()
    assert_idle(worker)


@pytest.mark.parametrize("stream", [True, False])
def test_n_samples_each_end_with_a_complete_of_their_index(worker, stream):
    """What the gateway sends for `n`: one stream, the samples' chunks interleaved by index, a complete each; each
    sample equal to an lmgate.v1 request with seed + index."""
    ids = worker.engine.tokenizer.encode("Once upon a time")
    messages = generate(worker, ids, stream, temperature=1.0, seed=4, n=3, max_tokens=10, ignore_eos=True)
    completes = [m.complete for m in messages if m.HasField("complete")]
    assert sorted(c.index for c in completes) == [0, 1, 2] and messages[-1].HasField("complete")
    for c in completes:
        tokens = [t for m in messages if m.HasField("chunk") and m.chunk.index == c.index for t in m.chunk.token_ids]
        tokens = tokens if stream else list(c.output_ids)
        seeded = pb.SamplingParams(seed=4 + c.index, temperature=1.0, max_new_tokens=10, ignore_eos=True)
        reference = lmgate_v1(worker, tokens=pb.TokenIds(ids=ids), sampling=seeded)
        assert tokens == [t for m in reference for t in m.token_ids]
        assert (c.finish_reason, c.completion_tokens, c.prompt_tokens) == ("length", 10, len(ids))
    assert_idle(worker)


def test_what_the_gateway_never_sends_text_input_prompt_logprobs_and_logit_bias(worker):
    tokenizer = worker.engine.tokenizer
    text = "The capital of France is"
    request = vllm.GenerateRequest(
        text=text, stream=False, sampling_params=vllm.SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2)
    )
    (message,) = list(stub(worker).Generate(request, timeout=GUARD))
    ids = tokenizer.encode(text)
    scored = message.complete.input_logprobs
    assert list(scored.token_ids) == ids and not scored.token_logprobs[0].HasField("value")
    reference = lmgate_v1(worker, prompt=text, sampling=pb.SamplingParams(max_new_tokens=4, prompt_logprobs=2))
    assert [lp.value for lp in scored.token_logprobs[1:]] == [lp.logprob for lp in reference[0].prompt_logprobs]
    assert [list(top.token_ids) for top in scored.top_logprobs[1:]] == [
        [t.token_id for t in lp.top] for lp in reference[0].prompt_logprobs
    ]
    assert list(message.complete.output_ids) == [t for m in reference for t in m.token_ids]
    first = message.complete.output_ids[0]
    biased = generate(worker, ids, False, temperature=0, max_tokens=4, logit_bias={first: -100.0})
    assert biased[-1].complete.output_ids[0] != first
    assert_idle(worker)


def test_logprobs_that_would_not_fit_in_a_message_are_refused_before_anything_runs(worker):
    with pytest.raises(grpc.RpcError) as err:  # a prompt's go in one message: 15,000 x 21 would not fit
        generate(worker, [1] * 15000, True, prompt_logprobs=20, max_tokens=1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "exceed a message" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:  # not streaming, the output's too
        generate(worker, [1, 2], False, logprobs=20, max_tokens=20000)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stream them" in err.value.details()
    assert_idle(worker)


def test_abort_ends_a_running_stream_and_is_idempotent(worker):
    ids = worker.engine.tokenizer.encode("Count to a thousand:")
    request = vllm.GenerateRequest(
        request_id="to-abort",
        tokenized=vllm.TokenizedInput(input_ids=ids),
        stream=True,
        sampling_params=vllm.SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True),
    )
    call = stub(worker).Generate(request, timeout=GUARD)
    assert next(call).chunk.token_ids
    for _ in range(2):  # a second Abort, and one of an id never seen, are no errors
        stub(worker).Abort(vllm.AbortRequest(request_ids=["to-abort", "never-seen"]))
    assert [m.complete.finish_reason for m in call if m.HasField("complete")] == ["abort"]
    assert_idle(worker)


def test_health_check_says_why_a_sleeping_server_takes_no_work(worker):
    assert stub(worker).HealthCheck(vllm.HealthCheckRequest()).healthy
    worker.engine.sleep(1)
    try:
        health = stub(worker).HealthCheck(vllm.HealthCheckRequest())
        assert not health.healthy and "asleep (kv_cache)" in health.message
        assert stub(worker).GetServerInfo(vllm.GetServerInfoRequest()).is_paused
    finally:
        worker.engine.wakeup()
    assert stub(worker).HealthCheck(vllm.HealthCheckRequest()).healthy


# --------------------------------------------------------------------------------- behind the real gateway
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gateway(worker):
    """`smg launch` in front of the worker, once it lists the model (the OpenAI API on its port)."""
    if not os.path.exists(SMG):
        pytest.skip("the smg gateway is not installed (its wheel exists for Linux x86_64 only)")
    port = free_port()
    proc = subprocess.Popen(
        [SMG, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", f"grpc://{worker.address}",
         "--policy", "round_robin", "--log-level", "warn", "--prometheus-host", "127.0.0.1",
         "--prometheus-port", str(free_port())],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_until_served(url, proc)
    yield url
    proc.terminate()
    proc.wait(GUARD)


def wait_until_served(url: str, proc: subprocess.Popen) -> None:
    """Until a completion goes through the gateway at `url`: it lists the model before its tokenizer has come."""
    probe = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 1}).encode()
    deadline = time.monotonic() + GUARD
    while True:
        try:
            request = urllib.request.Request(f"{url}/v1/completions", probe, {"content-type": "application/json"})
            if json.load(urllib.request.urlopen(request, timeout=GUARD))["choices"]:
                return
        except OSError:  # not listening yet, or 503 while it registers the worker and its tokenizer
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "the gateway never served the model"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def openai_client(gateway):
    import openai

    return openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", timeout=GUARD, max_retries=0)


def test_a_greedy_chat_completion_has_lmgate_v1s_tokens(worker, openai_client):
    chat = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in MESSAGES])
    reference = lmgate_v1(worker, messages=chat, sampling=pb.SamplingParams(max_new_tokens=40))
    text = "".join(m.text for m in reference)
    reply = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=40)
    assert reply.choices[0].message.content == text and reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == sum(len(m.token_ids) for m in reference)
    streamed = openai_client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=40, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text


def test_completions_stop_strings_length_and_logprobs_through_the_gateway(worker, openai_client):
    prompt = "The capital of France is"
    reply = openai_client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8)
    ids = worker.engine.tokenizer.encode(prompt)
    reference = lmgate_v1(worker, tokens=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(max_new_tokens=8))
    assert reply.choices[0].text == "".join(m.text for m in reference) and reply.choices[0].finish_reason == "length"
    chat = openai_client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=6, logprobs=True, top_logprobs=2
    )
    chat_ids = worker.engine.tokenizer.encode(worker.engine.tokenizer.apply_chat_template(MESSAGES), False)
    reference = lmgate_v1(
        worker, tokens=pb.TokenIds(ids=chat_ids), sampling=pb.SamplingParams(max_new_tokens=6, logprobs=2)
    )
    positions = chat.choices[0].logprobs.content
    assert [p.logprob for p in positions] == pytest.approx(
        [lp.logprob for m in reference for lp in m.logprobs], abs=1e-5
    )
    assert [len(p.top_logprobs) for p in positions] == [2] * 6
    cut = reply.choices[0].text[4:7]  # a stop string inside what greedy writes: the reply ends before it
    stopped = openai_client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8, stop=[cut])
    assert stopped.choices[0].text == reply.choices[0].text[: reply.choices[0].text.index(cut)]
    assert stopped.choices[0].finish_reason == "stop"


def test_n_choices_each_equal_the_lmgate_v1_request_with_seed_plus_index(worker, openai_client):
    reply = openai_client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=1.0, seed=7, n=3, max_tokens=12
    )
    assert sorted(c.index for c in reply.choices) == [0, 1, 2]
    chat = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in MESSAGES])
    streamed = openai_client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=1.0, seed=7, n=3, max_tokens=12, stream=True
    )
    deltas = [c for chunk in streamed for c in chunk.choices]
    for choice in reply.choices:
        seeded = pb.SamplingParams(seed=7 + choice.index, temperature=1.0, max_new_tokens=12)
        text = "".join(m.text for m in lmgate_v1(worker, messages=chat, sampling=seeded))
        assert choice.message.content == text
        assert "".join(d.delta.content or "" for d in deltas if d.index == choice.index) == text
    assert_idle(worker)


def test_structured_outputs_through_the_gateway(worker, openai_client):
    """The gateway sends the worker a json_schema constraint for `response_format`, a choice for none: lmgate's
    masks hold the reply to it."""
    import jsonschema

    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer", "minimum": 1}},
        "required": ["color", "count"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}}
    for seed in range(3):
        reply = openai_client.chat.completions.create(
            model=MODEL, messages=MESSAGES, temperature=1.0, seed=seed, max_tokens=60, response_format=response_format
        )
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    assert_idle(worker)


def test_bad_requests_get_the_http_status_a_user_expects(worker, openai_client):
    import openai

    with pytest.raises(openai.BadRequestError):  # past the context window
        openai_client.completions.create(model=MODEL, prompt="word " * 9000, max_tokens=8)
    with pytest.raises(openai.BadRequestError):  # lmgate's INVALID_ARGUMENT
        openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, presence_penalty=5)
    assert_idle(worker)


def test_a_client_that_leaves_its_stream_leaves_nothing_running(worker, openai_client):
    """The gateway sends Abort for a dropped stream: afterwards the engine runs nothing and every block is free."""
    stream = openai_client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4000, stream=True, extra_body={"ignore_eos": True}
    )
    assert any(c.choices and c.choices[0].delta.content for c in stream)
    stream.close()
    deadline = time.monotonic() + GUARD
    while (
        worker.engine.info().running_sequences
        or worker.engine.info().kv_blocks_free < worker.engine.info().kv_blocks_total
    ):
        assert time.monotonic() < deadline, "the engine still runs a request whose client left"
        time.sleep(0.05)
    assert_idle(worker)


def test_serve_openai_port_runs_the_gateway_and_stops_it(gateway):
    """`lmgate serve --openai-port P`: one command for the OpenAI API; SIGTERM stops the gateway with the server."""
    import openai

    port = free_port()
    proc, address = serve_process("--openai-port", str(port), "--kv-cache-tokens", "2048")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_served(url, proc)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=GUARD, max_retries=0)
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=8)
        assert reply.choices[0].message.content
    finally:
        proc.terminate()
        assert proc.wait(GUARD) == 0
    with pytest.raises(OSError):  # the gateway went with the server
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
