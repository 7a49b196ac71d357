"""`lmgate serve`: flags (each with an LMGATE_* environment variable), model loading, serving until SIGTERM."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time

from prometheus_client import start_http_server

from lmgate.engine.config import EngineConfig
from lmgate.engine.engine import Engine

from .server import Server

log = logging.getLogger("lmgate")


def _env(name: str, default):
    """The LMGATE_<name> environment variable, as the type of its default."""
    raw = os.environ.get(f"LMGATE_{name}")
    if raw is None:
        return default
    return raw if default is None else type(default)(raw)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="lmgate serve", description="Serve a language model over gRPC.")
    ap.add_argument("--model", default=_env("MODEL", None), help="HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct) [LMGATE_MODEL]")
    ap.add_argument("--host", default=_env("HOST", "127.0.0.1"), help="address to listen on [LMGATE_HOST]")
    ap.add_argument("--port", type=int, default=_env("PORT", 50051), help="port; 0 picks a free one [LMGATE_PORT]")
    ap.add_argument("--engine-loops", type=int, default=_env("ENGINE_LOOPS", 1), help="data-parallel engine loops, each with its own KV cache [LMGATE_ENGINE_LOOPS]")
    ap.add_argument("--max-batch-size", type=int, default=_env("MAX_BATCH_SIZE", 64), help="sequences per engine step [LMGATE_MAX_BATCH_SIZE]")
    ap.add_argument("--max-batched-tokens", type=int, default=_env("MAX_BATCHED_TOKENS", 512), help="tokens per engine step; long prompts are prefilled in chunks of this [LMGATE_MAX_BATCHED_TOKENS]")
    ap.add_argument("--kv-cache-tokens", type=int, default=_env("KV_CACHE_TOKENS", 32768), help="KV cache size per engine loop, in tokens [LMGATE_KV_CACHE_TOKENS]")
    ap.add_argument("--max-context-length", type=int, default=_env("MAX_CONTEXT_LENGTH", 0), help="cap on prompt + output tokens; 0: the model's [LMGATE_MAX_CONTEXT_LENGTH]")
    ap.add_argument("--max-queued-requests", type=int, default=_env("MAX_QUEUED_REQUESTS", 1024), help="requests waiting per engine loop before new ones get RESOURCE_EXHAUSTED [LMGATE_MAX_QUEUED_REQUESTS]")
    ap.add_argument("--dtype", default=_env("DTYPE", "float32"), choices=["float32", "bfloat16", "float16"], help="weights and KV dtype [LMGATE_DTYPE]")
    ap.add_argument("--attention-kernel", default=_env("ATTENTION_KERNEL", "on"), choices=["on", "off"], help="on: CPU decode attention in C++, compiled once on first use (torch ops if that fails); off: torch ops [LMGATE_ATTENTION_KERNEL]")
    ap.add_argument("--device", default=_env("DEVICE", "cpu"), help="cpu, cuda or cuda:N [LMGATE_DEVICE]")
    ap.add_argument("--admin-token", default=_env("ADMIN_TOKEN", None), help="require 'authorization: Bearer <token>' on Admin calls; unset: Admin from loopback only [LMGATE_ADMIN_TOKEN]")
    ap.add_argument("--metrics-port", type=int, default=_env("METRICS_PORT", 0), help="serve Prometheus /metrics on this port; 0: off [LMGATE_METRICS_PORT]")
    ap.add_argument("--grace", type=float, default=_env("GRACE", 10.0), help="seconds running streams get at shutdown [LMGATE_GRACE]")
    return ap.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    engine = Engine(EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, kv_cache_tokens=args.kv_cache_tokens,
        max_batch_size=args.max_batch_size, max_batched_tokens=args.max_batched_tokens,
        max_context_length=args.max_context_length or None, engine_loops=args.engine_loops,
        max_queued_requests=args.max_queued_requests, attention_kernel=args.attention_kernel == "on",
    ))
    server = Server(engine, f"{args.host}:{args.port}", admin_token=args.admin_token)
    await server.start()
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.host, registry=server.metrics.registry)
    print(f"lmgate serving {os.path.basename(engine.model_path)} on {args.host}:{server.port} "
          f"(ready in {time.perf_counter() - started:.1f}s)", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: %.0fs grace for running streams", args.grace)
    await server.stop(args.grace)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("LMGATE_LOG_LEVEL", "INFO"), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
