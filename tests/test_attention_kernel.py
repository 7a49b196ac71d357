"""The C++ paged decode-attention kernel (engine/kernels) against a plain reference and the torch path."""

from __future__ import annotations

import pytest
import torch

from lmgate.engine.models.attention import (
    DecodeTables,
    GatheredDecode,
    PrefillChunk,
    PrefillTables,
    _decode,
    _prefill,
    _prefill_kernel,
    decode_mask,
    gather_rows,
)
from lmgate.engine.kernels import _builder_lock, compiler_found, load_cpu_kernels

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module")
def kernel():
    """The kernel is built wherever a C++ compiler is found; without one the engine uses the torch path."""
    if not compiler_found():
        pytest.skip("no C++ compiler: the engine runs attention on torch ops")
    assert load_cpu_kernels()
    return torch.ops.lmgate.paged_decode_attention


def _case(heads: int, kv_heads: int, dim: int, block_size: int, lengths: list[int], dtype: torch.dtype, seed: int = 0):
    """Random queries and caches; each sequence's blocks scattered over the cache, tables padded with 0."""
    g = torch.Generator().manual_seed(seed)
    widths = [-(-n // block_size) for n in lengths]
    num_blocks = sum(widths) + 3
    k_cache = torch.randn(kv_heads, num_blocks, block_size, dim, generator=g).to(dtype)
    v_cache = torch.randn(kv_heads, num_blocks, block_size, dim, generator=g).to(dtype)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for w in widths:
        tables.append(order[used : used + w] + [0] * (max(widths) - w))
        used += w
    q = torch.randn(len(lengths), heads, dim, generator=g).to(dtype)
    return q, k_cache, v_cache, torch.tensor(tables, dtype=torch.long), torch.tensor(lengths, dtype=torch.long)


def _reference(q, k_cache, v_cache, tables, lengths, scale) -> torch.Tensor:
    """Each sequence on its own, in float64: its blocks in table order, cut to its length."""
    kv_heads, _, _, dim = k_cache.shape
    out = []
    for i, n in enumerate(lengths.tolist()):
        keys = k_cache[:, tables[i]].flatten(1, 2)[:, :n].double()  # [KVH, n, D]
        values = v_cache[:, tables[i]].flatten(1, 2)[:, :n].double()
        qi = q[i].double().view(kv_heads, -1, dim)  # [KVH, G, D]
        probs = torch.softmax(qi @ keys.transpose(1, 2) * scale, dim=-1)
        out.append((probs @ values).reshape(-1, dim))
    return torch.stack(out)


SHAPES = [  # heads, kv_heads, head_dim, block_size
    (9, 3, 64, 16),  # SmolLM2-135M
    (4, 4, 40, 5),  # no grouping; a head_dim that leaves a remainder after whole vector registers
    (6, 2, 40, 16),  # groups of 3 with that head_dim: the per-head path, not the register tiles
    (8, 1, 128, 16),  # one KV head for all
    (14, 2, 64, 16),  # Qwen2.5-0.5B: groups of 7, register tiles of 3, 3 and 1 heads
]
LENGTHS = [1, 15, 16, 17, 64, 300]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}-kv{}-d{}-bs{}".format(*s))
def test_kernel_matches_reference(kernel, shape, dtype):
    heads, kv_heads, dim, block_size = shape
    q, k_cache, v_cache, tables, lengths = _case(heads, kv_heads, dim, block_size, LENGTHS, dtype)
    scale = dim**-0.5
    out = kernel(q, k_cache, v_cache, tables, lengths, scale)
    assert out.dtype == dtype and out.shape == q.shape
    ref = _reference(q, k_cache, v_cache, tables, lengths, scale)
    torch.testing.assert_close(out.double(), ref, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}-kv{}-d{}-bs{}".format(*s))
def test_kernel_and_torch_path_agree(kernel, shape):
    """What the engine computes does not depend on whether the kernel could be built."""
    heads, kv_heads, dim, block_size = shape
    q, k_cache, v_cache, tables, lengths = _case(heads, kv_heads, dim, block_size, LENGTHS, torch.float32, seed=1)
    gathered = GatheredDecode(
        gather_rows(tables, kv_heads, k_cache.shape[1]), decode_mask(lengths, tables.shape[1] * block_size, k_cache)
    )
    by_kernel = _decode(q, k_cache, v_cache, DecodeTables(tables, lengths), dim**-0.5)
    by_torch = _decode(q, k_cache, v_cache, gathered, dim**-0.5)
    torch.testing.assert_close(by_kernel, by_torch, atol=2e-5, rtol=2e-5)


def test_kernel_reads_queries_whose_rows_are_strided(kernel):
    """The engine's queries are the first heads of the rotated Q and K heads: a view, read in place."""
    q, k_cache, v_cache, tables, lengths = _case(9, 3, 64, 16, LENGTHS, torch.float32, seed=2)
    qk = torch.cat([q, torch.randn(q.shape[0], 3, 64)], dim=1)
    view = qk[:, :9]
    assert not view.is_contiguous()
    out = kernel(view, k_cache, v_cache, tables, lengths, 0.125)
    assert out.is_contiguous()
    torch.testing.assert_close(out, kernel(q, k_cache, v_cache, tables, lengths, 0.125), rtol=0, atol=0)


def test_kernel_handles_an_empty_batch(kernel):
    q, k_cache, v_cache, _, _ = _case(9, 3, 64, 16, [5], torch.float32)
    out = kernel(q[:0], k_cache, v_cache, torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, dtype=torch.long), 0.125)
    assert out.shape == (0, 9, 64)


def _corrupt(case, what: str):
    q, k_cache, v_cache, tables, lengths = (t.clone() for t in case)
    if what == "zero length":
        lengths[0] = 0
    elif what == "length past its table":
        lengths[0] = tables.shape[1] * k_cache.shape[2] + 1
    elif what == "block outside the cache":
        tables[0, 0] = k_cache.shape[1]
    elif what == "negative block":
        tables[1, 0] = -1
    elif what == "int32 tables":
        tables = tables.int()
    elif what == "dtype mismatch":
        q = q.double()
    elif what == "non-contiguous q":
        q = q.transpose(0, 1).contiguous().transpose(0, 1)
    elif what == "heads not a multiple of kv heads":
        q = q[:, :8].contiguous()
    elif what == "one length too few":
        lengths = lengths[:-1]
    return q, k_cache, v_cache, tables, lengths


@pytest.mark.parametrize(
    "what",
    [
        "zero length",
        "length past its table",
        "block outside the cache",
        "negative block",
        "int32 tables",
        "dtype mismatch",
        "non-contiguous q",
        "heads not a multiple of kv heads",
        "one length too few",
    ],
)
def test_kernel_refuses_bad_input(kernel, what):
    """A bad table or length is an error, never a read outside the cache."""
    case = _case(9, 3, 64, 16, [20, 33], torch.float32)
    with pytest.raises(RuntimeError):
        kernel(*_corrupt(case, what), 0.125)


def test_a_build_lock_left_by_a_killed_build_is_cleared(tmp_path):
    """torch's builder waits for ever on the `lock` file of a build killed midway (every later start hung);
    whoever holds lmgate's flock, which dies with its process, knows such a file is stale."""
    (tmp_path / "lock").write_text("")
    with _builder_lock(str(tmp_path)):
        assert not (tmp_path / "lock").exists()


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}-kv{}-d{}-bs{}".format(*s))
def test_float32_queries_over_a_16_bit_cache(kernel, shape, cache_dtype):
    """`--kv-cache-dtype`: the kernel widens each block as it reads it, so the result is float32 attention over
    the cache's (rounded) values, as tight as a float32 cache's; the torch path computes the same."""
    heads, kv_heads, dim, block_size = shape
    q, k_cache, v_cache, tables, lengths = _case(heads, kv_heads, dim, block_size, LENGTHS, torch.float32, seed=2)
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    out = _decode(q, k_cache, v_cache, DecodeTables(tables, lengths), dim**-0.5)
    assert out.dtype == torch.float32
    ref = _reference(q, k_cache, v_cache, tables, lengths, dim**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    gathered = GatheredDecode(
        gather_rows(tables, kv_heads, k_cache.shape[1]), decode_mask(lengths, tables.shape[1] * block_size, k_cache)
    )
    torch.testing.assert_close(_decode(q, k_cache, v_cache, gathered, dim**-0.5), out, atol=2e-5, rtol=2e-5)


def test_kernel_refuses_a_cache_dtype_it_cannot_read_under_q(kernel):
    q, k_cache, v_cache, tables, lengths = _case(9, 3, 64, 16, [5], torch.float16)
    with pytest.raises(RuntimeError, match="dtype"):  # float16 queries over a float32 cache: not a configuration
        kernel(q, k_cache.float(), v_cache.float(), tables, lengths, 0.125)
    with pytest.raises(RuntimeError, match="dtype"):
        kernel(q.float(), k_cache.double(), v_cache.double(), tables, lengths, 0.125)


CHUNKS = [
    (1, 1),
    (15, 15),
    (16, 16),
    (17, 40),
    (40, 40),
    (3, 300),
    (33, 33),
]  # (queries, context): a prefix when they differ


def _prefill_case(heads, kv_heads, dim, block_size, chunks, dtype, q_dtype=None, seed=0):
    """Prefill chunks in one batch of rows, their blocks scattered over the cache like _case's."""
    q, k_cache, v_cache, tables, _ = _case(heads, kv_heads, dim, block_size, [c for _, c in chunks], dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    rows = sum(n for n, _ in chunks)
    q = torch.randn(rows, heads, dim, generator=g).to(q_dtype or dtype)
    starts = torch.tensor([0, *torch.tensor([n for n, _ in chunks]).cumsum(0).tolist()][:-1])
    return (
        q,
        k_cache,
        v_cache,
        PrefillTables(
            tables,
            starts,
            torch.tensor([n for n, _ in chunks]),
            torch.tensor([c for _, c in chunks]),
            max(n for n, _ in chunks),
        ),
    )


def _prefill_reference(q, k_cache, v_cache, chunks: PrefillTables, scale) -> torch.Tensor:
    """Each query on its own, in float64, against the keys up to and including its own position."""
    kv_heads, _, _, dim = k_cache.shape
    out = torch.empty(q.shape, dtype=torch.float64)
    for c in range(len(chunks.q_lens)):
        start, n, context = int(chunks.q_starts[c]), int(chunks.q_lens[c]), int(chunks.context_lens[c])
        keys = k_cache[:, chunks.block_tables[c]].flatten(1, 2)[:, :context].double()
        values = v_cache[:, chunks.block_tables[c]].flatten(1, 2)[:, :context].double()
        for i in range(n):
            seen = context - n + 1 + i
            qi = q[start + i].double().view(kv_heads, -1, dim)
            probs = torch.softmax(qi @ keys[:, :seen].transpose(1, 2) * scale, dim=-1)
            out[start + i] = (probs @ values[:, :seen]).reshape(-1, dim)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}-kv{}-d{}-bs{}".format(*s))
def test_prefill_kernel_matches_reference(kernel, shape, dtype):
    """Causal within each chunk, the prefix in full, tiles of 16 queries with short tails, any grouping."""
    heads, kv_heads, dim, block_size = shape
    q, k_cache, v_cache, chunks = _prefill_case(heads, kv_heads, dim, block_size, CHUNKS, dtype)
    out = _prefill_kernel(q, k_cache, v_cache, chunks, dim**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    ref = _prefill_reference(q, k_cache, v_cache, chunks, dim**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_prefill_kernel_reads_a_16_bit_cache_under_float32(kernel, cache_dtype):
    q, k_cache, v_cache, chunks = _prefill_case(9, 3, 64, 16, CHUNKS, cache_dtype, q_dtype=torch.float32)
    out = _prefill_kernel(q, k_cache, v_cache, chunks, 0.125)
    assert out.dtype == torch.float32
    torch.testing.assert_close(
        out.double(), _prefill_reference(q, k_cache, v_cache, chunks, 0.125), atol=2e-5, rtol=2e-5
    )


def test_prefill_kernel_and_torch_path_agree_on_strided_queries(kernel):
    """The engine's queries are a view of the rotated Q and K heads; torch's path reads gathered copies."""
    q, k_cache, v_cache, chunks = _prefill_case(9, 3, 64, 16, CHUNKS, torch.float32, seed=3)
    view = torch.cat([q, torch.randn(q.shape[0], 3, 64)], dim=1)[:, :9]
    by_kernel = _prefill_kernel(view, k_cache, v_cache, chunks, 0.125)
    for c in range(len(chunks.q_lens)):
        start, n = int(chunks.q_starts[c]), int(chunks.q_lens[c])
        chunk = PrefillChunk(
            start, start + n, int(chunks.context_lens[c]), gather_rows(chunks.block_tables[c], 3, k_cache.shape[1])
        )
        torch.testing.assert_close(
            by_kernel[start : start + n],
            _prefill(q[start : start + n], k_cache, v_cache, chunk, 0.125),
            atol=2e-5,
            rtol=2e-5,
        )


@pytest.mark.parametrize(
    "what, message",
    [
        ("a gap between chunks", "does not follow"),
        ("more queries than context", "inside its context"),
        ("rows left over", "cover"),
        ("context past its table", "capacity"),
        ("block outside the cache", "outside the cache"),
    ],
)
def test_prefill_kernel_refuses_bad_chunks(kernel, what, message):
    q, k_cache, v_cache, chunks = _prefill_case(9, 3, 64, 16, [(5, 20), (7, 7)], torch.float32)
    starts, lens, contexts, tables = (
        t.clone() for t in (chunks.q_starts, chunks.q_lens, chunks.context_lens, chunks.block_tables)
    )
    if what == "a gap between chunks":
        starts[1] += 1
    elif what == "more queries than context":
        lens[1], starts[1] = 21, 5
        q = torch.randn(26, 9, 64)
        contexts[1] = 20
    elif what == "rows left over":
        q = torch.randn(13, 9, 64)
    elif what == "context past its table":
        contexts[1] = tables.shape[1] * 16 + 1
    elif what == "block outside the cache":
        tables[0, 0] = k_cache.shape[1]
    with pytest.raises(RuntimeError, match=message):
        torch.ops.lmgate.paged_prefill_attention(q, k_cache, v_cache, tables, starts, lens, contexts, 0.125)
