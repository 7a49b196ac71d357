"""A CPU model's decoder layers for a decode step, as one C++ call: a quantized model's for steps of a few rows,
a float32 model's in column panels (gemm.cpp) for steps of any size.

Decoding one token with torch ops is hundreds of small ops and 4 matvecs per layer, each paying the
dispatcher and an OpenMP wake-up; for the embedded model that overhead was more than half the step. At 64
rows of float32 the ops are larger but as many: some 300 wake-ups of 25-35 us a step on a 2-core Zen 4. The
kernel (engine/kernels/decode_layers.cpp) runs every layer in one parallel region, from the same blocks or
panels, norms and KV cache the module path uses, and rounds activations to int8 where the layers do
(`--int8-activations`), so the two paths are interchangeable step by step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from .attention import AttentionMetadata, DecodeTables
from ..machine.hardware import cpu_features
from .panel_linear import PanelLinear
from .quantized_linear import MATVEC_ROWS, QuantizedLinear

if TYPE_CHECKING:  # llama.py imports this module
    from .llama import DecoderLayer, LlamaForCausalLM

COLUMN_PANELS = -1  # decode_layers.cpp's type for a float32 matrix packed by pack_columns
GATED_PANELS = -2  # and for a gate_up projection packed by pack_gated_columns


class FusedDecode:
    """The per-layer tensors of a LlamaForCausalLM whose four linear layers per decoder layer are quantized, or
    float32 in column panels, gathered once at build (the model is read-only from then on)."""

    def __init__(self, model: LlamaForCausalLM, quantized: bool) -> None:
        cfg = model.config
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.eps, self.scale = cfg.rms_norm_eps, cfg.head_dim**-0.5
        self.norms: list[torch.Tensor] = []
        self.weights: list[torch.Tensor] = []  # every part of every matrix, in order
        self.types: list[int] = []  # each part's GGUF type, or COLUMN_PANELS
        self.parts: list[int] = []  # how many parts each matrix has (a Q4_K_M layer's Q4_K Q, K and Q6_K V: 3)
        self.qkv_bias: list[torch.Tensor] = []
        layers = _decoder_layers(model)
        # alike in all (build); quantized: build found every linear layer a QuantizedLinear
        self.int8_activations = quantized and cast(QuantizedLinear, layers[0].self_attn.qkv_proj).int8_activations
        self.vnni = self.int8_activations and cpu_features().int8_vnni
        self.max_rows = MATVEC_ROWS if quantized else None  # quantized: rows one pass over the blocks serves
        for layer in layers:
            attn = layer.self_attn
            self.norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            if attn.qk_norm:
                self.norms += [attn.q_norm.weight, attn.k_norm.weight]
            for linear in (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                if quantized:  # build checked every one: all QuantizedLinear, else all PanelLinear
                    parts = cast(QuantizedLinear, linear).parts
                    self.weights += [p.blocks for p in parts]
                    self.types += [p.qtype for p in parts]
                    self.parts.append(len(parts))
                else:
                    panels = cast(PanelLinear, linear)
                    self.weights.append(panels.columns)
                    self.types.append(GATED_PANELS if panels.gated else COLUMN_PANELS)
                    self.parts.append(1)
            if attn.qkv_proj.bias is not None:
                self.qkv_bias.append(attn.qkv_proj.bias)

    @staticmethod
    def build(model: LlamaForCausalLM) -> FusedDecode | None:
        """None unless every decoder layer's linear layers are quantized, all rounding activations to int8 or
        none, or all float32 in column panels (`PanelLinear`) with gate_up gated; its other weights float32; and
        no bias but qkv_proj's (Qwen2's, which the kernel adds)."""
        layers = _decoder_layers(model)
        per_layer = [
            (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            for layer in layers
        ]
        linears = [m for four in per_layer for m in four]
        quantized = all(isinstance(m, QuantizedLinear) for m in linears)
        if quantized and len({m.int8_activations for m in linears}) > 1:
            return None
        if not quantized and not all(
            isinstance(m, PanelLinear) and m.gated == (m is four[2]) for four in per_layer for m in four
        ):
            return None
        if any(p.dtype != torch.float32 for layer in layers for p in layer.parameters()):
            return None
        if any(
            m.bias is not None
            for layer in layers
            for m in (layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        ):
            return None
        return FusedDecode(model, quantized)

    def serves(self, rows: int, meta: AttentionMetadata, kv_dtype: torch.dtype) -> bool:
        """A step of only decodes (for a quantized model, few enough for one pass over the blocks), on the C++
        attention path (over a float32, float16 or bfloat16 KV cache: the kernel converts as the module path's
        kernels do)."""
        return (
            (self.max_rows is None or rows <= self.max_rows)
            and meta.num_decode == rows
            and isinstance(meta.decode, DecodeTables)
            and not meta.triton
            and kv_dtype in (torch.float32, torch.float16, torch.bfloat16)
        )

    def __call__(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """x: [rows, hidden] float32 embeddings, updated in place into the last layer's output."""
        assert isinstance(meta.decode, DecodeTables)  # the caller checked `serves` for this step
        x = x.contiguous()
        cos, sin = (t.reshape(x.shape[0], -1).contiguous() for t in rope)
        torch.ops.lmgate.decode_layers(
            x,
            self.norms,
            self.weights,
            self.types,
            self.parts,
            self.qkv_bias,
            cos,
            sin,
            [k for k, _ in kv_caches],
            [v for _, v in kv_caches],
            meta.slot_mapping,
            meta.decode.block_tables,
            meta.decode.lengths,
            self.num_heads,
            self.num_kv_heads,
            self.eps,
            self.scale,
            self.int8_activations,
            self.vnni,
        )
        return x


def _decoder_layers(model: LlamaForCausalLM) -> list[DecoderLayer]:
    """The model's decoder layers, as their class (an nn.ModuleList yields nn.Module)."""
    return cast("list[DecoderLayer]", list(model.model.layers))  # LlamaModel's layers are all DecoderLayers
