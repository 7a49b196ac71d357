"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM2) over a paged KV cache.

Module names mirror Hugging Face's so checkpoints load by name; Q/K/V and gate/up are packed into one
matmul each at load time (`pack_weights`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, paged_attention
from ..config import ModelConfig
from ..kernels import layer_kernels
from ..kernels import triton as triton_kernels
from .fused_decode import FusedDecode
from .panel_linear import PanelLinear
from .quantized_linear import GGUFBlocks, GGUFStack, cat_rows


@functools.cache
def triton_layer_ops():
    """kernels/triton/layer_ops.py, imported where it serves (Triton is needed on CUDA only)."""
    from ..kernels.triton import layer_ops

    return layer_ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """Normalized in fp32, scaled in the model's dtype, as Hugging Face's LlamaRMSNorm does. With `delta`,
        the residual add comes first, in place: `x += delta` (one C++ pass with the norm where it can)."""
        if triton_kernels.serves(x):
            return triton_layer_ops().rms_norm(x, self.weight, self.eps, delta)
        if layer_kernels(x):
            if delta is not None:
                return torch.ops.lmgate.add_rms_norm(x, delta, self.weight, self.eps)
            return torch.ops.lmgate.rms_norm(x, self.weight, self.eps)
        if delta is not None:
            x.add_(delta)
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to the context window, computed as Hugging Face does.

    `sin` carries rotate_half's sign (-sin on the first half), so a rotation is two products of `x` and
    `x` rolled by half a head, with the same roundings as Hugging Face's `q * cos + rotate_half(q) * sin`.
    """

    cos: torch.Tensor  # buffers (register_buffer), which nn.Module's attribute typing does not know
    sin: torch.Tensor

    def __init__(self, head_dim: int, theta: float, max_positions: int, freq_factors: tuple[float, ...] = ()) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if freq_factors:  # scaled RoPE (ModelConfig.rope_freq_factors)
            inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        sign = torch.cat((-torch.ones_like(inv_freq), torch.ones_like(inv_freq)))
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin() * sign, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, head_dim] cos and signed sin of a step's positions, looked up once for all layers."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]."""
    if triton_kernels.serves(x):
        return triton_layer_ops().rotary(x, cos, sin)
    if layer_kernels(x):
        return torch.ops.lmgate.rotary(x, cos, sin)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.scale = cfg.head_dim**-0.5

    def forward(
        self, x, rope: tuple[torch.Tensor, torch.Tensor], kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ):
        """Q and K heads rotate together, in one pass over a view of the packed projection."""
        heads = self.num_heads + self.num_kv_heads
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(-1, heads, self.head_dim)
        if self.qk_norm:
            qk = torch.cat([self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])], dim=1)
        q, k = apply_rotary(qk, *rope).split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.gate_up_proj, PanelLinear) and self.gate_up_proj.gated:  # the activation is its output
            return self.down_proj(self.gate_up_proj(x))
        gate_up = self.gate_up_proj(x)
        if triton_kernels.serves(gate_up):
            return self.down_proj(triton_layer_ops().silu_and_mul(gate_up))
        if layer_kernels(gate_up):
            return self.down_proj(torch.ops.lmgate.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    # Tensor parallelism sums the partial outputs of the row-parallel o_proj and down_proj over the group
    # here (models/tensor_parallel.py); alone, a layer's outputs are whole.
    reduce: Callable[[torch.Tensor], torch.Tensor] = staticmethod(lambda x: x)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, delta, rope, kv, meta):
        """The residual stream `x` (updated in place) and the previous layer's output `delta`, not yet added:
        each residual add runs inside the norm that reads its sum, as vLLM's fused add-and-norm does."""
        attn = self.reduce(self.self_attn(self.input_layernorm(x, delta), rope, kv, meta))
        return self.reduce(self.mlp(self.post_attention_layernorm(x, attn)))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_freq_factors
        )


class LlamaForCausalLM(nn.Module):
    """Hidden states for a flat batch of tokens; logits only for the rows that sample."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.fused_decode: FusedDecode | None = None  # set by build_model on the CPU (fused_decode.py)
        self.weight_version = ""  # the engine's name for these weights (LocalWeights), reported with their tokens
        self.owns_memory = True  # False where build_model left it views of a caller's tensors (`private`)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        rope = self.model.rotary_emb.tables(positions, x.dtype)
        if self.fused_decode is not None and self.fused_decode.serves(x.shape[0], meta, kv_caches[0][0].dtype):
            return self.model.norm(self.fused_decode(x, rope, kv_caches, meta))
        delta = None
        for layer, kv in zip(self.model.layers, kv_caches):
            delta = layer(x, delta, rope, kv, meta)
        return self.model.norm(x, delta)

    def reduce_layers_with(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """A tensor-parallel shard: each decoder layer sums its row-parallel outputs with `reduce`, and the fused
        decode, which knows no all-reduce, is off."""
        self.fused_decode = None
        for layer in self.model.layers:
            cast(DecoderLayer, layer).reduce = reduce  # LlamaModel's layers are all DecoderLayers

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def pack_weights(
    weights: dict[str, torch.Tensor | GGUFBlocks], cfg: ModelConfig
) -> dict[str, torch.Tensor | GGUFBlocks | GGUFStack]:
    """Hugging Face names to this module's: q/k/v into qkv_proj, gate/up into gate_up_proj, tied head."""
    packed: dict[str, torch.Tensor | GGUFBlocks | GGUFStack] = dict(weights)  # cat_rows: a GGUFStack of mixed types
    for i in range(cfg.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        for kind in ("weight", "bias"):
            parts = [packed.pop(f"{attn}.{p}_proj.{kind}", None) for p in "qkv"]
            if all(t is not None for t in parts):
                packed[f"{attn}.qkv_proj.{kind}"] = cat_rows(parts)
        gate, up = packed.pop(f"{mlp}.gate_proj.weight", None), packed.pop(f"{mlp}.up_proj.weight", None)
        if gate is not None and up is not None:  # else left missing, for load_weights to refuse
            packed[f"{mlp}.gate_up_proj.weight"] = cat_rows([gate, up])
    if (cfg.tie_word_embeddings or "lm_head.weight" not in packed) and "model.embed_tokens.weight" in packed:
        packed["lm_head.weight"] = packed["model.embed_tokens.weight"]
    return packed


def hf_weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a checkpoint of this shape holds, by Hugging Face name (`pack_weights`' inputs), with its
    shape; `lm_head.weight` among them even when tied (transformers' `state_dict()` names it)."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (cfg.vocab_size, h),
    }
    for i in range(cfg.num_layers):
        layer, attn = f"model.layers.{i}", f"model.layers.{i}.self_attn"
        shapes |= {
            f"{layer}.input_layernorm.weight": (h,),
            f"{layer}.post_attention_layernorm.weight": (h,),
            f"{attn}.q_proj.weight": (q, h),
            f"{attn}.k_proj.weight": (kv, h),
            f"{attn}.v_proj.weight": (kv, h),
            f"{attn}.o_proj.weight": (h, q),
            f"{layer}.mlp.gate_proj.weight": (cfg.intermediate_size, h),
            f"{layer}.mlp.up_proj.weight": (cfg.intermediate_size, h),
            f"{layer}.mlp.down_proj.weight": (h, cfg.intermediate_size),
        }
        if cfg.attention_bias:
            shapes |= {f"{attn}.q_proj.bias": (q,), f"{attn}.k_proj.bias": (kv,), f"{attn}.v_proj.bias": (kv,)}
        if cfg.qk_norm:
            shapes |= {f"{attn}.q_norm.weight": (cfg.head_dim,), f"{attn}.k_norm.weight": (cfg.head_dim,)}
    return shapes
