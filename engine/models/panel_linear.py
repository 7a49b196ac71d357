"""float32 linear layers through lmgate's own GEMM (engine/kernels/gemm.cpp), and the choice of how each of a
CPU model's linear layers runs.

gemm.cpp packs W once into panels of 3 vectors of output columns (48 floats with AVX-512, 24 with AVX2), which
beat oneDNN's packed matmul at every row count a step has: on a 2-core Zen 4, 208-219 against 174-208 GFLOP/s at
64 rows, 182-202 against 127-162 at 16 (its header has the figures, AVX2's too). Whole panels are what
decode_layers.cpp shares between threads, so a float32 model's decode steps run every layer in one call
(`FusedDecode`). A tied head gets a packed copy of its own (the embedding's size again), as oneDNN's did. Other
dtypes go to oneDNN.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels import load_cpu_kernels
from .packed_linear import pack_linears


class PanelLinear(nn.Module):
    """`y = x @ W.T + b` for float32 W on the CPU, W packed in column panels (and not kept); read-only, so
    engine loops may share it.

    `gated`: W is a Llama MLP's gate_up projection (gate's rows, then up's, no bias), packed in pairs of panels
    that hold the gate and the up columns of the same activations, and `y = silu(x @ Wgate.T) * (x @ Wup.T)`, half W's
    rows wide: the activation comes from the GEMM's sums while they are in cache, with no [rows, 2 x
    intermediate] projection written and read back, and no pass (or, in decode_layers.cpp, barrier) of its own.
    """

    def __init__(self, linear: nn.Linear, gated: bool = False) -> None:
        super().__init__()
        if gated and (linear.bias is not None or linear.out_features % 2):
            raise ValueError("a gated layer is a gate_up projection: an even number of rows and no bias")
        self.gated = gated
        self.in_features = linear.in_features
        self.out_features = linear.out_features // 2 if gated else linear.out_features
        pack = torch.ops.lmgate.pack_gated_columns if gated else torch.ops.lmgate.pack_columns
        self.columns = pack(linear.weight.detach())
        self.bias = linear.bias

    def load_(self, weight: torch.Tensor) -> None:
        """New values of W (its shape), written into the panels served now (their padding stays zero): only
        while no step runs."""
        w = weight.to(torch.float32)
        if self.gated:  # panels in pairs: gate's, then up's, of the same columns
            pairs = self.columns.view(-1, 2, *self.columns.shape[1:])
            _into_panels(pairs[:, 0], w[: self.out_features])
            _into_panels(pairs[:, 1], w[self.out_features :])
        else:
            _into_panels(self.columns, w)

    @staticmethod
    def takes(linear: nn.Linear) -> bool:
        """float32 weights on the CPU, and the kernels built."""
        return linear.weight.dtype == torch.float32 and linear.weight.device.type == "cpu" and load_cpu_kernels()

    @property
    def packed_bytes(self) -> int:
        """Bytes of the column panels, padding included."""
        return self.columns.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gemm = torch.ops.lmgate.linear_gated_columns if self.gated else torch.ops.lmgate.linear_columns
        y = gemm(x.reshape(-1, self.in_features), self.columns, self.out_features)
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
            f"{', gated' if self.gated else ''}"
        )


def _into_panels(panels: torch.Tensor, w: torch.Tensor) -> None:
    """`pack_columns`' layout written in place: panels [P, K, C] take w [N, K]'s rows C at a time, transposed."""
    n, width = w.shape[0], panels.shape[-1]
    full = n // width
    panels[:full].copy_(w[: full * width].reshape(full, width, -1).transpose(1, 2))  # a shard's slice: a copy
    if n % width:
        panels[full, :, : n % width].copy_(w[full * width :].t())


def cpu_linears(model: nn.Module, batch_hint: int) -> None:
    """Every `nn.Linear` of a CPU model swapped for the fastest layer this machine has for it: float32 through
    gemm.cpp (`PanelLinear`; an MLP's `gate_up_proj` without bias gated), everything else packed for oneDNN
    where it takes it (`pack_linears`), else kept. `batch_hint`: the token count steps usually have (oneDNN
    packs for it)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and PanelLinear.takes(child):
                setattr(parent, name, PanelLinear(child, gated=name == "gate_up_proj" and child.bias is None))
    pack_linears(model, batch_hint)
