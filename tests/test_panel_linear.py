"""gemm.cpp's float32 linear layer (column tiles over W packed in panels, plain or gated) against a float64
matmul, and which layer each linear of a CPU model gets."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lmgate.engine.kernels import compiler_found, load_cpu_kernels
from lmgate.engine.models.panel_linear import PanelLinear, cpu_linears

pytestmark = pytest.mark.skipif(
    not (compiler_found() and load_cpu_kernels()), reason="no C++ compiler: gemm.cpp cannot be built"
)


def linear_columns(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.lmgate.linear_columns(x, torch.ops.lmgate.pack_columns(w), w.shape[0])


@pytest.mark.parametrize("m", [0, 1, 3, 4, 5, 8, 9, 16, 64, 300])
@pytest.mark.parametrize("n", [1, 2, 23, 24, 25, 47, 48, 49, 97, 160])
@pytest.mark.parametrize("k", [1, 3, 16, 24, 576, 1536, 2080])
def test_linear_matches_float64(m, n, k):
    """Every tile shape at the edges: rows of x not a multiple of 4 or 8 (AVX2's and AVX-512's tiles), columns
    not filling a panel of 24 or 48, one panel per thread or several, one panel over blocks of rows; no rows at
    all (the LM head of a step in which no sequence samples); any K, no multiple of the vector width needed. K
    past 768 runs in chunks: two equal ones (1536), or three, the last shorter (2080)."""
    torch.manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k), torch.randn(n, k)
    got = linear_columns(x, w)
    want = x.double() @ w.double().T
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * k**0.5)


def test_linear_of_no_columns_is_empty():
    packed = torch.ops.lmgate.pack_columns(torch.randn(0, 32))
    assert torch.ops.lmgate.linear_columns(torch.randn(5, 32), packed, 0).shape == (5, 0)


def test_linear_takes_a_strided_x():
    x, w = torch.randn(64, 40)[:, :32], torch.randn(20, 32)
    torch.testing.assert_close(linear_columns(x, w), x @ w.T, rtol=1e-5, atol=1e-5)


def test_column_panels_refuse_what_they_cannot_compute():
    packed = torch.ops.lmgate.pack_columns(torch.randn(50, 32))
    for x, n, match in [
        (torch.randn(4, 48), 50, "K"),
        (torch.randn(4, 32), 20, "n does not match"),
        (torch.randn(4, 32), 200, "n does not match"),
        (torch.randn(4, 32, dtype=torch.bfloat16), 50, "float32"),
    ]:
        with pytest.raises(RuntimeError, match=match):
            torch.ops.lmgate.linear_columns(x, packed, n)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.lmgate.pack_columns(torch.randn(8, 32, dtype=torch.float64))


@pytest.mark.parametrize("m", [0, 1, 7, 8, 9, 64, 300])
@pytest.mark.parametrize("n", [1, 13, 23, 24, 25, 47, 48, 49, 100])
@pytest.mark.parametrize("k", [3, 576, 2080])
def test_gated_linear_is_silu_of_gate_times_up(m, n, k):
    """A gated pack's pairs of panels hold 24 (AVX2) or 48 (AVX-512) activations' gate and up columns: n at and
    around both, one pair or several, rows in tiles and blocks, K in one chunk or three. The activations are exactly
    what the plain panels and silu_and_mul give (the same sums in the same order), and match float64."""
    torch.manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k), torch.randn(2 * n, k)
    got = torch.ops.lmgate.linear_gated_columns(x, torch.ops.lmgate.pack_gated_columns(w), n)
    assert got.shape == (m, n) and torch.equal(got, torch.ops.lmgate.silu_and_mul(linear_columns(x, w)))
    gate, up = (x.double() @ w.double().T).chunk(2, dim=-1)
    torch.testing.assert_close(got.double(), F.silu(gate) * up, rtol=1e-5, atol=2e-5 * k)  # products of two sums


def test_gated_panels_refuse_what_they_cannot_compute():
    packed = torch.ops.lmgate.pack_gated_columns(torch.randn(2 * 30, 32))
    for x, n, match in [
        (torch.randn(4, 48), 30, "K"),
        (torch.randn(4, 32), 60, "n does not match"),
        (torch.randn(4, 32, dtype=torch.float64), 30, "float32"),
    ]:
        with pytest.raises(RuntimeError, match=match):
            torch.ops.lmgate.linear_gated_columns(x, packed, n)
    with pytest.raises(RuntimeError, match=r"\[2n, K\]"):
        torch.ops.lmgate.pack_gated_columns(torch.randn(7, 32))
    with pytest.raises(ValueError, match="no bias"):
        PanelLinear(nn.Linear(32, 16), gated=True)


def test_gated_linear_of_no_activations_is_empty():
    packed = torch.ops.lmgate.pack_gated_columns(torch.randn(0, 32))
    assert torch.ops.lmgate.linear_gated_columns(torch.randn(5, 32), packed, 0).shape == (5, 0)


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
    model = nn.ModuleDict(
        {"embed": embed, "proj": nn.Linear(32, 64), "odd": nn.Linear(24, 8), "head": nn.Linear(32, 50, bias=False)}
    )
    model["head"].weight = embed.weight
    return model


def test_cpu_linears_gives_every_float32_layer_column_panels():
    """Column tiles take any K; the tied head packs a copy of the embedding, which keeps its own weight."""
    model = tied_model()
    embed, odd = model["embed"], model["odd"].weight.detach().clone()
    cpu_linears(model, batch_hint=16)
    assert all(isinstance(model[name], PanelLinear) for name in ("proj", "odd", "head"))
    assert model["head"].packed_bytes >= 50 * 32 * 4 and not hasattr(model["head"], "weight")
    ids, x = torch.tensor([3, 7]), torch.randn(5, 24)
    with torch.inference_mode():
        torch.testing.assert_close(model["head"](embed(ids)), embed(ids) @ embed.weight.T, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model["odd"](x), F.linear(x, odd, model["odd"].bias), rtol=1e-5, atol=1e-5)


def test_cpu_linears_gates_an_mlps_gate_up_projection():
    """A `gate_up_proj` without bias gives the MLP's activation (half its rows wide); one with a bias, and
    every other layer, stays plain."""
    mlp = nn.Module()
    mlp.gate_up_proj, mlp.down_proj = nn.Linear(32, 2 * 40, bias=False), nn.Linear(40, 32, bias=False)
    biased = nn.Module()
    biased.gate_up_proj = nn.Linear(32, 2 * 40)
    model = nn.ModuleDict({"mlp": mlp, "biased": biased})
    w = mlp.gate_up_proj.weight.detach().clone()
    cpu_linears(model, batch_hint=8)
    assert mlp.gate_up_proj.gated and mlp.gate_up_proj.out_features == 40
    assert not mlp.down_proj.gated and not biased.gate_up_proj.gated
    x = torch.randn(3, 5, 32)
    gate, up = (x @ w.T).chunk(2, dim=-1)
    with torch.inference_mode():
        torch.testing.assert_close(mlp.gate_up_proj(x), F.silu(gate) * up, rtol=1e-5, atol=1e-5)


def test_cpu_linears_leaves_other_dtypes_to_onednn():
    model = nn.Sequential(nn.Linear(32, 16)).to(torch.bfloat16)
    cpu_linears(model, batch_hint=8)
    assert not isinstance(model[0], PanelLinear)


def test_a_long_prompt_alone_prefills_in_chunks_that_sample_nothing(checkpoint, tokenizer):
    """Chunks of a prompt longer than the step budget, with nothing else running: steps whose LM head (on
    gemm.cpp) gets no rows."""
    from lmgate.engine.config import EngineConfig
    from lmgate.engine.engine import Engine
    from lmgate.engine.sampling.sampler import SamplingParams

    prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 12)
    config = EngineConfig(dtype="float32", weights="float", max_batched_tokens=32, kv_cache_tokens=1024)
    with Engine(config, checkpoint=checkpoint) as engine:
        assert isinstance(engine.loops[0].runner.model.lm_head, PanelLinear)
        out = engine.generate(prompt, SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(prompt) > 3 * 32 and len(out.token_ids) == 4
