"""float32 linear layers through lmgate's own GEMM (engine/kernels/gemm.cpp), and the choice of how each of a
CPU model's linear layers runs.

With AVX2 alone, oneDNN's packed matmul is fast at a few hundred rows but loses a fifth of its rate at the 64
rows of a 64-stream decode step, and a third at 16; gemm.cpp keeps its rate from 16 rows up (the figures are
in its header) and reads W where it lies: no packed copy, and a tied head shares its embedding's weight.
With AVX-512, oneDNN's kernels win at every row count: on a 2-core Zen 4, the model's four linear layers over
30 layers' weights ran at 97 against 67 GFLOP/s at 16 rows, 127-173 against 135-143 at 64, 196-201 against
145-174 at 512, and the float32 engine's 64 streams went from 228 to 272 tokens/s; there oneDNN takes every
layer, a tied head with a packed copy of its own (the embedding's size again).
"""
from __future__ import annotations

import torch
from torch import nn

from ..hardware import cpu_features
from ..kernels import load_cpu_kernels
from .packed_linear import pack_linears

K_MULTIPLE = 16  # gemm.cpp runs K in vectors: 8 floats with AVX2, 16 with AVX-512


class PanelLinear(nn.Module):
    """`y = x @ W.T + b` for float32 W on the CPU; read-only, so engine loops may share it."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter: a tied head stays tied
        self.bias = linear.bias

    @staticmethod
    def takes(linear: nn.Linear) -> bool:
        """float32 weights on the CPU, K a whole number of vectors, and the kernels built."""
        return (linear.weight.dtype == torch.float32 and linear.weight.device.type == "cpu"
                and linear.in_features % K_MULTIPLE == 0 and linear.weight.is_contiguous() and load_cpu_kernels())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.lmgate.linear(x.reshape(-1, self.in_features), self.weight)
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def cpu_linears(model: nn.Module, batch_hint: int) -> None:
    """Every `nn.Linear` of a CPU model swapped for the fastest layer this machine has for it: float32 through
    gemm.cpp (`PanelLinear`) on a CPU without oneDNN's AVX-512 kernels, everything else packed for oneDNN where
    it takes it (`pack_linears`), else kept. `batch_hint`: the token count steps usually have (oneDNN packs
    for it)."""
    if not (cpu_features().onednn_avx512 and torch.backends.mkldnn.is_available()):
        _panel_linears(model)
    pack_linears(model, batch_hint)


def _panel_linears(model: nn.Module) -> None:
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and PanelLinear.takes(child):
                setattr(parent, name, PanelLinear(child))
