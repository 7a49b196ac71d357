"""float32 linear layers through lmgate's own GEMM (engine/kernels/gemm.cpp), and the choice of how each of a
CPU model's linear layers runs.

With AVX2 alone, oneDNN's packed matmul is fast at a few hundred rows but loses a fifth of its rate at the 64
rows of a 64-stream decode step, and a third at 16; gemm.cpp's row tiles keep their rate from 16 rows up and
read W where it lies: no packed copy, and a tied head shares its embedding's weight. With AVX-512, gemm.cpp
packs W into panels of 48 columns, which beat oneDNN's packed matmul at every row count a step has (its header
has the figures; at 64 rows 208-219 against 174-208 GFLOP/s on a 2-core Zen 4); a tied head gets a packed copy
of its own (the embedding's size again), as oneDNN's did. Other dtypes go to oneDNN.
"""
from __future__ import annotations

import torch
from torch import nn

from ..hardware import cpu_features
from ..kernels import load_cpu_kernels
from .packed_linear import pack_linears

K_MULTIPLE = 16  # the row tiles run K in vectors: 8 floats with AVX2, 16 with AVX-512


def packs_columns() -> bool:
    """Whether gemm.cpp runs float32 layers over weights packed in column panels: on a CPU with AVX-512, as
    `cpu_features` says (either layout is exact on any CPU; this one is the faster there)."""
    return cpu_features().avx512


class PanelLinear(nn.Module):
    """`y = x @ W.T + b` for float32 W on the CPU; read-only, so engine loops may share it. `columns`: W packed
    in column panels (and not kept), else its rows read where they lie (the same Parameter: a tied head stays
    tied)."""

    def __init__(self, linear: nn.Linear, columns: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.columns = torch.ops.lmgate.pack_columns(linear.weight.detach()) if columns else None
        self.weight = None if columns else linear.weight
        self.bias = linear.bias

    @staticmethod
    def takes(linear: nn.Linear, columns: bool) -> bool:
        """float32 weights on the CPU, the kernels built, and for row tiles a contiguous W whose K is a whole
        number of vectors."""
        if linear.weight.dtype != torch.float32 or linear.weight.device.type != "cpu" or not load_cpu_kernels():
            return False
        return columns or (linear.in_features % K_MULTIPLE == 0 and linear.weight.is_contiguous())

    @property
    def packed_bytes(self) -> int:
        """Bytes of the column panels (padding included); none for rows read in place."""
        return 0 if self.columns is None else self.columns.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.columns is not None:
            y = torch.ops.lmgate.linear_columns(rows, self.columns, self.out_features)
        else:
            y = torch.ops.lmgate.linear(rows, self.weight)
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def cpu_linears(model: nn.Module, batch_hint: int) -> None:
    """Every `nn.Linear` of a CPU model swapped for the fastest layer this machine has for it: float32 through
    gemm.cpp (`PanelLinear`, in column panels where `packs_columns`), everything else packed for oneDNN where
    it takes it (`pack_linears`), else kept. `batch_hint`: the token count steps usually have (oneDNN packs
    for it)."""
    columns = packs_columns()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and PanelLinear.takes(child, columns):
                setattr(parent, name, PanelLinear(child, columns))
    pack_linears(model, batch_hint)
