"""What this machine can do, read in one place: the CPU's features, and the dtype that follows from them.

Every CPU-dependent choice (the `auto` dtype, whether oneDNN may pack bf16 weights, the int8 kernel's
dot-product instruction) asks `cpu_features()`,
never the CPU itself, so one value decides and tests can set it. `LMGATE_CPU_FLAGS` (flags as
/proc/cpuinfo names them, separated by spaces or commas) replaces what the CPU reports: with
`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` beside it, an AVX-512 machine takes an AVX2 one's paths.
"""

from __future__ import annotations

import functools
import os
import platform
import time
from dataclasses import dataclass

import torch

FLAGS_ENV = "LMGATE_CPU_FLAGS"
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class CpuFeatures:
    name: str
    arch: str  # platform.machine(): x86_64, aarch64, ...
    flags: frozenset[str]

    @property
    def native_bf16(self) -> bool:
        """bf16 dot products in hardware (AVX512-BF16, AMX, Arm's BF16); elsewhere bf16 math is emulated."""
        if self.arch in ("aarch64", "arm64"):
            return "bf16" in self.flags
        return bool({"avx512_bf16", "amx_bf16"} & self.flags)

    @property
    def onednn_bf16(self) -> bool:
        """Whether oneDNN takes bf16 weights: it asks for AVX-NE-CONVERT or AVX512 BW, VL and DQ on x86."""
        if self.arch in ("aarch64", "arm64"):
            return "bf16" in self.flags
        return "avx_ne_convert" in self.flags or {"avx512bw", "avx512vl", "avx512dq"} <= self.flags

    @property
    def int8_vnni(self) -> bool:
        """AVX512-VNNI with 256-bit forms (Ice Lake, Sapphire Rapids, Zen 4 and later): the int8 kernel's
        vpdpbusd, one instruction where AVX2 takes two and a widening step."""
        return {"avx512_vnni", "avx512vl"} <= self.flags

    @property
    def vector_isa(self) -> str:
        """The widest x86 vector extension, for logs and benchmark tables."""
        for isa in ("amx_bf16", "avx512_bf16", "avx512f", "avx2", "avx"):
            if isa in self.flags:
                return isa
        return self.arch

    def describe(self) -> str:
        return f"{self.name} ({self.vector_isa}{', native bf16' if self.native_bf16 else ''})"


@functools.cache
def cpu_features() -> CpuFeatures:
    """The CPU's name and flags from /proc/cpuinfo (or `LMGATE_CPU_FLAGS`); read once per process.
    Tests that set the variable call `cpu_features.cache_clear()`."""
    name, flags = _read_cpuinfo()
    override = os.environ.get(FLAGS_ENV)
    if override is not None:
        flags = frozenset(override.replace(",", " ").split())
    return CpuFeatures(name=name, arch=platform.machine(), flags=flags)


def _read_cpuinfo() -> tuple[str, frozenset[str]]:
    name, flags = platform.processor() or platform.machine(), frozenset[str]()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and value.strip():
                    name = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = frozenset(value.split())
                if key == "" and flags:  # the first processor's block is enough
                    break
    except OSError:
        pass
    return name, flags


def choose_dtype(
    requested: str, device: torch.device, features: CpuFeatures | None = None, quantized_weights: bool = False
) -> tuple[torch.dtype, str]:
    """The weights' and KV cache's dtype, and why. `auto`: bfloat16 on CUDA (float16 before Ampere) and on CPUs
    with bf16 arithmetic in hardware, float32 elsewhere (emulated bf16 runs several times slower than float32),
    and float32 where a GGUF's quantized weights stay blocks on one rank (`quantized_weights`): their kernels
    compute in float32, and bfloat16 would expand the blocks (5x the bytes a decoded token reads)."""
    if requested != "auto":
        if requested not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {requested!r}")
        return DTYPES[requested], f"asked for {requested}"
    if device.type == "cuda":
        # (Without CUDA, the placement check that follows says what is wrong.)
        major, minor = torch.cuda.get_device_capability(device) if torch.cuda.is_available() else (8, 0)
        if major < 8:  # before Ampere: no bf16 in hardware (nor in Triton's dot there)
            return torch.float16, f"auto: float16 on a CUDA device of compute capability {major}.{minor}, without bf16"
        return torch.bfloat16, "auto: bfloat16 on CUDA"
    if quantized_weights:
        return torch.float32, "auto: float32, in which the kernels read the GGUF's quantized weights (--weights)"
    features = features or cpu_features()
    if features.native_bf16:
        return torch.bfloat16, f"auto: this CPU has bf16 arithmetic in hardware ({features.vector_isa})"
    return torch.float32, "auto: this CPU has no bf16 arithmetic in hardware (no AVX512-BF16 or AMX)"


def matmul_gflops(dtype: torch.dtype, m: int = 256, k: int = 576, n: int = 1536, seconds: float = 0.2) -> float:
    """Measured GFLOP/s of `F.linear` at a decode-step shape; for telling an operator what a dtype costs."""
    x, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    with torch.inference_mode():
        torch.nn.functional.linear(x, w)
        runs, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            torch.nn.functional.linear(x, w)
            runs += 1
    return 2 * m * k * n * runs / (time.perf_counter() - start) / 1e9
