"""The Triton kernels (engine/kernels/triton) against a float64 reference in plain torch: small shapes, odd
lengths, GQA groups that are not powers of two, blocks shared and out of order, padded rows. Without a GPU
they run in Triton's interpreter on CPU tensors (`TRITON_INTERPRET=1`, set by conftest.py before Triton
loads); the engine's Triton path then runs a tiny model end to end on the CPU."""

from __future__ import annotations

import math
import random

import pytest
import torch

from lmgate.engine.config import EngineConfig
from lmgate.engine.step.cuda_graphs import DecodeGraphs
from lmgate.engine.engine import Engine
from lmgate.engine.kernels import triton as triton_package
from lmgate.engine.sampling.sampler import SamplingParams

triton_kernels = pytest.importorskip("lmgate.engine.kernels.triton.paged_attention", reason="Triton is not installed")
layer_ops = pytest.importorskip("lmgate.engine.kernels.triton.layer_ops", reason="Triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK, D = 16, 32
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def make_cache(
    kvh: int, num_blocks: int, dtype: torch.dtype, seed: int, d: int = D, block: int = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (kvh, num_blocks, block, d)
    return (torch.randn(shape, generator=g).to(dtype).to(DEVICE), torch.randn(shape, generator=g).to(dtype).to(DEVICE))


def tables_for(
    lengths: list[int], num_blocks: int, seed: int, block: int = BLOCK
) -> tuple[list[list[int]], torch.Tensor]:
    """Distinct random blocks per sequence, out of order; the table padded with block 0."""
    rng = random.Random(seed)
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in lengths:
        need = -(-n // block)
        tables.append(ids[at : at + need])
        at += need
    width = max(len(t) for t in tables)
    return tables, torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64, device=DEVICE)


def context(cache: torch.Tensor, table: list[int], n: int) -> torch.Tensor:
    """[KVH, n, D] float64: a sequence's first n tokens of KV, gathered by its table."""
    return cache[:, table].reshape(cache.shape[0], -1, cache.shape[-1])[:, :n].double()


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix: int, scale: float) -> torch.Tensor:
    """q: [m, H, D] rows at positions prefix .. prefix+m-1, each seeing keys up to its own position."""
    m, heads, _ = q.shape
    group = heads // keys.shape[0]
    k, v = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)  # [H, L, D]
    scores = torch.einsum("mhd,hld->hml", q.double(), k) * scale
    pos = torch.arange(keys.shape[1], device=q.device)
    scores = scores.masked_fill(
        pos[None, None, :] > (prefix + torch.arange(m, device=q.device))[None, :, None], float("-inf")
    )
    return torch.einsum("hml,hld->mhd", torch.softmax(scores, -1), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [D, 80])  # 80: a head_dim that is not a power of two (h2o-danube, Llama-shaped)
def test_store_kv_writes_slots_and_skips_padding(dtype, d):
    kvh, num_blocks = 3, 5
    k_cache, v_cache = (torch.zeros(kvh, num_blocks, BLOCK, d, dtype=dtype, device=DEVICE) for _ in range(2))
    k = torch.randn(6, kvh, d).to(dtype).to(DEVICE)
    v = torch.randn(6, kvh, d).to(dtype).to(DEVICE)
    slots = torch.tensor([0, 17, 79, -1, 33, 5], device=DEVICE)
    triton_kernels.store_kv(k, v, k_cache, v_cache, slots)
    want_k, want_v = (torch.zeros_like(k_cache) for _ in range(2))
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want_k[:, slot // BLOCK, slot % BLOCK] = k[t]
            want_v[:, slot // BLOCK, slot % BLOCK] = v[t]
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kvh", [(9, 3), (4, 4), (6, 1)])
@pytest.mark.parametrize("max_splits", [1, 2, 64])  # 300 tokens: 1 piece, 2 of 192 keys, 5 of 64
@pytest.mark.parametrize("d,block", [(D, BLOCK), (80, BLOCK), (D, 80)])  # 80: neither a power of two
def test_decode_attention_matches_reference(dtype, heads, kvh, max_splits, d, block):
    lengths = [1, 15, 16, 17, 0, 70, 33, 300]  # 0: a CUDA graph bucket's padded row, which reads nothing
    k_cache, v_cache = make_cache(kvh, 40, dtype, seed=heads, d=d, block=block)
    tables, table_tensor = tables_for(lengths, 40, seed=kvh, block=block)
    q = torch.randn(len(lengths), heads, d).to(dtype).to(DEVICE)
    scale = 1 / math.sqrt(d)
    got = triton_kernels.decode_attention(
        q, k_cache, v_cache, table_tensor, torch.tensor(lengths, device=DEVICE), scale, max_splits
    )
    assert got.shape == q.shape and got.dtype == dtype
    for i, n in enumerate(lengths):
        if n == 0:
            assert torch.equal(got[i], torch.zeros_like(got[i]))
            continue
        want = reference(q[i : i + 1], context(k_cache, tables[i], n), context(v_cache, tables[i], n), n - 1, scale)
        torch.testing.assert_close(got[i].double(), want[0], rtol=TOL[dtype], atol=TOL[dtype])


def test_a_decodes_sums_depend_on_its_own_length_only():
    """The same sequence alone with a table just wide enough (an eager step), and among others with a table as
    wide as a CUDA graph's (the longest context): the same pieces, the same bits."""
    lengths = [150, 7, 300]
    k_cache, v_cache = make_cache(2, 40, torch.float32, seed=5)
    tables, table_tensor = tables_for(lengths, 40, seed=6)
    q = torch.randn(len(lengths), 6, D, device=DEVICE)
    wide = torch.nn.functional.pad(table_tensor, (0, 64 - table_tensor.shape[1]))
    together = triton_kernels.decode_attention(q, k_cache, v_cache, wide, torch.tensor(lengths, device=DEVICE), 0.2)
    alone = triton_kernels.decode_attention(
        q[:1], k_cache, v_cache, table_tensor[:1, : len(tables[0])], torch.tensor(lengths[:1], device=DEVICE), 0.2
    )
    assert torch.equal(alone[0], together[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kvh", [(9, 3), (4, 2)])
@pytest.mark.parametrize("d,block", [(D, BLOCK), (80, BLOCK), (D, 80)])
def test_prefill_attention_over_cached_prefix_matches_reference(dtype, heads, kvh, d, block):
    # (chunk length, prefix already cached): a whole prompt, chunks after a prefix, a one-token chunk
    chunks = [(23, 0), (16, 16), (5, 37), (1, 48), (40, 3)]
    lengths = [m + p for m, p in chunks]
    k_cache, v_cache = make_cache(kvh, 32, dtype, seed=7, d=d, block=block)
    tables, table_tensor = tables_for(lengths, 32, seed=3, block=block)
    total = sum(m for m, _ in chunks)
    q = torch.randn(total, heads, d).to(dtype).to(DEVICE)
    starts = [sum(m for m, _ in chunks[:c]) for c in range(len(chunks))]
    scale = 1 / math.sqrt(d)
    got = triton_kernels.prefill_attention(
        q,
        k_cache,
        v_cache,
        table_tensor,
        torch.tensor(starts, device=DEVICE),
        torch.tensor([m for m, _ in chunks], device=DEVICE),
        torch.tensor(lengths, device=DEVICE),
        scale,
        max_q_len=max(m for m, _ in chunks),
    )
    for c, (m, prefix) in enumerate(chunks):
        n = m + prefix
        want = reference(
            q[starts[c] : starts[c] + m], context(k_cache, tables[c], n), context(v_cache, tables[c], n), prefix, scale
        )
        torch.testing.assert_close(got[starts[c] : starts[c] + m].double(), want, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize(
    "graphs,overlap,model,temperature",
    [
        (False, False, "llama", 0.0),
        (True, False, "llama", 0.0),
        (True, True, "llama", 0.0),
        (True, True, "llama", 0.8),
        ("failing", False, "llama", 0.8),
        (True, False, "llama_head_24", 0.0),
    ],
    ids=[
        "eager",
        "graph-buffers",
        "graph-buffers-overlap",
        "graph-buffers-overlap-sampled",
        "graph-capture-fails",
        "graph-buffers-head-dim-24",
    ],
)
def test_engine_tokens_equal_on_the_triton_path(tiny_models, monkeypatch, graphs, overlap, model, temperature):
    """Chunked prefills (some after a cached prefix), decodes and mixed steps through the Triton kernels, the
    layer ops' included, give the torch path's tokens. With `graphs`, decode-only steps go through the
    CUDA-graph runner's static buffers, padded to their bucket (three sequences in a bucket of four), run
    eagerly: a CPU cannot capture. With `overlap`, the decodes' input ids are the last step's draws, put
    into those buffers on the device. "failing": the runner tries to capture, which a CPU cannot do, and a
    capture that fails (out of memory, on a GPU) leaves the loop on eager steps, not failing them. With a
    `temperature` (seeded), the graph steps draw through the runner's draw buffers (`DecodeGraphs.draw`)."""
    calls = {"decode_attention": 0, "prefill_attention": 0, "run": 0, "draw": 0, "rms_norm": 0, "rotary": 0}

    def counted(owner, name: str):
        kernel = getattr(owner, name)

        def call(*args, **kwargs):
            calls[name] += 1
            return kernel(*args, **kwargs)

        monkeypatch.setattr(owner, name, call)

    for name in ("decode_attention", "prefill_attention"):
        counted(triton_kernels, name)
    for name in ("rms_norm", "rotary"):
        counted(layer_ops, name)
    counted(DecodeGraphs, "run")
    counted(DecodeGraphs, "draw")
    with Engine(
        EngineConfig(
            dtype="float32",
            model=tiny_models(model).path,
            kv_cache_tokens=1024,
            attention_kernel=False,
            max_batched_tokens=16,
            prefix_caching=False,
        )
    ) as eng:
        texts = (
            "The quick brown fox jumps over the lazy dog, twice.",
            "Paged attention keeps blocks apart.",
            "Graphs replay.",
        )
        prompts = [eng.tokenizer.encode(text) for text in texts]
        params = SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=temperature, seed=7)
        want = [eng.generate(p, params).token_ids for p in prompts]
        monkeypatch.setattr(triton_package, "serves", lambda x: True)  # the layer ops, as on CUDA
        for loop in eng.loops:
            loop.runner.attention = "triton"
            loop.overlap = overlap
            if graphs:
                loop.runner.graphs = DecodeGraphs(4, 8, torch.device("cpu"), capture=False)
                loop.runner.graphs.capture = graphs == "failing"
        streams = [eng.submit(p, params) for p in prompts]
        got = [[t for out in s for t in out.token_ids] for s in streams]
        assert eng.info().kv_blocks_free == eng.info().kv_blocks_total
        assert all(loop.runner.graphs.capture_failed == (graphs == "failing") for loop in eng.loops if graphs)
    assert got == want
    assert calls["decode_attention"] > 0 and calls["prefill_attention"] > 0
    assert calls["rms_norm"] > 0 and calls["rotary"] > 0  # SiLU is inside the CPU's packed gate_up matmul
    assert (calls["run"] > 0) == bool(graphs)
    assert (calls["draw"] > 0) == bool(graphs and temperature)


# The torch expressions of models/llama.py, which the Triton ops replace on CUDA
TORCH_LAYERS = {
    "norm": lambda x, w, eps: w * torch.nn.functional.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype),
    "rotary": lambda x, cos, sin: x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin,
    "silu_and_mul": lambda gate_up: torch.nn.functional.silu(gate_up.chunk(2, -1)[0]) * gate_up.chunk(2, -1)[1],
}
LAYER_DTYPES = [
    torch.float32,
    torch.float16,
    pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(
            DEVICE == "cpu", reason="Triton's interpreter casts float32 to bfloat16 by truncation, not to nearest"
        ),
    ),
]
# One rounding step of the dtype apart at most: 1/sqrt against torch's rsqrt, exp against its own
LAYER_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}


@pytest.mark.parametrize("dtype", LAYER_DTYPES)
@pytest.mark.parametrize("n", [64, 96])
def test_add_rms_norm_adds_in_place_and_normalizes_as_torch(dtype, n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(5, n, generator=g).to(dtype).to(DEVICE)
    delta = torch.randn(5, n, generator=g).to(dtype).to(DEVICE)
    w = (1 + torch.randn(n, generator=g) / 4).to(dtype).to(DEVICE)
    want_x = x + delta
    want = TORCH_LAYERS["norm"](want_x, w, 1e-6)
    got = layer_ops.rms_norm(x, w, 1e-6, delta)
    assert torch.equal(x, want_x)  # the residual add, in place and rounded as torch rounds it
    torch.testing.assert_close(got, want, rtol=LAYER_TOL[dtype], atol=LAYER_TOL[dtype])
    torch.testing.assert_close(layer_ops.rms_norm(x, w, 1e-6), want, rtol=LAYER_TOL[dtype], atol=LAYER_TOL[dtype])


@pytest.mark.parametrize("dtype", LAYER_DTYPES)
def test_per_head_norm_and_rotary_read_a_view_of_the_projection(dtype):
    """Qwen3's q/k norms and the rotary embedding read [T, heads, head_dim] views whose rows are strided."""
    tokens, heads, d = 4, 5, 24  # a head_dim whose half is not a power of two
    g = torch.Generator().manual_seed(1)
    packed = torch.randn(tokens, (heads + 2) * d, generator=g).to(dtype).to(DEVICE)
    view = packed[:, : heads * d].view(tokens, heads, d)
    w = (1 + torch.randn(d, generator=g) / 4).to(dtype).to(DEVICE)
    tol = dict(rtol=LAYER_TOL[dtype], atol=LAYER_TOL[dtype])
    torch.testing.assert_close(layer_ops.rms_norm(view, w, 1e-6), TORCH_LAYERS["norm"](view, w, 1e-6), **tol)
    angles = torch.randn(tokens, 1, d, generator=g)
    sign = torch.cat([-torch.ones(d // 2), torch.ones(d // 2)])
    cos, sin = angles.cos().to(dtype).to(DEVICE), (angles.sin() * sign).to(dtype).to(DEVICE)
    torch.testing.assert_close(layer_ops.rotary(view, cos, sin), TORCH_LAYERS["rotary"](view, cos, sin), **tol)


@pytest.mark.parametrize("dtype", LAYER_DTYPES)
@pytest.mark.parametrize("n", [48, 1500])  # one program a row, and several
def test_silu_and_mul_as_torch(dtype, n):
    gate_up = (torch.randn(3, 2 * n, generator=torch.Generator().manual_seed(n)) * 4).to(dtype).to(DEVICE)
    torch.testing.assert_close(
        layer_ops.silu_and_mul(gate_up),
        TORCH_LAYERS["silu_and_mul"](gate_up),
        rtol=LAYER_TOL[dtype],
        atol=LAYER_TOL[dtype],
    )
