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

from lmgate.engine.config import DP_BACKEND_MODES, KV_CACHE_DTYPES, OVERLAP_MODES, WEIGHT_MODES, EngineConfig
from lmgate.engine.ranks.node import run_node
from lmgate.engine.engine import Engine
from lmgate.engine.step.engine_loop import overlap_scheduling
from lmgate.engine.errors import EngineError
from lmgate.engine.machine.hardware import DTYPE_CHOICES
from lmgate.engine.loading.loader import read_config

from .logs import configure as configure_logging
from .openai_gateway import OpenAIGateway, smg_binary
from .replica import default_replica_id
from .server import Server, TlsFiles

log = logging.getLogger("lmgate")


class EngineFailed(Exception):
    """An engine rank died while serving: streams ended UNAVAILABLE, the server stopped; exit status 1."""


class StartupError(Exception):
    """A setting that cannot work, found before or while loading: one line for the operator, exit status 2."""


def _ranged(kind: Callable[[str], Any], low: float, high: float = math.inf) -> Callable[[str], Any]:
    """An argparse type that also checks the range (NaN is out of every range)."""

    def parse(text: str) -> Any:
        value = kind(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"must be {low}..{high}, got {text}" if high < math.inf else f"must be at least {low}, got {text}"
            )
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its error messages
    return parse


PORT = _ranged(int, 0, 65535)
PORT_FLAGS = ("--port", "--metrics-port", "--openai-port")  # node 0's own: free, and not the same
DEFAULT_MASTER_PORT = 29500  # torchrun's
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
COUNT = _ranged(int, 1)
FRACTION = _ranged(float, 0.01, 1.0)


def _kv_tokens(text: str) -> int:
    """`auto` (0: the engine sizes the cache) or a count of tokens."""
    return 0 if text == "auto" else COUNT(text)


_kv_tokens.__name__ = "auto or a count"


def _one_of(*values: str, convert: Callable[[str], str] = str) -> Callable[[str], str]:
    """An argparse type for a fixed set of words; unlike `choices`, it also checks LMGATE_* values, which
    argparse takes as string defaults."""

    def parse(text: str) -> str:
        value = convert(text)
        if value not in values:
            raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from {', '.join(values)})")
        return value

    return parse


def _host(text: str) -> str:
    """An address to listen on, an IPv6 one with or without brackets ("::", "[::1]"); kept without them."""
    host = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    if not host:
        raise argparse.ArgumentTypeError("is empty: give an address (127.0.0.1, ::1, 0.0.0.0, ::)")
    return host


def _optional(text: str) -> str | None:
    """A path whose empty value (an LMGATE_* variable set to "") means unset."""
    return text or None


_optional.__name__ = "path"


def _header_value(text: str) -> str:
    """A value sent in a gRPC header: printable ASCII, with no space at either end (which no header keeps)."""
    if not text or not text.isascii() or not text.isprintable() or text != text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} cannot go in a header: printable ASCII, no space at either end")
    return text


_header_value.__name__ = "header value"


def _secret(text: str) -> str:
    """An API key or admin token: a header value a client can send (a secret file's trailing newline is not)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: give a secret, or leave it unset")
    return _header_value(text)


_secret.__name__ = "secret"


def _address(host: str, port: int) -> str:
    """host:port as gRPC takes it: an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class EnvValue(str):
    """A flag's value read from its LMGATE_* variable: argparse checks it as if typed, and `Parser` names the
    variable where it is bad (the flag alone sends an operator looking for a flag nobody passed)."""

    variable: str


def _env(name: str, default: Any) -> Any:
    """LMGATE_<name> if set, as a string argparse parses (and checks) with the flag's type, else `default`."""
    variable = f"LMGATE_{name}"
    if variable not in os.environ:
        return default
    value = EnvValue(os.environ[variable])
    value.variable = variable
    return value


class Parser(argparse.ArgumentParser):
    """argparse, saying which LMGATE_* variable held a bad value."""

    def _get_value(self, action: argparse.Action, arg_string: str) -> Any:
        try:
            return super()._get_value(action, arg_string)
        except argparse.ArgumentError as exc:
            if isinstance(arg_string, EnvValue):
                raise argparse.ArgumentError(action, f"{exc.message} (from {arg_string.variable})") from None
            raise


ON_OFF = _one_of("on", "off")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = Parser(
        prog="lmgate serve",
        description="Serve a language model over gRPC. Every flag "
        "has an environment variable, LMGATE_<FLAG> (in brackets).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument(
        "--model",
        type=_optional,
        default=_env("MODEL", None),
        help="HF model directory or .gguf file; unset: the embedded SmolLM2-135M-Instruct [LMGATE_MODEL]",
    )
    ap.add_argument(
        "--host",
        type=_host,
        default=_env("HOST", "127.0.0.1"),
        help="address to listen on: IPv4 or IPv6 (::1, or :: for every address of both families) [LMGATE_HOST]",
    )
    ap.add_argument("--port", type=PORT, default=_env("PORT", 50051), help="port; 0 picks a free one [LMGATE_PORT]")
    ap.add_argument(
        "--engine-loops",
        type=COUNT,
        default=_env("ENGINE_LOOPS", 1),
        help="data-parallel engine loops, each with its own KV cache [LMGATE_ENGINE_LOOPS]",
    )
    ap.add_argument(
        "--dp-backend",
        default=_env("DP_BACKEND", "auto"),
        type=_one_of(*DP_BACKEND_MODES),
        metavar="{" + ",".join(DP_BACKEND_MODES) + "}",
        help="thread: the engine loops are threads sharing one copy of the weights; process: each loop a process of its own (spawned), with its own copy, past the GIL; auto: process with --device cuda, where a loop sharing the server's GIL waits for the server at every kernel launch, else thread [LMGATE_DP_BACKEND]",
    )
    ap.add_argument(
        "--tensor-parallel",
        type=COUNT,
        default=_env("TENSOR_PARALLEL", 1),
        help="ranks each engine loop's model is split over (by whole GQA groups; always processes): --tensor-parallel 2 --engine-loops 2 makes four [LMGATE_TENSOR_PARALLEL]",
    )
    ap.add_argument(
        "--nnodes",
        type=COUNT,
        default=_env("NNODES", 1),
        help="machines the ranks (--engine-loops x --tensor-parallel) are spread over, evenly; the ranks are then processes [LMGATE_NNODES]",
    )
    ap.add_argument(
        "--node-rank",
        type=_ranged(int, 0),
        default=_env("NODE_RANK", 0),
        help="this machine's place among --nnodes: 0 serves gRPC and holds the first ranks; the others run ranks only, taking every other setting from node 0 [LMGATE_NODE_RANK]",
    )
    ap.add_argument(
        "--master-addr",
        default=_env("MASTER_ADDR", "127.0.0.1"),
        help="node 0's address, reachable from every node (IPv4 or a name) [LMGATE_MASTER_ADDR]",
    )
    ap.add_argument(
        "--master-port",
        type=PORT,
        default=_env("MASTER_PORT", None),
        help=f"node 0's rendezvous port; default {DEFAULT_MASTER_PORT} with more than one node, else any free one [LMGATE_MASTER_PORT]",
    )
    ap.add_argument(
        "--max-batch-size",
        type=COUNT,
        default=_env("MAX_BATCH_SIZE", 64),
        help="sequences per engine step [LMGATE_MAX_BATCH_SIZE]",
    )
    ap.add_argument(
        "--max-batched-tokens",
        type=COUNT,
        default=_env("MAX_BATCHED_TOKENS", 512),
        help="tokens per engine step; long prompts are prefilled in chunks of this [LMGATE_MAX_BATCHED_TOKENS]",
    )
    ap.add_argument(
        "--kv-cache-tokens",
        type=_kv_tokens,
        default=_env("KV_CACHE_TOKENS", "auto"),
        help="KV cache size per engine loop, in tokens; also caps the context. auto: 32768 on the CPU; on CUDA what --gpu-memory-utilization leaves after the weights and activations [LMGATE_KV_CACHE_TOKENS]",
    )
    ap.add_argument(
        "--gpu-memory-utilization",
        type=FRACTION,
        default=_env("GPU_MEMORY_UTILIZATION", 0.9),
        help="with --device cuda and --kv-cache-tokens auto: the share of the GPU's memory the server may take, memory others use now counted against it [LMGATE_GPU_MEMORY_UTILIZATION]",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        default=_env("KV_CACHE_DTYPE", "auto"),
        type=_one_of(*KV_CACHE_DTYPES),
        metavar="{" + ",".join(KV_CACHE_DTYPES) + "}",
        help="KV cache dtype; auto: the model's. float16 or bfloat16 under float32 on the CPU halve the cache's memory and the bytes decode attention reads, rounding keys and values once [LMGATE_KV_CACHE_DTYPE]",
    )
    ap.add_argument(
        "--max-context-length",
        type=_ranged(int, 0),
        default=_env("MAX_CONTEXT_LENGTH", 0),
        help="cap on prompt + output tokens; 0: the model's [LMGATE_MAX_CONTEXT_LENGTH]",
    )
    ap.add_argument(
        "--max-queued-requests",
        type=COUNT,
        default=_env("MAX_QUEUED_REQUESTS", 1024),
        help="requests waiting per engine loop before new ones get RESOURCE_EXHAUSTED [LMGATE_MAX_QUEUED_REQUESTS]",
    )
    ap.add_argument(
        "--stream-interval",
        type=COUNT,
        default=_env("STREAM_INTERVAL", 1),
        help="tokens a stream gathers before they are sent as one message (its first token and its end go at once): 1 streams each token as it is drawn; more means fewer messages for the server and clients to handle, at the cost of smoothness [LMGATE_STREAM_INTERVAL]",
    )
    ap.add_argument(
        "--dtype",
        default=_env("DTYPE", "auto"),
        type=_one_of(*DTYPE_CHOICES),
        metavar="{" + ",".join(DTYPE_CHOICES) + "}",
        help="weights dtype, and the KV cache's unless --kv-cache-dtype says otherwise; auto: bfloat16 on CUDA (float16 before Ampere) and on CPUs with AVX512-BF16 or AMX, else float32 [LMGATE_DTYPE]",
    )
    ap.add_argument(
        "--attention-kernel",
        default=_env("ATTENTION_KERNEL", "on"),
        type=ON_OFF,
        metavar="{on,off}",
        help="on: CPU decode and prefill attention in C++, compiled once on first use (torch ops if that fails); off: torch ops [LMGATE_ATTENTION_KERNEL]",
    )
    ap.add_argument(
        "--weights",
        default=_env("WEIGHTS", "auto"),
        type=_one_of(*WEIGHT_MODES),
        metavar="{" + ",".join(WEIGHT_MODES) + "}",
        help="auto: a GGUF's quantized matrices kept as the file's blocks where the CPU kernels run them (a C++ compiler, float32, no tensor parallelism), else float; quantized: the same, with a warning where they cannot; float: expanded to float at load [LMGATE_WEIGHTS]",
    )
    ap.add_argument(
        "--int8-activations",
        default=_env("INT8_ACTIVATIONS", "off"),
        type=ON_OFF,
        metavar="{on,off}",
        help="on: with quantized weights, every step rounds activations to int8 per block of 32 for Q4_0, Q4_1, Q8_0, Q4_K and Q5_K matrices, as llama.cpp does: faster where compute binds, but not the float model (measured by perplexity; greedy tokens may differ) [LMGATE_INT8_ACTIVATIONS]",
    )
    ap.add_argument(
        "--cuda-graphs",
        default=_env("CUDA_GRAPHS", "on"),
        type=ON_OFF,
        metavar="{on,off}",
        help="on: with --device cuda, decode steps replay CUDA graphs captured per batch-size bucket (not under --tensor-parallel); off: every step eager [LMGATE_CUDA_GRAPHS]",
    )
    ap.add_argument(
        "--overlap-scheduling",
        default=_env("OVERLAP_SCHEDULING", "auto"),
        type=_one_of(*OVERLAP_MODES),
        metavar="{" + ",".join(OVERLAP_MODES) + "}",
        help="on: each step goes to the device before the last step's tokens are read, so the host's work (scheduling, detokenizing, streaming) runs while the device computes; a sequence that stops may run one step more, its token dropped; off: one step at a time; auto: on with --device cuda (not under --tensor-parallel) [LMGATE_OVERLAP_SCHEDULING]",
    )
    ap.add_argument(
        "--prefix-caching",
        default=_env("PREFIX_CACHING", "on"),
        type=ON_OFF,
        metavar="{on,off}",
        help="on: prompts that start with the same tokens (a system prompt, a few-shot preamble, a retry) share their full KV blocks [LMGATE_PREFIX_CACHING]",
    )
    ap.add_argument(
        "--threads",
        type=_ranged(int, 0),
        default=_env("THREADS", 0),
        help="torch threads, split between engine loops; 0: the CPUs this process may use (affinity and cgroup quota) [LMGATE_THREADS]",
    )
    ap.add_argument("--device", default=_env("DEVICE", "cpu"), help="cpu, cuda or cuda:N [LMGATE_DEVICE]")
    ap.add_argument(
        "--admin-token",
        type=_secret,
        default=_env("ADMIN_TOKEN", None),
        help="require 'authorization: Bearer <token>' on Admin calls; unset: Admin from loopback only [LMGATE_ADMIN_TOKEN]",
    )
    ap.add_argument(
        "--tls-cert",
        default=_env("TLS_CERT", None),
        help="PEM certificate chain: serve TLS only (with --tls-key) [LMGATE_TLS_CERT]",
    )
    ap.add_argument("--tls-key", default=_env("TLS_KEY", None), help="PEM private key of --tls-cert [LMGATE_TLS_KEY]")
    ap.add_argument(
        "--tls-client-ca",
        default=_env("TLS_CLIENT_CA", None),
        help="PEM CA bundle: require client certificates it signed (mutual TLS) [LMGATE_TLS_CLIENT_CA]",
    )
    ap.add_argument(
        "--api-key",
        type=_secret,
        default=_env("API_KEY", None),
        help="require 'authorization: Bearer <key>' on Inference calls [LMGATE_API_KEY]",
    )
    ap.add_argument(
        "--replica-id",
        type=_header_value,
        default=_env("REPLICA_ID", default_replica_id()),
        help="this server's name among replicas, in Info and the x-lmgate-replica response header [LMGATE_REPLICA_ID]",
    )
    ap.add_argument(
        "--served-model-name",
        type=_optional,
        default=_env("SERVED_MODEL_NAME", None),
        metavar="NAME",
        help="the model's name to the gateway's clients (the VllmEngine service's GetModelInfo, the OpenAI API's "
        "model); unset: the model's folder or GGUF file name [LMGATE_SERVED_MODEL_NAME]",
    )
    ap.add_argument(
        "--openai-port",
        type=PORT,
        default=_env("OPENAI_PORT", 0),
        help="serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models) on this port through the "
        "Shepherd Model Gateway (smg, pip install 'lmgate[openai]'), started as a child process in front of this "
        "server; 0: off [LMGATE_OPENAI_PORT]",
    )
    ap.add_argument(
        "--metrics-port",
        type=PORT,
        default=_env("METRICS_PORT", 0),
        help="serve Prometheus /metrics on this port; 0: off [LMGATE_METRICS_PORT]",
    )
    ap.add_argument(
        "--session-idle-timeout",
        type=_ranged(float, 0),
        default=_env("SESSION_IDLE_TIMEOUT", 0.0),
        help="seconds after which a session that has had no turn is ended, as End would (its next turn is NOT_FOUND): clients that vanish without End leave nothing behind; 0: sessions last until End [LMGATE_SESSION_IDLE_TIMEOUT]",
    )
    ap.add_argument(
        "--grace",
        type=_ranged(float, 0),
        default=_env("GRACE", 10.0),
        help="seconds running streams get at shutdown [LMGATE_GRACE]",
    )
    ap.add_argument(
        "--log-level",
        type=_one_of(*LOG_LEVELS, convert=str.upper),
        default=_env("LOG_LEVEL", "INFO"),
        metavar="{" + ",".join(LOG_LEVELS) + "}",
        help="[LMGATE_LOG_LEVEL]",
    )
    ap.add_argument(
        "--log-format",
        default=_env("LOG_FORMAT", "text"),
        type=_one_of("text", "json"),
        metavar="{text,json}",
        help="json: one object per line, the access log's fields as keys [LMGATE_LOG_FORMAT]",
    )
    return ap.parse_args(argv)


def check_settings(args: argparse.Namespace) -> EngineConfig:
    """The checks that cost nothing, before the model loads: ports free, device present, model readable,
    engine limits consistent; `args.tls` is set to the TLS files, if any. Raises StartupError."""
    if args.master_port is None:
        args.master_port = DEFAULT_MASTER_PORT if args.nnodes > 1 else 0
    if args.node_rank >= args.nnodes:
        raise StartupError(f"--node-rank {args.node_rank} is not one of --nnodes {args.nnodes} (0..{args.nnodes - 1})")
    serving = args.node_rank == 0  # other nodes run ranks only
    ports = [(flag, args.host, getattr(args, flag[2:].replace("-", "_"))) for flag in PORT_FLAGS] if serving else []
    if serving and args.nnodes > 1:  # node 0's store and rank sockets listen on --master-addr
        ports.append(("--master-port", args.master_addr, args.master_port))
    for flag, host, port in ports:
        if port:
            _check_port_free(flag, host, port)
    taken = [(flag, port) for flag, _, port in ports if port]
    for i, (flag, port) in enumerate(taken):
        other = next((f for f, p in taken[i + 1 :] if p == port), None)
        if other:
            raise StartupError(f"{flag} and {other} are both {port}")
    if args.openai_port and serving:
        _check_openai_gateway(args)
    args.tls = _tls_files(args)
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        raise StartupError(f"--device {args.device!r}: {exc}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise StartupError(f"--device {args.device}: this torch build sees no CUDA device (torch {torch.__version__})")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise StartupError(
            f"--device {args.device}: this machine has {count} CUDA device{'s' if count > 1 else ''}, "
            f"cuda:0 to cuda:{count - 1}"
        )
    if device.type not in ("cpu", "cuda"):
        raise StartupError(f"--device {args.device}: only cpu and cuda are supported")
    try:
        if args.model is not None:
            read_config(args.model)
        return EngineConfig(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            kv_cache_tokens=args.kv_cache_tokens,
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_dtype=args.kv_cache_dtype,
            max_batch_size=args.max_batch_size,
            max_batched_tokens=args.max_batched_tokens,
            max_context_length=args.max_context_length or None,
            engine_loops=args.engine_loops,
            dp_backend=args.dp_backend,
            tensor_parallel=args.tensor_parallel,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            master_addr=args.master_addr,
            master_port=args.master_port,
            max_queued_requests=args.max_queued_requests,
            attention_kernel=args.attention_kernel == "on",
            cuda_graphs=args.cuda_graphs == "on",
            overlap_scheduling=args.overlap_scheduling,
            weights=args.weights,
            int8_activations=args.int8_activations == "on",
            prefix_caching=args.prefix_caching == "on",
            threads=args.threads,
            stream_interval=args.stream_interval,
        )
    except EngineError as exc:
        raise StartupError(str(exc)) from None


def _check_openai_gateway(args: argparse.Namespace) -> None:
    """--openai-port: smg installed, and a server it can reach as it is started here (plaintext, no API key)."""
    if smg_binary() is None:
        raise StartupError("--openai-port needs the smg gateway: pip install 'lmgate[openai]' (Linux x86_64 wheels)")
    if args.tls_cert or args.api_key:
        raise StartupError(
            "--openai-port fronts a plaintext server without --api-key: run smg yourself for TLS or a key"
        )


def _tls_files(args: argparse.Namespace) -> TlsFiles | None:
    if not (args.tls_cert or args.tls_key or args.tls_client_ca):
        return None
    if not (args.tls_cert and args.tls_key):
        raise StartupError("TLS needs both --tls-cert and --tls-key")
    for flag, path in (
        ("--tls-cert", args.tls_cert),
        ("--tls-key", args.tls_key),
        ("--tls-client-ca", args.tls_client_ca),
    ):
        if path and not os.access(path, os.R_OK):
            raise StartupError(f"{flag} {path}: no readable file there")
    return TlsFiles(args.tls_cert, args.tls_key, args.tls_client_ca)


def _check_port_free(flag: str, host: str, port: int) -> None:
    try:
        with socket.create_server(
            (host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET, reuse_port=False
        ):
            pass
    except OSError as exc:
        raise StartupError(f"{flag} {port}: cannot listen on {_address(host, port)}: {exc.strerror or exc}") from None


def serve_node(config: EngineConfig) -> int:
    """A node past the first: its ranks, until node 0 closes them (0) or one dies or loses node 0 (1)."""
    try:
        return run_node(config)
    except EngineError as exc:
        raise StartupError(str(exc)) from None
    except RuntimeError as exc:  # the store: node 0 never came, or went
        raise StartupError(f"node 0 at {config.master_addr}:{config.master_port}: {str(exc).splitlines()[0]}") from None


async def serve(args: argparse.Namespace, config: EngineConfig) -> None:
    started = time.perf_counter()
    try:
        engine = Engine(config)
    except EngineError as exc:
        raise StartupError(str(exc)) from None
    if engine.max_context_length < engine.model_config.max_position_embeddings:
        log.warning(
            "the context is capped at %d tokens (the model takes %d): --kv-cache-tokens %d%s",
            engine.max_context_length,
            engine.model_config.max_position_embeddings,
            engine.config.kv_cache_tokens,
            f", --max-context-length {args.max_context_length}" if args.max_context_length else "",
        )
    try:
        server = Server(
            engine,
            _address(args.host, args.port),
            admin_token=args.admin_token,
            tls=args.tls,
            api_key=args.api_key,
            replica_id=args.replica_id,
            session_idle_timeout=args.session_idle_timeout,
            served_model_name=args.served_model_name,
        )
        if args.metrics_port:
            start_http_server(args.metrics_port, addr=args.host, registry=server.metrics.registry)
    except (OSError, RuntimeError) as exc:  # a port taken while the model loaded
        engine.shutdown()
        raise StartupError(f"cannot listen: {exc}") from None
    await server.start()
    print(
        f"lmgate serving {os.path.basename(engine.model_path)} on {_address(args.host, server.port)} "
        f"(ready in {time.perf_counter() - started:.1f}s)",
        flush=True,
    )
    info = engine.info()
    log.info(
        "started: model %s (%s), dtype %s (%s), weights %.0f MiB (--weights %s, int8 activations %s), device %s, %d engine loop(s) as %s, tensor parallel %d, x %d torch threads, KV cache "
        "%d tokens of %s (%.0f MiB), batches of %d sequences / %d tokens, context %d, overlap scheduling %s, gRPC port %d (%s), "
        "metrics port %s, replica %s",
        os.path.basename(engine.model_path),
        info.architecture,
        str(engine.dtype).removeprefix("torch."),
        engine.dtype_reason,
        info.weights_bytes / 2**20,
        engine.config.weights,
        "on" if engine.config.int8_activations else "off",
        engine.device,
        info.engine_loops,
        "threads" if engine.loops else "processes",
        args.tensor_parallel,
        engine.threads_per_loop,
        info.kv_blocks_total * info.kv_block_size,
        str(engine.kv_dtype).removeprefix("torch."),
        info.kv_cache_bytes / 2**20,
        args.max_batch_size,
        args.max_batched_tokens,
        info.max_context_length,
        "on" if overlap_scheduling(engine.config, engine.device) else "off",
        server.port,
        ("mutual TLS" if args.tls.client_ca else "TLS") if args.tls else "plaintext",
        args.metrics_port or "off",
        server.replica_id,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    gateway = None
    if args.openai_port:
        gateway = OpenAIGateway(
            smg_binary(),
            args.host,
            args.openai_port,
            _address("127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host, server.port),
        )
        log.info(
            "the OpenAI API on %s/v1 (smg, pid %d; its metrics on port %d)",
            gateway.url,
            gateway.process.pid,
            gateway.metrics_port,
        )
        asyncio.ensure_future(_watch(gateway))

    def on_signal() -> None:
        stop.set()
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second one ends the process at once, grace or not
            loop.remove_signal_handler(sig)  # (a handler: as a container's PID 1, a default action is ignored)
            signal.signal(sig, lambda signum, _: os._exit(128 + signum))

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(server.failed.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
    if server.failed.is_set():
        await server.stop(0)
        raise EngineFailed(engine.failure)
    log.info("shutting down: %.0fs grace for running streams", args.grace)
    if gateway is not None:
        await asyncio.to_thread(gateway.stop)
    await server.stop(args.grace)
    if engine.failure is not None:  # a rank died while the engine stopped
        raise EngineFailed(engine.failure)
    log.info("stopped")


async def _watch(gateway: OpenAIGateway) -> None:
    """One line if the gateway exits while lmgate serves (lmgate.v1 and the worker protocol go on)."""
    status = await asyncio.to_thread(gateway.wait)
    if not gateway.stopping:
        log.error("the OpenAI gateway (smg) exited with status %d: %s/v1 no longer answers", status, gateway.url)


def main(argv: list[str] | None = None) -> int:
    """Exit status 0 after a clean shutdown, 2 when a setting cannot work, 1 when an engine rank died (said in
    one line on stderr)."""
    args = parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    try:
        config = check_settings(args)
        if config.node_rank:
            return serve_node(config)
        asyncio.run(serve(args, config))
    except StartupError as exc:
        print(f"lmgate serve: error: {exc}", file=sys.stderr)
        return 2
    except EngineFailed as exc:
        print(f"lmgate serve: error: {exc}; stopped", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
