"""C++ CPU kernels, compiled on first use with torch's extension builder and cached across runs
(in `~/.cache/torch_extensions`, or `$TORCH_EXTENSIONS_DIR`).

* paged_attention.cpp: CPU attention over the paged KV cache (`paged_decode_attention`, `paged_prefill_attention`);
* gemm.cpp: float32 `x @ W.T` over W packed in column panels (`pack_columns`, `linear_columns`: the float
  path's linear layers), and over rows expanded from quantized blocks (`panel_gemm`, which `gguf_matmul` runs);
* quantized_matmul.cpp: linear layers over GGUF's quantized blocks (`gguf_matvec`, `gguf_matmul`,
  `gguf_dequantize`); int8_matmul.cpp: the same with x rounded to int8 (`gguf_matvec_int8`, `gguf_matmul_int8`,
  `--int8-activations`; int8_matmul.h declares its few-row path for decode_layers.cpp); gguf_blocks.h: the
  block layouts both read;
* layer_ops.cpp: a decoder layer's elementwise parts in one pass each over float32 or bfloat16 rows (`rms_norm`,
  `add_rms_norm`, `rotary`, `silu_and_mul`), a step's keys and values into their cache slots (`store_kv`),
  and greedy sampling's `argmax_rows`;
* decode_layers.cpp: every decoder layer for a decode step in one call (`decode_layers`, read by
  engine/models/fused_decode.py): a quantized model's steps of a few rows, a float32 model's in column panels.

Where no compiler is found, or the build fails, `load_cpu_kernels` says so once in the log and returns
False; the engine then runs attention with torch ops, linear layers on oneDNN, and expands GGUF weights to
float at load.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import sys
import threading
import time
from typing import Iterator

import torch

log = logging.getLogger(__name__)

SOURCES = [
    os.path.join(os.path.dirname(__file__), name)
    for name in (
        "paged_attention.cpp",
        "gemm.cpp",
        "quantized_matmul.cpp",
        "int8_matmul.cpp",
        "layer_ops.cpp",
        "decode_layers.cpp",
    )
]

# The flags torch builds its own kernels of each capability with, so that ATen's Vectorized takes the same
# instructions; "DEFAULT" (and other architectures) get its portable version.
CAPABILITY_FLAGS = {
    "AVX512": [
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mfma",
        "-mf16c",
        "-DCPU_CAPABILITY_AVX512",
        "-DCPU_CAPABILITY=AVX512",
    ],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"],
}

_lock = threading.Lock()
_loaded: bool | None = None


def load_cpu_kernels() -> bool:
    """Whether the `torch.ops.lmgate` CPU kernels are available, building them the first time."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _build()
        return _loaded


def layer_kernels(x: torch.Tensor) -> bool:
    """Whether the C++ elementwise ops (layer_ops.cpp: norms, rotary, SiLU, KV stores) serve `x`: float32 or
    bfloat16 on the CPU, where the kernels are loaded (a float32 model's linear layers load them, whatever
    `--attention-kernel` says; a bfloat16 model's, the C++ attention). The torch expressions beside each call
    are the same arithmetic, rounded at the same points, in more passes."""
    return x.dtype in (torch.float32, torch.bfloat16) and x.device.type == "cpu" and cpu_kernels_loaded()


def cpu_kernels_loaded() -> bool:
    """Whether the kernels are loaded already: never builds and never waits, so a layer may ask at every call.
    The engine loads them at start where it wants them (C++ attention, quantized weights)."""
    return _loaded is True


def compiler_found() -> bool:
    """Whether the C++ compiler torch's builder would run (`$CXX`, else `c++`) is on PATH."""
    return shutil.which(os.environ.get("CXX", "c++")) is not None


def _build() -> bool:
    _put_ninja_on_path()
    capability = torch.backends.cpu.get_cpu_capability()
    name = f"lmgate_kernels_{capability.lower()}"  # a cache shared by different CPUs keeps one build each
    start = time.perf_counter()
    try:
        from torch.utils.cpp_extension import get_default_build_root, load  # imports setuptools, which a venv may lack

        root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
        build_dir = os.path.join(
            root, f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}", name
        )
        os.makedirs(build_dir, exist_ok=True)
        with _builder_lock(build_dir):
            # -fopenmp: at::parallel_for is inline OpenMP; it runs on the pool torch's own ops use.
            load(
                name=name,
                sources=SOURCES,
                is_python_module=False,
                build_directory=build_dir,
                extra_cflags=["-O3", "-fopenmp", *CAPABILITY_FLAGS.get(capability, [])],
            )
    except Exception as exc:  # no compiler, ninja or setuptools, or a failed build: the torch path still works
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log.warning(
            "CPU kernels unavailable (%s): attention runs on torch ops, linear layers on oneDNN, "
            "GGUF weights are expanded to float",
            first_line,
        )
        return False
    log.info("CPU kernels %s ready in %.1fs", name, time.perf_counter() - start)
    return True


@contextlib.contextmanager
def _builder_lock(build_dir: str) -> Iterator[None]:
    """One builder per build directory across processes, and no stale lock left by a killed one.

    torch's builder marks a build in progress with a `lock` file that only a finished build removes: a
    process killed mid-build (Ctrl-C on a first `make serve`) left every later start waiting on it forever.
    An flock dies with its process, so whoever holds this one knows any `lock` file inside is stale.
    """
    with open(os.path.join(build_dir, "lmgate.flock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(build_dir, "lock"))
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _put_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the `ninja` package puts it beside a venv's python, which
    is not on PATH when the venv is not activated."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
