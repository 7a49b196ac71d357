"""CPU features read in one place, and the dtype `--dtype auto` chooses from them (tested for every kind of
CPU without needing each: the choice is a function of the flags)."""

from __future__ import annotations

import logging
import math
import os

import pytest
import torch

from lmgate.engine.config import EngineConfig
from lmgate.engine.engine import Engine
from lmgate.engine.errors import InvalidRequest
from lmgate.engine.sampling.sampler import SamplingParams
from lmgate.engine.machine.hardware import CpuFeatures, choose_dtype, cpu_features
from lmgate.engine.step.weights import quantized_gguf
from lmgate.engine.kernels import compiler_found, load_cpu_kernels
from lmgate.engine.machine.threads import available_cpus, cgroup_cpu_quota
from tests.conftest import AVX2, AVX512

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def x86(flags: str) -> CpuFeatures:
    return CpuFeatures("test cpu", "x86_64", frozenset(flags.split()))


@pytest.mark.parametrize(
    "arch,flags,want",
    [
        ("x86_64", AVX2, torch.float32),  # AMD Zen 3, Intel Haswell .. Alder Lake
        ("x86_64", AVX512, torch.float32),  # Skylake-X: AVX-512 but no bf16 arithmetic
        ("x86_64", AVX512 + " avx512_bf16", torch.bfloat16),  # Cooper Lake, Zen 4 / 5
        ("x86_64", AVX512 + " amx_bf16 amx_tile", torch.bfloat16),  # Sapphire Rapids
        ("aarch64", "fp asimd sve", torch.float32),
        ("aarch64", "fp asimd sve bf16", torch.bfloat16),  # Graviton 3, Neoverse V1
    ],
)
def test_auto_dtype_follows_cpu_flags(arch, flags, want):
    dtype, why = choose_dtype("auto", CPU, CpuFeatures("test cpu", arch, frozenset(flags.split())))
    assert dtype == want and why.startswith("auto:")


@pytest.mark.parametrize(
    "capability, want", [((9, 0), torch.bfloat16), ((8, 0), torch.bfloat16), ((7, 5), torch.float16)]
)
def test_auto_dtype_on_cuda_is_bfloat16_from_ampere_on_else_float16(monkeypatch, capability, want):
    """The device's compute capability as the driver reports it (stood in for here: this machine has no GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert choose_dtype("auto", CUDA, x86(AVX2))[0] == want


def test_explicit_dtypes_are_kept():
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        assert choose_dtype(name, CPU, x86(AVX2)) == (dtype, f"asked for {name}")
    with pytest.raises(ValueError, match="auto"):
        choose_dtype("float64", CPU, x86(AVX2))


def test_onednn_bf16_needs_avx512_bw_vl_dq_or_avx_ne_convert():
    assert not x86(AVX2).onednn_bf16
    assert not x86(AVX2 + " avx512f").onednn_bf16
    assert x86(AVX512).onednn_bf16
    assert x86(AVX2 + " avx_ne_convert").onednn_bf16  # Arrow Lake, Sierra Forest


def test_int8_kernel_takes_vpdpbusd_only_with_avx512_vnni_and_vl():
    assert not x86(AVX2).int8_vnni
    assert not x86(AVX2 + " avx_vnni").int8_vnni  # Alder Lake's VEX form is another instruction
    assert not x86(AVX2 + " avx512_vnni").int8_vnni
    assert x86(AVX512 + " avx512_vnni").int8_vnni


def test_cpu_flags_override_is_the_one_value_code_reads(cpu_flags):
    real = cpu_features()
    assert real.name and real.arch
    cpu_flags("avx2, fma")
    assert cpu_features().flags == {"avx2", "fma"} and cpu_features().name == real.name
    assert choose_dtype("auto", CPU)[0] == torch.float32
    cpu_flags("avx512f avx512bw avx512vl avx512dq avx512_bf16")
    assert choose_dtype("auto", CPU)[0] == torch.bfloat16


def test_engine_auto_dtype_and_bf16_warning_on_emulating_cpu(cpu_flags, tiny_models, caplog):
    path = tiny_models("llama").path
    cpu_flags(AVX2)
    with Engine(EngineConfig(model=path, kv_cache_tokens=256)) as eng:
        assert eng.dtype == torch.float32 and "no bf16 arithmetic" in eng.dtype_reason
    with caplog.at_level(logging.WARNING, logger="lmgate.engine.engine"):
        with Engine(EngineConfig(model=path, dtype="bfloat16", kv_cache_tokens=256)) as eng:
            assert eng.dtype == torch.bfloat16 and "emulated on this CPU" in eng.dtype_reason
            assert eng.generate("Hello", SamplingParams(max_new_tokens=4)).token_ids  # slower, but it works
    warnings = [r for r in caplog.records if "no bf16 arithmetic in hardware" in r.getMessage()]
    assert len(warnings) == 1 and "GFLOP/s" in warnings[0].getMessage()


def test_auto_dtype_keeps_float32_where_gguf_weights_stay_quantized(cpu_flags, checkpoint):
    """On a bf16 CPU, the embedded GGUF stays quantized in float32 (bfloat16 would expand its blocks); an
    explicit --dtype bfloat16, or --weights float, still gets bfloat16."""
    assert choose_dtype("auto", CPU, x86(AVX512 + " avx512_bf16"), quantized_weights=True)[0] == torch.float32
    assert choose_dtype("bfloat16", CPU, x86(AVX2), quantized_weights=True)[0] == torch.bfloat16
    cpu_flags(AVX512 + " avx512_bf16")
    with Engine(EngineConfig(kv_cache_tokens=256), checkpoint=checkpoint) as eng:
        quantized = compiler_found()  # where the kernels can be built
        assert eng.dtype == (torch.float32 if quantized else torch.bfloat16)
        assert ("quantized weights" in eng.dtype_reason) == quantized
        if quantized and load_cpu_kernels():
            assert eng.weights_bytes < 110e6  # the blocks, not bfloat16 copies of them
    with Engine(EngineConfig(kv_cache_tokens=256, weights="float"), checkpoint=checkpoint) as eng:
        assert eng.dtype == torch.bfloat16 and "bf16 arithmetic in hardware" in eng.dtype_reason


def test_auto_dtype_under_tensor_parallelism_is_one_ranks(cpu_flags, gguf_path):
    """A GGUF split over ranks is expanded to float, but `--dtype auto` still picks what one rank computes
    in: bfloat16 there would change greedy tokens against one rank's (README: "Outputs equal one rank's")."""
    cpu_flags(AVX512 + " avx512_bf16")
    chosen = [
        choose_dtype("auto", CPU, quantized_weights=quantized_gguf(EngineConfig(tensor_parallel=tp), gguf_path, CPU))
        for tp in (1, 2, 4)
    ]
    assert chosen[0] == chosen[1] == chosen[2]
    assert chosen[0][0] == (torch.float32 if compiler_found() else torch.bfloat16)


def test_engine_refuses_unknown_dtype(tiny_models):
    with pytest.raises(InvalidRequest, match="dtype"):
        Engine(EngineConfig(model=tiny_models("llama").path, dtype="int3"))


@pytest.mark.parametrize(
    "files,want",
    [
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu.max": "150000 100000\n"}, 1.5),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "50000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 0.5),
        ({}, None),
    ],
)
def test_cgroup_cpu_quota_v1_and_v2(tmp_path, files, want):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_cpu_quota(str(tmp_path)) == want
    cpus = available_cpus(str(tmp_path))
    assert 1 <= cpus <= len(os.sched_getaffinity(0))
    if want:
        assert cpus == min(len(os.sched_getaffinity(0)), math.ceil(want))


def test_threads_split_between_engine_loops(tiny_models):
    path = tiny_models("llama").path
    with Engine(EngineConfig(model=path, kv_cache_tokens=256, threads=1, dtype="float32")) as eng:
        assert eng.num_threads == 1 and eng.threads_per_loop == 1
    with Engine(EngineConfig(model=path, kv_cache_tokens=256, dtype="float32")) as eng:
        assert eng.num_threads == available_cpus()
    with pytest.raises(InvalidRequest, match="threads"):
        EngineConfig(threads=-1)
    assert os.environ["OMP_WAIT_POLICY"]  # set before torch loaded libgomp (engine/__init__.py)
