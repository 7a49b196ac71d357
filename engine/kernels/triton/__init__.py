"""GPU kernels in Triton: over lmgate's paged KV cache, read and written where it lies (no gather copies),
storing a step's keys and values, decode attention as flash decoding, prefill attention over a cached prefix
(paged_attention.py); and a layer's elementwise work, fused (layer_ops.py).

Testable without a GPU: with `TRITON_INTERPRET=1` set before Triton is imported, they run on CPU tensors
(tests/test_triton_kernels.py). `available()` says whether Triton can be imported at all.
"""

from __future__ import annotations

import functools
import importlib.util

import torch


@functools.cache
def available() -> bool:
    return importlib.util.find_spec("triton") is not None


def serves(x: torch.Tensor) -> bool:
    """Whether layer_ops.py does the elementwise work on `x`: a CUDA tensor, with Triton installed."""
    return x.is_cuda and available()
