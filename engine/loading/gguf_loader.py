"""Loading a GGUF file: metadata to a config, tensors to Hugging Face names and layout. Matrices of the
quantization types the CPU kernels read stay quantized (`GGUFBlocks`); `build_model` expands them where the
model runs in float."""

from __future__ import annotations

import logging
import re

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from ..config import ModelConfig
from ..errors import UnsupportedModel
from ..models.quantized_linear import BLOCK_LAYOUTS, TYPE_NAMES, GGUFBlocks, gguf_blocks

log = logging.getLogger(__name__)

_ARCHES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class GGUFFile(GGUFReader):
    """gguf's reader over a plain ndarray view of its memmap. The reader slices its data once per value, a
    vocabulary's strings included (about 250,000 slices for a 49,152-token vocabulary and its merges), and a
    memmap's slice costs several times a plain array's (`memmap.__array_finalize__`): 0.6 s against 2.0 for
    the embedded model. The views still read the mapped file; nothing is copied."""

    @property  # type: ignore[override]  # gguf's reader declares its memmap; this is a plain view of it
    def data(self) -> np.ndarray:
        return self._array

    @data.setter
    def data(self, mapped: np.ndarray) -> None:  # the reader's `__init__` sets its memmap here
        self._array = mapped.view(np.ndarray)


def _field(reader: GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_gguf_config(reader: GGUFReader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHES:
        raise UnsupportedModel(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(_ARCHES)}")
    hidden = _field(reader, f"{arch}.embedding_length")
    heads = _field(reader, f"{arch}.attention.head_count")
    names = {t.name for t in reader.tensors}
    # Llama 3.1 and 3.2 ship their scaled RoPE as a divisor per frequency (a rope_freqs tensor); other scaling
    # (linear, YaRN) is refused, as in a config.json, never run as plain RoPE.
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise UnsupportedModel(f"GGUF RoPE scaling {scaling!r} is not supported (only llama3's rope_freqs)")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    return ModelConfig(
        architecture=_ARCHES[arch],
        vocab_size=_field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data),
        hidden_size=hidden,
        intermediate_size=_field(reader, f"{arch}.feed_forward_length"),
        num_layers=_field(reader, f"{arch}.block_count"),
        num_heads=heads,
        num_kv_heads=_field(reader, f"{arch}.attention.head_count_kv", heads),
        head_dim=_field(reader, f"{arch}.attention.key_length", hidden // heads),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=_field(reader, f"{arch}.context_length", 2048),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        rope_freq_factors=() if freqs is None else tuple(np.asarray(freqs.data, dtype=np.float32).ravel().tolist()),
    )


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of rotary halves in Q/K rows, back to Hugging Face's rotate-half layout."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf_weights(reader: GGUFReader, config: ModelConfig) -> dict[str, torch.Tensor | GGUFBlocks]:
    """Tensors by Hugging Face name: matrices of a type in `BLOCK_LAYOUTS` as their blocks, everything else
    as fp32; unknown tensors (e.g. rope tables) are skipped."""
    permute = config.architecture in ("LlamaForCausalLM", "MistralForCausalLM")
    weights: dict[str, torch.Tensor | GGUFBlocks] = {}
    expanded: set[str] = set()
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            continue
        shape = [int(d) for d in reversed(t.shape)]
        heads = config.num_heads if ".q_proj." in name else config.num_kv_heads
        # llama.cpp's converter interleaves the rotary halves of Q's and K's rows: weights and biases alike
        rotated = permute and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias"))
        if int(t.tensor_type) in BLOCK_LAYOUTS and len(shape) == 2:
            rows = np.asarray(t.data).reshape(shape[0], -1)
            weights[name] = gguf_blocks(
                _unpermute(rows, heads) if rotated else rows, int(t.tensor_type), (shape[0], shape[1])
            )
            continue
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            data = np.asarray(t.data, dtype=np.float32)
        else:
            data = dequantize(t.data, t.tensor_type)
            expanded.add(t.tensor_type.name)
        data = data.reshape(shape)
        if rotated:
            data = _unpermute(data, heads)
        weights[name] = torch.from_numpy(np.array(data, dtype=np.float32))
    if expanded:
        log.info(
            "GGUF tensors of types %s expanded to float32 (the CPU kernels read %s)",
            ", ".join(sorted(expanded)),
            ", ".join(TYPE_NAMES.values()),
        )
    return weights
