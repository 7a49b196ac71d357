"""Prometheus figures of the serving path, on a registry of the server's own (tests run several servers).

Names follow Prometheus' conventions and the series vLLM users look for: counters end in `_total`, gauges
do not, durations are histograms in seconds, and every lmgate series has a `model_name` label.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import time
from typing import Iterator

import prometheus_client
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from lmgate.engine.engine import SLEEP_TAGS, Engine
from lmgate.engine.errors import EngineError
from lmgate.engine.gateway.request import FinishReason, Usage

from .status import status_code

prometheus_client.disable_created_metrics()  # no `_created` series beside every counter and histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class Metrics:
    """Counters and histograms are updated on the gRPC event loop; engine state is read at scrape time."""

    def __init__(self, engine: Engine) -> None:
        self.model_name = os.path.basename(engine.model_path)
        self.registry = r = CollectorRegistry()
        model = ["model_name"]

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(name, doc, model + list(labels), registry=r)

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(name, doc, model, registry=r, buckets=buckets).labels(self.model_name)

        self.requests = counter("lmgate_requests", "Finished Generate streams, by finish reason", "reason")
        self.refusals = counter("lmgate_refused_requests", "Generate calls refused before queueing, by status", "code")
        self.prompt_tokens = counter("lmgate_prompt_tokens", "Prompt tokens of finished requests").labels(
            self.model_name
        )
        self.output_tokens = counter("lmgate_output_tokens", "Generated tokens streamed to clients").labels(
            self.model_name
        )
        self.sessions_started = counter("lmgate_sessions_started", "Sessions opened by Start").labels(self.model_name)
        self.sessions_ended = counter("lmgate_sessions_ended", "End calls completed").labels(self.model_name)
        self.sessions_expired = counter(
            "lmgate_sessions_expired", "Sessions ended after --session-idle-timeout without a turn"
        ).labels(self.model_name)
        self.sleep_transitions = counter(
            "lmgate_sleep_transitions", "Completed Sleep, Wakeup, Pause and Resume calls", "transition"
        )
        self.weight_updates = counter("lmgate_weight_updates", "Completed UpdateWeights calls").labels(self.model_name)
        self.ttft = histogram(
            "lmgate_time_to_first_token_seconds", "From the Generate call to its first token", LATENCY_BUCKETS
        )
        self.itl = histogram(
            "lmgate_inter_token_latency_seconds",
            "Between two messages of a stream (tokens merged "
            "while a client is slow, or gathered by --stream-interval, arrive as one)",
            LATENCY_BUCKETS,
        )
        self.tpot = histogram(
            "lmgate_time_per_output_token_seconds", "A request's decode time per token after the first", LATENCY_BUCKETS
        )
        self.e2e = histogram(
            "lmgate_e2e_request_latency_seconds", "From the Generate call to its last message", LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "lmgate_request_queue_time_seconds",
            "From submission until the request first ran in a batch",
            LATENCY_BUCKETS,
        )
        self.prompt_len = histogram("lmgate_request_prompt_tokens", "Prompt tokens per finished request", TOKEN_BUCKETS)
        self.output_len = histogram(
            "lmgate_request_generation_tokens", "Generated tokens per finished request", TOKEN_BUCKETS
        )
        self.active_streams = Gauge("lmgate_active_streams", "Generate streams open now", model, registry=r).labels(
            self.model_name
        )
        Info("lmgate_build", "Versions of lmgate and what it runs on", registry=r).info(
            {
                "model_name": self.model_name,
                "version": _version(),
                "torch": torch.__version__,
                "python": platform.python_version(),
            }
        )
        r.register(EngineCollector(engine, self.model_name))
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)

    def refused(self, code: str) -> None:
        """A Generate refused before it was queued, with the status of that name."""
        self.refusals.labels(self.model_name, code).inc()

    def track(self) -> "StreamTracker":
        return StreamTracker(self)


class StreamTracker:
    """One Generate stream's figures; lives on the event loop with its stream."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.start = self.last = time.perf_counter()
        self.first_token: float | None = None  # seconds from start
        self.num_tokens = 0
        self.usage: Usage | None = None
        self.outcome = ""  # finish reason, or the status of an error
        metrics.active_streams.inc()

    def tokens(self, count: int, reason: FinishReason | None, usage: Usage | None) -> None:
        now = time.perf_counter()
        if count:
            if self.first_token is None:
                self.first_token = now - self.start
                self.metrics.ttft.observe(self.first_token)
            else:
                self.metrics.itl.observe(now - self.last)
            self.last = now
        self.num_tokens += count
        self.metrics.output_tokens.inc(count)
        self.usage = usage or self.usage
        if reason is not None:
            self._end(reason.value)

    def failed(self, error: EngineError) -> None:
        self._end(status_code(error).name)

    def finish_cancelled(self) -> None:
        self._end(FinishReason.CANCELLED.value)

    @property
    def duration(self) -> float:
        return time.perf_counter() - self.start

    def _end(self, outcome: str) -> None:
        m = self.metrics
        self.outcome = outcome
        m.requests.labels(m.model_name, outcome).inc()
        m.active_streams.dec()
        m.e2e.observe(self.duration)
        if self.num_tokens > 1:
            m.tpot.observe((self.last - self.start - self.first_token) / (self.num_tokens - 1))
        if self.usage is not None:
            m.prompt_tokens.inc(self.usage.prompt_tokens)
            m.prompt_len.observe(self.usage.prompt_tokens)
            m.output_len.observe(self.usage.completion_tokens)
            m.queue_time.observe(self.usage.queue_seconds)


class EngineCollector(Collector):
    """The engine's state, read once per scrape from `Engine.info()` (lock-free, possibly a step stale)."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator:
        i = self.engine.info()
        gauges = {
            "lmgate_kv_cache_blocks": ("KV cache blocks over all engine loops", i.kv_blocks_total),
            "lmgate_kv_cache_free_blocks": (
                "KV cache blocks no sequence or session holds (cached prefixes included: they are evicted on demand)",
                i.kv_blocks_free,
            ),
            "lmgate_kv_cache_usage_ratio": (
                "Share of KV cache blocks in use",
                1 - i.kv_blocks_free / max(i.kv_blocks_total, 1),
            ),
            "lmgate_weights_bytes": ("Bytes of weights on the engine's device", i.weights_bytes),
            "lmgate_kv_cache_bytes": ("Bytes held for the KV cache", i.kv_cache_bytes),
            "lmgate_sessions_open": ("Open sessions", i.active_sessions),
            "lmgate_running_requests": ("Sequences in the running batches", i.running_sequences),
            "lmgate_waiting_requests": ("Sequences waiting for room in a batch", i.waiting_sequences),
            "lmgate_queued_requests": ("Generate requests queued for the engine loops", i.queued_requests),
        }
        for name, (doc, value) in gauges.items():
            yield self._family(GaugeMetricFamily, name, doc, value)
        counters = {
            "lmgate_preemptions": ("Sequences preempted for lack of KV blocks", i.preemptions),
            "lmgate_prefix_cache_queries": (
                "Prompt tokens looked up in the prefix cache",
                i.prefix_cache_queried_tokens,
            ),
            "lmgate_prefix_cache_hits": ("Prompt tokens whose KV the prefix cache held", i.prefix_cache_hit_tokens),
        }
        for name, (doc, value) in counters.items():
            yield self._family(CounterMetricFamily, name, doc, value)
        sleeping = GaugeMetricFamily("lmgate_sleeping", "1 while the tag sleeps", labels=["model_name", "tag"])
        for tag in SLEEP_TAGS:
            sleeping.add_metric([self.model_name, tag], float(tag in i.sleeping_tags))
        yield sleeping

    def _family(self, kind, name: str, doc: str, value: float):
        family = kind(name, doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family


def _version() -> str:
    try:
        return importlib.metadata.version("lmgate")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
