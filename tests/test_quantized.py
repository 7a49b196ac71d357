"""GGUF weights kept quantized (`--weights quantized`): the C++ kernels against float64 over the dequantized
weights, tiny models written as GGUF files of each type against the float path over the same file, the
embedded SmolLM2 against transformers, and bad files refused. Where no C++ compiler is found the kernels
cannot be built and these tests are skipped (the engine then keeps float weights)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize

from lmgate.engine.config import EngineConfig
from lmgate.engine.engine import Engine
from lmgate.engine.errors import UnsupportedModel
from lmgate.engine.kernels import compiler_found, load_cpu_kernels
from lmgate.engine.loading.gguf_loader import GGUFFile
from lmgate.engine.loading.loader import load_checkpoint
from lmgate.engine.models.quantized_linear import GGUFBlocks, GGUFStack, QuantizedEmbedding, QuantizedLinear, cat_rows
from lmgate.engine.sampling.sampler import SamplingParams
from lmgate.engine.step.weights import keep_quantized, quantized_gguf
from tests.conftest import CountingFusedDecode
from tests.test_engine import NEW, hf_greedy, reference_prompts  # noqa: F401  (fixtures)
from tests.test_models import TinyModel, _write_gguf, prompt_ids, tokenizer_fields  # noqa: F401  (fixtures)

kernels = pytest.mark.skipif(
    not (compiler_found() and load_cpu_kernels()), reason="no C++ compiler: the quantized kernels cannot be built"
)
TYPES = [GGMLQuantizationType[name] for name in ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")]
QUANTIZABLE = {GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0}


def blocks_for(data: np.ndarray, qtype: GGMLQuantizationType, seed: int) -> np.ndarray:
    """`data` quantized by gguf where it can; for the K types (gguf only reads them) random blocks of the
    right size, their fp16 scales set small so that the weights stay near the float model's scale."""
    if qtype in QUANTIZABLE:
        return quantize(data, qtype)
    weights, nbytes = GGML_QUANT_SIZES[qtype]
    rows, cols = data.shape
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // weights, nbytes), dtype=np.uint8)
    scales = (np.abs(rng.standard_normal((rows, cols // weights, 2))) * 2e-3 + 1e-4).astype(np.float16).view(np.uint8)
    if qtype == GGMLQuantizationType.Q6_K:
        blocks[..., 208:210] = scales[..., :2]  # d, after ql, qh and the int8 scales
    else:
        blocks[..., 0:4] = scales  # d and dmin
    return blocks.reshape(rows, -1)


@kernels
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_blocks_expand_to_ggufs_own_values(qtype):
    data = np.random.default_rng(1).standard_normal((37, 768)).astype(np.float32)
    raw = blocks_for(data, qtype, seed=2)
    blocks = GGUFBlocks(torch.from_numpy(raw), int(qtype), 768)
    assert torch.equal(blocks.dequantize(), torch.from_numpy(dequantize(raw, qtype).reshape(37, 768)))


@kernels
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 10, 16, 64, 300])
def test_quantized_linear_matches_float64(qtype, m):
    """Three blocks per row, an odd number of rows, with a bias; few rows stream the blocks, many rows take
    expanded tiles."""
    n, k = 37, 3 * GGML_QUANT_SIZES[qtype][0]
    rng = np.random.default_rng(m)
    raw = blocks_for(rng.standard_normal((n, k)).astype(np.float32), qtype, seed=m)
    weight = torch.from_numpy(dequantize(raw, qtype).reshape(n, k)).double()
    bias = torch.randn(n)
    layer = QuantizedLinear(GGUFBlocks(torch.from_numpy(raw), int(qtype), k), bias)
    x = torch.randn(m, k)
    want = x.double() @ weight.T + bias.double()
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@kernels
@pytest.mark.parametrize("m", [3, 6, 7, 9, 64, 300])
@pytest.mark.parametrize("n", [1, 47, 97])
@pytest.mark.parametrize("blocks", [1, 48, 65])
def test_expanded_panels_cover_every_tile_edge(m, n, blocks):
    """gemm.cpp's row tiles over panels expanded from Q8_0 blocks: rows of x of every remainder by 4, rows of W not
    a multiple of 3 or 6 or of the 48-row panel, one panel per thread or several; K past 768 in two equal
    chunks (1536) or three, the last shorter (2080)."""
    qtype, k = GGMLQuantizationType.Q8_0, 32 * blocks
    rng = np.random.default_rng(m * 1000 + n + blocks)
    raw = blocks_for(rng.standard_normal((n, k)).astype(np.float32), qtype, seed=n)
    weight = torch.from_numpy(dequantize(raw, qtype).reshape(n, k)).double()
    x = torch.randn(m, k)
    got = torch.ops.lmgate.gguf_matmul(x, torch.from_numpy(raw), int(qtype))
    torch.testing.assert_close(got.double(), x.double() @ weight.T, rtol=1e-5, atol=1e-5 * k**0.5)


@kernels
@pytest.mark.parametrize("m", [1, 64])
def test_rows_of_different_types_stay_blocks(m):
    """Q4_K rows over Q6_K rows (Q4_K_M's Q, K and V): stacked as they are, not expanded, and the layer over
    the stack equals float64 over the stacked weights."""
    k, rng = 256, np.random.default_rng(m)
    parts = [(GGMLQuantizationType.Q4_K, 24), (GGMLQuantizationType.Q6_K, 8), (GGMLQuantizationType.Q4_K, 5)]
    blocks = [
        GGUFBlocks(torch.from_numpy(blocks_for(rng.standard_normal((n, k)).astype(np.float32), t, seed=n)), int(t), k)
        for t, n in parts
    ]
    stacked = cat_rows(blocks)
    assert isinstance(stacked, GGUFStack) and stacked.shape == (37, k)
    weight = torch.cat([torch.from_numpy(dequantize(b.blocks.numpy(), GGMLQuantizationType(b.qtype))) for b in blocks])
    torch.testing.assert_close(stacked.dequantize(), weight.reshape(37, k))
    x = torch.randn(m, k)
    want = x.double() @ weight.reshape(37, k).double().T
    torch.testing.assert_close(
        QuantizedLinear(stacked)(x).double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item()
    )


def random_tiny(name: str, config_class=transformers.LlamaConfig, kv_heads: int = 2) -> TinyModel:
    """A model with every matrix a multiple of 256 wide (the K types' block), random weights (norms near 1,
    biases included), the embedded tokenizer's vocabulary."""
    config = config_class(
        vocab_size=49152,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=64,
        rope_theta=50000.0,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for param_name, p in hf.named_parameters():
            p.copy_(
                torch.ones_like(p) + 0.3 * torch.randn_like(p) if "norm" in param_name else 0.3 * torch.randn_like(p)
            )
    return TinyModel(name, "", hf)


@pytest.fixture(scope="module")
def tiny_gguf_model():
    return random_tiny("llama")


@kernels
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_tiny_gguf_quantized_equals_float_path(qtype, tiny_gguf_model, tokenizer_fields, tmp_path, prompt_ids):
    """The same file served with its blocks kept and with them expanded: the same model, so the same greedy
    tokens and logprobs up to summation order; the quantized one holds a fraction of the bytes."""
    path = str(tmp_path / f"tiny-{qtype.name}.gguf")
    _write_gguf(
        tiny_gguf_model,
        path,
        tokenizer_fields,
        quantize=lambda name, data: (blocks_for(data, qtype, seed=len(name)), qtype) if data.ndim == 2 else None,
    )
    ckpt = load_checkpoint(path)
    assert all(
        isinstance(ckpt.weights[k], GGUFBlocks)
        for k in ckpt.weights
        if k.endswith(("proj.weight", "embed_tokens.weight"))
    )
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=3)
    runs = {}
    for mode in ("float", "quantized"):
        with Engine(
            EngineConfig(dtype="float32", model=path, kv_cache_tokens=2048, weights=mode), checkpoint=ckpt
        ) as eng:
            model = eng.loops[0].runner.model
            assert isinstance(model.lm_head, QuantizedLinear) == (mode == "quantized")
            assert isinstance(model.model.embed_tokens, QuantizedEmbedding) == (mode == "quantized")
            streams = [eng.submit(ids, params) for ids in (prompt_ids, prompt_ids[:5], prompt_ids * 3)]
            runs[mode] = ([o for s in streams for o in s], eng.weights_bytes)
    (float_out, float_bytes), (quant_out, quant_bytes) = runs["float"], runs["quantized"]
    assert [o.token_ids for o in quant_out] == [o.token_ids for o in float_out]
    for q, f in zip((lp for o in quant_out for lp in o.logprobs), (lp for o in float_out for lp in o.logprobs)):
        assert q.logprob == pytest.approx(f.logprob, abs=1e-3)
    assert quant_bytes < float_bytes / 3


Q4_K, Q6_K = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K


def q4_k_m(name: str) -> GGMLQuantizationType:
    """llama.cpp's Q4_K_M mix: Q6_K for V and the down projection (in some layers; here all), Q4_K elsewhere."""
    return Q6_K if name.endswith(("attn_v.weight", "ffn_down.weight")) else Q4_K


@kernels
@pytest.mark.parametrize(
    "arch, config_class, type_of, kv, int8, kv_heads",
    [
        ("llama", transformers.LlamaConfig, lambda name: GGMLQuantizationType.Q4_K, "float32", False, 2),
        (
            "qwen2",
            transformers.Qwen2Config,
            lambda name: GGMLQuantizationType.Q8_0,
            "float32",
            False,
            2,
        ),  # a bias on Q, K, V
        (
            "qwen3",
            transformers.Qwen3Config,
            lambda name: GGMLQuantizationType.Q4_1,
            "float32",
            False,
            2,
        ),  # RMSNorm on heads
        ("llama", transformers.LlamaConfig, q4_k_m, "float32", False, 2),  # Q, K, V one projection of two types
        ("llama", transformers.LlamaConfig, lambda name: GGMLQuantizationType.Q4_1, "float16", False, 2),
        ("qwen3", transformers.Qwen3Config, lambda name: GGMLQuantizationType.Q4_K, "bfloat16", False, 2),
        ("llama", transformers.LlamaConfig, q4_k_m, "float32", True, 2),  # Q6_K parts stay float32 beside int8 ones
        (
            "qwen2",
            transformers.Qwen2Config,
            lambda name: GGMLQuantizationType.Q8_0,
            "float32",
            True,
            2,
        ),  # signed integers
        ("qwen3", transformers.Qwen3Config, lambda name: GGMLQuantizationType.Q4_1, "float16", True, 2),
        # one KV head: odd row counts split each context over the threads (decode_layers.cpp's context_parts)
        ("llama", transformers.LlamaConfig, lambda name: GGMLQuantizationType.Q4_1, "float32", False, 1),
        ("qwen3", transformers.Qwen3Config, lambda name: GGMLQuantizationType.Q4_0, "float16", False, 1),
    ],
    ids=[
        "llama-Q4_K",
        "qwen2-Q8_0",
        "qwen3-Q4_1",
        "llama-Q4_K_M",
        "llama-Q4_1-f16-kv",
        "qwen3-Q4_K-bf16-kv",
        "llama-Q4_K_M-int8",
        "qwen2-Q8_0-int8",
        "qwen3-Q4_1-f16-kv-int8",
        "llama-Q4_1-mqa",
        "qwen3-Q4_0-f16-kv-mqa",
    ],
)
def test_fused_decode_equals_the_layer_path(
    arch, config_class, type_of, kv, int8, kv_heads, tokenizer_fields, tmp_path, prompt_ids
):
    """Decode steps of up to 8 rows run every layer in one C++ call (models/fused_decode.py). The same engine
    with it switched off runs the modules: the same tokens, logprobs up to the order of float32 sums, for
    batches shrinking from 8 rows to 1 at different context lengths, over a 32- or 16-bit KV cache (both paths
    round keys and values into it alike), with float32 or int8 activations (both paths round each matrix's
    input alike). With one KV head, a step of an odd row count splits each row's context into two parts (one
    per thread, merged by log-sum-exp), one of them empty while the context is a single block."""
    path = str(tmp_path / f"{arch}.gguf")
    _write_gguf(
        random_tiny(arch, config_class, kv_heads),
        path,
        tokenizer_fields,
        quantize=lambda name, data: (
            (blocks_for(data, type_of(name), seed=len(name)), type_of(name)) if data.ndim == 2 else None
        ),
    )
    prompts = [prompt_ids[: 3 + 2 * i] * (1 + i % 3) for i in range(8)]
    runs = []
    config = EngineConfig(
        dtype="float32", model=path, kv_cache_tokens=2048, weights="quantized", kv_cache_dtype=kv, int8_activations=int8
    )
    with Engine(config) as eng:
        model = eng.loops[0].runner.model
        counting = model.fused_decode = CountingFusedDecode(model.fused_decode)
        for fused in (counting, None):
            model.fused_decode = fused
            streams = [
                eng.submit(ids, SamplingParams(max_new_tokens=4 + 2 * i, ignore_eos=True, logprobs=2))
                for i, ids in enumerate(prompts)
            ]
            runs.append([o for s in streams for o in s])
    assert counting.calls >= 15  # 8 rows down to 1, over 18 tokens of the longest stream
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, QuantizedLinear)  # blocks kept, whatever the mix
    assert counting.inner.int8_activations == int8
    fused_out, layer_out = runs
    assert [o.token_ids for o in fused_out] == [o.token_ids for o in layer_out]
    for f, m in zip((lp for o in fused_out for lp in o.logprobs), (lp for o in layer_out for lp in o.logprobs)):
        assert f.logprob == pytest.approx(m.logprob, abs=1e-4)
        assert [t for t, _ in f.top] == [t for t, _ in m.top]


@kernels
def test_embedded_model_quantized_matches_transformers(checkpoint, hf_model, reference_prompts):
    """SmolLM2's Q4_1 and Q8_0 blocks kept as they are: under 110 MB, and transformers' greedy tokens."""
    with Engine(EngineConfig(dtype="float32", kv_cache_tokens=8192, weights="quantized"), checkpoint=checkpoint) as eng:
        assert eng.weights_bytes < 110e6
        streams = [eng.submit(ids, SamplingParams(max_new_tokens=NEW, ignore_eos=True)) for ids in reference_prompts]
        got = [[t for out in s for t in out.token_ids] for s in streams]
        eng.sleep(2)  # the weights dropped, then read again from the file: quantized again
        eng.wakeup()
        assert eng.weights_bytes < 110e6
        again = eng.generate(reference_prompts[0], SamplingParams(max_new_tokens=NEW, ignore_eos=True)).token_ids
        assert eng.info().kv_blocks_free == eng.info().kv_blocks_total
    assert got == [hf_greedy(hf_model, ids, NEW) for ids in reference_prompts]
    assert again == got[0]


def test_weights_stay_float_where_the_kernels_cannot_run():
    cpu = torch.device("cpu")
    assert not keep_quantized(EngineConfig(weights="float"), torch.float32, cpu)
    assert not keep_quantized(EngineConfig(weights="quantized"), torch.bfloat16, cpu)
    assert not keep_quantized(EngineConfig(), torch.float32, torch.device("cuda"))
    assert not keep_quantized(EngineConfig(weights="quantized", tensor_parallel=2), torch.float32, cpu)
    assert not keep_quantized(EngineConfig(weights="quantized"), torch.float32, torch.device("cuda"))
    for mode in ("auto", "quantized"):
        assert keep_quantized(EngineConfig(weights=mode), torch.float32, cpu) == (
            compiler_found() and load_cpu_kernels()
        )


def test_a_gguf_file_without_the_extension_keeps_its_blocks(gguf_path, tmp_path):
    """An Ollama blob (sha256-...) is a GGUF file all the same: --dtype auto and --weights treat it as one."""
    blob = tmp_path / "sha256-0123abcd"
    blob.symlink_to(gguf_path)
    cpu = torch.device("cpu")
    assert (
        quantized_gguf(EngineConfig(), str(blob), cpu)
        == quantized_gguf(EngineConfig(), gguf_path, cpu)
        == compiler_found()
    )
    assert not quantized_gguf(EngineConfig(), str(tmp_path), cpu)  # a Hugging Face directory


def test_our_gguf_reader_reads_what_ggufs_own_reads(gguf_path):
    """GGUFFile (plain array views of the mapped file) against gguf's reader: every field, every tensor."""
    ours, theirs = GGUFFile(gguf_path), GGUFReader(gguf_path)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        assert ours.fields[name].types == field.types
        assert ours.fields[name].contents() == field.contents(), name
    assert [(t.name, t.tensor_type, t.shape.tolist()) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.shape.tolist()) for t in theirs.tensors
    ]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors, strict=True))
    assert np.shares_memory(ours.tensors[0].data, ours.data)  # views of the file, nothing copied


def test_a_truncated_tensor_is_a_clear_load_error(tiny_gguf_model, tokenizer_fields, tmp_path):
    path = tmp_path / "truncated.gguf"
    _write_gguf(
        tiny_gguf_model,
        str(path),
        tokenizer_fields,
        quantize=lambda name, data: (
            (quantize(data, GGMLQuantizationType.Q4_0), GGMLQuantizationType.Q4_0) if data.ndim == 2 else None
        ),
    )
    path.write_bytes(path.read_bytes()[:-4096])
    with pytest.raises(UnsupportedModel, match="is not a readable GGUF file"):
        load_checkpoint(str(path))
