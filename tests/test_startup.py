"""`lmgate serve` with settings that cannot work: one clear line on stderr, exit status 2, no traceback, and
the cheap checks (ports, flags, paths, device) made before the model loads."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def serve(*flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lmgate.service.main", *flags],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def taken_port():
    with socket.create_server(("127.0.0.1", 0)) as sock:
        yield str(sock.getsockname()[1])


def bad_settings(taken_port: str) -> list[tuple[list[str], dict[str, str], str]]:
    return [
        (["--port", taken_port], {}, f"--port {taken_port}: cannot listen"),
        (["--port", "0", "--metrics-port", taken_port], {}, f"--metrics-port {taken_port}: cannot listen"),
        (["--port", "99999"], {}, "--port: must be 0..65535"),
        (["--max-batch-size", "0"], {}, "--max-batch-size: must be at least 1"),
        (["--stream-interval", "0"], {}, "--stream-interval: must be at least 1"),
        (["--grace", "nan"], {}, "--grace"),
        (["--session-idle-timeout", "-1"], {}, "--session-idle-timeout"),
        ([], {"LMGATE_PORT": "abc"}, "--port: invalid int value: 'abc' (from LMGATE_PORT)"),
        ([], {"LMGATE_LOG_LEVEL": "chatty"}, "--log-level: invalid choice: 'CHATTY'"),
        ([], {"LMGATE_DTYPE": "float64"}, "--dtype: invalid choice: 'float64'"),
        ([], {"LMGATE_WEIGHTS": "bogus"}, "--weights: invalid choice: 'bogus'"),
        ([], {"LMGATE_API_KEY": ""}, "--api-key: is empty: give a secret, or leave it unset (from LMGATE_API_KEY)"),
        (["--admin-token", " "], {}, "--admin-token: is empty"),
        ([], {"LMGATE_API_KEY": "s3cret\n"}, "--api-key: 's3cret\\n' cannot go in a header"),  # a file's newline
        (["--admin-token", "clé"], {}, "--admin-token: 'clé' cannot go in a header"),
        (["--replica-id", "réplica-1"], {}, "--replica-id: 'réplica-1' cannot go in a header"),
        ([], {"LMGATE_HOST": ""}, "--host: is empty"),
        (["--prefix-caching", "maybe"], {}, "--prefix-caching: invalid choice: 'maybe'"),
        (["--int8-activations", "maybe"], {}, "--int8-activations: invalid choice: 'maybe'"),
        (
            ["--port", "0", "--weights", "float", "--int8-activations", "on"],
            {},
            "int8 activations run on quantized weights: they cannot be had with weights float",
        ),
        (["--kv-cache-dtype", "fp8"], {}, "--kv-cache-dtype: invalid choice: 'fp8'"),
        (
            ["--port", "0", "--dtype", "bfloat16", "--kv-cache-dtype", "float16"],
            {},
            "--kv-cache-dtype float16 under bfloat16 weights on cpu",
        ),
        (["--port", "0", "--model", os.path.join(ROOT, "README.md")], {}, "is not a readable GGUF file"),
        (["--port", "0", "--model", "/nonexistent/model"], {}, "does not exist"),
        (["--port", "0", "--device", "tpu"], {}, "--device"),
        (
            ["--port", "0", "--kv-cache-tokens", "8", "--dtype", "float32"],
            {},
            "kv_cache_tokens (8) must hold one block",
        ),
        (
            [],
            {"LMGATE_KV_CACHE_TOKENS": "most"},
            "--kv-cache-tokens: invalid auto or a count value: 'most' (from LMGATE_KV_CACHE_TOKENS)",
        ),
        (
            ["--port", "abc"],
            {"LMGATE_PORT": "1"},
            "--port: invalid int value: 'abc'\n",
        ),  # the flag's, not the variable's
        (["--gpu-memory-utilization", "1.5"], {}, "--gpu-memory-utilization: must be 0.01..1.0"),
        (["--port", "0", "--openai-port", "8000", "--api-key", "k"], {}, "--openai-port fronts a plaintext server"),
        (["--port", "8001", "--openai-port", "8001"], {}, "--port and --openai-port are both 8001"),
        (["--port", "0", "--nnodes", "2", "--node-rank", "2"], {}, "--node-rank 2 is not one of --nnodes 2"),
        (
            ["--port", "0", "--nnodes", "2", "--engine-loops", "3"],
            {},
            "3 ranks (engine_loops x tensor_parallel) do not spread evenly over 2 nodes",
        ),
        (
            ["--port", "0", "--nnodes", "2", "--engine-loops", "2", "--master-addr", "192.0.2.1"],
            {},
            "--master-port 29500: cannot listen on 192.0.2.1:29500",
        ),  # node 0 listens on --master-addr: one of its own
    ]


def test_bad_settings_exit_two_with_one_line_before_loading(taken_port):
    cases = bad_settings(taken_port)
    with ThreadPoolExecutor(max_workers=3) as pool:  # each a Python start-up of its own: two at a time halve it
        results = list(pool.map(lambda case: serve(*case[0], env=case[1]), cases))
    for (flags, env, words), result in zip(cases, results):
        assert result.returncode == 2, (flags, env, result.stderr)
        assert words in result.stderr, (flags, env, result.stderr)
        assert "Traceback" not in result.stderr and "loaded" not in result.stderr, result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_exits_two():
    result = serve("--port", "0", "--device", "cuda")
    assert result.returncode == 2 and "sees no CUDA device" in result.stderr and "Traceback" not in result.stderr


def test_serve_help_shows_defaults():
    result = serve("--help")
    text = " ".join(result.stdout.split())  # argparse wraps lines anywhere
    assert result.returncode == 0
    assert "(default: 50051)" in text and "(default: auto)" in text
