"""GGUF weights kept quantized on the CPU: the blocks as the file stores them, and the layers that read them.

`GGUFBlocks` is a quantized matrix as the loader hands it over (rows of blocks, in the row order of the
Hugging Face layout). `QuantizedLinear` computes `x @ W.T` from the blocks with the C++ kernels of
engine/kernels (quantized_matmul.cpp): a step of few rows (decoding) reads the blocks once and never
writes W out; a step of many rows (prefill, big batches) expands W in tiles of rows and multiplies each
tile at the float32 matmul rate, so that the expansion is paid once per tile for all the rows. An
embedding over blocks expands only the rows it looks up.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from torch import nn

from ..kernels import load_cpu_kernels

# ggml type number -> (weights, bytes) per block, for the types kept quantized (gguf.GGMLQuantizationType).
BLOCK_LAYOUTS = {2: (32, 18), 3: (32, 20), 8: (32, 34), 12: (256, 144), 13: (256, 176), 14: (256, 210)}
TYPE_NAMES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}

MATVEC_ROWS = 16  # up to this many rows the kernel streams the blocks; beyond, expanded tiles and a matmul
TILE_WEIGHTS = 1 << 21  # weights expanded at a time for a matmul: 8 MB of float32, within the L3 of most CPUs


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
            return torch.from_numpy(dequantize(self.blocks.numpy(), GGMLQuantizationType(self.qtype)).reshape(self.shape))
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
        raise ValueError(f"{TYPE_NAMES[qtype]} tensor of shape {shape} has {data.size} bytes, "
                         f"expected {rows * (cols // weights) * nbytes}")
    return GGUFBlocks(torch.from_numpy(np.array(data, dtype=np.uint8)).view(rows, -1), qtype, cols)  # a copy: the file may close


def cat_rows(parts: list) -> "GGUFBlocks | torch.Tensor":
    """Matrices stacked by rows (Q, K, V into one projection): blocks stay blocks when all parts share a
    type; otherwise every part is expanded to float32."""
    if all(isinstance(p, GGUFBlocks) for p in parts) and len({(p.qtype, p.cols) for p in parts}) == 1:
        return GGUFBlocks(torch.cat([p.blocks for p in parts]), parts[0].qtype, parts[0].cols)
    return torch.cat([p.dequantize() if isinstance(p, GGUFBlocks) else p for p in parts])


_scratch = threading.local()  # each engine loop's thread expands its tiles into its own buffer


def _matmul(rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """rows @ w.T through oneDNN where torch has it (MKL's float32 path is the slow one on AMD CPUs)."""
    if torch.backends.mkldnn.is_available():
        return torch.ops.mkldnn._linear_pointwise(rows, w, None, "none", [], "")
    return F.linear(rows, w)


class QuantizedLinear(nn.Module):
    """`y = x @ W.T + b` over GGUF blocks; read-only, so engine loops may share it."""

    def __init__(self, weight: GGUFBlocks, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.qtype = weight.qtype
        self.register_buffer("blocks", weight.blocks)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        if rows.shape[0] <= MATVEC_ROWS:
            y = torch.ops.lmgate.gguf_matvec(rows, self.blocks, self.qtype)
        else:
            y = self._tiled(rows)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def _tiled(self, rows: torch.Tensor) -> torch.Tensor:
        """Expanded tiles of W, each multiplied into all rows of x at once. The tile lives in a buffer of the
        calling thread's, reused across layers and steps: a fresh 8 MB would be fresh pages, faulted in at
        every call."""
        step = max(1, TILE_WEIGHTS // self.in_features)
        if step >= self.out_features:
            return _matmul(rows, self._expand(self.blocks))
        y = torch.empty(rows.shape[0], self.out_features)
        for start in range(0, self.out_features, step):
            part = self.blocks[start : start + step]
            y[:, start : start + part.shape[0]] = _matmul(rows, self._expand(part))
        return y

    def _expand(self, part: torch.Tensor) -> torch.Tensor:
        scratch = getattr(_scratch, "tile", None)
        if scratch is None:
            scratch = _scratch.tile = torch.empty(TILE_WEIGHTS + self.in_features)
        w = scratch[: part.shape[0] * self.in_features].view(part.shape[0], self.in_features)
        torch.ops.lmgate.gguf_dequantize(part, self.qtype, w)
        return w

    @property
    def weight(self) -> GGUFBlocks:
        return GGUFBlocks(self.blocks, self.qtype, self.in_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {TYPE_NAMES[self.qtype]}"


class QuantizedEmbedding(nn.Module):
    """Token embeddings over GGUF blocks: only the rows looked up are expanded."""

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
