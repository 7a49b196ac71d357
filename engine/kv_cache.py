"""The paged KV cache tensors of one engine loop: [layers] x (key, value) of [kv_heads, blocks, block_size, head_dim]."""
from __future__ import annotations

import torch

from .config import ModelConfig


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
