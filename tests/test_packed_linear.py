"""Prepacked oneDNN linear layers: same results as `F.linear`, every linear of a CPU model packed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lmgate.engine.machine.hardware import cpu_features
from lmgate.engine.models.packed_linear import DIRECT_BYTES, PackedLinear, pack_linears
from tests.conftest import AVX2

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(dtype, tol, tokens, bias):
    """Where oneDNN packs no bf16 (AVX2-only CPUs), the bf16 cases check the fallback instead: the layer stays
    an `nn.Linear` and computes the same."""
    torch.manual_seed(tokens)
    linear = nn.Linear(96, 160, bias=bias).to(dtype)
    x = torch.randn(tokens, 96, dtype=dtype)
    model = nn.Sequential(linear)
    with torch.inference_mode():
        want = F.linear(x, linear.weight, linear.bias)
        pack_linears(model, batch_hint=64)
        got = model(x)
    packs = dtype == torch.float32 or cpu_features().onednn_bf16
    assert isinstance(model[0], PackedLinear if packs else nn.Linear)
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [4096, 4100])  # whole blocks of rows, and rows oneDNN pads to a block
def test_a_packed_weight_loaded_anew_serves_exactly_the_new_values(dtype, rows):
    """`load_` writes a weight of DIRECT_BYTES or more into oneDNN's layout itself where `row_blocks` found it
    (float32's is the same on every x86 CPU oneDNN packs for), through oneDNN's reorder where rows are padded.
    The new weight starts one element into its storage, as a pushed one may after an odd count of bf16 ones."""
    if dtype == torch.bfloat16 and not cpu_features().onednn_bf16:
        pytest.skip("oneDNN packs no bf16 weights on this CPU")
    torch.manual_seed(rows)
    layer = PackedLinear(nn.Linear(2048, rows, bias=False).to(dtype), batch_hint=64)
    new = torch.randn(rows * 2048 + 1, dtype=dtype)[1:].view(rows, 2048)
    assert new.numel() * new.element_size() >= DIRECT_BYTES
    with torch.inference_mode():
        layer.load_(new)
        assert torch.equal(layer.packed.to_dense(), new)
        x = torch.randn(3, 2048, dtype=dtype)
        torch.testing.assert_close(layer(x).float(), F.linear(x, new).float(), rtol=2e-2, atol=2e-2)
    if dtype == torch.float32 and rows == 4096:
        assert layer._layout() is not None


def test_pack_linears_keeps_bf16_unpacked_where_onednn_cannot(cpu_flags):
    cpu_flags(AVX2)  # an AVX2 machine without AVX-512, on whatever CPU runs the test
    model = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 16)).to(torch.bfloat16)
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = model(x)
        pack_linears(model, batch_hint=8)
        got = model(x)
    assert all(isinstance(m, nn.Linear) for m in model)
    torch.testing.assert_close(got, want)


def test_pack_linears_swaps_every_linear_and_keeps_tied_embedding():
    embed = nn.Embedding(50, 32)
    model = nn.ModuleDict({"embed": embed, "proj": nn.Linear(32, 64), "head": nn.Linear(32, 50, bias=False)})
    model["head"].weight = embed.weight  # tied, as SmolLM2's head is
    pack_linears(model, batch_hint=16)
    assert isinstance(model["proj"], PackedLinear) and isinstance(model["head"], PackedLinear)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert model["embed"].weight is embed.weight  # lookups still read the plain weight
    assert model["proj"].packed_bytes + model["head"].packed_bytes == (32 * 64 + 32 * 50) * 4
    ids = torch.tensor([3, 7])
    with torch.inference_mode():
        torch.testing.assert_close(model["head"](embed(ids)), embed(ids) @ embed.weight.T)


def test_pack_linears_leaves_layers_onednn_refuses_unpacked():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)).double()  # oneDNN takes no float64 weights
    pack_linears(model, batch_hint=4)
    assert all(isinstance(m, nn.Linear) for m in model)
    x = torch.randn(2, 8, dtype=torch.float64)
    assert model(x).shape == (2, 4)
