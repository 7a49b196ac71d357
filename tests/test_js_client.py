"""A grpc-js client (@grpc/grpc-js + @grpc/proto-loader from npm) streams a Generate from the server."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from lmgate.engine.sampling.sampler import SamplingParams

JS_DIR = Path(__file__).parent / "js"


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
def test_grpc_js_client_streams_generate(server):
    assert (JS_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir(), "run `make test`: it installs the npm packages"
    run = subprocess.run(
        ["node", str(JS_DIR / "generate.js"), server.address, "The capital of France is"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    engine = server.engine
    ref = engine.generate(
        engine.tokenizer.encode("The capital of France is"), SamplingParams(max_new_tokens=16, ignore_eos=True)
    )
    assert result["token_ids"] == ref.token_ids
    assert result["text"] == ref.text
    assert result["finish_reason"] == "FINISH_REASON_LENGTH"
    assert result["usage"]["completion_tokens"] == 16
    assert result["messages"] >= 2
