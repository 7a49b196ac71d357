"""Tensor parallelism: heads split by whole GQA groups, rank processes summing over gloo, outputs equal to
one rank's (and to transformers')."""

from __future__ import annotations

import pytest
import torch

from lmgate.engine.config import EngineConfig
from lmgate.engine.engine import Engine
from lmgate.engine.errors import InvalidRequest
from lmgate.engine.kernels import compiler_found
from lmgate.engine.models.tensor_parallel import shard_of
from lmgate.engine.sampling.sampler import SamplingParams
from tests.serving import status_bytes
from tests.test_engine import hf_greedy
from tests.test_models import ARCH_NAMES, prompt_ids  # noqa: F401  (fixtures)

NEW = 24
LOGPROB_TOLERANCE = 1e-3  # partial sums over the group change the summation order, nothing else


def heads(cfg, size: int) -> list[tuple[list[int], list[int]]]:
    return [(list(s.q_heads), list(s.kv_heads)) for s in (shard_of(cfg, r, size) for r in range(size))]


def test_heads_split_by_whole_gqa_groups_unevenly_and_replicated_past_the_kv_heads(checkpoint):
    cfg = checkpoint.config  # SmolLM2: 9 query heads in 3 KV groups
    assert (cfg.num_heads, cfg.num_kv_heads) == (9, 3)
    assert heads(cfg, 2) == [(list(range(6)), [0, 1]), ([6, 7, 8], [2])]
    assert heads(cfg, 3) == [([0, 1, 2], [0]), ([3, 4, 5], [1]), ([6, 7, 8], [2])]
    assert heads(cfg, 4) == [([0, 1], [0]), ([2], [0]), ([3, 4, 5], [1]), ([6, 7, 8], [2])]
    assert [len(shard_of(cfg, r, 2).intermediate) for r in range(2)] == [768, 768]
    for size in (2, 4, 9):  # every query head and MLP column held exactly once
        shards = [shard_of(cfg, r, size) for r in range(size)]
        assert sorted(h for s in shards for h in s.q_heads) == list(range(9))
        assert sorted(c for s in shards for c in s.intermediate) == list(range(cfg.intermediate_size))
    with pytest.raises(InvalidRequest):
        shard_of(cfg, 0, 10)


def _outputs(engine: Engine, prompts: list[list[int]]):
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=1)
    streams = [engine.submit(p, params) for p in prompts]  # concurrent: one batch, both DP ranks
    outs = []
    for s in streams:
        tokens, logprobs = [], []
        for o in s:
            tokens += o.token_ids
            logprobs += [lp.logprob for lp in o.logprobs]
        outs.append((tokens, logprobs))
    return outs


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_tp2_equals_one_rank_on_every_architecture(tiny_models, arch, prompt_ids):
    """One rank decodes in one fused call (where the kernels build), the TP ranks through their modules, whose
    all-reduce the fused call does not know."""
    tiny = tiny_models(arch)
    prompts = [prompt_ids, prompt_ids[:7], prompt_ids[3:]]
    config = dict(dtype="float32", model=tiny.path, kv_cache_tokens=2048)
    with Engine(EngineConfig(**config)) as one:
        want = _outputs(one, prompts)
    with Engine(EngineConfig(**config, tensor_parallel=2)) as tp:
        assert not tp.loops and tp.info().engine_loops == 1
        got = _outputs(tp, prompts)
        assert tp.info().kv_blocks_free == tp.info().kv_blocks_total
    assert want[0][0] == tiny.hf_greedy(prompt_ids)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want):
        assert tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < LOGPROB_TOLERANCE


def test_tp2_times_dp2_makes_four_ranks_with_equal_outputs(tiny_models, prompt_ids):
    tiny = tiny_models("qwen2")  # attention biases: column-parallel biases split with their rows
    prompts = [prompt_ids[i:] for i in range(4)]
    config = dict(dtype="float32", model=tiny.path, kv_cache_tokens=2048)
    with Engine(EngineConfig(**config)) as one:
        want = _outputs(one, prompts)
    with Engine(EngineConfig(**config, tensor_parallel=2, engine_loops=2)) as tp:
        info = tp.info()
        assert info.engine_loops == 2 and info.kv_blocks_total == 2 * 2048 // info.kv_block_size
        assert [t for t, _ in _outputs(tp, prompts)] == [t for t, _ in want]


def test_embedded_model_under_tp2_is_greedy_equal_to_transformers(checkpoint, hf_model, tokenizer):
    """Uneven: one rank holds two KV groups, the other one. With the default dtype, where one rank would keep
    the GGUF's blocks (a compiler for its kernels): the split computes in float32 as that rank does."""
    prompts = [tokenizer.encode(p) for p in ("The capital of France is", "def fibonacci(n):")]
    dtype = "auto" if compiler_found() else "float32"
    with Engine(EngineConfig(dtype=dtype, tensor_parallel=2, kv_cache_tokens=2048), checkpoint) as tp:
        assert tp.dtype == torch.float32
        got = [t for t, _ in _outputs(tp, prompts)]
        tp.sleep(2)  # weights and KV of every rank freed, then rebuilt as shards
        assert tp.info().weights_bytes == 0 and tp.info().kv_cache_bytes == 0
        tp.wakeup()
        again = [t for t, _ in _outputs(tp, prompts)]
    assert got == [hf_greedy(hf_model, p, NEW) for p in prompts] == again


def test_update_weights_under_tp2_switches_every_rank_of_the_group(checkpoint, checkpoints, tokenizer):
    """Each rank stages its shard of the new checkpoint; the leader puts them in at one step. Outputs are
    then the new model's (as one rank computes them), and going back restores the old ones, also when it is
    written into the served shards while paused."""
    prompts = [tokenizer.encode(p) for p in ("The capital of France is", "def fibonacci(n):")]
    with Engine(EngineConfig(dtype="float32", model=checkpoints["changed"], kv_cache_tokens=2048)) as one:
        want = [t for t, _ in _outputs(one, prompts)]
    with Engine(EngineConfig(dtype="float32", tensor_parallel=2, kv_cache_tokens=2048), checkpoint) as tp:
        before = [t for t, _ in _outputs(tp, prompts)]
        tp.update_weights(checkpoints["changed"])
        changed = [t for t, _ in _outputs(tp, prompts)]
        tp.pause("abort")  # nothing steps: each rank writes its shard into the model it serves
        tp.update_weights(checkpoints["original"])
        tp.resume()
        after = [t for t, _ in _outputs(tp, prompts)]
    assert changed == want != before == after


def test_sleep_gives_the_kv_cache_back_to_the_os_in_every_rank_process(checkpoint, tokenizer):
    """Level 1 frees the KV cache where it lives: in the leader's and the follower's processes, returned to
    the OS (freed tensors otherwise stay resident), and Wakeup gives the same outputs."""
    prompts = [tokenizer.encode("The capital of France is")]
    with Engine(EngineConfig(dtype="float32", tensor_parallel=2, kv_cache_tokens=8192), checkpoint) as tp:
        before = [t for t, _ in _outputs(tp, prompts)]
        kv_bytes = tp.info().kv_cache_bytes
        ranks = [p.pid for p in tp.ranks._procs.values()]
        awake = sum(map(status_bytes, ranks))
        tp.sleep(1)
        asleep = sum(map(status_bytes, ranks))
        assert awake - asleep >= kv_bytes // 2, (awake, asleep, kv_bytes)
        tp.wakeup()
        assert [t for t, _ in _outputs(tp, prompts)] == before


def test_a_split_the_model_cannot_take_is_refused_before_any_rank_starts(tiny_models):
    with pytest.raises(InvalidRequest, match="tensor parallelism 5"):
        Engine(EngineConfig(dtype="float32", model=tiny_models("llama").path, tensor_parallel=5))
