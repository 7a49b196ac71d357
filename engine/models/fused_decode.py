"""A quantized model's decoder layers for a decode step of a few rows, as one C++ call.

Decoding one token with torch ops is hundreds of small ops and 4 matvecs per layer, each paying the
dispatcher and an OpenMP wake-up; for the embedded model that overhead was more than half the step. The
kernel (engine/kernels/decode_layers.cpp) runs every layer in one parallel region, from the same blocks,
norms and KV cache the module path uses, and rounds activations to int8 where the layers do
(`--int8-activations`), so the two paths are interchangeable step by step.
"""
from __future__ import annotations

import torch

from ..attention import AttentionMetadata, DecodeTables
from ..hardware import cpu_features
from .quantized_linear import MATVEC_ROWS, QuantizedLinear


class FusedDecode:
    """The per-layer tensors of a LlamaForCausalLM whose four linear layers per decoder layer are quantized,
    gathered once at build (the model is read-only from then on)."""

    def __init__(self, model: torch.nn.Module) -> None:
        cfg = model.config
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.eps, self.scale = cfg.rms_norm_eps, cfg.head_dim**-0.5
        self.norms: list[torch.Tensor] = []
        self.weights: list[torch.Tensor] = []  # every part of every matrix, in order
        self.types: list[int] = []  # each part's GGUF type
        self.parts: list[int] = []  # how many parts each matrix has (a Q4_K_M layer's Q4_K Q, K and Q6_K V: 3)
        self.qkv_bias: list[torch.Tensor] = []
        self.int8_activations = model.model.layers[0].self_attn.qkv_proj.int8_activations  # alike in all (build)
        self.vnni = self.int8_activations and cpu_features().int8_vnni
        for layer in model.model.layers:
            attn = layer.self_attn
            self.norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            if attn.qk_norm:
                self.norms += [attn.q_norm.weight, attn.k_norm.weight]
            for linear in (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                self.weights += [p.blocks for p in linear.parts]
                self.types += [p.qtype for p in linear.parts]
                self.parts.append(len(linear.parts))
            if attn.qkv_proj.bias is not None:
                self.qkv_bias.append(attn.qkv_proj.bias)

    @staticmethod
    def build(model: torch.nn.Module) -> FusedDecode | None:
        """None unless every decoder layer's linear layers are quantized, all rounding activations to int8 or
        none, and its other weights float32."""
        layers = model.model.layers
        linears = [m for layer in layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                   layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        if not all(isinstance(m, QuantizedLinear) for m in linears) or len({m.int8_activations for m in linears}) > 1:
            return None
        if any(p.dtype != torch.float32 for layer in layers for p in layer.parameters()):
            return None
        return FusedDecode(model)  # only qkv_proj has a bias in this family (Qwen2), which the kernel adds

    @staticmethod
    def serves(rows: int, meta: AttentionMetadata, kv_dtype: torch.dtype) -> bool:
        """A step of only decodes, few enough for one pass over the weights, on the C++ attention path (over a
        float32, float16 or bfloat16 KV cache: the kernel converts as the module path's kernels do)."""
        return (rows <= MATVEC_ROWS and meta.num_decode == rows and isinstance(meta.decode, DecodeTables)
                and not meta.triton and kv_dtype in (torch.float32, torch.float16, torch.bfloat16))

    def __call__(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """x: [rows, hidden] float32 embeddings, updated in place into the last layer's output."""
        x = x.contiguous()
        cos, sin = (t.reshape(x.shape[0], -1).contiguous() for t in rope)
        torch.ops.lmgate.decode_layers(
            x, self.norms, self.weights, self.types, self.parts, self.qkv_bias, cos, sin, [k for k, _ in kv_caches],
            [v for _, v in kv_caches], meta.slot_mapping, meta.decode.block_tables, meta.decode.lengths,
            self.num_heads, self.num_kv_heads, self.eps, self.scale, self.int8_activations, self.vnni)
        return x
