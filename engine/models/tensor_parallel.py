"""Tensor parallelism for the Llama family: which heads and MLP columns a rank holds, and its share of the
checkpoint.

A rank holds whole GQA groups, as evenly as they go: SmolLM2's 9 query heads in 3 KV groups split 6 + 3 at
TP=2 (vLLM refuses such a model). With more ranks than KV heads, the ranks of a group share its query heads
and each keeps a copy of its KV head. Q/K/V and gate/up are column-parallel (their output rows split),
o_proj and down_proj row-parallel (their input columns split), so each decoder layer sums two partial
outputs across the group (`DecoderLayer.reduce`). Norms, the embedding and the LM head are replicated.
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import ModelConfig
from ..errors import InvalidRequest


@dataclasses.dataclass(frozen=True, slots=True)
class Shard:
    """What tensor-parallel rank `rank` of `size` holds."""

    q_heads: range
    kv_heads: range
    intermediate: range


def even_part(n: int, parts: int, i: int) -> range:
    """Part `i` of `range(n)` cut into `parts` contiguous pieces as even as they go, the larger ones first."""
    base, extra = divmod(n, parts)
    start = i * base + min(i, extra)
    return range(start, start + base + (i < extra))


def shard_of(cfg: ModelConfig, rank: int, size: int) -> Shard:
    """Rank `rank`'s heads and MLP columns; a size the model cannot be split into is InvalidRequest."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} out of range for a group of {size}")
    group = cfg.num_heads // cfg.num_kv_heads
    if size > cfg.num_heads or size > cfg.intermediate_size:
        raise InvalidRequest(f"tensor parallelism {size} exceeds the model's {cfg.num_heads} query heads")
    if size <= cfg.num_kv_heads:
        kv = even_part(cfg.num_kv_heads, size, rank)
        q = range(kv.start * group, kv.stop * group)
    else:
        # Ranks spread over the KV groups; a group's ranks share its query heads and copy its KV head.
        owners = [even_part(size, cfg.num_kv_heads, g) for g in range(cfg.num_kv_heads)]
        g = next(g for g, ranks in enumerate(owners) if rank in ranks)
        if len(owners[g]) > group:
            raise InvalidRequest(
                f"tensor parallelism {size} leaves a rank without query heads: "
                f"{cfg.num_kv_heads} KV groups of {group} heads"
            )
        part = even_part(group, len(owners[g]), rank - owners[g].start)
        kv, q = range(g, g + 1), range(g * group + part.start, g * group + part.stop)
    return Shard(q, kv, even_part(cfg.intermediate_size, size, rank))


def shard_config(cfg: ModelConfig, shard: Shard) -> ModelConfig:
    """The config of the smaller model a rank runs: its heads, its MLP columns."""
    return dataclasses.replace(
        cfg, num_heads=len(shard.q_heads), num_kv_heads=len(shard.kv_heads), intermediate_size=len(shard.intermediate)
    )


def shard_weights(weights: dict[str, torch.Tensor], cfg: ModelConfig, shard: Shard) -> dict[str, torch.Tensor]:
    """A rank's slices of a checkpoint by Hugging Face name (before `pack_weights`); other tensors whole."""
    d = cfg.head_dim
    q_rows = slice(shard.q_heads.start * d, shard.q_heads.stop * d)
    kv_rows = slice(shard.kv_heads.start * d, shard.kv_heads.stop * d)
    inter = slice(shard.intermediate.start, shard.intermediate.stop)
    rows = {
        "self_attn.q_proj": q_rows,
        "self_attn.k_proj": kv_rows,
        "self_attn.v_proj": kv_rows,
        "mlp.gate_proj": inter,
        "mlp.up_proj": inter,
    }
    columns = {"self_attn.o_proj": q_rows, "mlp.down_proj": inter}
    out = {}
    for name, tensor in weights.items():
        module = name.rsplit(".", 1)[0].split(".", 3)[-1] if name.startswith("model.layers.") else ""
        if module in rows:
            tensor = tensor[rows[module]]
        elif module in columns and name.endswith(".weight"):
            tensor = tensor[:, columns[module]]
        out[name] = tensor.contiguous()
    return out
