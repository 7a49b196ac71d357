"""A decoder layer's elementwise work in Triton, one kernel each where torch launches three to five: the
residual add with RMSNorm, the rotary embedding, SiLU-and-multiply. A decode step of a small model is mostly
such launches (Qwen2.5-0.5B's shape: about 25 kernels a layer, 15 of them elementwise).

Each does the arithmetic of the torch expression beside its call (models/llama.py) with the same roundings:
every intermediate the torch code keeps in the model's dtype is rounded to it here too, so the two paths
agree within one rounding step (a norm's sum of squares adds in another order). Rows are the last dimension,
contiguous: a norm's program handles one (a head's, for per-head norms), rotary's a token's heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(X, Delta, W, Out, eps, n, stride_xt, stride_xh, stride_d, ADD: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    live = cols < n
    x_at = X + t * stride_xt + h * stride_xh
    x = tl.load(x_at + cols, mask=live, other=0.0)
    if ADD:  # the residual add, rounded to the model's dtype, written back in place
        delta = tl.load(Delta + t * stride_d + cols, mask=live, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(x_at + cols, x, mask=live)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
    normed = (xf * inv).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=live, other=0.0).to(tl.float32)
    tl.store(Out + (t * tl.num_programs(1) + h) * n + cols, (w * normed).to(Out.dtype.element_ty), mask=live)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None) -> torch.Tensor:
    """`weight * rms_norm(x.float()).to(x.dtype)` over the last dimension, which is contiguous, of a [T, n] or
    [T, heads, n] `x` (Qwen3's per-head norms read a view of the QKV projection); with `delta` ([T, n]),
    `x += delta` first, in place. Returns a new contiguous tensor."""
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = x.shape[-1]
    add = delta is not None
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(x3.shape[0], x3.shape[1])](
        x3,
        delta if add else x3,
        weight,
        out,
        eps,
        n,
        x3.stride(0),
        x3.stride(1),
        delta.stride(0) if delta is not None else 0,
        ADD=add,
        BLOCK=block,
        num_warps=1 if block <= 256 else 4,
    )  # a head's norm: one warp
    return out


@triton.jit
def _rotary_kernel(
    X, Cos, Sin, Out, heads, half, stride_xt, stride_xh, stride_c, HEADS: tl.constexpr, BLOCK: tl.constexpr
):
    t = tl.program_id(0)
    h = tl.arange(0, HEADS)
    first = tl.arange(0, BLOCK)
    live_c = first < half
    live = (h < heads)[:, None] & live_c[None, :]
    dtype = X.dtype.element_ty
    x_at = X + t * stride_xt + h[:, None] * stride_xh + first[None, :]  # [HEADS, BLOCK]: a token's heads
    x1 = tl.load(x_at, mask=live)
    x2 = tl.load(x_at + half, mask=live)
    c1 = tl.load(Cos + t * stride_c + first, mask=live_c)[None, :]
    c2 = tl.load(Cos + t * stride_c + half + first, mask=live_c)[None, :]
    s1 = tl.load(Sin + t * stride_c + first, mask=live_c)[None, :]  # sin carries rotate_half's sign: negative first
    s2 = tl.load(Sin + t * stride_c + half + first, mask=live_c)[None, :]
    # x * cos + roll(x, half) * sin, each product rounded to the dtype as torch does
    out1 = ((x1 * c1).to(dtype).to(tl.float32) + (x2 * s1).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)).to(dtype)
    o_at = Out + (t * heads + h[:, None]) * 2 * half + first[None, :]
    tl.store(o_at, out1, mask=live)
    tl.store(o_at + half, out2, mask=live)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim], its last dimension contiguous (a view of the QKV projection will do);
    cos, sin: [T, 1, head_dim] in x's dtype. Returns a new contiguous [T, heads, head_dim]. A program rotates
    one token's heads, its cos and sin read once."""
    tokens, heads, d = x.shape
    out = torch.empty((tokens, heads, d), dtype=x.dtype, device=x.device)
    cos, sin = cos.contiguous(), sin.contiguous()
    _rotary_kernel[(tokens,)](
        x,
        cos,
        sin,
        out,
        heads,
        d // 2,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        HEADS=triton.next_power_of_2(heads),
        BLOCK=triton.next_power_of_2(d // 2),
    )
    return out


@triton.jit
def _silu_and_mul_kernel(GateUp, Out, n, stride_g, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < n
    dtype = Out.dtype.element_ty
    gate = tl.load(GateUp + row * stride_g + cols, mask=live, other=0.0).to(tl.float32)
    up = tl.load(GateUp + row * stride_g + n + cols, mask=live, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # F.silu, rounded to the dtype
    tl.store(Out + row * n + cols, (act * up).to(dtype), mask=live)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of a 2-D [T, 2 * n] whose halves are gate and up; returns [T, n]."""
    tokens, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((tokens, n), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_and_mul_kernel[(tokens, triton.cdiv(n, block))](gate_up, out, n, gate_up.stride(0), BLOCK=block)
    return out
