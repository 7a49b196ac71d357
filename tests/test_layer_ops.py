"""The C++ elementwise layer ops (engine/kernels/layer_ops.cpp) against the torch expressions they replace,
on shapes with vector tails, single rows, many rows (split over threads) and strided views."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmgate.engine.kernels import compiler_found, load_cpu_kernels
from lmgate.engine.models.llama import RMSNorm, apply_rotary, layer_kernels

pytestmark = pytest.mark.skipif(
    not (compiler_found() and load_cpu_kernels()), reason="no C++ compiler: the kernels cannot be built"
)


@pytest.mark.parametrize("rows", [1, 3, 64, 300])
@pytest.mark.parametrize("dim", [576, 64, 37])
def test_rms_norm_matches_hugging_faces_formula(rows, dim):
    g = torch.Generator().manual_seed(rows * dim)
    x, w = torch.randn(rows, dim, generator=g) * 3, torch.randn(dim, generator=g)
    want = w * (x * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5).float())
    torch.testing.assert_close(torch.ops.lmgate.rms_norm(x, w, 1e-5), want, rtol=1e-5, atol=1e-5)
    norm = RMSNorm(dim, 1e-5)
    norm.weight.data.copy_(w)
    assert layer_kernels(x)
    torch.testing.assert_close(norm(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 64, 300])
@pytest.mark.parametrize("dim", [576, 37])
def test_add_rms_norm_adds_in_place_then_normalizes(rows, dim):
    """A decoder layer's residual add inside the norm that reads the sum: x becomes x + delta, in place, and
    the result equals rms_norm of that sum, in C++ and on torch's path (a dtype the kernels do not take)."""
    g = torch.Generator().manual_seed(rows + dim)
    x, delta, w = (
        torch.randn(rows, dim, generator=g),
        torch.randn(rows, dim, generator=g),
        torch.randn(dim, generator=g),
    )
    total = x + delta
    want = torch.ops.lmgate.rms_norm(total, w, 1e-5)
    got = torch.ops.lmgate.add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(x, total)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    norm = RMSNorm(dim, 1e-5)
    norm.weight.data.copy_(w)
    x64 = total.double() - delta.double()
    torch.testing.assert_close(norm.double()(x64, delta.double()), want.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x64, total.double())
    with pytest.raises(RuntimeError, match="shape"):
        torch.ops.lmgate.add_rms_norm(x, delta[:, :-1], w, 1e-5)


@pytest.mark.parametrize("rows, vocab", [(1, 49152), (64, 49152), (5, 13), (3, 1), (4, 5)])
def test_argmax_rows_matches_torch_with_ties_and_nans(rows, vocab):
    """Greedy sampling's argmax: the first of equal maxima, a NaN wins (torch's rule), tails of any length."""
    g = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=g)
    if vocab < 8:  # a row shorter than one vector, all negative: nothing past the row may win
        logits = -(logits.abs() + 1)
    logits[0, vocab // 2 :] = 50.0  # a tie: the first index of it wins
    if rows > 2:
        logits[1, vocab - 1] = 60.0  # the maximum in the last lane of a tail
        logits[2, max(vocab - 3, 0)] = float("nan")
    assert torch.equal(torch.ops.lmgate.argmax_rows(logits), logits.argmax(dim=-1))
    with pytest.raises(RuntimeError, match="vocab"):
        torch.ops.lmgate.argmax_rows(torch.ones(2, 0))


@pytest.mark.parametrize("tokens", [1, 5, 200])
@pytest.mark.parametrize("heads, dim", [(12, 64), (3, 6), (2, 128)])
def test_rotary_matches_rotate_half_on_a_strided_view(tokens, heads, dim):
    """The Q/K heads are a view of the fused QKV projection's rows: read in place, written contiguous."""
    g = torch.Generator().manual_seed(tokens + heads)
    qkv = torch.randn(tokens, (heads + 1) * dim, generator=g)
    x = qkv[:, : heads * dim].view(tokens, heads, dim)
    cos, sin = torch.randn(tokens, 1, dim, generator=g), torch.randn(tokens, 1, dim, generator=g)
    want = x * cos + x.roll(dim // 2, dims=-1) * sin
    got = torch.ops.lmgate.rotary(x, cos, sin)
    assert got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(apply_rotary(x, cos, sin), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [(1, 3072), (64, 3072), (7, 2, 18), (300, 22)])
def test_silu_and_mul_matches_torch(shape):
    gate_up = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[0])) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    got = torch.ops.lmgate.silu_and_mul(gate_up)
    assert got.shape == (*shape[:-1], shape[-1] // 2)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-5, atol=1e-6)


def test_bad_inputs_are_refused_and_other_dtypes_take_torch():
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.lmgate.rms_norm(torch.ones(2, 4, dtype=torch.float64), torch.ones(4, dtype=torch.float64), 1e-5)
    with pytest.raises(RuntimeError, match="elements"):
        torch.ops.lmgate.rms_norm(torch.ones(2, 4), torch.ones(5), 1e-5)
    with pytest.raises(RuntimeError, match="even"):
        torch.ops.lmgate.rotary(torch.ones(2, 1, 5), torch.ones(2, 1, 5), torch.ones(2, 1, 5))
    with pytest.raises(RuntimeError, match="even"):
        torch.ops.lmgate.silu_and_mul(torch.ones(2, 5))
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.lmgate.rms_norm(torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(4), 1e-5)
    assert not layer_kernels(torch.ones(2, dtype=torch.float16))
    x = torch.randn(3, 8, dtype=torch.float16)
    norm = RMSNorm(8, 1e-5).to(torch.float16)
    torch.testing.assert_close(norm(x), norm.weight * F.rms_norm(x.float(), (8,), eps=1e-5).to(torch.float16))


BF16 = torch.bfloat16


def equal_but_for_a_rounding(got: torch.Tensor, want: torch.Tensor, share: float = 0.01) -> None:
    """bfloat16 results of the same arithmetic as torch's: equal bits, but for the few values where a float32
    intermediate (a sum in another order, another exp) lands on the other side of a rounding: one step apart."""
    assert got.dtype == want.dtype == BF16 and got.shape == want.shape
    differ = int((got != want).sum())
    assert differ <= max(1, share * got.numel()), f"{differ} of {got.numel()} differ"
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 64, 2000])
@pytest.mark.parametrize("dim", [576, 37])
def test_bfloat16_norms_round_as_the_torch_path(rows, dim):
    """A bfloat16 model's norms: normalized in float32, rounded, times the weight in bfloat16 (Hugging Face's
    LlamaRMSNorm); the residual add before the norm rounded as a bfloat16 add. 2000 x 576 rows are split over
    threads."""
    g = torch.Generator().manual_seed(rows * dim)
    x, delta = (torch.randn(rows, dim, generator=g) * 3).to(BF16), torch.randn(rows, dim, generator=g).to(BF16)
    w = torch.randn(dim, generator=g).to(BF16)
    assert layer_kernels(x)
    torch_path = lambda t: w * F.rms_norm(t.float(), (dim,), eps=1e-5).to(BF16)  # noqa: E731
    equal_but_for_a_rounding(torch.ops.lmgate.rms_norm(x, w, 1e-5), torch_path(x))
    total = x + delta
    got = torch.ops.lmgate.add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(x, total)
    equal_but_for_a_rounding(got, torch_path(total))


@pytest.mark.parametrize("tokens", [1, 200, 1500])
@pytest.mark.parametrize("heads, dim", [(12, 64), (3, 6), (9, 80)])
def test_bfloat16_rotary_equals_the_torch_expression(tokens, heads, dim):
    """x * cos + rotate_half(x) * sin in bfloat16 rounds each product and the sum: exact products of bfloat16
    values, so the bits are torch's. Half of an 80-wide head is whole vectors and a tail; 1500 tokens of 12
    heads are split over threads."""
    g = torch.Generator().manual_seed(tokens + heads)
    qkv = torch.randn(tokens, (heads + 1) * dim, generator=g).to(BF16)
    x = qkv[:, : heads * dim].view(tokens, heads, dim)
    cos, sin = (torch.randn(tokens, 1, dim, generator=g).to(BF16) for _ in range(2))
    want = x * cos + x.roll(dim // 2, dims=-1) * sin
    assert torch.equal(torch.ops.lmgate.rotary(x, cos, sin), want)
    assert torch.equal(apply_rotary(x, cos, sin), want)


@pytest.mark.parametrize("shape", [(1, 3072), (64, 3072), (7, 2, 18), (400, 3072)])
def test_bfloat16_silu_and_mul_rounds_as_the_torch_path(shape):
    gate_up = (torch.randn(*shape, generator=torch.Generator().manual_seed(shape[0])) * 4).to(BF16)
    gate, up = gate_up.chunk(2, dim=-1)
    equal_but_for_a_rounding(torch.ops.lmgate.silu_and_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_store_kv_writes_strided_rows_into_their_slots(tokens, dtype):
    """k and v as the model hands them over: views of one QKV projection, rows strided; the slots scattered
    over the cache. Every other slot keeps what it held."""
    torch.manual_seed(tokens)
    kvh, blocks, block_size, d = 3, 40, 16, 64
    qkv = torch.randn(tokens, (9 + 2 * kvh) * d).to(dtype)
    k = qkv[:, 9 * d : (9 + kvh) * d].view(tokens, kvh, d)
    v = qkv[:, (9 + kvh) * d :].view(tokens, kvh, d)
    slots = torch.randperm(blocks * block_size)[:tokens]
    k_cache, v_cache = (torch.randn(kvh, blocks, block_size, d).to(dtype) for _ in range(2))
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k.view(kvh, -1, d).index_copy_(1, slots, k.transpose(0, 1))
    want_v.view(kvh, -1, d).index_copy_(1, slots, v.transpose(0, 1))
    torch.ops.lmgate.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_store_kv_refuses_a_slot_outside_the_cache_and_writes_nothing():
    k = v = torch.randn(2, 1, 8)
    k_cache, v_cache = torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="outside"):
        torch.ops.lmgate.store_kv(k, v, k_cache, v_cache, torch.tensor([3, 8]))
    assert not k_cache.any() and not v_cache.any()


@pytest.mark.parametrize(
    "dtype, cache_dtype",
    [
        (torch.float32, torch.float16),
        (torch.float32, torch.bfloat16),
        (BF16, BF16),
        (BF16, torch.float16),
        (BF16, torch.float32),
    ],
    ids=str,
)
def test_store_kv_converts_into_the_caches_dtype(dtype, cache_dtype):
    k, v = torch.randn(5, 2, 64).to(dtype), torch.randn(5, 2, 64).to(dtype)
    k_cache, v_cache = torch.zeros(2, 4, 16, 64, dtype=cache_dtype), torch.zeros(2, 4, 16, 64, dtype=cache_dtype)
    slots = torch.tensor([0, 17, 33, 63, 5])
    torch.ops.lmgate.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(2, -1, 64)[:, slots], k.transpose(0, 1).to(cache_dtype))
    assert torch.equal(v_cache.view(2, -1, 64)[:, slots], v.transpose(0, 1).to(cache_dtype))
