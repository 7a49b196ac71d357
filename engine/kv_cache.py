"""The paged KV cache tensors of one engine loop: [layers] x (key, value) of [kv_heads, blocks, block_size, head_dim]."""
from __future__ import annotations

import torch

from .config import ModelConfig
from .errors import InvalidRequest


def kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """`--kv-cache-dtype`: `auto` keeps the model's dtype. A 16-bit cache under float32 weights (CPU only: the
    C++ kernels convert each block to float32 as they read it) holds twice the tokens in the same memory and
    halves the bytes decode attention reads, which bound it; keys and values are rounded once, when stored."""
    if name == "auto":
        return model_dtype
    dtype = getattr(torch, name)
    if dtype != model_dtype and (device.type != "cpu" or model_dtype != torch.float32):
        raise InvalidRequest(f"--kv-cache-dtype {name} under {str(model_dtype).removeprefix('torch.')} weights on "
                             f"{device.type}: a cache of another dtype than the model's is served on the CPU under "
                             f"float32 only")
    return dtype


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()


def allocate_kv_cache(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(cfg.num_layers)
    ]
