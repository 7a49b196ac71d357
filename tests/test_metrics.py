"""/metrics scraped over HTTP and read with prometheus_client's own parser: Prometheus' naming conventions,
the series vLLM users expect, and counters that move; the access log's line per finished request."""

from __future__ import annotations

import json
import logging
import time
import urllib.request

import grpc
import pytest
from prometheus_client import start_http_server
from prometheus_client.parser import text_string_to_metric_families

from lmgate.service.logs import JsonFormatter
from lmgate.v1 import lmgate_pb2 as pb

HISTOGRAMS = (
    "lmgate_time_to_first_token_seconds",
    "lmgate_inter_token_latency_seconds",
    "lmgate_time_per_output_token_seconds",
    "lmgate_e2e_request_latency_seconds",
    "lmgate_request_queue_time_seconds",
    "lmgate_request_prompt_tokens",
    "lmgate_request_generation_tokens",
)
COUNTERS = (
    "lmgate_requests",
    "lmgate_output_tokens",
    "lmgate_prompt_tokens",
    "lmgate_preemptions",
    "lmgate_prefix_cache_queries",
    "lmgate_prefix_cache_hits",
    "lmgate_sessions_expired",
    "process_cpu_seconds",
)
GAUGES = (
    "lmgate_kv_cache_blocks",
    "lmgate_kv_cache_free_blocks",
    "lmgate_kv_cache_usage_ratio",
    "lmgate_running_requests",
    "lmgate_sessions_open",
    "lmgate_sleeping",
    "process_resident_memory_bytes",
)


@pytest.fixture(scope="module")
def scrape(server):
    httpd, _ = start_http_server(0, addr="127.0.0.1", registry=server.server.metrics.registry)

    def read() -> dict:
        text = urllib.request.urlopen(f"http://127.0.0.1:{httpd.server_port}/metrics").read().decode()
        return {f.name: f for f in text_string_to_metric_families(text)}

    yield read
    httpd.shutdown()


def value(families: dict, name: str, **labels: str) -> float:
    return sum(
        s.value
        for s in families[name].samples
        if s.name in (name, name + "_total") and labels.items() <= s.labels.items()
    )


def count(families: dict, histogram: str) -> float:
    return sum(s.value for s in families[histogram].samples if s.name == histogram + "_count")


def test_metrics_names_types_and_labels(scrape, server):
    families = scrape()
    for name in HISTOGRAMS:
        assert families[name].type == "histogram", name
    for name in COUNTERS:
        assert families[name].type == "counter", name
    for name in GAUGES:
        assert families[name].type == "gauge", name
    build = families["lmgate_build_info"].samples[0]  # an Info metric: a gauge of 1 in the text format
    assert build.value == 1 and build.labels["version"] and build.labels["torch"]
    model = server.server.metrics.model_name
    for family in families.values():
        for sample in family.samples:
            assert not sample.name.endswith("_created"), sample.name
            if family.type == "counter":
                assert sample.name.endswith("_total"), sample.name
            if family.type == "gauge":
                assert not sample.name.endswith("_total"), sample.name
            if family.name.startswith("lmgate_"):
                assert sample.labels.get("model_name") == model, sample


def test_metrics_counters_and_histograms_move(scrape, server):
    before = scrape()
    prompt = pb.TokenIds(ids=list(range(300, 340)))
    for _ in range(2):
        list(
            server.stub().Generate(
                pb.GenerateRequest(tokens=prompt, sampling=pb.SamplingParams(max_new_tokens=5, ignore_eos=True))
            )
        )
    after = scrape()
    assert value(after, "lmgate_requests", reason="length") == value(before, "lmgate_requests", reason="length") + 2
    assert value(after, "lmgate_output_tokens") == value(before, "lmgate_output_tokens") + 10
    assert value(after, "lmgate_prompt_tokens") == value(before, "lmgate_prompt_tokens") + 80
    assert value(after, "lmgate_prefix_cache_hits") >= value(before, "lmgate_prefix_cache_hits") + 32
    for name in HISTOGRAMS:
        if name != "lmgate_inter_token_latency_seconds":  # merged messages of a fast stream make no gap
            assert count(after, name) == count(before, name) + 2, name
    assert 0 <= value(after, "lmgate_kv_cache_usage_ratio") <= 1


def test_access_log_line_per_request(server, caplog):
    with caplog.at_level(logging.INFO, logger="lmgate.access"):
        list(
            server.stub().Generate(
                pb.GenerateRequest(
                    request_id="logged-1", prompt="Hi", sampling=pb.SamplingParams(max_new_tokens=3, ignore_eos=True)
                )
            )
        )
        with pytest.raises(Exception):
            list(server.stub().Generate(pb.GenerateRequest(session_id=424242, prompt="Hi")))
        forged = "x\n12:00:00 INFO lmgate.access: request_id=forged outcome=stop"
        with pytest.raises(grpc.RpcError):  # refused, and logged as one line with the id quoted
            list(server.stub().Generate(pb.GenerateRequest(request_id=forged, prompt="Hi")))
    records = [r for r in caplog.records if r.name == "lmgate.access"]
    assert [r.getMessage() for r in records if r.fields["request_id"] == forged] == [
        f"request_id={forged!r} session_id=0 peer={records[-1].fields['peer']} prompt_tokens=0 completion_tokens=0 "
        "cached_tokens=0 ttft_s=None duration_s=0.0 outcome=INVALID_ARGUMENT"
    ]
    done = next(r for r in records if r.fields["request_id"] == "logged-1")
    assert done.fields["completion_tokens"] == 3 and done.fields["outcome"] == "length"
    assert done.fields["prompt_tokens"] > 0 and done.fields["ttft_s"] is not None and "127.0.0.1" in done.fields["peer"]
    refused = next(r for r in records if r.fields["session_id"] == 424242)
    assert refused.fields["outcome"] == "NOT_FOUND"
    line = json.loads(JsonFormatter().format(done))
    assert (
        line["logger"] == "lmgate.access"
        and line["request_id"] == "logged-1"
        and "request_id=logged-1" in line["message"]
    )


def test_access_log_names_the_peer_of_streams_whose_client_left(server, caplog):
    """The line of a stream whose client disconnected is written after gRPC has let go of the call: the peer
    must have been read while it was alive (asking for it afterwards crashed the process). It waits for the
    engine's end of the request, which says how long the prompt was."""
    ids = [f"left-{i}" for i in range(20)]
    with caplog.at_level(logging.INFO, logger="lmgate.access"):
        for request_id in ids:
            call = server.stub().Generate(
                pb.GenerateRequest(
                    request_id=request_id,
                    prompt="Tell me a story",
                    sampling=pb.SamplingParams(max_new_tokens=64, ignore_eos=True),
                )
            )
            next(call)
            call.cancel()
        deadline = time.monotonic() + 60  # a guard against a hang, not a performance bound
        while time.monotonic() < deadline and len(logged := _access(caplog, ids)) < len(ids):
            time.sleep(0.05)
    assert sorted(logged) == sorted(ids)
    assert all("127.0.0.1" in r.fields["peer"] and r.fields["outcome"] == "cancelled" for r in logged.values())
    prompt_tokens = len(server.engine.tokenizer.encode("Tell me a story"))  # the engine's count, not 0
    assert [r.fields["prompt_tokens"] for r in logged.values()] == [prompt_tokens] * len(ids)
    assert all(r.fields["completion_tokens"] >= 1 for r in logged.values())


def _access(caplog, ids: list[str]) -> dict:
    return {
        r.fields["request_id"]: r for r in caplog.records if r.name == "lmgate.access" and r.fields["request_id"] in ids
    }
