"""`--int8-activations`: quantized layers round x to int8 per block of 32. The kernels (a GEMM over expanded
panels for many rows, a matvec over the blocks where they lie for few) against float64 over x rounded the same
way (so only summation order may differ), the types they do not take left to the float32 kernels, and the
embedded model's perplexity against the float-activation path (the issue's measure: tokens may differ). Skipped
where no C++ compiler builds the kernels."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from lmgate.engine.config import EngineConfig
from lmgate.engine.engine import Engine
from lmgate.engine.errors import InvalidRequest
from lmgate.engine.machine.hardware import CpuFeatures, _read_cpuinfo, cpu_features
from lmgate.engine.kernels import compiler_found, load_cpu_kernels
from lmgate.engine.models import build_model
from lmgate.engine.models.quantized_linear import INT8_TYPES, MATVEC_ROWS, GGUFBlocks, QuantizedLinear
from lmgate.engine.sampling.sampler import SamplingParams
from tests.perplexity import PASSAGE, perplexity
from tests.test_quantized import blocks_for

kernels = pytest.mark.skipif(
    not (compiler_found() and load_cpu_kernels()), reason="no C++ compiler: the quantized kernels cannot be built"
)
INT8 = [GGMLQuantizationType(t) for t in sorted(INT8_TYPES)]
OTHERS = [GGMLQuantizationType.Q6_K]


def rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel rounds it, in float64: per block of 32, round(x * (127 / max|x|)) in float32 arithmetic
    (ties to even), times max|x| / 127."""
    blocks = x.view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127).div(amax), 0)  # `127 / amax` is 127 * (1 / amax) in torch
    return (torch.round(blocks * inv).double() * (amax / 127).double()).view_as(x)


def weights_and_x(qtype: GGMLQuantizationType, m: int) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """37 rows of W (four full groups of 8, a partial one, an odd count of groups) as blocks and as float64,
    three blocks of K, and m rows of x whose first block is zeros (a block of zeros has no scale)."""
    n, k = 37, 3 * GGML_QUANT_SIZES[qtype][0]
    rng = np.random.default_rng(m)
    raw = blocks_for(rng.standard_normal((n, k)).astype(np.float32), qtype, seed=m)
    x = torch.randn(m, k)
    x[0, :32] = 0
    return raw, torch.from_numpy(dequantize(raw, qtype).reshape(n, k)).double(), x


# (op, rows of x): the GEMM at any count, the matvec at 1 to 8 rows a pass (11: a pass of 8, one of 3)
SHAPES = [("gguf_matmul_int8", m) for m in (1, 3, 10, 64, 300)] + [("gguf_matvec_int8", m) for m in (1, 3, 8, 11)]


@kernels
@pytest.mark.parametrize("qtype", INT8, ids=lambda t: t.name)
@pytest.mark.parametrize("op, m", SHAPES)
def test_int8_kernel_is_rounded_x_times_the_weights(qtype, op, m):
    raw, weight, x = weights_and_x(qtype, m)
    got = getattr(torch.ops.lmgate, op)(x, torch.from_numpy(raw), int(qtype)).double()
    want = rounded(x) @ weight.T
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    exact = x.double() @ weight.T
    assert 1e-4 < ((got - exact).norm() / exact.norm()).item() < 0.05  # rounded, and by little


@kernels
@pytest.mark.skipif(
    not cpu_features().int8_vnni, reason="this CPU has no AVX512-VNNI: its vpdpbusd path cannot run here"
)
@pytest.mark.parametrize("qtype", INT8, ids=lambda t: t.name)
@pytest.mark.parametrize(
    "op, m",
    [
        ("gguf_matmul_int8", 3),
        ("gguf_matmul_int8", 64),
        ("gguf_matmul_int8", 300),
        ("gguf_matvec_int8", 1),
        ("gguf_matvec_int8", 5),
    ],
)
def test_vnni_kernel_gives_the_same_bits_as_avx2(qtype, op, m):
    """vpdpbusd and vpmaddubsw sum the same integers exactly (Q5_K's near the int16 limit, Q8_0's signed ones),
    and the float steps after them are the same."""
    raw, _, x = weights_and_x(qtype, m)
    x[1:, 32:64] = x[1:, 32:64].sign() * 10  # |x| at its block's maximum: every rounded value is +-127
    x[0, 64:] = x[0, 64:].sign() * 10
    blocks, kernel = torch.from_numpy(raw), getattr(torch.ops.lmgate, op)
    assert torch.equal(kernel(x, blocks, int(qtype), True), kernel(x, blocks, int(qtype), False))


@kernels
@pytest.mark.skipif(
    CpuFeatures("", "x86_64", _read_cpuinfo()[1]).int8_vnni,  # the CPU's own, not LMGATE_CPU_FLAGS
    reason="this CPU has AVX512-VNNI: the refusal is for CPUs without it",
)
@pytest.mark.parametrize("op", ["gguf_matmul_int8", "gguf_matvec_int8"])
def test_vnni_kernel_refused_on_a_cpu_without_it(op):
    raw, _, x = weights_and_x(GGMLQuantizationType.Q4_0, 16)
    with pytest.raises(RuntimeError, match="without AVX512-VNNI"):
        getattr(torch.ops.lmgate, op)(x, torch.from_numpy(raw), int(GGMLQuantizationType.Q4_0), True)


@kernels
@pytest.mark.parametrize("qtype", INT8 + OTHERS, ids=lambda t: t.name)
def test_layer_rounds_x_for_the_types_the_kernels_take(qtype):
    """Few rows (the matvec) and many (the GEMM) alike; Q6_K (a scale per 16 weights) stays float32."""
    n, k = 40, 2 * GGML_QUANT_SIZES[qtype][0]
    raw = blocks_for(np.random.default_rng(3).standard_normal((n, k)).astype(np.float32), qtype, seed=3)
    weight = torch.from_numpy(dequantize(raw, qtype).reshape(n, k)).double()
    layer = QuantizedLinear(GGUFBlocks(torch.from_numpy(raw), int(qtype), k), int8_activations=True)
    for m in (1, MATVEC_ROWS, 64):
        x = torch.randn(m, k)
        int8 = qtype in INT8
        want = (rounded(x) if int8 else x.double()) @ weight.T
        torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_int8_activations_need_quantized_weights():
    with pytest.raises(InvalidRequest, match="int8 activations run on quantized weights"):
        EngineConfig(weights="float", int8_activations=True)


@kernels
@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_embedded_model_perplexity_with_int8_activations(checkpoint, tokenizer, hf_model, decode):
    """SmolLM2 over an English passage, in one prefill (the int8 GEMM) or one token a step (the fused decode's
    int8 matrix-vector products): with float activations its perplexity is transformers' (so the measure is
    right); rounding x to int8 moves it by under 2%, and does move it (the int8 kernels ran)."""
    ids = tokenizer.encode(PASSAGE)
    assert len(ids) > 200
    ppl = {}
    for int8 in (False, True):
        model = build_model(
            checkpoint.config,
            checkpoint.weights,
            torch.float32,
            torch.device("cpu"),
            quantized=True,
            int8_activations=int8,
        )
        assert model.model.layers[0].mlp.down_proj.int8_activations == int8
        assert model.fused_decode.int8_activations == int8
        ppl[int8] = perplexity(model, ids, decode=decode)
    with torch.inference_mode():
        reference = math.exp(hf_model(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item())
    assert ppl[False] == pytest.approx(reference, rel=1e-3)
    assert ppl[True] != ppl[False]
    assert abs(ppl[True] / ppl[False] - 1) < 0.02, ppl


@kernels
def test_engine_serves_concurrent_streams_with_int8_activations(checkpoint):
    """Prefills and 24-row decode steps through the int8 kernels: every stream ends with its tokens, every KV
    block comes back, and a cancel mid-stream is clean."""
    config = EngineConfig(dtype="float32", kv_cache_tokens=8192, weights="quantized", int8_activations=True)
    with Engine(config, checkpoint=checkpoint) as eng:
        model = eng.loops[0].runner.model
        assert model.model.layers[0].self_attn.qkv_proj.int8_activations
        prompts = [[(7 * i + j) % 1000 + 100 for j in range(20 + i)] for i in range(24)]
        streams = [eng.submit(ids, SamplingParams(max_new_tokens=16, ignore_eos=True)) for ids in prompts]
        cancelled = eng.submit(prompts[0], SamplingParams(max_new_tokens=200, ignore_eos=True))
        it = iter(cancelled)
        next(it)
        assert cancelled.cancel()
        rest = list(it)
        outs = [[t for out in s for t in out.token_ids] for s in streams]
        assert sum(len(o.token_ids) for o in rest) < 200
        assert all(len(o) == 16 for o in outs)
        info = eng.info()
        assert info.kv_blocks_free == info.kv_blocks_total
