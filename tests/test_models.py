"""Tiny random models of every supported architecture, checked against transformers.

Each model is written as a Hugging Face directory (config.json, model.safetensors and the SmolLM2
tokenizer), then loaded by our loader. We compare
  * the model's logits over a paged KV cache (a whole prefill, a chunked prefill that attends to a
    cached prefix, and a batched decode step) with transformers' fp32 logits, and
  * the engine's greedy tokens with transformers' `generate(do_sample=False)`.
A GGUF file written from the same weights (llama.cpp tensor names and Q/K layout) must load to the
same tensors and generate the same tokens. Checkpoints that don't fit are refused.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
from dataclasses import dataclass, field

import gguf
import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch
import transformers

from lmgate.engine.models.attention import (
    AttentionMetadata,
    DecodeTables,
    GatheredDecode,
    PrefillChunk,
    PrefillTables,
    decode_mask,
    gather_rows,
)
from lmgate.engine.config import EngineConfig, ModelConfig
from lmgate.engine.engine import Engine
from lmgate.engine.errors import UnsupportedModel
from lmgate.engine.kernels import compiler_found, layer_kernels, load_cpu_kernels
from lmgate.engine.step.kv_cache import allocate_kv_cache
from lmgate.engine.loading.loader import load_checkpoint, read_config
from lmgate.engine.models import (
    build_model,
    can_load_in_place,
    count_weight_bytes,
    instantiate,
    load_in_place,
    load_weights,
)
from lmgate.engine.models.fused_decode import FusedDecode
from lmgate.engine.models.packed_linear import PackedLinear
from lmgate.engine.models.panel_linear import PanelLinear
from lmgate.engine.sampling.sampler import SamplingParams
from tests.conftest import CountingFusedDecode

VOCAB = 49152  # the SmolLM2 tokenizer's, so a real tokenizer can ship with every model
NEW_TOKENS = 24
CPU = torch.device("cpu")
# float32 sums in another order than transformers' (8 lanes along K in gemm.cpp, whose error against a float64
# matmul is a third of oneDNN's and half of F.linear's): logits of order 0.1 agree to about 1e-4.
ATOL, RTOL = 2e-4, 1e-4

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,
)

# name -> (transformers config class, overrides). Sizes, rope theta, eps and head_dim vary across them.
ARCHS = {
    "llama": (transformers.LlamaConfig, dict(num_hidden_layers=2, head_dim=32, rope_theta=50000.0, rms_norm_eps=1e-5)),
    "llama_tied": (transformers.LlamaConfig, dict(num_hidden_layers=3, tie_word_embeddings=True, rope_theta=50000.0)),
    "mistral": (transformers.MistralConfig, dict(num_hidden_layers=2, rope_theta=1e6, rms_norm_eps=1e-5)),
    "qwen2": (transformers.Qwen2Config, dict(num_hidden_layers=2, rope_theta=1e6)),
    "qwen3": (transformers.Qwen3Config, dict(num_hidden_layers=2, head_dim=32, rope_theta=1e6)),
    # Llama 3.1's scaled RoPE, its original context shorter than a prompt here: tests of its own
    "llama3": (
        transformers.LlamaConfig,
        dict(
            num_hidden_layers=2,
            rope_theta=500000.0,
            rope_parameters=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
                rope_theta=500000.0,
            ),
        ),
    ),
    # Q/K/V biases in a Llama GGUF (early Qwen conversions): only their loading is tested, as lmgate's Llama
    # has no o_proj bias
    "llama_bias": (
        transformers.LlamaConfig,
        dict(num_hidden_layers=2, head_dim=32, rope_theta=50000.0, attention_bias=True),
    ),
    # A head_dim that is not a power of two (h2o-danube's 80, open_llama_3b's 100): the Triton path's own test
    "llama_head_24": (transformers.LlamaConfig, dict(num_hidden_layers=2, head_dim=24, rope_theta=50000.0)),
}
ARCH_NAMES = [name for name in ARCHS if name not in ("llama3", "llama_bias", "llama_head_24")]

PROMPT = "The quick brown fox jumps over the lazy dog, then naps under 3 old oak trees."
PROMPT_B = "Paged attention keeps blocks apart."


@dataclass
class TinyModel:
    name: str
    path: str
    hf: transformers.PreTrainedModel
    _greedy: dict = field(default_factory=dict)
    _ours: tuple | None = None

    def ours(self):
        """(checkpoint, our model) from the directory, built once: the tests only read the model."""
        if self._ours is None:
            self._ours = _ours(self.path)
        return self._ours

    def hf_logits(self, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.hf(torch.tensor([ids])).logits[0].float()

    def hf_greedy(self, ids: list[int]) -> list[int]:
        key = tuple(ids)
        if key not in self._greedy:
            with torch.no_grad():
                out = self.hf.generate(
                    torch.tensor([ids]),
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    do_sample=False,
                    max_new_tokens=NEW_TOKENS,
                    eos_token_id=None,
                    pad_token_id=0,
                )
            tokens = out[0, len(ids) :].tolist()
            assert len(tokens) == NEW_TOKENS  # transformers must not stop early
            self._greedy[key] = tokens
        return self._greedy[key]


# ----------------------------------------------------------------------------------------- fixtures


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights far from init defaults: non-trivial norms and biases, peaked logits (greedy is meaningful)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def make_model(name: str, root, tokenizer_dir: str) -> TinyModel:
    cls, overrides = ARCHS[name]
    cfg = cls(**_COMMON, **overrides)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    _randomize(hf, seed=list(ARCHS).index(name) + 1)
    if cfg.tie_word_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    hf.eval()
    path = root / name
    hf.save_pretrained(str(path), safe_serialization=True)
    for f in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, f), path / f)
    return TinyModel(name, str(path), hf)


@pytest.fixture(params=ARCH_NAMES)
def tiny(request, tiny_models) -> TinyModel:
    return tiny_models(request.param)


@pytest.fixture(scope="session")
def prompt_ids(tokenizer) -> list[int]:
    ids = tokenizer.encode(PROMPT)
    assert 15 <= len(ids) <= 25
    return ids


@pytest.fixture(scope="session")
def prompt_b_ids(tokenizer) -> list[int]:
    ids = tokenizer.encode(PROMPT_B)
    assert 5 <= len(ids) <= 12
    return ids


def _ours(path: str):
    ckpt = load_checkpoint(path)
    return ckpt, build_model(ckpt.config, ckpt.weights, torch.float32, CPU)


def _unpacked(path: str):
    """A model as `build_model` has it before packing its linear layers: the parameters `load_weights` replaces."""
    ckpt = load_checkpoint(path)
    return ckpt, instantiate(ckpt.config, ckpt.weights)


def _ids(ids: list[int]) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long)


def _slots(block_table: list[int], positions, block_size: int) -> list[int]:
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


def _meta(kv, slots: list[int], prefills=(), decodes=None, kernel: bool = False) -> AttentionMetadata:
    """Attention metadata as the model runner builds it.

    prefills: (start, end, context_len, block_table) per chunk; decodes: (block_tables, lengths), the
    tables padded with block 0. The C++ kernels read both in place (tables); the torch path gathers them.
    """
    kvh, num_blocks, block_size = kv[0][0].shape[:3]
    chunks = [
        PrefillChunk(start, end, ctx, gather_rows(torch.tensor(table[: -(-ctx // block_size)]), kvh, num_blocks))
        for start, end, ctx, table in prefills
    ]
    if kernel and prefills:
        width = max(len(table) for *_, table in prefills)
        first = prefills[0][0]
        chunks = PrefillTables(
            torch.tensor([table + [0] * (width - len(table)) for *_, table in prefills]),
            _ids([start - first for start, *_ in prefills]),
            _ids([end - start for start, end, *_ in prefills]),
            _ids([ctx for _, _, ctx, _ in prefills]),
            max(end - start for start, end, *_ in prefills),
        )
    meta = AttentionMetadata(slot_mapping=_ids(slots), num_decode=0, decode=None, prefills=chunks)
    if decodes is not None:
        block_tables, lengths = decodes
        width = max(len(t) for t in block_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.long)
        meta.num_decode = len(block_tables)
        if kernel:
            meta.decode = DecodeTables(tables, torch.tensor(lengths))
        else:
            mask = decode_mask(torch.tensor(lengths), width * block_size, kv[0][0])
            meta.decode = GatheredDecode(gather_rows(tables, kvh, num_blocks), mask)
    return meta


def _decode_paths() -> list:
    """The torch path always; the C++ kernels where they could be built (tests/test_attention_kernel.py says
    why it could not)."""
    kernel = pytest.param(True, id="kernel", marks=pytest.mark.skipif(not compiler_found(), reason="no C++ compiler"))
    return [pytest.param(False, id="torch"), kernel]


# ------------------------------------------------------------------------------------------- config
def test_config_from_hf_reads_tiny_model(tiny):
    cfg = read_config(tiny.path)
    hf = tiny.hf.config
    assert cfg.architecture == hf.architectures[0]
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (
        hf.hidden_size,
        hf.intermediate_size,
        hf.num_hidden_layers,
    )
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        hf.num_attention_heads,
        hf.num_key_value_heads,
        tiny.hf.model.layers[0].self_attn.head_dim,
    )
    assert cfg.rope_theta == ARCHS[tiny.name][1]["rope_theta"]
    assert cfg.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert cfg.tie_word_embeddings == bool(hf.tie_word_embeddings)
    assert cfg.attention_bias == (tiny.name == "qwen2")
    assert cfg.qk_norm == (tiny.name == "qwen3")


# ------------------------------------------------------------------------------------------- logits
def test_model_prefill_logits_match_transformers(tiny, prompt_ids):
    ckpt, model = tiny.ours()
    n, bs = len(prompt_ids), 16
    blocks = -(-n // bs)
    kv = allocate_kv_cache(ckpt.config, blocks, bs, torch.float32, CPU)
    meta = _meta(kv, list(range(n)), prefills=[(0, n, n, list(range(blocks)))])
    with torch.inference_mode():
        ours = model.compute_logits(model(_ids(prompt_ids), torch.arange(n), kv, meta))
    ref = tiny.hf_logits(prompt_ids)
    assert ours.shape == ref.shape == (n, VOCAB)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)
    # The logits are peaked enough that greedy choices are not decided by rounding noise.
    assert ref.std() > 3


@pytest.mark.parametrize("kernel", _decode_paths())
def test_model_chunked_prefill_matches_transformers(tiny, prompt_ids, kernel):
    """A second prefill chunk attends to the prefix already in the cache (masked SDPA, or the C++ kernel)."""
    assert not kernel or load_cpu_kernels()
    ckpt, model = tiny.ours()
    n, split, bs = len(prompt_ids), 11, 4
    table = [5, 2, 7, 0, 3, 1]  # non-contiguous blocks
    assert len(table) * bs >= n
    kv = allocate_kv_cache(ckpt.config, 8, bs, torch.float32, CPU)
    outs = []
    with torch.inference_mode():
        for start, end in ((0, split), (split, n)):
            meta = _meta(
                kv, _slots(table, range(start, end), bs), prefills=[(0, end - start, end, table)], kernel=kernel
            )
            hidden = model(_ids(prompt_ids[start:end]), torch.arange(start, end), kv, meta)
            outs.append(model.compute_logits(hidden))
    torch.testing.assert_close(torch.cat(outs), tiny.hf_logits(prompt_ids), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("kernel", _decode_paths())
def test_model_batched_decode_matches_transformers(tiny, prompt_ids, prompt_b_ids, kernel):
    """Two prompts prefilled in one step, then one decode token each in one step (padded block tables)."""
    assert not kernel or load_cpu_kernels()
    ckpt, model = tiny.ours()
    bs = 8
    a, b = list(prompt_ids), list(prompt_b_ids)
    table_a, table_b = [0, 1, 2, 3], [6, 4]  # b's table is shorter: its decode row is padded
    assert len(table_a) * bs > len(a) and len(table_b) * bs > len(b)
    kv = allocate_kv_cache(ckpt.config, 8, bs, torch.float32, CPU)
    with torch.inference_mode():
        meta = _meta(
            kv,
            _slots(table_a, range(len(a)), bs) + _slots(table_b, range(len(b)), bs),
            prefills=[(0, len(a), len(a), table_a), (len(a), len(a) + len(b), len(b), table_b)],
            kernel=kernel,
        )
        prefill = model.compute_logits(model(_ids(a + b), _ids(list(range(len(a))) + list(range(len(b)))), kv, meta))
        next_a, next_b = int(prefill[len(a) - 1].argmax()), int(prefill[-1].argmax())
        meta = _meta(
            kv,
            _slots(table_a, [len(a)], bs) + _slots(table_b, [len(b)], bs),
            decodes=([table_a, table_b], [len(a) + 1, len(b) + 1]),
            kernel=kernel,
        )
        decode = model.compute_logits(model(_ids([next_a, next_b]), _ids([len(a), len(b)]), kv, meta))
    ref_a, ref_b = tiny.hf_logits(a + [next_a]), tiny.hf_logits(b + [next_b])
    torch.testing.assert_close(prefill[: len(a)], ref_a[:-1], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(prefill[len(a) :], ref_b[:-1], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(decode[0], ref_a[-1], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(decode[1], ref_b[-1], atol=ATOL, rtol=RTOL)


# ------------------------------------------------------------------------------------------- engine
@pytest.mark.parametrize("kernel", _decode_paths())
def test_engine_greedy_tokens_match_transformers(tiny, prompt_ids, kernel):
    expected = tiny.hf_greedy(prompt_ids)
    assert len(set(expected)) >= NEW_TOKENS // 2, f"degenerate reference {expected}"
    with Engine(
        EngineConfig(dtype="float32", model=tiny.path, kv_cache_tokens=4096, attention_kernel=kernel)
    ) as engine:
        assert engine.loops[0].runner.attention == ("cpu" if kernel else "torch")
        out = engine.generate(prompt_ids, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert out.error is None
    assert out.token_ids == expected


@pytest.mark.parametrize("dp_backend", ["thread", "process"])
def test_ids_past_the_tokenizer_are_never_generated(tmp_path, hf_tokenizer_dir, dp_backend):
    """An embedding padded past its tokenizer (Qwen2.5: 151,936 rows for 151,665 tokens). Here a padding row's
    logit is the largest at every step (the final norm keeps one dimension, which only two padding rows of the
    head read, with opposite signs): still only the tokenizer's ids come out, greedy, sampled, or offered as
    logprob alternatives."""
    config = transformers.LlamaConfig(**{**_COMMON, "vocab_size": VOCAB + 64}, num_hidden_layers=1)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        hf.model.norm.weight.zero_()
        hf.model.norm.weight[0] = 1.0
        hf.lm_head.weight.zero_()
        hf.lm_head.weight[VOCAB, 0], hf.lm_head.weight[VOCAB + 1, 0] = 100.0, -100.0
    hf.save_pretrained(str(tmp_path))
    for f in os.listdir(hf_tokenizer_dir):
        shutil.copy(os.path.join(hf_tokenizer_dir, f), tmp_path / f)
    with Engine(
        EngineConfig(dtype="float32", model=str(tmp_path), kv_cache_tokens=1024, dp_backend=dp_backend)
    ) as engine:
        assert engine.vocab_size == VOCAB
        prompt = engine.tokenizer.encode("Hello")
        for params in (
            SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=3),
            SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=1.0, seed=1),
        ):
            out = engine.generate(prompt, params)
            assert out.error is None and len(out.token_ids) == 6
            assert all(t < VOCAB for t in out.token_ids), out.token_ids
            assert all(t < VOCAB for lp in out.logprobs for t, _ in lp.top)


# --------------------------------------------------------------------------------------------- GGUF
_GGUF_ARCH = {
    "llama": "llama",
    "llama_tied": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "llama3": "llama",
    "llama_bias": "llama",
}
_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotary halves interleaved per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="session")
def tokenizer_fields(gguf_path) -> list[tuple[str, object, gguf.GGUFValueType, gguf.GGUFValueType | None]]:
    """The embedded GGUF's tokenizer.* metadata, read once (GGUFReader takes seconds on a 49k vocabulary)."""
    reader = gguf.GGUFReader(gguf_path)
    fields = []
    for key, f in reader.fields.items():
        if key.startswith("tokenizer."):
            vtype = f.types[0]
            fields.append((key, f.contents(), vtype, f.types[1] if vtype == gguf.GGUFValueType.ARRAY else None))
    return fields


def _write_gguf(tiny: TinyModel, path: str, tokenizer_fields, quantize=None, drop: tuple[str, ...] = ()) -> None:
    """`quantize(gguf_name, float32 array)`: (bytes, quantization type) for a tensor stored quantized, or
    None to store it as float32. Tensors whose name ends with one of `drop` are left out."""
    cfg = tiny.hf.config
    arch = _GGUF_ARCH[tiny.name]
    head_dim = tiny.hf.model.layers[0].self_attn.head_dim
    w = gguf.GGUFWriter(path, arch)
    w.add_uint32(f"{arch}.vocab_size", cfg.vocab_size)
    w.add_uint32(f"{arch}.context_length", cfg.max_position_embeddings)
    w.add_uint32(f"{arch}.embedding_length", cfg.hidden_size)
    w.add_uint32(f"{arch}.block_count", cfg.num_hidden_layers)
    w.add_uint32(f"{arch}.feed_forward_length", cfg.intermediate_size)
    w.add_uint32(f"{arch}.attention.head_count", cfg.num_attention_heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", cfg.num_key_value_heads)
    w.add_uint32(f"{arch}.attention.key_length", head_dim)
    w.add_uint32(f"{arch}.attention.value_length", head_dim)
    w.add_uint32(f"{arch}.rope.dimension_count", head_dim)
    w.add_float32(f"{arch}.rope.freq_base", ARCHS[tiny.name][1]["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    for key, value, vtype, sub_type in tokenizer_fields:
        w.add_key_value(key, value, vtype, sub_type)
    if cfg.rope_parameters.get("rope_type") == "llama3":  # as llama.cpp converts it: a divisor per frequency
        w.add_tensor("rope_freqs.weight", _llama3_freq_divisors(cfg))
    for name, t in tiny.hf.state_dict().items():
        if name.endswith(drop):
            continue
        data = t.detach().float().numpy().copy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            gname = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            gname = f"blk.{layer}.{_GGUF_LAYER[rest]}"
            if arch == "llama" and rest in ("self_attn.q_proj.weight", "self_attn.q_proj.bias"):
                data = _llama_cpp_permute(data, cfg.num_attention_heads)
            elif arch == "llama" and rest in ("self_attn.k_proj.weight", "self_attn.k_proj.bias"):
                data = _llama_cpp_permute(data, cfg.num_key_value_heads)
        stored = quantize(gname, data) if quantize else None
        if stored is None:
            w.add_tensor(gname, data)
        else:
            w.add_tensor(gname, stored[0], raw_dtype=stored[1])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _llama3_freq_divisors(cfg) -> np.ndarray:
    """transformers' plain inverse frequencies over its llama3 ones."""
    scaled, _ = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"](cfg, CPU)
    head_dim = cfg.head_dim
    plain = 1.0 / (
        cfg.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    )
    return (plain / scaled).numpy()


def test_llama3_scaled_rope_matches_transformers(tiny_models, tmp_path, tokenizer_fields, prompt_ids):
    """Llama 3.1 and 3.2: RoPE scaled per frequency, read from config.json (rope_type llama3) and from a GGUF
    (its rope_freqs tensor): greedy tokens past the original context are transformers'."""
    tiny = tiny_models("llama3")
    ckpt = tiny.ours()[0]
    divisors = _llama3_freq_divisors(tiny.hf.config)
    assert ckpt.config.rope_freq_factors == pytest.approx(divisors.tolist(), rel=1e-6)
    assert min(divisors) == 1.0 and max(divisors) == 8.0  # kept, slowed, and blended between
    assert len(prompt_ids) + NEW_TOKENS > 32
    path = str(tmp_path / "llama3.gguf")
    _write_gguf(tiny, path, tokenizer_fields)
    for model in (tiny.path, path):
        with Engine(EngineConfig(dtype="float32", model=model, kv_cache_tokens=1024)) as engine:
            out = engine.generate(prompt_ids, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
        assert out.token_ids == tiny.hf_greedy(prompt_ids), model


def test_gguf_llama_q_and_k_biases_come_back_in_hugging_face_order(tiny_models, tmp_path, tokenizer_fields):
    """llama.cpp's converter interleaves the rotary halves of Q's and K's biases as it does their rows."""
    tiny = tiny_models("llama_bias")
    path = str(tmp_path / "llama_bias.gguf")
    _write_gguf(tiny, path, tokenizer_fields, drop=("o_proj.bias",))
    weights, theirs = load_checkpoint(path).weights, tiny.hf.state_dict()
    for layer in range(2):
        for proj in ("q_proj", "k_proj", "v_proj"):
            name = f"model.layers.{layer}.self_attn.{proj}.bias"
            assert torch.equal(weights[name], theirs[name].float()), name


@pytest.mark.parametrize("name", ["llama", "llama_tied", "qwen2", "qwen3"])
def test_gguf_roundtrip_matches_hf_directory(name, tiny_models, tmp_path, tokenizer_fields, prompt_ids):
    tiny = tiny_models(name)
    path = str(tmp_path / f"{name}.gguf")
    _write_gguf(tiny, path, tokenizer_fields)

    from_gguf, from_hf = load_checkpoint(path), tiny.ours()[0]
    # GGUF stores eps as float32: equal up to that rounding, everything else exactly.
    assert from_gguf.config.rms_norm_eps == pytest.approx(from_hf.config.rms_norm_eps, rel=1e-6)
    assert dataclasses.replace(from_gguf.config, rms_norm_eps=from_hf.config.rms_norm_eps) == from_hf.config
    tied = from_hf.config.tie_word_embeddings
    hf_weights = {k: v for k, v in from_hf.weights.items() if not (tied and k == "lm_head.weight")}
    assert from_gguf.weights.keys() == hf_weights.keys()
    for k, v in hf_weights.items():
        assert torch.equal(from_gguf.weights[k], v), k  # F32 round-trip, Q/K un-permuted exactly
    assert from_gguf.tokenizer.encode(PROMPT) == prompt_ids

    # The checkpoint already read (reading a GGUF again costs seconds): the engine over the GGUF's weights.
    with Engine(EngineConfig(dtype="float32", model=path, kv_cache_tokens=4096), checkpoint=from_gguf) as engine:
        out = engine.generate(prompt_ids, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert out.token_ids == tiny.hf_greedy(prompt_ids)


def _metadata_gguf(path: str, arch: str, fields: dict) -> str:
    """A GGUF of `arch` with these metadata fields (ints as uint32, floats as float32, strings) and one
    tensor: enough for the loader to read its config, and refuse it."""
    w = gguf.GGUFWriter(path, arch)
    for key, value in fields.items():
        {int: w.add_uint32, float: w.add_float32, str: w.add_string}[type(value)](key, value)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_unsupported_architecture_refused(tmp_path):
    path = _metadata_gguf(str(tmp_path / "gpt2.gguf"), "gpt2", {"gpt2.block_count": 1})
    with pytest.raises(UnsupportedModel, match="gpt2"):
        load_checkpoint(path)


@pytest.mark.parametrize("how", ["linear", "yarn"])
def test_gguf_rope_scaling_refused(tmp_path, how):
    """Scaled RoPE other than Llama 3's (a rope_freqs tensor) is refused, as in a config.json, never run as
    plain RoPE."""
    fields = {
        "llama.block_count": 1,
        "llama.embedding_length": 8,
        "llama.feed_forward_length": 16,
        "llama.context_length": 131072,
        "llama.attention.head_count": 2,
        "llama.rope.scaling.type": how,
        "llama.rope.scaling.factor": 8.0,
    }
    path = _metadata_gguf(str(tmp_path / "scaled.gguf"), "llama", fields)
    with pytest.raises(UnsupportedModel, match="RoPE scaling"):
        load_checkpoint(path)


# -------------------------------------------------------------------------------------------- refusal
def _break(weights: dict[str, torch.Tensor], how: str) -> dict[str, torch.Tensor]:
    weights = dict(weights)
    if how == "q_proj_rows":
        k = "model.layers.0.self_attn.q_proj.weight"
        weights[k] = torch.cat([weights[k], weights[k][:1]])
    elif how == "down_proj_transposed":
        k = "model.layers.1.mlp.down_proj.weight"
        weights[k] = weights[k].t().contiguous()
    elif how == "embed_vocab":
        k = "model.embed_tokens.weight"
        weights[k] = weights[k][:-1]
    elif how == "norm_width":
        k = "model.norm.weight"
        weights[k] = torch.ones(weights[k].shape[0] * 2)
    elif how == "missing_layer":
        weights = {k: v for k, v in weights.items() if ".layers.1." not in k}
    elif how == "unexpected_tensor":
        weights["model.layers.0.self_attn.gate.weight"] = torch.ones(8)
    return weights


# The error lists each kind of misfit; these patterns match only a non-empty list of that kind.
_WRONG, _MISSING, _UNEXPECTED = r"wrong shape \[\(", r"missing \['", r"unexpected \['"
_MISFITS = {
    "q_proj_rows": _WRONG,
    "down_proj_transposed": _WRONG,
    "embed_vocab": _WRONG,
    "norm_width": _WRONG,
    "missing_layer": _MISSING,  # a checkpoint with fewer layers than its config says
    "unexpected_tensor": _UNEXPECTED,
}


def test_a_model_is_built_in_memory_of_its_own(tiny_models, tmp_path):
    """The rotary buffers older transformers saved (`rotary_emb.inv_freq`) are ignored, as transformers does;
    and a model built on the CPU in the file's own dtype holds the file's weights as they were read: the file
    written over in place afterwards (a `cp` of the next checkpoint onto it) changes nothing in it."""
    source = tiny_models("llama")
    path = tmp_path / "model"
    shutil.copytree(source.path, path)
    weights = safetensors.torch.load_file(str(path / "model.safetensors"))
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    safetensors.torch.save_file(weights, str(path / "model.safetensors"))
    ckpt = load_checkpoint(str(path))
    assert not any("rotary_emb" in name for name in ckpt.weights)
    assert {w.dtype for w in ckpt.weights.values()} == {torch.float32}
    model = build_model(ckpt.config, ckpt.weights, torch.float32, CPU)
    built = {k: v.clone() for k, v in model.state_dict().items()}
    size = (path / "model.safetensors").stat().st_size
    with open(path / "model.safetensors", "r+b") as f:
        f.seek(size // 2)
        f.write(bytes(size - size // 2))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in built.items())


@pytest.mark.parametrize("how", list(_MISFITS))
def test_load_weights_refuses_misfit_and_keeps_parameters(how, tiny):
    ckpt, model = _unpacked(tiny.path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids_before = {k: id(p) for k, p in model.named_parameters()}
    # Every tensor shifted, so that a partial load before the refusal would show.
    bad = _break({k: v + 1 for k, v in ckpt.weights.items()}, how)
    with pytest.raises(UnsupportedModel, match=_MISFITS[how]):
        load_weights(model, bad)
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    assert {k: id(p) for k, p in model.named_parameters()} == ids_before
    with pytest.raises(UnsupportedModel, match=_MISFITS[how]):
        build_model(ckpt.config, bad, torch.float32, CPU)


def _prefill_logits(model, cfg, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    n, bs = len(ids), 16
    kv = allocate_kv_cache(cfg, -(-n // bs), bs, dtype, CPU)
    meta = _meta(kv, list(range(n)), prefills=[(0, n, n, list(range(-(-n // bs))))])
    with torch.inference_mode():
        return model.compute_logits(model(_ids(ids), torch.arange(n), kv, meta))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_written_in_place_answer_as_a_model_built_from_them(tiny, prompt_ids, dtype):
    """Whatever layers this machine builds (column panels, oneDNN's packing, plain), new values written into a
    served model give the very logits of a model built from them, in the same tensors; weights of another
    shape are refused before anything is written."""
    ckpt = load_checkpoint(tiny.path)
    model = build_model(ckpt.config, ckpt.weights, dtype, CPU)
    assert can_load_in_place(model)
    g = torch.Generator().manual_seed(7)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in ckpt.weights.items()}
    tensors = {k: v.data_ptr() for k, v in model.state_dict(keep_vars=True).items()}
    load_in_place(model, new)
    assert {k: v.data_ptr() for k, v in model.state_dict(keep_vars=True).items()} == tensors
    built = build_model(ckpt.config, new, dtype, CPU)
    assert torch.equal(
        _prefill_logits(model, ckpt.config, prompt_ids, dtype), _prefill_logits(built, ckpt.config, prompt_ids, dtype)
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for how in ("q_proj_rows", "missing_layer", "unexpected_tensor"):
        with pytest.raises(UnsupportedModel, match="does not fit"):
            load_in_place(model, _break({k: v + 1 for k, v in new.items()}, how))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_a_quantized_model_is_not_written_in_place(gguf_path):
    if not load_cpu_kernels():
        pytest.skip("no C++ compiler: GGUF blocks are expanded to float")
    ckpt = load_checkpoint(gguf_path)
    assert not can_load_in_place(build_model(ckpt.config, ckpt.weights, torch.float32, CPU, quantized=True))


def test_load_weights_refuses_other_architecture_weights(tiny_models):
    """Qwen2 weights (with q/k/v biases) don't fit a Llama model, and vice versa."""
    _, llama = _unpacked(tiny_models("mistral").path)
    qwen2 = load_checkpoint(tiny_models("qwen2").path).weights
    with pytest.raises(UnsupportedModel, match=_UNEXPECTED):
        load_weights(llama, qwen2)
    _, qwen = _unpacked(tiny_models("qwen2").path)
    with pytest.raises(UnsupportedModel, match=_MISSING):
        load_weights(qwen, load_checkpoint(tiny_models("mistral").path).weights)


@pytest.mark.parametrize("arch", ["GPT2LMHeadModel", "MixtralForCausalLM", "Gemma2ForCausalLM"])
def test_config_unsupported_architecture_refused(arch, tmp_path, tiny_models):
    src = tiny_models("llama").path
    shutil.copytree(src, tmp_path / "m")
    cfg_file = tmp_path / "m" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["architectures"] = [arch]
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModel, match=arch):
        ModelConfig.from_hf(cfg)
    with pytest.raises(UnsupportedModel, match=arch):
        read_config(str(tmp_path / "m"))
    with pytest.raises(UnsupportedModel, match=arch):
        load_checkpoint(str(tmp_path / "m"))


def test_a_directory_reads_the_shards_its_index_names(tiny_models, tmp_path):
    """A repository may hold other safetensors files beside the model's shards (Mistral's
    consolidated.safetensors, an adapter): with an index, only the shards it names are read."""
    model = shutil.copytree(tiny_models("llama").path, tmp_path / "m")
    shards = sorted(p.name for p in model.glob("*.safetensors"))
    names = safetensors.safe_open(str(model / shards[0]), "pt").keys()
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: shards[0] for n in names}}))
    safetensors.torch.save_file({"tok_embeddings.weight": torch.zeros(2, 2)}, str(model / "consolidated.safetensors"))
    assert "tok_embeddings.weight" not in load_checkpoint(str(model)).weights


@pytest.mark.parametrize("damage", ["no tokenizer.json", "config a list", "truncated weights"])
def test_a_damaged_directory_is_refused_in_one_line(tiny_models, tmp_path, damage):
    """What a partial download or a repository without a fast tokenizer looks like: UnsupportedModel (the
    server's one-line start-up error, exit status 2), never a parser's traceback."""
    model = shutil.copytree(tiny_models("llama").path, tmp_path / "m")
    if damage == "no tokenizer.json":
        (model / "tokenizer.json").unlink()
    elif damage == "config a list":
        (model / "config.json").write_text("[]")
    else:
        shard = next(model.glob("*.safetensors"))
        shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(UnsupportedModel, match=str(model)):
        load_checkpoint(str(model))


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "yarn"])
def test_config_rope_scaling_refused(key, rope_type, tiny_models):
    """Scaled RoPE other than llama3 is not implemented: refused whether written the transformers 4 way
    (rope_scaling) or the transformers 5 way (rope_type inside rope_parameters), never run as plain RoPE."""
    cfg = json.loads(open(os.path.join(tiny_models("llama").path, "config.json")).read())
    cfg[key] = {"rope_type": rope_type, "factor": 2.0, "rope_theta": 50000.0}
    with pytest.raises(UnsupportedModel, match=key):
        ModelConfig.from_hf(cfg)


def test_config_rope_scaling_from_transformers_config_refused(tmp_path):
    transformers.LlamaConfig(
        **_COMMON,
        num_hidden_layers=1,
        architectures=["LlamaForCausalLM"],
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
    ).save_pretrained(str(tmp_path))
    with pytest.raises(UnsupportedModel, match="linear"):
        read_config(str(tmp_path))


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_config_default_rope_accepted(key, tiny_models):
    cfg = json.loads(open(os.path.join(tiny_models("llama").path, "config.json")).read())
    cfg.pop("rope_parameters", None)
    cfg[key] = {"rope_type": "default", "rope_theta": 1234.0}
    assert ModelConfig.from_hf(cfg).rope_theta == (1234.0 if key == "rope_parameters" else 10000.0)


def test_build_model_swaps_every_linear_layer_on_cpu(tiny):
    """float32 layers run on gemm.cpp where the kernels build, and then decode steps in one fused call; else
    on oneDNN's packed matmul."""
    _, model = _ours(tiny.path)
    kind = PanelLinear if load_cpu_kernels() else PackedLinear
    if kind is PanelLinear or torch.backends.mkldnn.is_available():
        assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
        assert sum(isinstance(m, kind) for m in model.modules()) == 4 * model.config.num_layers + 1
        assert all(
            m.gated == (name.endswith("gate_up_proj"))
            for name, m in model.named_modules()
            if isinstance(m, PanelLinear)
        )
        # weights counted once each: the parameters left (norms, the embedding) and every layer's packed copy
        layers = [m for m in model.modules() if isinstance(m, kind)]
        assert count_weight_bytes(model) == (
            sum(p.nbytes for p in model.parameters()) + sum(m.packed_bytes for m in layers)
        )
        assert all(m.packed_bytes >= m.in_features * m.out_features * 4 for m in layers)
    assert isinstance(model.fused_decode, FusedDecode) == (kind is PanelLinear)


@pytest.mark.skipif(not compiler_found(), reason="no C++ compiler: gemm.cpp and decode_layers.cpp cannot be built")
@pytest.mark.parametrize("kv", ["float32", "float16"])
def test_float32_fused_decode_equals_the_layer_path(tiny, prompt_ids, kv):
    """float32 layers in column panels run decode steps of any size as one C++ call (models/fused_decode.py).
    The same engine with it switched off runs the modules: the same tokens, logprobs up to the order of float32
    sums, for 12 streams (more rows than a quantized model's fused steps take) shrinking to 1, at different
    context lengths."""
    prompts = [prompt_ids[: 3 + i] * (1 + i % 3) for i in range(12)]
    runs = []
    with Engine(EngineConfig(dtype="float32", model=tiny.path, kv_cache_tokens=4096, kv_cache_dtype=kv)) as engine:
        model = engine.loops[0].runner.model
        assert isinstance(model.fused_decode, FusedDecode) and model.fused_decode.max_rows is None
        counting = CountingFusedDecode(model.fused_decode)
        for fused in (counting, None):
            model.fused_decode = fused
            streams = [
                engine.submit(ids, SamplingParams(max_new_tokens=4 + i, ignore_eos=True, logprobs=2))
                for i, ids in enumerate(prompts)
            ]
            runs.append([o for s in streams for o in s])
        assert engine.info().kv_blocks_free == engine.info().kv_blocks_total
    assert counting.calls >= 10  # 12 rows down to 1, over 15 tokens of the longest stream
    fused_out, layer_out = runs
    assert [o.token_ids for o in fused_out] == [o.token_ids for o in layer_out]
    for f, m in zip((lp for o in fused_out for lp in o.logprobs), (lp for o in layer_out for lp in o.logprobs)):
        assert f.logprob == pytest.approx(m.logprob, abs=1e-4)
        assert [t for t, _ in f.top] == [t for t, _ in m.top]


@pytest.mark.skipif(not compiler_found(), reason="no C++ compiler: layer_ops.cpp cannot be built")
def test_bfloat16_engine_is_as_close_to_float32_as_transformers_own_bfloat16(tiny, prompt_ids):
    """A bfloat16 model on the CPU runs its norms, rotary, SiLU and KV stores in C++ (layer_ops.cpp), rounding
    where torch's bfloat16 ops round: its logprobs, over the prefill and the decodes, stay about as close to
    transformers' float32 as transformers' own bfloat16 does."""
    with Engine(EngineConfig(dtype="bfloat16", model=tiny.path, kv_cache_tokens=4096)) as engine:
        assert layer_kernels(torch.ones(1, dtype=torch.bfloat16))
        out = engine.generate(prompt_ids, SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=5))
    assert out.error is None
    ids = prompt_ids + out.token_ids[:-1]
    at = slice(len(prompt_ids) - 1, len(ids))
    reference = tiny.hf_logits(ids)[at].log_softmax(-1)
    with torch.no_grad():
        hf_bf16 = copy.deepcopy(tiny.hf).to(torch.bfloat16)(torch.tensor([ids])).logits[0, at].float().log_softmax(-1)
    ours_error = max(abs(lp - reference[i, t].item()) for i, step in enumerate(out.logprobs) for t, lp in step.top)
    hf_error = max(
        abs(hf_bf16[i, t] - reference[i, t]).item() for i, step in enumerate(out.logprobs) for t, _ in step.top
    )
    assert ours_error <= max(4 * hf_error, 0.05), (ours_error, hf_error)


def test_ids_the_model_cannot_embed_are_refused(tmp_path):
    """A tokenizer larger than the model's embedding (a model whose vocabulary was trimmed): an id past the
    model's rows is the caller's error, not a failed step."""
    from lmgate.engine.errors import InvalidRequest
    from tests.gpu_models import write_model, write_tokenizer

    path = str(tmp_path / "trimmed")
    write_model(
        path,
        transformers.LlamaConfig(
            vocab_size=600,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        torch.float32,
    )
    write_tokenizer(path, 1000)
    with Engine(EngineConfig(dtype="float32", model=path, kv_cache_tokens=1024)) as engine:
        assert engine.info().vocab_size == 600
        with pytest.raises(InvalidRequest, match="outside the vocabulary"):
            engine.generate([5, 700], SamplingParams(max_new_tokens=2))
        assert len(engine.generate([5, 599], SamplingParams(max_new_tokens=2, ignore_eos=True)).token_ids) == 2
        assert engine.info().kv_blocks_free == engine.info().kv_blocks_total


@pytest.mark.parametrize(
    "name,extra,context",
    [
        ("mistral", dict(sliding_window=8), 8),  # Mistral 7B v0.1: every layer windowed
        ("mistral", dict(sliding_window=None), 4096),
        ("qwen2", dict(sliding_window=8, use_sliding_window=False), 4096),  # Qwen2.5's configs: the window unused
        ("qwen2", dict(sliding_window=8, use_sliding_window=True, max_window_layers=1), 8),
        ("qwen2", dict(sliding_window=8, use_sliding_window=True, max_window_layers=2), 4096),
    ],
)
def test_config_sliding_window_caps_the_context(name, extra, context, tiny_models):
    """Attention over a sliding window equals full attention within the window: the context stops there, where
    lmgate's full attention and the model's windowed attention would part."""
    cfg = json.loads(open(os.path.join(tiny_models(name).path, "config.json")).read())
    cfg.pop("layer_types", None)
    cfg.update(max_position_embeddings=4096, num_hidden_layers=2, **extra)
    assert ModelConfig.from_hf(cfg).max_position_embeddings == context
    if extra.get("use_sliding_window"):  # transformers' own list of Qwen2's layer types agrees
        hf_types = transformers.AutoConfig.for_model(**{**cfg, "model_type": name}).layer_types
        assert ("sliding_attention" in hf_types) == (context == 8)


def test_config_activation_other_than_silu_refused(tiny_models):
    cfg = json.loads(open(os.path.join(tiny_models("llama").path, "config.json")).read())
    cfg["hidden_act"] = "gelu"
    with pytest.raises(UnsupportedModel, match="hidden_act 'gelu'"):
        ModelConfig.from_hf(cfg)
