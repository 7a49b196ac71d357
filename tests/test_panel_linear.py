"""gemm.cpp's float32 linear layer against a float64 matmul, and which layer each linear of a CPU model gets."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lmgate.engine.kernels import compiler_found, load_cpu_kernels
from lmgate.engine.models.packed_linear import PackedLinear
from lmgate.engine.models.panel_linear import PanelLinear, cpu_linears
from tests.conftest import AVX2, AVX512

pytestmark = pytest.mark.skipif(not (compiler_found() and load_cpu_kernels()),
                                reason="no C++ compiler: gemm.cpp cannot be built")


@pytest.mark.parametrize("m", [0, 1, 3, 4, 5, 16, 64, 300])
@pytest.mark.parametrize("n", [1, 2, 3, 47, 48, 49, 97, 160])
@pytest.mark.parametrize("k", [16, 64, 576, 1536, 2080])
def test_linear_matches_float64(m, n, k):
    """Every tile shape at the edges: rows of x not a multiple of 4, rows of W not a multiple of 3 or of
    the 48-row panel, one panel per thread or several; and no rows at all (the LM head of a step in which
    no sequence samples). K past 768 runs in chunks: two equal ones (1536), or three, the last shorter (2080)."""
    torch.manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k), torch.randn(n, k)
    got = torch.ops.lmgate.linear(x, w)
    want = x.double() @ w.double().T
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * k**0.5)


def test_linear_takes_a_strided_x():
    x, w = torch.randn(64, 40)[:, :32], torch.randn(20, 32)
    torch.testing.assert_close(torch.ops.lmgate.linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("x,w,match", [
    (torch.randn(4, 20), torch.randn(8, 20), "multiple"),
    (torch.randn(4, 32), torch.randn(8, 48), "K"),
    (torch.randn(4, 32), torch.randn(8, 32, dtype=torch.float64), "float32"),
    (torch.randn(4, 32, dtype=torch.bfloat16), torch.randn(8, 32), "float32"),
])
def test_linear_refuses_what_it_cannot_compute(x, w, match):
    with pytest.raises(RuntimeError, match=match):
        torch.ops.lmgate.linear(x, w)


@pytest.mark.parametrize("bias", [False, True])
def test_panel_linear_matches_f_linear_on_any_leading_shape(bias):
    linear = nn.Linear(64, 50, bias=bias)
    x = torch.randn(2, 7, 64)
    with torch.inference_mode():
        got = PanelLinear(linear)(x)
        torch.testing.assert_close(got, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)
    assert got.shape == (2, 7, 50)


def tied_model() -> nn.ModuleDict:
    embed = nn.Embedding(50, 32)
    model = nn.ModuleDict({"embed": embed, "proj": nn.Linear(32, 64), "odd": nn.Linear(24, 8),
                           "head": nn.Linear(32, 50, bias=False)})
    model["head"].weight = embed.weight
    return model


def test_cpu_linears_gives_float32_layers_the_panel_gemm_and_keeps_a_tied_head_tied(cpu_flags):
    cpu_flags(AVX2)
    model = tied_model()
    embed = model["embed"]
    cpu_linears(model, batch_hint=16)
    assert isinstance(model["proj"], PanelLinear) and isinstance(model["head"], PanelLinear)
    assert model["head"].weight is embed.weight  # no copy of the embedding
    # K = 24 is no whole number of AVX-512 vectors: oneDNN's layer where torch has it, else nn.Linear.
    assert isinstance(model["odd"], PackedLinear if torch.backends.mkldnn.is_available() else nn.Linear)
    ids = torch.tensor([3, 7])
    with torch.inference_mode():
        torch.testing.assert_close(model["head"](embed(ids)), embed(ids) @ embed.weight.T)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_cpu_linears_gives_every_layer_to_onednn_where_it_has_avx512(cpu_flags):
    """oneDNN's AVX-512 kernels run float32 faster than gemm.cpp: every layer packed, the tied head a copy."""
    cpu_flags(AVX512)
    model = tied_model()
    embed = model["embed"]
    cpu_linears(model, batch_hint=16)
    assert all(isinstance(model[name], PackedLinear) for name in ("proj", "odd", "head"))
    ids = torch.tensor([3, 7])
    with torch.inference_mode():
        torch.testing.assert_close(model["head"](embed(ids)), embed(ids) @ embed.weight.T, rtol=1e-5, atol=1e-5)


def test_cpu_linears_leaves_other_dtypes_to_onednn():
    model = nn.Sequential(nn.Linear(32, 16)).to(torch.bfloat16)
    cpu_linears(model, batch_hint=8)
    assert not isinstance(model[0], PanelLinear)


def test_a_long_prompt_alone_prefills_in_chunks_that_sample_nothing(checkpoint, tokenizer, cpu_flags):
    """Chunks of a prompt longer than the step budget, with nothing else running: steps whose LM head gets no
    rows (the float32 head runs on gemm.cpp, as on an AVX2 CPU)."""
    cpu_flags(AVX2)
    from lmgate.engine.config import EngineConfig
    from lmgate.engine.engine import Engine
    from lmgate.engine.sampling import SamplingParams

    prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 12)
    config = EngineConfig(dtype="float32", weights="float", max_batched_tokens=32, kv_cache_tokens=1024)
    with Engine(config, checkpoint=checkpoint) as engine:
        assert isinstance(engine.loops[0].runner.model.lm_head, PanelLinear)
        out = engine.generate(prompt, SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(prompt) > 3 * 32 and len(out.token_ids) == 4
