"""Attention over the paged KV cache for a mixed batch: decode tokens first, then prefill chunks."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillChunk:
    """One sequence's prefill tokens in this step: rows [start, end) of the batch."""

    start: int
    end: int
    context_len: int  # tokens of KV after this chunk is written, prefix included
    block_table: torch.Tensor  # [blocks covering context_len]


@dataclass(slots=True)
class AttentionMetadata:
    """Where each token's K/V goes and what each query may see; built once per step by the model runner."""

    slot_mapping: torch.Tensor  # [tokens], index into the flattened [blocks * block_size] cache
    num_decode: int  # the first num_decode tokens are one-token decodes
    decode_block_tables: torch.Tensor | None  # [num_decode, max_blocks], padded with block 0
    decode_mask: torch.Tensor | None  # [num_decode, max_blocks * block_size], 0 or -inf
    prefills: list[PrefillChunk]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D]; caches: [blocks, block_size, KVH, D]. Returns [T, H, D]."""
    kvh, d = k_cache.shape[-2:]
    k_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, v)
    parts = []
    if meta.num_decode:
        parts.append(_decode(q[: meta.num_decode], k_cache, v_cache, meta, scale))
    parts.extend(_prefill(q[c.start : c.end], k_cache, v_cache, c, scale) for c in meta.prefills)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """One query per sequence against its gathered cache, as grouped batched matmuls (no head expansion)."""
    n, h, d = q.shape
    kvh = k_cache.shape[-2]
    keys = k_cache[meta.decode_block_tables].view(n, -1, kvh, d).transpose(1, 2)  # [n, KVH, L, D]
    values = v_cache[meta.decode_block_tables].view(n, -1, kvh, d).transpose(1, 2)
    q = q.view(n, kvh, h // kvh, d)
    scores = torch.matmul(q, keys.transpose(2, 3)) * scale  # [n, KVH, G, L]
    scores = scores + meta.decode_mask[:, None, None, :]
    probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
    return torch.matmul(probs, values).view(n, h, d)


def _prefill(q, k_cache, v_cache, chunk: PrefillChunk, scale: float) -> torch.Tensor:
    """A chunk of queries against its sequence's whole context, causal within the chunk."""
    n, h, d = q.shape
    kvh = k_cache.shape[-2]
    keys = k_cache[chunk.block_table].view(-1, kvh, d)[: chunk.context_len].transpose(0, 1)
    values = v_cache[chunk.block_table].view(-1, kvh, d)[: chunk.context_len].transpose(0, 1)
    prefix = chunk.context_len - n
    if prefix == 0:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys, values, is_causal=True, scale=scale, enable_gqa=True
        )
    else:
        rows = torch.arange(n, device=q.device)[:, None] + prefix
        mask = torch.arange(chunk.context_len, device=q.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
    return out.transpose(0, 1)
