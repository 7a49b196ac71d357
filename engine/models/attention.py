"""Attention over the paged KV cache for a mixed batch: decode tokens first, then prefill chunks.

On the CPU, attention runs in C++ kernels (`kernels/paged_attention.cpp`), built with torch's extension builder
the first time an engine starts (about 10 s) and cached in `~/.cache/torch_extensions`. Both read the blocks
where they lie: a decode's (sequence, KV head) walks its key blocks, then its value blocks, once each, for all
the query heads of its group; a prefill chunk goes the same way in tiles of 16 queries, each tile scoring only
the keys up to its last query (causal) and zeroing the few past each row's own position. The torch path instead
gathers the blocks into a padded copy and reads it again in two matmuls (decode), which on a 2-core machine cost
about 20% of the batch throughput, or runs torch's flash kernel over gathered copies (prefill), which computes
the masked half of a chunk too: 1.8 ms against the kernel's 1.0 ms for four 128-token chunks. Without a
compiler, or with `attention_kernel=False`, the torch path runs; both are tested against each other and against
transformers.

Which attention path a loop's `ModelRunner` takes (`ATTENTION_PATHS`) is chosen once, at build: Triton on CUDA
(torch ops where Triton is missing), the C++ kernels on the CPU (torch ops without a compiler or with
`attention_kernel=False`). The runner builds the metadata that path reads (`DecodeTables` and `PrefillTables`
for Triton and C++, rows and masks for torch ops); the model calls one `paged_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels import layer_kernels

MAX_DECODE_SPLITS = 64  # the Triton decode's pieces of a context at most, each sequence's by its own length


@dataclass(slots=True)
class PrefillChunk:
    """One sequence's prefill tokens in this step: rows [start, end) of the batch."""

    start: int
    end: int
    context_len: int  # tokens of KV after this chunk is written, prefix included
    rows: torch.Tensor  # [KVH * blocks covering context_len] rows of the [KVH * blocks] cache view


@dataclass(slots=True)
class PrefillTables:
    """The prefill chunks as the Triton and C++ kernels read them: per chunk, its rows (counted from the first
    prefill row), its context and its block table."""

    block_tables: torch.Tensor  # [chunks, width] int64, padded with block 0
    q_starts: torch.Tensor  # [chunks]
    q_lens: torch.Tensor  # [chunks]
    context_lens: torch.Tensor  # [chunks], tokens of KV after the chunk is written, prefix included
    max_q_len: int


@dataclass(slots=True)
class AttentionMetadata:
    """Where each token's K/V goes and what each query may see; built once per step by the model runner,
    in the form its attention path reads (`ModelRunner.attention`: torch ops, the C++ kernel, Triton)."""

    slot_mapping: torch.Tensor  # [tokens], index into the flattened [blocks * block_size] cache
    num_decode: int  # the first num_decode tokens are one-token decodes
    decode: DecodeTables | GatheredDecode | None
    prefills: list[PrefillChunk] | PrefillTables  # PrefillTables on the Triton and C++ paths
    triton: bool = False  # the Triton kernels store the KV and read it (engine/kernels/triton)


@dataclass(slots=True)
class DecodeTables:
    """The decodes' block tables, read in place by the C++ kernel (`engine/kernels`)."""

    block_tables: torch.Tensor  # [num_decode, max_blocks] int64, padded with block 0
    lengths: torch.Tensor  # [num_decode] int64, tokens of KV including this step's


@dataclass(slots=True)
class GatheredDecode:
    """Where the torch path gathers the decodes' context from, and which gathered tokens each may see."""

    rows: torch.Tensor  # [KVH * num_decode * max_blocks] rows of the [KVH * blocks] cache view
    mask: torch.Tensor  # [KVH * num_decode, 1, max_blocks * block_size], 0 or -inf, head-major


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D]; caches: [KVH, blocks, block_size, D]. Returns [T, H, D].

    Head-major caches make a gathered context [KVH, ..., L, D] contiguous per head, so the score and value
    matmuls read it in place instead of copying a transposed view.
    """
    if meta.triton:
        return _triton_attention(q, k, v, k_cache, v_cache, meta, scale)
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    parts = []
    if meta.num_decode:
        assert meta.decode is not None  # built whenever there are decodes
        parts.append(_decode(q[: meta.num_decode], k_cache, v_cache, meta.decode, scale))
    if isinstance(meta.prefills, PrefillTables):  # the C++ kernel's form: every chunk in one call
        if meta.prefills.max_q_len:
            parts.append(_prefill_kernel(q[meta.num_decode :], k_cache, v_cache, meta.prefills, scale))
    else:
        parts.extend(_prefill(q[c.start : c.end], k_cache, v_cache, c, scale) for c in meta.prefills)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """A step's keys and values [T, KVH, D] into their slots, rounded to the cache's dtype: in C++ (layer_ops.cpp)
    for float32 or bfloat16 on the CPU where the kernels are loaded, else with index_copy_."""
    if layer_kernels(k):
        torch.ops.lmgate.store_kv(k, v, k_cache, v_cache, slots)
        return
    kvh, _, _, d = k_cache.shape
    k_cache.view(kvh, -1, d).index_copy_(1, slots, k.transpose(0, 1).to(k_cache.dtype))
    v_cache.view(kvh, -1, d).index_copy_(1, slots, v.transpose(0, 1).to(v_cache.dtype))


def _triton_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The GPU path: KV stored and read in place by Triton kernels, decodes first, then the prefill chunks."""
    from ..kernels.triton import paged_attention as kernels  # Triton is needed on this path only

    kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    parts = []
    if meta.num_decode:
        d = meta.decode
        assert isinstance(d, DecodeTables)  # what the model runner builds for the Triton path
        parts.append(
            kernels.decode_attention(
                q[: meta.num_decode], k_cache, v_cache, d.block_tables, d.lengths, scale, MAX_DECODE_SPLITS
            )
        )
    p = meta.prefills
    if isinstance(p, PrefillTables) and len(p.q_lens):
        parts.append(
            kernels.prefill_attention(
                q[meta.num_decode :],
                k_cache,
                v_cache,
                p.block_tables,
                p.q_starts,
                p.q_lens,
                p.context_lens,
                scale,
                p.max_q_len,
            )
        )
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _decode(q, k_cache, v_cache, decode: DecodeTables | GatheredDecode, scale: float) -> torch.Tensor:
    if isinstance(decode, DecodeTables):
        return torch.ops.lmgate.paged_decode_attention(q, k_cache, v_cache, decode.block_tables, decode.lengths, scale)
    return _gathered_decode(q, k_cache, v_cache, decode, scale)


def _gathered_decode(q, k_cache, v_cache, decode: GatheredDecode, scale: float) -> torch.Tensor:
    """One query per sequence against its gathered cache, as grouped batched matmuls (no head expansion);
    the scale and the padding mask ride along in the score matmul. The gather copies the whole context
    before the matmuls read it again: the kernel's in-place reads are about twice as fast on a CPU."""
    n, h, d = q.shape
    kvh = k_cache.shape[0]
    keys = _gather(k_cache, decode.rows, q.dtype).view(kvh * n, -1, d)  # [KVH * n, L, D]
    values = _gather(v_cache, decode.rows, q.dtype).view(kvh * n, -1, d)
    q = q.view(n, kvh, h // kvh, d).transpose(0, 1).reshape(kvh * n, h // kvh, d)  # [KVH * n, G, D]
    scores = torch.baddbmm(decode.mask.to(q.dtype), q, keys.transpose(1, 2), alpha=scale)  # [KVH * n, G, L]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
    return torch.bmm(probs, values).view(kvh, n, h // kvh, d).transpose(0, 1).reshape(n, h, d)


def _prefill_kernel(q, k_cache, v_cache, chunks: PrefillTables, scale: float) -> torch.Tensor:
    """The prefill chunks read in place by the C++ kernel: causal, each block read once per tile of 16
    queries. torch's flash kernel, on gathered copies, computed the masked half of a 128-token chunk too."""
    return torch.ops.lmgate.paged_prefill_attention(
        q, k_cache, v_cache, chunks.block_tables, chunks.q_starts, chunks.q_lens, chunks.context_lens, scale
    )


def _prefill(q, k_cache, v_cache, chunk: PrefillChunk, scale: float) -> torch.Tensor:
    """A chunk of queries against its sequence's whole context, causal within the chunk."""
    n = q.shape[0]
    kvh, _, _, d = k_cache.shape
    keys = _gather(k_cache, chunk.rows, q.dtype).view(kvh, -1, d)[:, : chunk.context_len]
    values = _gather(v_cache, chunk.rows, q.dtype).view(kvh, -1, d)[:, : chunk.context_len]
    prefix = chunk.context_len - n
    # A leading batch dimension of one takes torch's flash kernel on the CPU; 3-d inputs fall back to the
    # math path, 2-3x slower for a 128-512 token chunk.
    q, keys, values = q.transpose(0, 1)[None], keys[None], values[None]
    if prefix == 0:
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:
        rows = torch.arange(n, device=q.device)[:, None] + prefix
        mask = torch.arange(chunk.context_len, device=q.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def _gather(cache: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Whole blocks, one contiguous [block_size * D] row each, picked from the [KVH * blocks] view, in the
    queries' dtype (a 16-bit cache under float32 is widened here)."""
    kvh, blocks, block_size, d = cache.shape
    return cache.view(kvh * blocks, block_size * d).index_select(0, rows).to(dtype)


def gather_rows(block_tables: torch.Tensor, kv_heads: int, num_blocks: int) -> torch.Tensor:
    """Row indices, head-major, of each table's blocks in the [KVH * blocks] view of a cache."""
    heads = torch.arange(kv_heads, device=block_tables.device).view(-1, *([1] * block_tables.dim())) * num_blocks
    return (heads + block_tables).flatten()


def decode_mask(lengths: torch.Tensor, width: int, cache: torch.Tensor) -> torch.Tensor:
    """[KVH * n, 1, width] additive mask in the cache's dtype: -inf at and beyond each sequence's length."""
    mask = torch.zeros(len(lengths), width, dtype=cache.dtype)
    mask.masked_fill_(torch.arange(width)[None, :] >= lengths[:, None], float("-inf"))
    return mask.repeat(cache.shape[0], 1).unsqueeze(1)
