"""`lmgate serve`: flags (each with an LMGATE_* environment variable), model loading, serving until SIGTERM."""
from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import socket
import sys
import time
from typing import Any, Callable

import torch
from prometheus_client import start_http_server

from lmgate.engine.config import EngineConfig
from lmgate.engine.engine import Engine
from lmgate.engine.errors import EngineError
from lmgate.engine.hardware import DTYPE_CHOICES
from lmgate.engine.loader import read_config

from .server import Server

log = logging.getLogger("lmgate")


class StartupError(Exception):
    """A setting that cannot work, found before or while loading: one line for the operator, exit status 2."""


def _ranged(kind: Callable[[str], Any], low: float, high: float = math.inf) -> Callable[[str], Any]:
    """An argparse type that also checks the range (NaN is out of every range)."""

    def parse(text: str) -> Any:
        value = kind(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be {low}..{high}, got {text}" if high < math.inf else f"must be at least {low}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its error messages
    return parse


PORT = _ranged(int, 0, 65535)
COUNT = _ranged(int, 1)


def _env(name: str, default: Any) -> Any:
    """LMGATE_<name> if set, as a string argparse parses (and checks) with the flag's type, else `default`."""
    return os.environ.get(f"LMGATE_{name}", default)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="lmgate serve", description="Serve a language model over gRPC. Every flag "
                                 "has an environment variable, LMGATE_<FLAG> (in brackets).",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=_env("MODEL", None), help="HF model directory or .gguf file; unset: the embedded SmolLM2-135M-Instruct [LMGATE_MODEL]")
    ap.add_argument("--host", default=_env("HOST", "127.0.0.1"), help="address to listen on [LMGATE_HOST]")
    ap.add_argument("--port", type=PORT, default=_env("PORT", 50051), help="port; 0 picks a free one [LMGATE_PORT]")
    ap.add_argument("--engine-loops", type=COUNT, default=_env("ENGINE_LOOPS", 1), help="data-parallel engine loops, each with its own KV cache [LMGATE_ENGINE_LOOPS]")
    ap.add_argument("--max-batch-size", type=COUNT, default=_env("MAX_BATCH_SIZE", 64), help="sequences per engine step [LMGATE_MAX_BATCH_SIZE]")
    ap.add_argument("--max-batched-tokens", type=COUNT, default=_env("MAX_BATCHED_TOKENS", 512), help="tokens per engine step; long prompts are prefilled in chunks of this [LMGATE_MAX_BATCHED_TOKENS]")
    ap.add_argument("--kv-cache-tokens", type=COUNT, default=_env("KV_CACHE_TOKENS", 32768), help="KV cache size per engine loop, in tokens; also caps the context [LMGATE_KV_CACHE_TOKENS]")
    ap.add_argument("--max-context-length", type=_ranged(int, 0), default=_env("MAX_CONTEXT_LENGTH", 0), help="cap on prompt + output tokens; 0: the model's [LMGATE_MAX_CONTEXT_LENGTH]")
    ap.add_argument("--max-queued-requests", type=COUNT, default=_env("MAX_QUEUED_REQUESTS", 1024), help="requests waiting per engine loop before new ones get RESOURCE_EXHAUSTED [LMGATE_MAX_QUEUED_REQUESTS]")
    ap.add_argument("--dtype", default=_env("DTYPE", "auto"), choices=DTYPE_CHOICES, help="weights and KV dtype; auto: bfloat16 on CUDA and on CPUs with AVX512-BF16 or AMX, else float32 [LMGATE_DTYPE]")
    ap.add_argument("--attention-kernel", default=_env("ATTENTION_KERNEL", "on"), choices=["on", "off"], help="on: CPU decode attention in C++, compiled once on first use (torch ops if that fails); off: torch ops [LMGATE_ATTENTION_KERNEL]")
    ap.add_argument("--device", default=_env("DEVICE", "cpu"), help="cpu, cuda or cuda:N [LMGATE_DEVICE]")
    ap.add_argument("--admin-token", default=_env("ADMIN_TOKEN", None), help="require 'authorization: Bearer <token>' on Admin calls; unset: Admin from loopback only [LMGATE_ADMIN_TOKEN]")
    ap.add_argument("--metrics-port", type=PORT, default=_env("METRICS_PORT", 0), help="serve Prometheus /metrics on this port; 0: off [LMGATE_METRICS_PORT]")
    ap.add_argument("--grace", type=_ranged(float, 0), default=_env("GRACE", 10.0), help="seconds running streams get at shutdown [LMGATE_GRACE]")
    return ap.parse_args(argv)


def check_settings(args: argparse.Namespace) -> EngineConfig:
    """The checks that cost nothing, before the model loads: ports free, device present, model readable,
    engine limits consistent. Raises StartupError."""
    for flag, port in (("--port", args.port), ("--metrics-port", args.metrics_port)):
        if port:
            _check_port_free(flag, args.host, port)
    if args.port and args.port == args.metrics_port:
        raise StartupError(f"--port and --metrics-port are both {args.port}")
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        raise StartupError(f"--device {args.device!r}: {exc}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise StartupError(f"--device {args.device}: this torch build sees no CUDA device (torch {torch.__version__})")
    if device.type not in ("cpu", "cuda"):
        raise StartupError(f"--device {args.device}: only cpu and cuda are supported")
    try:
        if args.model is not None:
            read_config(args.model)
        return EngineConfig(
            model=args.model, dtype=args.dtype, device=args.device, kv_cache_tokens=args.kv_cache_tokens,
            max_batch_size=args.max_batch_size, max_batched_tokens=args.max_batched_tokens,
            max_context_length=args.max_context_length or None, engine_loops=args.engine_loops,
            max_queued_requests=args.max_queued_requests, attention_kernel=args.attention_kernel == "on",
        )
    except EngineError as exc:
        raise StartupError(str(exc)) from None


def _check_port_free(flag: str, host: str, port: int) -> None:
    try:
        with socket.create_server((host, port), reuse_port=False):
            pass
    except OSError as exc:
        raise StartupError(f"{flag} {port}: cannot listen on {host}:{port}: {exc.strerror or exc}") from None


async def serve(args: argparse.Namespace, config: EngineConfig) -> None:
    started = time.perf_counter()
    try:
        engine = Engine(config)
    except EngineError as exc:
        raise StartupError(str(exc)) from None
    if engine.max_context_length < engine.model_config.max_position_embeddings:
        log.warning("the context is capped at %d tokens (the model takes %d): --kv-cache-tokens %d%s",
                    engine.max_context_length, engine.model_config.max_position_embeddings, args.kv_cache_tokens,
                    f", --max-context-length {args.max_context_length}" if args.max_context_length else "")
    try:
        server = Server(engine, f"{args.host}:{args.port}", admin_token=args.admin_token)
        if args.metrics_port:
            start_http_server(args.metrics_port, addr=args.host, registry=server.metrics.registry)
    except (OSError, RuntimeError) as exc:  # a port taken while the model loaded
        engine.shutdown()
        raise StartupError(f"cannot listen: {exc}") from None
    await server.start()
    print(f"lmgate serving {os.path.basename(engine.model_path)} on {args.host}:{server.port} "
          f"(ready in {time.perf_counter() - started:.1f}s)", flush=True)
    info = engine.info()
    log.info("started: model %s (%s), dtype %s (%s), device %s, %d engine loop(s) x %d torch threads, KV cache "
             "%d tokens (%.0f MiB), batches of %d sequences / %d tokens, context %d, gRPC port %d, metrics port %s",
             os.path.basename(engine.model_path), info.architecture, str(engine.dtype).removeprefix("torch."),
             engine.dtype_reason, engine.device, info.engine_loops, engine.threads_per_loop,
             info.kv_blocks_total * info.kv_block_size, info.kv_cache_bytes / 2**20, args.max_batch_size,
             args.max_batched_tokens, info.max_context_length, server.port, args.metrics_port or "off")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: %.0fs grace for running streams", args.grace)
    await server.stop(args.grace)
    log.info("stopped")


def main(argv: list[str] | None = None) -> int:
    """Exit status 0 after a clean shutdown, 2 when a setting cannot work (said in one line on stderr)."""
    level = os.environ.get("LMGATE_LOG_LEVEL", "INFO").upper()
    if level not in logging.getLevelNamesMapping():
        print(f"lmgate serve: error: LMGATE_LOG_LEVEL={level}: use DEBUG, INFO, WARNING or ERROR", file=sys.stderr)
        return 2
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    try:
        asyncio.run(serve(args, check_settings(args)))
    except StartupError as exc:
        print(f"lmgate serve: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
