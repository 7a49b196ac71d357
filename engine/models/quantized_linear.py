"""GGUF weights kept quantized on the CPU: the blocks as the file stores them, and the layers that read them.

`GGUFBlocks` is a quantized matrix as the loader hands it over (rows of blocks, in the row order of the
Hugging Face layout). `QuantizedLinear` computes `x @ W.T` from the blocks with the C++ kernels of
engine/kernels (quantized_matmul.cpp): a step of few rows (decoding) reads the blocks once and never
writes W out; a step of many rows (prefill, big batches) runs the float path's own float32 GEMM
(kernels/gemm.cpp) over panels of W expanded in L2. An embedding over blocks expands only the rows
it looks up.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from torch import nn

from ..machine.hardware import cpu_features
from ..kernels import load_cpu_kernels

# ggml type number -> (weights, bytes) per block, for the types kept quantized (gguf.GGMLQuantizationType).
BLOCK_LAYOUTS = {2: (32, 18), 3: (32, 20), 8: (32, 34), 12: (256, 144), 13: (256, 176), 14: (256, 210)}
TYPE_NAMES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}

MATVEC_ROWS = 8  # up to this many rows the blocks stream through registers; beyond, a GEMM over expanded panels
INT8_TYPES = {2, 3, 8, 12, 13}  # Q4_0, Q4_1, Q8_0, Q4_K, Q5_K: one scale per 32 weights (int8_matmul.cpp)


@dataclass(frozen=True, slots=True)
class GGUFBlocks:
    """A [rows, cols] matrix as quantized blocks: `blocks` is uint8 [rows, bytes per row]."""

    blocks: torch.Tensor
    qtype: int
    cols: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.blocks.shape[0], self.cols)

    @property
    def type_name(self) -> str:
        return TYPE_NAMES[self.qtype]

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols]: the values `gguf.quants.dequantize` gives (the tests hold them equal), by the
        C++ kernel, or by gguf itself where no compiler built it."""
        if not load_cpu_kernels():
            return torch.from_numpy(
                dequantize(self.blocks.numpy(), GGMLQuantizationType(self.qtype)).reshape(self.shape)
            )
        out = torch.empty(self.shape, dtype=torch.float32)
        torch.ops.lmgate.gguf_dequantize(self.blocks, self.qtype, out)
        return out

    def take_rows(self, index: torch.Tensor | slice) -> "GGUFBlocks":
        return GGUFBlocks(self.blocks[index].contiguous(), self.qtype, self.cols)


def gguf_blocks(data: np.ndarray, qtype: int, shape: tuple[int, int]) -> GGUFBlocks:
    """Blocks from a GGUF tensor's raw bytes; a tensor whose size does not fit its type is refused."""
    weights, nbytes = BLOCK_LAYOUTS[qtype]
    rows, cols = shape
    if cols % weights or data.size != rows * cols // weights * nbytes:
        raise ValueError(
            f"{TYPE_NAMES[qtype]} tensor of shape {shape} has {data.size} bytes, "
            f"expected {rows * (cols // weights) * nbytes}"
        )
    return GGUFBlocks(
        torch.from_numpy(np.array(data, dtype=np.uint8)).view(rows, -1), qtype, cols
    )  # a copy: the file may close


@dataclass(frozen=True, slots=True)
class GGUFStack:
    """Matrices of different GGUF types stacked by rows, each keeping its blocks: a Q4_K_M file stores some
    layers' V projection as Q6_K under Q4_K Q and K, and Q, K, V are one projection here."""

    parts: tuple[GGUFBlocks, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].cols)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])


def cat_rows(parts: list) -> "GGUFBlocks | GGUFStack | torch.Tensor":
    """Matrices stacked by rows (Q, K, V into one projection): blocks stay blocks (one matrix where all parts
    share a type, a `GGUFStack` where they do not); a float part makes every part float32."""
    if all(isinstance(p, GGUFBlocks) for p in parts) and len({p.cols for p in parts}) == 1:
        if len({p.qtype for p in parts}) == 1:
            return GGUFBlocks(torch.cat([p.blocks for p in parts]), parts[0].qtype, parts[0].cols)
        return GGUFStack(tuple(parts))
    floats = [p.dequantize() if isinstance(p, (GGUFBlocks, GGUFStack)) else p for p in parts]
    view = _adjacent(floats)
    return torch.cat(floats) if view is None else view


def _adjacent(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The parts as one view of the memory they share, where each lies right after the one before (Q, K and V
    as a trainer's `state_dict()` orders them, pushed into one buffer): no copy. None where they do not."""
    first = parts[0]
    rows = sum(p.shape[0] for p in parts)
    at = first.storage_offset()
    for p in parts:
        same_kind = p.dtype == first.dtype and p.shape[1:] == first.shape[1:] and p.is_contiguous()
        same_memory = p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        if not (same_kind and same_memory and p.storage_offset() == at):
            return None
        at += p.numel()
    return first.as_strided((rows, *first.shape[1:]), first.stride())


class QuantizedLinear(nn.Module):
    """`y = x @ W.T + b` over GGUF blocks, one or more parts of rows each of its own type; read-only, so
    engine loops may share it. With `int8_activations`, every step rounds x to int8 for the parts whose type
    allows it (llama.cpp's way on the CPU: not the float model, tokens may differ). Few rows gain too: turning
    4-bit weights into floats for float32 x bound the matvec, not reading them."""

    def __init__(
        self, weight: GGUFBlocks | GGUFStack, bias: torch.Tensor | None = None, int8_activations: bool = False
    ) -> None:
        super().__init__()
        self.int8_activations = int8_activations
        self.out_features, self.in_features = weight.shape
        self.parts = list(weight.parts) if isinstance(weight, GGUFStack) else [weight]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        outs = [self._matmul(rows, p) for p in self.parts]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def _matmul(self, rows: torch.Tensor, part: GGUFBlocks) -> torch.Tensor:
        few = rows.shape[0] <= MATVEC_ROWS
        if self.int8_activations and part.qtype in INT8_TYPES:
            op = torch.ops.lmgate.gguf_matvec_int8 if few else torch.ops.lmgate.gguf_matmul_int8
            return op(rows, part.blocks, part.qtype, cpu_features().int8_vnni)
        op = torch.ops.lmgate.gguf_matvec if few else torch.ops.lmgate.gguf_matmul
        return op(rows, part.blocks, part.qtype)

    def extra_repr(self) -> str:
        types = "+".join(TYPE_NAMES[p.qtype] for p in self.parts)
        int8 = ", int8 activations" if self.int8_activations else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {types}{int8}"


class QuantizedEmbedding(nn.Module):
    """Token embeddings over GGUF blocks: only the rows looked up are expanded."""

    blocks: torch.Tensor  # a buffer (register_buffer), which nn.Module's attribute typing does not know

    def __init__(self, weight: GGUFBlocks) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.qtype = weight.qtype
        self.register_buffer("blocks", weight.blocks)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        out = torch.empty(flat.shape[0], self.embedding_dim)
        torch.ops.lmgate.gguf_dequantize(self.blocks.index_select(0, flat), self.qtype, out)
        return out.view(*ids.shape, self.embedding_dim)
