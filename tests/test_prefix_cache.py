"""Automatic prefix caching: full KV blocks shared by prompts that start with the same tokens, in stateless
requests and across sessions; never a change in output; evicted (least recently used) before any session's
KV or running sequence is touched; every block free again afterwards."""

from __future__ import annotations

import random
import threading

import pytest

from lmgate.engine.scheduling.block_manager import BlockManager
from lmgate.engine.config import EngineConfig
from lmgate.engine.engine import Engine
from lmgate.engine.gateway.request import FinishReason
from lmgate.engine.sampling.sampler import SamplingParams
from lmgate.engine.scheduling.sequence import Session

GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


def config(**kw) -> EngineConfig:
    return EngineConfig(**{"dtype": "float32", "kv_cache_tokens": 4096, **kw})


@pytest.fixture(scope="module")
def cached(checkpoint):
    with Engine(config(), checkpoint=checkpoint) as eng:
        yield eng


@pytest.fixture(scope="module")
def uncached(checkpoint):
    with Engine(config(prefix_caching=False), checkpoint=checkpoint) as eng:
        yield eng


def words(seed: int, n: int, vocab: int = 49152) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200, vocab) for _ in range(n)]


def assert_all_free(engine: Engine) -> None:
    for loop in engine.loops:
        assert loop.blocks.num_free == loop.blocks.num_blocks and not any(loop.blocks.ref_counts)


def test_shared_prefix_reused_and_output_unchanged(cached, uncached):
    prefix = words(1, 200)
    first = cached.generate(prefix + words(2, 20), GREEDY)
    second = cached.generate(prefix + words(3, 20), GREEDY)
    assert second.usage.cached_tokens >= 192
    assert first.token_ids == uncached.generate(prefix + words(2, 20), GREEDY).token_ids
    assert second.token_ids == uncached.generate(prefix + words(3, 20), GREEDY).token_ids
    retried = cached.generate(prefix + words(3, 20), GREEDY)  # a retry: all but the last block's tail
    assert retried.token_ids == second.token_ids and retried.usage.cached_tokens == 208
    assert uncached.generate(prefix + words(3, 20), GREEDY).usage.cached_tokens == 0
    info = cached.info()
    assert 0 < info.prefix_cache_hit_tokens <= info.prefix_cache_queried_tokens
    assert_all_free(cached)


def test_copies_of_a_prompt_sent_at_once_compute_it_once(checkpoint, uncached):
    """Six prompts sharing 200 tokens, queued together behind a long prefill (its step lets them all arrive),
    with budget for every one of them: the first computes the shared blocks, the other five wait for them and
    take them from the cache, and each gets the output it gets alone."""
    prefix = words(1, 200)
    prompts = [prefix + words(10 + i, 20) for i in range(6)]
    with Engine(config(max_batched_tokens=2048), checkpoint=checkpoint) as eng:
        blocker = eng.submit(words(9, 1500), GREEDY)
        streams = [eng.submit(p, GREEDY) for p in prompts]
        outputs = [list(s) for s in streams]
        assert len(list(blocker)) > 0
        cached = sorted(outs[-1].usage.cached_tokens for outs in outputs)
        assert cached[0] == 0 and cached[1] >= 192, cached
        for prompt, outs in zip(prompts, outputs):
            assert [t for o in outs for t in o.token_ids] == uncached.generate(prompt, GREEDY).token_ids
        assert_all_free(eng)


def test_sessions_share_system_prompt_blocks(cached, uncached):
    system = [{"role": "system", "content": "You answer in one short sentence. " * 12}]
    a, b = cached.start_session(), cached.start_session()
    cached.generate(system + [{"role": "user", "content": "Name a fruit."}], GREEDY, session_id=a)
    cached.generate(system + [{"role": "user", "content": "Name a tree."}], GREEDY, session_id=b)
    blocks = cached.loops[0].blocks
    table_a, table_b = (cached.loops[0].sessions[s].block_table for s in (a, b))
    shared = [x for x, y in zip(table_a, table_b) if x == y]
    assert len(shared) >= 4 and all(blocks.ref_counts[x] == 2 for x in shared)
    cached.end_session(a)
    assert all(blocks.ref_counts[x] == 1 for x in shared)
    got = cached.generate([{"role": "user", "content": "And a flower?"}], GREEDY, session_id=b)
    ref = uncached.start_session()
    uncached.generate(system + [{"role": "user", "content": "Name a tree."}], GREEDY, session_id=ref)
    want = uncached.generate([{"role": "user", "content": "And a flower?"}], GREEDY, session_id=ref)
    assert got.token_ids == want.token_ids
    cached.end_session(b)
    uncached.end_session(ref)
    assert_all_free(cached)


def test_eviction_under_tiny_kv_budget_with_preemption(checkpoint, uncached):
    prefixes = [words(10 + i, 96) for i in range(3)]
    prompts = [prefixes[i % 3] + words(100 + i, 24) for i in range(12)]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    with Engine(config(kv_cache_tokens=512, max_batch_size=8), checkpoint=checkpoint) as small:
        sid = small.start_session()
        small.generate(words(5, 60), GREEDY, session_id=sid)  # an idle session's KV: dropped last
        streams = [small.submit(p, params) for p in prompts]
        outputs = [list(s) for s in streams]
        assert small.info().preemptions > 0
        for prompt, outs in zip(prompts, outputs):
            assert [t for o in outs for t in o.token_ids] == uncached.generate(prompt, params).token_ids
        assert sum(o[-1].usage.cached_tokens for o in outputs) > 0
        small.end_session(sid)
        assert_all_free(small)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_chunked_prompts_under_a_full_cache_finish(checkpoint, uncached, prefix_caching):
    """Plain memory pressure, nothing shared: the newest stream is preempted, its full blocks stay cached on
    the free list, and its chunked prefill (8 tokens a step) takes them back when it is admitted again. The
    scheduler once counted them only after taking them and preempted and admitted that stream forever."""
    prompts = [words(20, 4), words(21, 14)]
    params = [SamplingParams(max_new_tokens=20, ignore_eos=True), SamplingParams(max_new_tokens=14, ignore_eos=True)]
    small = config(block_size=4, kv_cache_tokens=32, max_batched_tokens=8, prefix_caching=prefix_caching)
    with Engine(small, checkpoint=checkpoint) as eng:
        streams = [eng.submit(p, sp) for p, sp in zip(prompts, params)]
        results: list[list] = [[], []]
        readers = [threading.Thread(target=out.extend, args=(s,), daemon=True) for out, s in zip(results, streams)]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(300)  # a guard against the old endless loop, not a timing
        assert not any(reader.is_alive() for reader in readers), "a stream never ended"
        assert eng.info().preemptions > 0
        for prompt, sp, outs in zip(prompts, params, results):
            assert [t for o in outs for t in o.token_ids] == uncached.generate(prompt, sp).token_ids
        assert_all_free(eng)


def test_idle_session_kv_outlives_unused_cached_blocks(checkpoint):
    with Engine(config(kv_cache_tokens=256, max_batch_size=4), checkpoint=checkpoint) as small:
        sid = small.start_session()
        small.generate(words(7, 64), GREEDY, session_id=sid)
        session: Session = small.loops[0].sessions[sid]
        held = list(session.block_table)
        for i in range(4):  # fill the cache with blocks no one holds
            small.generate(words(20 + i, 80), GREEDY)
        assert session.block_table == held  # evicting cached blocks came first
        small.end_session(sid)
        assert_all_free(small)


def test_the_block_a_stopped_sequence_fills_one_step_late_is_shared(checkpoint, uncached):
    """Overlap scheduling runs a sequence once more after the step that drew its stop token, and that last step
    may fill a block (the stop token's KV ends it): the block is keyed before the request's blocks go back,
    so a prompt that repeats the request's whole text takes every full block of it from the cache."""
    bs = 16
    for length in range(30, 46):  # a prompt after which the stop token's KV ends a block, the token new there
        prompt = words(7, length)
        out = uncached.generate(prompt, SamplingParams(max_new_tokens=bs, ignore_eos=True)).token_ids
        j = bs - length % bs  # the output tokens through the one whose KV ends the block
        if j >= 2 and out[j - 1] not in out[: j - 1]:
            break
    else:
        pytest.fail("no prompt length gave a stop token new to its output")
    with Engine(config(overlap_scheduling="on", block_size=bs), checkpoint=checkpoint) as eng:
        stop = SamplingParams(max_new_tokens=bs, stop_token_ids=(out[j - 1],), ignore_eos=True)
        first = eng.generate(prompt, stop)
        assert first.finish_reason is FinishReason.STOP and first.token_ids == out[:j]
        again = eng.generate(prompt + out[:j] + [5], GREEDY)
        assert again.usage.cached_tokens == length + j
        assert_all_free(eng)


def test_cancel_and_sleep_with_shared_blocks(checkpoint, uncached):
    prefix = words(30, 128)
    long = SamplingParams(max_new_tokens=400, ignore_eos=True)
    with Engine(config(), checkpoint=checkpoint) as eng:
        streams = [eng.submit(prefix + words(40 + i, 8), long) for i in range(4)]
        iters = [iter(s) for s in streams]
        for it in iters:
            next(it)
        streams[0].cancel()
        assert list(iters[0])[-1].finish_reason is FinishReason.CANCELLED
        eng.sleep(1)
        for it in iters[1:]:
            assert list(it)[-1].finish_reason is FinishReason.CANCELLED
        assert_all_free(eng)
        eng.wakeup()
        again = eng.generate(prefix + words(41, 8), GREEDY)
        assert again.usage.cached_tokens == 0  # sleep freed the KV, so nothing is cached
        assert again.token_ids == uncached.generate(prefix + words(41, 8), GREEDY).token_ids
        assert_all_free(eng)


def test_new_weights_empty_the_prefix_cache(checkpoint):
    prompt = words(50, 100)
    with Engine(config(), checkpoint=checkpoint) as eng:
        eng.generate(prompt, GREEDY)
        assert eng.generate(prompt, GREEDY).usage.cached_tokens == 96
        eng.update_weights(checkpoint.path)
        assert eng.generate(prompt, GREEDY).usage.cached_tokens == 0


def test_kv_computed_beside_replaced_weights_is_never_shared(checkpoint, checkpoints):
    """A session's KV outlives new weights, and so do the blocks its next turn computes with the new weights:
    they attend to the old KV. None of it may enter the prefix cache: a later stateless request whose prompt
    starts with that conversation once took such a block and answered differently from the same request
    computed afresh."""
    logprobs = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=1)
    with Engine(config(), checkpoint=checkpoint) as eng:
        eng.start_session(5)
        eng.generate(words(60, 40), SamplingParams(max_new_tokens=1), session_id=5)
        eng.update_weights(checkpoints["changed"])
        eng.generate(words(61, 30), SamplingParams(max_new_tokens=1), session_id=5)
        history = eng.loops[0].sessions[5].token_ids
        prompt = history[:48] + words(62, 11)  # three whole blocks of the conversation, then new tokens
        fresh = eng.generate(prompt, logprobs)
        again = eng.generate(prompt, logprobs)
        assert again.usage.cached_tokens > 0  # the first request's own blocks serve the second
        assert again.token_ids == fresh.token_ids
        for a, b in zip(again.logprobs, fresh.logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        eng.end_session(5)
        assert_all_free(eng)


def test_block_manager_evicts_least_recently_released_cached_block():
    bm = BlockManager(num_blocks=6, block_size=2)

    class Seq(Session):  # the fields match_prefix and cache_full_blocks read
        def __init__(self, tokens):
            super().__init__(0)
            self.token_ids = tokens
            self.prompt_logprobs = None

    first, second = Seq([1, 2, 3, 4, 9]), Seq([5, 6, 7, 8, 9])
    for seq in (first, second):
        seq.block_table = bm.allocate(2)
        seq.num_computed = 4
        bm.cache_full_blocks([seq])
    bm.release(first.block_table)
    bm.release(second.block_table)
    assert bm.num_free == 6 and len(bm.cached) == 4
    bm.allocate(3)  # the two never-used blocks, then first's tail block (released before its head)
    assert len(bm.cached) == 3
    again = Seq([1, 2, 3, 4, 9])
    assert bm.take_prefix(again, bm.match_prefix(again)) == 2 and again.block_table == first.block_table[:1]
    other = Seq([5, 6, 7, 8, 9])
    assert bm.take_prefix(other, bm.match_prefix(other)) == 4 and other.block_table == second.block_table


def test_a_block_is_shared_only_after_the_same_whole_prefix():
    """Two first blocks whose Python hashes agree (an int hashes modulo 2**61 - 1), then the same second
    block: the chain names the whole prefix, so the second prompt computes its own second block instead of
    attending to the first one's context."""
    bm = BlockManager(num_blocks=6, block_size=2)

    class Seq(Session):
        def __init__(self, tokens):
            super().__init__(0)
            self.token_ids = tokens
            self.prompt_logprobs = None

    victim, crafted = [7, 8, 3, 4, 9], [7 + 2**61 - 1, 8, 3, 4, 9]
    assert hash(tuple(victim[:2])) == hash(tuple(crafted[:2]))
    first = Seq(victim)
    first.block_table, first.num_computed = bm.allocate(2), 4
    bm.cache_full_blocks([first])
    assert bm.match_prefix(Seq(victim)) == first.block_table
    attacker = Seq(crafted)  # its first block computed itself (it matches nothing), then a look for the rest
    attacker.block_table, attacker.num_computed = bm.allocate(1), 2
    bm.cache_full_blocks([attacker])
    assert bm.match_prefix(attacker) == []
