"""`--kv-cache-tokens auto`: a fixed size on the CPU; on CUDA the share of the GPU that
`--gpu-memory-utilization` leaves after what is in use, the weights and a step's activations (the CUDA run of
it is in test_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from lmgate.engine.config import EngineConfig
from lmgate.engine.step.cuda_graphs import buckets
from lmgate.engine.engine import Engine
from lmgate.engine.errors import InvalidRequest
from lmgate.engine.step.kv_cache import CPU_KV_CACHE_TOKENS, activation_bytes, kv_tokens_in_budget
from lmgate.engine.models.tensor_parallel import shard_config, shard_of

GiB = 1 << 30
QWEN_KV = 2 * 24 * 2 * 64 * 2  # bytes per token of Qwen2.5-0.5B's bf16 KV: layers x (K, V) x heads x dim


def test_the_cache_takes_what_the_share_leaves_in_whole_blocks():
    tokens = kv_tokens_in_budget(
        free=79 * GiB, total=80 * GiB, utilization=0.9, fixed=3 * GiB, bytes_per_token=QWEN_KV, block_size=16
    )
    assert tokens % 16 == 0
    assert tokens * QWEN_KV <= (72 - 1 - 3) * GiB < (tokens + 16) * QWEN_KV  # 90% of 80, less 1 used and 3 fixed


def test_memory_others_use_counts_against_the_share():
    alone = kv_tokens_in_budget(79 * GiB, 80 * GiB, 0.9, 3 * GiB, QWEN_KV, 16)
    beside_a_trainer = kv_tokens_in_budget(39 * GiB, 80 * GiB, 0.9, 3 * GiB, QWEN_KV, 16)
    assert beside_a_trainer * QWEN_KV <= (72 - 41 - 3) * GiB
    assert beside_a_trainer < alone


def test_no_room_is_refused_with_what_took_it():
    with pytest.raises(InvalidRequest, match=r"no room for a KV cache: .* 80\.0 GiB, of which 70\.0 GiB is in use"):
        kv_tokens_in_budget(10 * GiB, 80 * GiB, 0.9, 3 * GiB, QWEN_KV, 16)


def test_activations_grow_with_the_step(checkpoint):
    def step(tp: int = 1, **config) -> int:  # the embedded SmolLM2: 9 query heads, 3 KV heads
        shard = shard_config(checkpoint.config, shard_of(checkpoint.config, 0, tp))
        return activation_bytes(EngineConfig(tensor_parallel=tp, **config), shard, torch.float32)

    base = step(max_batched_tokens=256, max_batch_size=64)
    assert step(max_batched_tokens=8192, max_batch_size=64) > base
    assert step(max_batched_tokens=256, max_batch_size=256) > base
    assert step(tp=3, max_batched_tokens=256, max_batch_size=64) < base  # a tensor-parallel shard's heads
    # The scheduler gives every running decode its token before the budget: 64 decodes are 64 rows even with
    # a budget of 16 tokens.
    assert step(max_batched_tokens=16, max_batch_size=64) == step(max_batched_tokens=64, max_batch_size=64)
    # Each bucket's CUDA graph keeps its float32 logits: 1 + 2 + 4 + 8 + ... + 64 = 295 rows of the vocabulary.
    eager = step(max_batched_tokens=256, max_batch_size=64, cuda_graphs=False)
    assert base - eager == sum(buckets(64)) * checkpoint.config.vocab_size * 4 == 295 * 49152 * 4
    assert step(tp=3, max_batched_tokens=256, max_batch_size=64) == step(
        tp=3, max_batched_tokens=256, max_batch_size=64, cuda_graphs=False
    )  # no graphs under tensor parallelism


def test_settings_out_of_range_are_refused():
    with pytest.raises(InvalidRequest, match="must be 0 .auto. or at least 16"):
        EngineConfig(kv_cache_tokens=-16)
    for bad in (dict(kv_cache_tokens=8), dict(gpu_memory_utilization=0.0), dict(gpu_memory_utilization=1.5)):
        with pytest.raises(InvalidRequest):
            EngineConfig(**bad)


def test_auto_on_the_cpu_is_the_fixed_size(checkpoint):
    with Engine(EngineConfig(dtype="float32"), checkpoint=checkpoint) as eng:
        info = eng.info()
        assert eng.config.kv_cache_tokens == CPU_KV_CACHE_TOKENS
        assert info.kv_blocks_total * info.kv_block_size == CPU_KV_CACHE_TOKENS
