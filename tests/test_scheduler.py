"""The scheduler on hand-built sequences: its batch order (the model runner reads the first rows as decodes) and
its admission under a full cache."""

from __future__ import annotations

import random
import threading

import pytest

from lmgate.engine.scheduling.block_manager import BlockManager
from lmgate.engine.gateway.request import Request, RequestKind
from lmgate.engine.scheduling.scheduler import Scheduler
from lmgate.engine.scheduling.sequence import Sequence, SequenceStatus, Session


def sequence(prompt: list[int]) -> Sequence:
    request = Request(RequestKind.GENERATE, 0, lambda out: None, input_ids=prompt)
    return Sequence(request, Session(0), detokenizer=None, max_new_tokens=8, eos_ids=frozenset())


def running_sequence(prompt_len: int, computed: int) -> Sequence:
    seq = sequence(list(range(prompt_len)))
    seq.status, seq.num_computed = SequenceStatus.RUNNING, computed
    return seq


def test_a_one_token_prefill_chunk_goes_after_the_decodes():
    """Two tokens of budget, one decode: the prefill ahead of it in `running` gets a chunk of one token, which
    must come after the decode (it was sorted among the decodes, and its row read as one)."""
    scheduler = Scheduler(BlockManager(16, 16), {}, max_batch_size=8, max_batched_tokens=2)
    prefilling, decoding = running_sequence(40, computed=16), running_sequence(3, computed=2)
    scheduler.running = [prefilling, decoding]
    batch = scheduler.schedule()
    assert batch == [decoding, prefilling]
    assert (decoding.num_scheduled, prefilling.num_scheduled) == (1, 1)


def test_admission_counts_the_free_cached_blocks_it_takes():
    """A waiting prompt whose cached prefix lies on the free list, its first chunk cut by the budget: taking
    the prefix uses up free blocks too. Counted only after it was taken, the chunk found no room, preempted
    the sequence just admitted, and admitted it again with the same budget: `schedule` never returned."""
    blocks = BlockManager(4, 4)
    scheduler = Scheduler(blocks, {}, max_batch_size=8, max_batched_tokens=5)

    def computed(prompt: list[int]) -> Sequence:
        seq = sequence(prompt)
        scheduler.add(seq)
        while seq.num_uncomputed:
            scheduler.schedule()
            seq.num_computed += seq.num_scheduled
            blocks.cache_full_blocks([seq])
        seq.token_ids.append(1)  # its first sampled token
        return seq

    shared = list(range(100, 108))  # two full blocks
    finished = computed(shared + [1])
    scheduler.remove(finished)
    blocks.release(finished.block_table)  # its two full blocks stay cached on the free list
    decoding = computed(list(range(500, 507)))  # holds the two other blocks
    arriving = sequence(shared + list(range(900, 908)))
    assert sorted(blocks.free) == sorted(blocks.match_prefix(arriving))  # the only free blocks are its prefix
    scheduler.add(arriving)
    outcome: list[list[Sequence]] = []
    worker = threading.Thread(target=lambda: outcome.append(scheduler.schedule()), daemon=True)
    worker.start()
    worker.join(60)  # a guard against the old endless loop, not a timing: the step takes microseconds
    assert outcome, "schedule() did not return"
    # the decode runs; the prompt takes its two cached blocks and waits, as two more would not fit beside them
    assert outcome[0] == [decoding] and scheduler.num_preemptions == 0
    assert list(scheduler.waiting) == [arriving] and not arriving.block_table and blocks.num_free == 2
    scheduler.remove(decoding)
    blocks.release(decoding.block_table)
    assert scheduler.schedule() == [arriving] and arriving.num_cached_tokens == 8 and arriving.num_scheduled == 5


def test_a_sequence_whose_last_token_is_still_on_the_device_is_not_scheduled_again():
    """Overlap scheduling: a decode whose draw is on the device runs again (its input taken from there), unless
    that draw is its last (max_new_tokens): it then only waits to be read. A preempted sequence with a draw on
    the device is not admitted before the draw is read (its recompute needs the token)."""
    scheduler = Scheduler(BlockManager(16, 16), {}, max_batch_size=8, max_batched_tokens=64)
    going, ending = running_sequence(3, computed=3), running_sequence(3, computed=3)
    going.num_pending = ending.num_pending = 1
    ending.token_ids += [7] * (ending.max_new_tokens - 1)  # its draw on the device is number max_new_tokens
    ending.num_computed = len(ending.token_ids)
    scheduler.running = [going, ending]
    assert scheduler.schedule() == [going] and going.num_scheduled == 1 and going.samples_this_step
    preempted = sequence([1, 2, 3])
    preempted.num_pending = 1
    scheduler.add(preempted)
    assert preempted not in scheduler.schedule()
    preempted.token_ids.append(9)
    preempted.num_pending = 0
    assert preempted in scheduler.schedule() and preempted.num_scheduled == 4


def test_a_waiting_turn_gives_up_its_sessions_kv_to_the_head_of_the_queue():
    """Two sessions' next turns arrive at once, each taking over its session's two blocks of four, each
    needing a third. The head of the queue needs a block only the other waiting turn holds: once it
    could not take it, nothing was ever admitted again. Now the turn behind it drops that KV (recomputed
    when it runs, and not counted as cached) and the head runs."""
    blocks = BlockManager(4, 16)
    sessions, turns = {}, []
    for sid in (1, 2):
        session = sessions[sid] = Session(sid)
        session.token_ids = list(range(25))
        session.block_table, session.num_computed = blocks.allocate(2), 24
        request = Request(RequestKind.GENERATE, sid, lambda out: None, input_ids=list(range(100, 110)))
        turn = Sequence(request, session, detokenizer=None, max_new_tokens=8, eos_ids=frozenset())
        session.active = turn
        turns.append(turn)
    scheduler = Scheduler(blocks, sessions, max_batch_size=8, max_batched_tokens=64)
    for turn in turns:
        scheduler.add(turn)
    head, behind = turns
    assert head.num_cached_tokens == behind.num_cached_tokens == 24
    assert scheduler.schedule() == [head] and head.num_scheduled == 11 and len(head.block_table) == 3
    assert list(scheduler.waiting) == [behind] and not behind.block_table and behind.num_computed == 0
    assert behind.num_cached_tokens == 0 and head.num_cached_tokens == 24


def test_an_idle_sessions_kv_stays_while_dropping_it_would_not_admit_the_head():
    """Ten blocks of four: a running prompt holds five, an idle session three, two are free. The head of the
    queue needs six: dropping the session's three would not admit it, so the session keeps them (it dropped
    them every step, and recomputed its history next turn). A head that fits once they go still gets them."""
    blocks = BlockManager(10, 4)
    idle = Session(7)
    idle.token_ids, idle.block_table, idle.num_computed = list(range(12)), blocks.allocate(3), 12
    scheduler = Scheduler(blocks, {7: idle}, max_batch_size=8, max_batched_tokens=64)
    running = running_sequence(20, computed=19)  # decoding its last prompt token, in its five blocks
    running.block_table = blocks.allocate(5)
    scheduler.running = [running]
    head = sequence(list(range(200, 224)))
    scheduler.add(head)
    for _ in range(3):
        assert scheduler.schedule() == [running]
        assert head.status is SequenceStatus.WAITING and len(idle.block_table) == 3 and blocks.num_free == 2
    scheduler.waiting.clear()
    fits = sequence(list(range(300, 320)))  # five blocks: the two free and the session's three
    scheduler.add(fits)
    assert fits in scheduler.schedule() and not idle.block_table and blocks.num_free == 0


def computing(scheduler: Scheduler) -> list[Sequence]:
    """One step as the loop runs it: schedule, compute what was scheduled, key the blocks filled (no sampling:
    a prefill that reaches its prompt's end draws nothing here)."""
    batch = scheduler.schedule()
    for seq in batch:
        seq.num_computed += seq.num_scheduled
    scheduler.blocks.cache_full_blocks(batch)
    return batch


def test_prompts_that_share_a_prefill_under_way_wait_for_its_blocks_and_take_them_from_the_cache():
    """Three copies of a prompt of five blocks and a prompt of its own, queued at once with budget for all: the
    first copy computes the prompt, the other two wait a step and take its four shared blocks from the cache (its
    last block holds their last token, which each computes); the prompt of its own, behind them, runs at once."""
    blocks = BlockManager(64, 16)
    scheduler = Scheduler(blocks, {}, max_batch_size=8, max_batched_tokens=1024)
    shared = list(range(1000, 1080))
    first, second, third = (sequence(shared) for _ in range(3))
    alone = sequence(list(range(2000, 2080)))
    for seq in (first, second, third, alone):
        scheduler.add(seq)
    assert computing(scheduler) == [first, alone]
    assert list(scheduler.waiting) == [second, third] and second.follows == (first, 4)
    assert computing(scheduler) == [second, third]  # first and alone computed their prompts (nothing drawn here)
    for seq in (second, third):
        assert seq.num_cached_tokens == 64 and seq.num_scheduled == 16 and seq.block_table[:4] == first.block_table[:4]
    assert blocks.hit_tokens == 128


def test_a_prompt_follows_a_chunked_prefill_until_its_shared_blocks_are_keyed():
    """A budget of 64 tokens: the first of two prompts that share ten blocks prefills them in three chunks; the
    second, looked at once the last chunk leaves budget, waits while that chunk computes the last two, then
    takes all ten from the cache."""
    blocks = BlockManager(64, 16)
    scheduler = Scheduler(blocks, {}, max_batch_size=8, max_batched_tokens=64)
    shared = list(range(1000, 1160))
    first, second = sequence(shared), sequence(shared + [7])
    scheduler.add(first)
    scheduler.add(second)
    for _ in range(3):
        assert computing(scheduler) == [first] and second.status is SequenceStatus.WAITING
    assert computing(scheduler) == [second] and second.num_cached_tokens == 160 and second.num_scheduled == 1
    assert second.block_table[:10] == first.block_table


def test_a_follower_runs_on_its_own_once_its_prefill_ends_or_shares_too_little():
    """Cancelled before its blocks were keyed, the prefill no longer holds its follower back: that computes the
    prompt itself. A prompt sharing one block (16 tokens, under FOLLOW_MIN_TOKENS) with a prefill under way
    does not wait for it."""
    blocks = BlockManager(64, 16)
    scheduler = Scheduler(blocks, {}, max_batch_size=8, max_batched_tokens=1024)
    shared = list(range(1000, 1160))
    first, second = sequence(shared), sequence(shared)
    scheduler.add(first)
    scheduler.add(second)
    assert scheduler.schedule() == [first] and second.follows == (first, 9)
    scheduler.remove(first)  # cancelled while its step ran: its blocks go back without keys
    blocks.release(first.block_table)
    assert computing(scheduler) == [second] and second.num_cached_tokens == 0 and second.follows is None
    own = sequence(list(range(3000, 3016)) + list(range(4000, 4060)))
    alike = sequence(list(range(3000, 3016)) + list(range(5000, 5060)))
    scheduler.add(own)
    scheduler.add(alike)
    assert computing(scheduler) == [own, alike] and alike.num_cached_tokens == 0


@pytest.mark.parametrize("seed", range(4))
def test_random_arrivals_cancels_and_preemptions_share_only_computed_blocks(seed):
    """Prompts drawn from three shared beginnings arrive alone and in bursts, are cancelled, run and end at random
    under a small cache (preemptions, evictions) and a random budget. Every position computed writes its token
    into a shadow of the KV; at every step each running sequence's computed positions must hold its own tokens
    there, which a block taken from the cache before its prefill computed it would not. Every sequence ends, some
    having waited for a prefill (`follows`), and then every block is free."""
    rng = random.Random(seed)
    bs = 4
    blocks = BlockManager(48, bs)
    scheduler = Scheduler(blocks, {}, max_batch_size=6, max_batched_tokens=32)
    beginnings = [[rng.randrange(1000) for _ in range(rng.randrange(36, 64))] for _ in range(3)]
    shadow: dict[tuple[int, int], int] = {}  # (block, offset) -> the token whose KV it holds
    live: list[Sequence] = []
    finished = followed = 0

    def end(seq: Sequence) -> None:
        if seq.status is not SequenceStatus.FINISHED:
            scheduler.remove(seq)
            blocks.release(seq.block_table)
        live.remove(seq)

    for step in range(800):
        if step < 600 and rng.random() < 0.3:
            beginning = rng.choice(beginnings)
            for _ in range(rng.choice((1, 1, 2, 4))):
                seq = sequence(beginning + [rng.randrange(1000) for _ in range(rng.randrange(0, 12))])
                scheduler.add(seq)
                live.append(seq)
        if live and rng.random() < 0.05:
            end(rng.choice(live))  # cancelled, waiting or running
        scheduler.max_batched_tokens = rng.randrange(8, 96)
        for seq in scheduler.schedule():
            for pos in range(seq.num_computed, seq.num_computed + seq.num_scheduled):
                shadow[seq.block_table[pos // bs], pos % bs] = seq.token_ids[pos]
            seq.num_computed += seq.num_scheduled
            if seq.num_computed == len(seq.token_ids):  # its prompt's last position: it draws a token
                seq.token_ids.append(rng.randrange(1000))
        blocks.cache_full_blocks(scheduler.running)
        followed += any(s.follows is not None for s in scheduler.waiting)
        for seq in list(scheduler.running):
            assert all(
                shadow[seq.block_table[pos // bs], pos % bs] == seq.token_ids[pos] for pos in range(seq.num_computed)
            )
            if seq.num_output >= seq.max_new_tokens:
                end(seq)
                finished += 1
    assert not live and finished > 100
    assert scheduler.num_preemptions > 0 and blocks.hit_tokens > 0 and followed > 0
    assert blocks.num_free == blocks.num_blocks and not any(blocks.ref_counts)
