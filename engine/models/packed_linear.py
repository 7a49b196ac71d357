"""Linear layers whose weights are reordered once, at load time, into oneDNN's blocked layout (CPU only).

`F.linear` on the CPU reorders a bf16 weight on every call, and runs fp32 through MKL, whose code path on
AMD processors is the slow one. Packing once and calling oneDNN directly made a whole model's matmuls 2.4x
(bf16) and 3.3x (fp32) faster at one token, and 1.6x / 3x at 64 tokens, on the 2-core EPYC we develop on.
Where oneDNN cannot take a weight (a torch build without it, an unsupported dtype, bf16 on a CPU without
AVX512 BW/VL/DQ or AVX-NE-CONVERT, as `hardware.cpu_features` says) the layer stays a plain `nn.Linear`.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass

import torch
from torch import nn

from ..machine.hardware import cpu_features
from ..machine.threads import in_shares

log = logging.getLogger(__name__)


class PackedLinear(nn.Module):
    """`y = x @ W.T + b` over a prepacked weight; read-only, so engine loops may share it."""

    def __init__(self, linear: nn.Linear, batch_hint: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.batch_hint = batch_hint
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)
        self.bias = linear.bias

    def load_(self, weight: torch.Tensor) -> None:
        """New values of W (its shape), written into the weight served now: only while no step runs. Where the
        layout oneDNN chose is one `RowBlocks` knows, strided copies put the values in place, three times as
        fast as oneDNN's reorder into fresh memory and a copy back (an RL trainer's push waits on this)."""
        weight = weight.to(self.packed.dtype)
        layout = self._layout() if weight.numel() * weight.element_size() >= DIRECT_BYTES else None
        if layout is None:
            self.packed.copy_(torch.ops.mkldnn._reorder_linear_weight(weight, self.batch_hint))
        else:
            layout.write(_memory_of(self.packed), weight)

    def _layout(self) -> RowBlocks | None:
        """This weight's `RowBlocks`, if oneDNN described its memory as it did the probe's `row_blocks` read;
        None too where this torch lacks the oneDNN internals it takes (the reorder then, as before)."""
        try:
            layout, descriptor = row_blocks(self.out_features, self.in_features, self.packed.dtype, self.batch_hint)
            same = torch.equal(torch.ops.mkldnn._get_mkldnn_serialized_md(self.packed), descriptor)
        except (AttributeError, RuntimeError) as exc:
            log.warning("new weights go through oneDNN's reorder: %s", exc)
            return None
        return layout if same else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    @property
    def packed_bytes(self) -> int:
        return self.in_features * self.out_features * self.packed.element_size()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module, batch_hint: int) -> None:
    """Swap every `nn.Linear` of a CPU model for a `PackedLinear`; a tied head gets a packed copy of its own,
    the embedding keeps the plain weight for lookups. `batch_hint`: the token count steps usually have."""
    if not torch.backends.mkldnn.is_available():
        return
    dtypes = {p.dtype for p in model.parameters()}
    if torch.bfloat16 in dtypes and not cpu_features().onednn_bf16:
        log.info("linear layers stay unpacked: oneDNN packs no bf16 weights on this CPU")
        return
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.weight.device.type == "cpu":
                try:
                    setattr(parent, name, PackedLinear(child, batch_hint))
                except RuntimeError as exc:  # oneDNN refuses this dtype on this machine
                    log.info("linear layers stay unpacked: %s", exc)
                    return


# Below DIRECT_BYTES oneDNN's reorder is the faster (its output, in reused memory, stays in the caches); above,
# it writes fresh pages. A thread's least share of a direct write: below, starting one costs what it saves.
DIRECT_BYTES, SHARE_BYTES = 16 << 20, 8 << 20
_UNITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # a unit's bytes: the dtype that moves it whole


@dataclass(frozen=True, slots=True)
class RowBlocks:
    """A packed weight's layout where oneDNN blocks W [N, K] by rows: `rows` rows after `rows` rows, each block
    stored as its K columns `unit` at a time, a unit of every row of the block before the next unit. oneDNN's
    AB16b64a2b (bf16 on AVX512-BF16) is rows 64, unit 2; AB16b64a (float32) rows 64, unit 1; plain ab rows 1."""

    rows: int
    unit: int

    def fits(self, n: int, k: int, dtype: torch.dtype) -> bool:
        return n % self.rows == 0 and k % self.unit == 0 and self.unit * dtype.itemsize in _UNITS

    def views(self, memory: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`memory` (a packed weight's bytes) as blocks of units by row, and `weight` (contiguous) seen alike."""
        n, k = weight.shape
        unit = _UNITS[self.unit * weight.element_size()]
        blocks = memory.view(unit).view(n // self.rows, k // self.unit, self.rows)
        return blocks, weight.view(unit).view(n // self.rows, self.rows, k // self.unit).transpose(1, 2)

    def write(self, memory: torch.Tensor, weight: torch.Tensor) -> None:
        """`weight` into `memory` in this layout. One strided copy runs on one core, so the blocks are shared
        among as many threads as torch's (a rank process's share of the CPUs; fresh threads:
        engine/machine/threads.py says why)."""
        weight = weight.contiguous()
        if weight.storage_offset() % self.unit:  # a view whose start no unit of its storage begins at
            weight = weight.clone()
        dst, src = self.views(memory, weight)
        if self.rows == 1:
            dst.copy_(src)
            return
        shares = min(torch.get_num_threads(), len(dst), 1 + memory.numel() // SHARE_BYTES)
        bounds = [len(dst) * i // shares for i in range(shares + 1)]

        def copy(share: int) -> None:
            with torch.inference_mode():  # a thread's own mode: the caller's views may be inference tensors
                for block in range(bounds[share], bounds[share + 1]):
                    dst[block].copy_(src[block])

        in_shares(copy, shares)


@functools.cache
def row_blocks(n: int, k: int, dtype: torch.dtype, batch_hint: int) -> tuple[RowBlocks | None, torch.Tensor]:
    """The layout oneDNN packs an [n, k] weight of `dtype` in, with its memory descriptor, found once per shape
    by packing a probe whose values tell where each came from and trying every `RowBlocks`: oneDNN exposes no
    layout, and which it picks depends on the CPU. None where none matches (padded rows, say). The first push
    of a shape pays for it (0.7 s for a 128256 x 2048 bf16 head on the 2-core EPYC, 0.1 s for 16384 x 2048),
    and twice the weight's bytes for as long."""
    row_values, column_values = (torch.arange(n) % 16 * 16).to(dtype), (torch.arange(k) % 16).to(dtype)
    probe = row_values.view(n, 1) + column_values  # 0 to 255: exact in bfloat16 too
    packed = torch.ops.mkldnn._reorder_linear_weight(probe, batch_hint)
    descriptor = torch.ops.mkldnn._get_mkldnn_serialized_md(packed)
    memory = _memory_of(packed)
    if memory.numel() != probe.numel() * probe.element_size():
        return None, descriptor
    for rows in (64, 32, 16, 8, 48, 24, 1):
        for unit in (1, 2, 4):
            layout = RowBlocks(rows, unit)
            if layout.fits(n, k, dtype):
                dst, src = layout.views(memory, probe)
                if torch.equal(dst[:1], src[:1]) and torch.equal(dst, src):  # the first block weeds out most
                    return layout, descriptor
    return None, descriptor


def _memory_of(packed: torch.Tensor) -> torch.Tensor:
    """A oneDNN tensor's bytes as a uint8 tensor over the same memory (torch has no view of its own); valid as
    long as `packed` lives."""
    nbytes = torch.ops.mkldnn._nbytes(packed)
    buffer = (ctypes.c_uint8 * nbytes).from_address(torch.ops.mkldnn.data_ptr(packed))
    return torch.frombuffer(buffer, dtype=torch.uint8)
