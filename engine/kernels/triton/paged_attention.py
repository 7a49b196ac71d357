"""Paged attention in Triton. Caches are [kv_heads, blocks, block_size, head_dim], as kv_cache.py allocates
them; a block table row lists a sequence's blocks in order. Softmax runs in fp32 whatever the cache dtype.

* `store_kv`: each token's key and value into its slot (`block * block_size + offset`); a negative slot
  (a padded row) writes nothing.
* `decode_attention`: one query token per sequence (a padded row of a CUDA graph's bucket sees none), as
  flash decoding: each sequence's context is cut into up to 64 pieces by its own length (a one-stream
  decode of 640 tokens: 10 pieces of 64 keys, each its own program), one program per (sequence, KV head,
  piece) handles the query heads of that KV head's GQA group together (padded to the 16 rows a `tl.dot`
  takes), DECODE_KEYS keys at a time, and a second kernel merges the pieces by their running max and sum.
  The launch grid depends on shapes only (batch, heads, table width), so a CUDA graph can hold it.
* `prefill_attention`: a chunk of query tokens per sequence against its whole context (the cached prefix
  plus the chunk itself, whose keys `store_kv` wrote first), causal within the chunk; flash attention's
  loop, its two products `tl.dot`s (tensor cores).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DECODE_KEYS = 64  # keys a decode program reads at a time: four 16-token blocks, their table entries in one load


@triton.jit
def _store_kv_kernel(
    K,
    V,
    KCache,
    VCache,
    Slots,
    num_blocks,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    BLOCK: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(Slots + t)
    if slot >= 0:
        d = tl.arange(0, D_PAD)
        real = d < D
        dest = ((h * num_blocks + slot // BLOCK) * BLOCK + slot % BLOCK) * D + d
        tl.store(KCache + dest, tl.load(K + t * stride_kt + h * stride_kh + d, mask=real), mask=real)
        tl.store(VCache + dest, tl.load(V + t * stride_vt + h * stride_vh + d, mask=real), mask=real)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """k, v: [T, KVH, D] (last dim contiguous); slots: [T] int, -1 for rows that write nothing."""
    kvh, num_blocks, block, d = k_cache.shape
    _store_kv_kernel[(k.shape[0], kvh)](
        k,
        v,
        k_cache,
        v_cache,
        slots,
        num_blocks,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        BLOCK=block,
        D=d,
        D_PAD=_padded(d),
    )


@triton.jit
def _load_keys(
    KCache,
    VCache,
    Table,
    pos,
    valid,
    h,
    num_blocks,
    BLOCK: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    DOT: tl.constexpr,
):
    """KV head h's keys and values [len(pos), D_PAD] at context positions `pos` of the sequence whose block
    table row is `Table` (zeros where not `valid`, and past D): a run of positions spans several cache blocks,
    their table entries loaded together."""
    block = tl.load(Table + pos // BLOCK, mask=valid, other=0)
    base = ((h * num_blocks + block) * BLOCK + pos % BLOCK) * D
    d = tl.arange(0, D_PAD)
    mask = valid[:, None] & (d < D)[None, :]
    k = tl.load(KCache + base[:, None] + d[None, :], mask=mask, other=0.0).to(DOT)
    v = tl.load(VCache + base[:, None] + d[None, :], mask=mask, other=0.0).to(DOT)
    return k, v


@triton.jit
def _online_softmax(scores, v, m, s_sum, acc, DOT: tl.constexpr, PRECISION: tl.constexpr):
    """A run of keys' scores [rows, keys] and values [keys, D] into each row's running max, sum and weighted
    values; a row that has seen no key yet (all -inf) keeps zeros."""
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(scores - m_safe[:, None])
    alpha = tl.exp(m - m_safe)
    return (
        m_new,
        s_sum * alpha + tl.sum(p, axis=1),
        acc * alpha[:, None] + tl.dot(p.to(DOT), v, input_precision=PRECISION),
    )


@triton.jit
def _split_len(length, BLOCK_N: tl.constexpr, MAX_SPLITS: tl.constexpr):
    """Keys in each piece of a sequence's context: whole runs of BLOCK_N, at most MAX_SPLITS pieces. A function
    of the sequence's own length only, so that its sums never depend on its batch or on the table's width."""
    return tl.maximum(tl.cdiv(tl.cdiv(length, MAX_SPLITS), BLOCK_N), 1) * BLOCK_N


@triton.jit
def _decode_split_kernel(
    Q,
    KCache,
    VCache,
    Tables,
    Lengths,
    Acc,
    Max,
    Sum,
    scale,
    num_blocks,
    table_width,
    num_splits,
    stride_qt,
    stride_qh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.program_id(2)
    length = tl.load(Lengths + i)
    split_len = _split_len(length, BLOCK_N, MAX_SPLITS)
    split_start = j * split_len
    # The grid has a piece for the longest context the table holds; pieces past this one's end write nothing,
    # and the merge reads only those that hold keys.
    if split_start < length:
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D_PAD)
        heads = h * GROUP + g
        live = g < GROUP
        real = live[:, None] & (d < D)[None, :]
        q = tl.load(Q + i * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=real, other=0.0).to(DOT)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        s_sum = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
        offs = tl.arange(0, BLOCK_N)
        split_end = tl.minimum(split_start + split_len, length)
        for start in range(split_start, split_end, BLOCK_N):
            pos = start + offs
            valid = pos < split_end
            k, v = _load_keys(KCache, VCache, Tables + i * table_width, pos, valid, h, num_blocks, BLOCK, D, D_PAD, DOT)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [GROUP_PAD, BLOCK_N], fp32
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m, s_sum, acc = _online_softmax(scores, v, m, s_sum, acc, DOT, PRECISION)
        row = (i * tl.num_programs(1) * GROUP + heads) * num_splits + j  # [n, H, splits] layout
        tl.store(Max + row, m, mask=live)
        tl.store(Sum + row, s_sum, mask=live)
        tl.store(Acc + row[:, None] * D + d[None, :], acc, mask=real)


@triton.jit
def _decode_merge_kernel(
    Acc,
    Max,
    Sum,
    Out,
    Lengths,
    num_splits,
    stride_ot,
    stride_oh,
    heads_per_seq,
    SPLITS_PAD: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
):
    i = tl.program_id(0)
    hq = tl.program_id(1)
    length = tl.load(Lengths + i)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    row = (i * heads_per_seq + hq) * num_splits + s
    live = s < tl.cdiv(length, _split_len(length, BLOCK_N, MAX_SPLITS))  # the pieces that hold keys
    m = tl.load(Max + row, mask=live, other=float("-inf"))
    total_max = tl.max(m, axis=0)
    total_max = tl.where(total_max == float("-inf"), 0.0, total_max)  # no KV at all (a padded row): zeros out
    weight = tl.where(live, tl.exp(m - total_max), 0.0)
    norm = tl.sum(tl.load(Sum + row, mask=live, other=0.0) * weight, axis=0)
    acc = tl.load(Acc + row[:, None] * D + d[None, :], mask=live[:, None] & (d < D)[None, :], other=0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(norm == 0.0, 1.0, norm)
    tl.store(Out + i * stride_ot + hq * stride_oh + d, out.to(Out.dtype.element_ty), mask=d < D)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    max_splits: int = 64,
) -> torch.Tensor:
    """q: [n, H, D]; block_tables: [n, width] int (padding entries never read); lengths: [n], tokens of KV
    each query sees (0 for a padded row, whose output is zeros). Returns [n, H, D] in q's dtype. A sequence's
    context is cut into at most `max_splits` pieces by its own length; the grid, by the table's width. The
    merge sums a fixed `max_splits` lanes, whatever the width: on a GPU a sum's order follows its lanes, so
    lanes sized by the width gave a sequence other bits beside a longer one."""
    n, heads, d = q.shape
    kvh, num_blocks, block, _ = k_cache.shape
    width = block_tables.shape[1]
    block_n = max(DECODE_KEYS, triton.next_power_of_2(block))
    splits = min(max_splits, triton.cdiv(width * block, block_n))
    acc = torch.empty((n, heads, splits, d), dtype=torch.float32, device=q.device)
    part_max = torch.empty((n, heads, splits), dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    group = heads // kvh
    _decode_split_kernel[(n, kvh, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        lengths,
        acc,
        part_max,
        part_sum,
        scale,
        num_blocks,
        width,
        splits,
        q.stride(0),
        q.stride(1),
        GROUP=group,
        GROUP_PAD=max(triton.next_power_of_2(group), 16),
        BLOCK_N=block_n,
        BLOCK=block,
        D=d,
        D_PAD=_padded(d),
        MAX_SPLITS=max_splits,
        **_dot_types(q),
    )
    out = torch.empty_like(q)
    _decode_merge_kernel[(n, heads)](
        acc,
        part_max,
        part_sum,
        out,
        lengths,
        splits,
        out.stride(0),
        out.stride(1),
        heads,
        SPLITS_PAD=triton.next_power_of_2(max_splits),
        D=d,
        D_PAD=_padded(d),
        BLOCK_N=block_n,
        MAX_SPLITS=max_splits,
    )
    return out


@triton.jit
def _prefill_kernel(
    Q,
    KCache,
    VCache,
    Out,
    Tables,
    QStarts,
    QLens,
    ContextLens,
    scale,
    num_blocks,
    table_width,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    DOT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    c = tl.program_id(0)
    tile = tl.program_id(1)
    hq = tl.program_id(2)
    h = hq // GROUP
    q_len = tl.load(QLens + c)
    if tile * BLOCK_M < q_len:
        q_start = tl.load(QStarts + c)
        context = tl.load(ContextLens + c)
        prefix = context - q_len
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        live = rows < q_len
        d = tl.arange(0, D_PAD)
        real = live[:, None] & (d < D)[None, :]
        q = tl.load(Q + (q_start + rows)[:, None] * stride_qt + hq * stride_qh + d[None, :], mask=real, other=0.0).to(
            DOT
        )
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        s_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        offs = tl.arange(0, BLOCK_N)
        visible = tl.minimum(prefix + (tile + 1) * BLOCK_M, context)  # the tile's last row sees this far
        for start in range(0, visible, BLOCK_N):
            pos = start + offs
            seen = pos < visible
            k, v = _load_keys(KCache, VCache, Tables + c * table_width, pos, seen, h, num_blocks, BLOCK, D, D_PAD, DOT)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_M, BLOCK_N], fp32
            allowed = (pos[None, :] <= (prefix + rows)[:, None]) & seen[None, :]
            scores = tl.where(allowed, scores, float("-inf"))
            m, s_sum, acc = _online_softmax(scores, v, m, s_sum, acc, DOT, PRECISION)
        out = acc / tl.where(s_sum == 0.0, 1.0, s_sum)[:, None]
        tl.store(
            Out + (q_start + rows)[:, None] * stride_ot + hq * stride_oh + d[None, :],
            out.to(Out.dtype.element_ty),
            mask=real,
        )


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_q_len: int,
) -> torch.Tensor:
    """q: [T, H, D], the chunks' rows one after another; per chunk c: rows [q_starts[c], +q_lens[c]),
    context_lens[c] tokens of KV (its chunk's included, already stored), block_tables[c]. Returns [T, H, D].
    Both products run on tensor cores: bf16 and fp16 in their own type (the probabilities rounded to it, as
    flash attention does), fp32 in full precision, not TF32. On a CPU (Triton's interpreter, whose bf16 dot
    gives garbage in Triton 3.9) every operand goes to fp32."""
    heads, d = q.shape[1], q.shape[2]
    kvh, num_blocks, block, _ = k_cache.shape
    out = torch.empty_like(q)
    tile = 32 if q.dtype == torch.float32 else 64  # fp32 tiles of 64 x 64 spill registers on an H100 or H200
    grid = (len(q_lens), triton.cdiv(max_q_len, tile), heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        q_starts,
        q_lens,
        context_lens,
        scale,
        num_blocks,
        block_tables.shape[1],
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=heads // kvh,
        BLOCK_M=tile,
        BLOCK_N=max(tile, triton.next_power_of_2(block)),
        BLOCK=block,
        D=d,
        D_PAD=_padded(d),
        **_dot_types(q),
    )
    return out


def _padded(head_dim: int) -> int:
    """The width a head's vectors take in the kernels: a power of two, as `tl.arange` needs (Llama shapes of
    80, 96 or 100), and at least the 16 a `tl.dot` takes; lanes past head_dim load zeros and store nothing."""
    return max(triton.next_power_of_2(head_dim), 16)


def _dot_types(q: torch.Tensor) -> dict:
    """The type `tl.dot`'s operands take, and its precision for fp32 ones."""
    if q.dtype == torch.float32 or q.device.type == "cpu":
        return dict(DOT=tl.float32, PRECISION="ieee")
    return dict(DOT=tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16, PRECISION="tf32")
