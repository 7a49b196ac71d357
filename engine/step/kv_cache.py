"""The paged KV cache tensors of one engine loop: [layers] x (key, value) of [kv_heads, blocks, block_size, head_dim].

The KV cache holds the model's dtype unless `kv_cache_dtype` asks for float16 or bfloat16 under float32 weights
on the CPU: keys and values are rounded once, when `store_kv` writes them, and everything else stays float32
(the C++ kernels widen each block as they read it, float16 with F16C; the torch path widens what it gathers).
Half the memory per token, and half the bytes decode attention reads, which bound it. A quantized model's fused
decode stores and reads a 16-bit cache the same way (`attend_group` takes the cache's dtype).
"""

from __future__ import annotations

import math

import torch

from ..models.attention import MAX_DECODE_SPLITS
from ..config import EngineConfig, ModelConfig
from .cuda_graphs import buckets
from ..errors import InvalidRequest
from ..models.tensor_parallel import shard_config, shard_of

CPU_KV_CACHE_TOKENS = 32768  # the automatic size on the CPU, per engine loop: host memory is shared with all else
GPU_PROCESS_RESERVE = 1 << 30  # per process on a GPU: CUDA graphs' pool, cuBLAS workspaces, Triton
GPU_CONTEXT = 512 << 20  # a rank process's own CUDA context (the serving process's is in use when it measures)


def kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """`--kv-cache-dtype`: `auto` keeps the model's dtype. A 16-bit cache under float32 weights (CPU only: the
    C++ kernels convert each block to float32 as they read it) holds twice the tokens in the same memory and
    halves the bytes decode attention reads, which bound it; keys and values are rounded once, when stored."""
    if name == "auto":
        return model_dtype
    dtype = getattr(torch, name)
    if dtype != model_dtype and (device.type != "cpu" or model_dtype != torch.float32):
        raise InvalidRequest(
            f"--kv-cache-dtype {name} under {str(model_dtype).removeprefix('torch.')} weights on "
            f"{device.type}: a cache of another dtype than the model's is served on the CPU under "
            f"float32 only"
        )
    return dtype


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()


def allocate_kv_cache(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(cfg.num_layers)
    ]


def copy_blocks(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]], sources: torch.Tensor, destinations: torch.Tensor
) -> None:
    """Copy whole blocks, every layer's keys and values (copy on write: a block shared by the samples of a
    request, about to be written by one of them). Each gathers all its sources before it writes."""
    for key, value in kv_caches:
        key[:, destinations] = key[:, sources]
        value[:, destinations] = value[:, sources]


def auto_kv_cache_tokens(config: EngineConfig, model: ModelConfig, dtype: torch.dtype, kv_dtype: torch.dtype) -> int:
    """`kv_cache_tokens` 0, per engine loop. On the CPU a fixed size; on CUDA, as vLLM's gpu-memory-utilization
    does, what `gpu_memory_utilization` of the GPU leaves once the memory in use now (other processes', this
    one's), the models and the steps of everything that will share that GPU are counted, split among its
    caches. Measured on the serving process's GPU, for every GPU: a machine's GPUs are taken to be alike."""
    device = torch.device(config.device)
    if device.type != "cuda":
        return CPU_KV_CACHE_TOKENS
    rank = shard_config(model, shard_of(model, 0, config.tensor_parallel))  # the first ranks hold the larger parts
    weights = (rank.num_params + rank.vocab_size * rank.hidden_size) * dtype.itemsize  # the embedding too
    if config.rank_processes:  # each rank a process with its own model (its shard) and CUDA context
        gpus = torch.cuda.device_count() if device.index is None else 1
        ranks = math.ceil(config.world_size // config.nnodes / max(gpus, 1))
        fixed = ranks * (weights + activation_bytes(config, rank, dtype) + GPU_PROCESS_RESERVE + GPU_CONTEXT)
    else:  # threads: one model, one process, a loop's steps each
        ranks = config.engine_loops
        fixed = weights + ranks * activation_bytes(config, rank, dtype) + GPU_PROCESS_RESERVE
    free, total = torch.cuda.mem_get_info(device)
    return kv_tokens_in_budget(
        free, total, config.gpu_memory_utilization, fixed, kv_bytes_per_token(rank, kv_dtype) * ranks, config.block_size
    )


def activation_bytes(config: EngineConfig, model: ModelConfig, dtype: torch.dtype) -> int:
    """The most a step of `model` (a tensor-parallel rank's shard) holds beside weights and KV: a prefill
    chunk's widest activations (a layer's input and its MLP's gate and up), the sampler's [rows, vocab] float32
    tensors (logits, probabilities, their running sum, one spare), and decode attention's per-split partial
    sums at the longest context (a CUDA graph keeps them); with CUDA graphs, the float32 logits each bucket's
    graph keeps as its output (Qwen2.5's vocabulary at 256 rows: 1.3 GiB over the buckets)."""
    rows = max(config.max_batched_tokens, config.max_batch_size)  # decodes run past the token budget
    chunk = 2 * rows * (model.hidden_size + 2 * model.intermediate_size) * dtype.itemsize
    sampler = 4 * config.max_batch_size * model.vocab_size * 4
    decode = config.max_batch_size * model.num_heads * MAX_DECODE_SPLITS * (model.head_dim + 2) * 4
    graphed = config.cuda_graphs and config.tensor_parallel == 1  # as EngineLoop.build decides
    graph_logits = sum(buckets(config.max_batch_size)) * model.vocab_size * 4 if graphed else 0
    return chunk + sampler + decode + graph_logits


def kv_tokens_in_budget(
    free: int, total: int, utilization: float, fixed: int, bytes_per_token: int, block_size: int
) -> int:
    """Whole blocks of tokens in `utilization` x `total` bytes, less what is in use (`total - free`) and `fixed`."""
    used = total - free
    budget = int(utilization * total) - used - fixed
    tokens = max(budget, 0) // bytes_per_token // block_size * block_size
    if tokens < block_size:
        raise InvalidRequest(
            f"no room for a KV cache: gpu_memory_utilization {utilization} of the GPU's {total / 2**30:.1f} GiB, "
            f"of which {used / 2**30:.1f} GiB is in use, and weights and activations need {fixed / 2**30:.1f} GiB; "
            "raise gpu_memory_utilization, free the GPU, or set kv_cache_tokens"
        )
    return tokens
