"""Prometheus figures of the serving path, on a registry of the server's own (tests run several servers)."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from lmgate.engine.engine import SLEEP_TAGS, Engine
from lmgate.engine.errors import EngineError
from lmgate.engine.request import FinishReason

from .status import status_code


class Metrics:
    """Counters are updated on the gRPC event loop; gauges of engine state are read at scrape time."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.registry = r = CollectorRegistry()
        self.requests = Counter("lmgate_requests", "Finished Generate streams by finish reason", ["reason"], registry=r)
        self.refusals = Counter("lmgate_refused_requests", "Generate calls refused before queueing, by status", ["code"], registry=r)
        self.prompt_tokens = Counter("lmgate_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.output_tokens = Counter("lmgate_output_tokens", "Generated tokens streamed to clients", registry=r)
        self.ttft = Histogram(
            "lmgate_time_to_first_token_seconds", "From admission to the first streamed token", registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.sessions_started = Counter("lmgate_sessions_started", "Sessions opened by Start", registry=r)
        self.sessions_ended = Counter("lmgate_sessions_ended", "End calls completed", registry=r)
        self.sleep_transitions = Counter("lmgate_sleep_transitions", "Completed Sleep and Wakeup calls", ["transition"], registry=r)
        self.weight_updates = Counter("lmgate_weight_updates", "Completed UpdateWeights calls", registry=r)
        sleeping = Gauge("lmgate_sleeping", "1 while the tag sleeps", ["tag"], registry=r)
        for tag in SLEEP_TAGS:
            sleeping.labels(tag).set_function(lambda tag=tag: float(tag in self._engine.sleeping))
        self._engine_gauge("lmgate_weights_bytes", "Bytes of weights on the engine's device", lambda i: i.weights_bytes)
        self._engine_gauge("lmgate_kv_cache_bytes", "Bytes held for the KV cache", lambda i: i.kv_cache_bytes)
        self.active_streams = Gauge("lmgate_active_streams", "Generate streams open now", registry=r)
        self._engine_gauge("lmgate_kv_blocks_total", "KV cache blocks over all engine loops", lambda i: i.kv_blocks_total)
        self._engine_gauge("lmgate_kv_blocks_free", "KV cache blocks not in use", lambda i: i.kv_blocks_free)
        self._engine_gauge("lmgate_sessions_open", "Open sessions", lambda i: i.active_sessions)
        self._engine_gauge("lmgate_running_requests", "Sequences in the running batches", lambda i: i.running_sequences)
        self._engine_gauge("lmgate_waiting_requests", "Sequences waiting for room in a batch", lambda i: i.waiting_sequences)
        self._engine_gauge("lmgate_queued_requests", "Generate requests queued for the engine loops", lambda i: i.queued_requests)
        self._engine_gauge("lmgate_preemptions", "Sequences preempted for lack of KV blocks", lambda i: i.preemptions)

    def _engine_gauge(self, name: str, doc: str, read) -> None:
        Gauge(name, doc, registry=self.registry).set_function(lambda: read(self._engine.info()))

    def refused(self, error: EngineError) -> None:
        self.refusals.labels(status_code(error).name).inc()

    def track(self, prompt_tokens: int) -> "StreamTracker":
        self.prompt_tokens.inc(prompt_tokens)
        return StreamTracker(self)


class StreamTracker:
    """One Generate stream's figures; lives on the event loop with its stream."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.start = time.perf_counter()
        self.first_token = False
        metrics.active_streams.inc()

    def tokens(self, count: int, reason: FinishReason | None) -> None:
        if count and not self.first_token:
            self.first_token = True
            self.metrics.ttft.observe(time.perf_counter() - self.start)
        self.metrics.output_tokens.inc(count)
        if reason is not None:
            self._end(reason.value)

    def failed(self) -> None:
        self._end("error")

    def finish_cancelled(self) -> None:
        self._end(FinishReason.CANCELLED.value)

    def _end(self, reason: str) -> None:
        self.metrics.requests.labels(reason).inc()
        self.metrics.active_streams.dec()
