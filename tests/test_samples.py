"""`n` samples of one prompt: prefilled once and forked, sharing the prompt's KV blocks (the last, partly filled
one copied when written); each sample equals a request of its own with seed + index. Also the prompt's
log-probabilities and the logit bias, which come with the same protocol work."""

from __future__ import annotations

import threading

import grpc
import pytest

from lmgate.engine import Engine
from lmgate.engine.config import EngineConfig
from lmgate.engine.errors import InvalidRequest
from lmgate.engine.gateway.request import FinishReason, Request, RequestKind, RequestOutput, TokenLogprob
from lmgate.engine.sampling.sampler import SamplingParams
from lmgate.engine.scheduling.block_manager import BlockManager
from lmgate.engine.scheduling.scheduler import Scheduler
from lmgate.engine.scheduling.sequence import Sequence, Session
from lmgate.service import convert
from lmgate.v1 import lmgate_pb2 as pb

GUARD = 120  # seconds: a guard against a hang, never a timing
PROMPT = "Write one sentence about a lighthouse keeper named Ada."


def assert_idle(engine: Engine) -> None:
    info = engine.info()
    assert info.kv_blocks_free == info.kv_blocks_total
    assert info.running_sequences == 0 and info.waiting_sequences == 0


@pytest.fixture(scope="module", params=["off", "on"])
def engine(request, checkpoint):
    """Overlap scheduling on too: the samples forked in a step draw tokens the next step reads on the device."""
    eng = Engine(
        EngineConfig(dtype="float32", kv_cache_tokens=4096, block_size=16, overlap_scheduling=request.param),
        checkpoint=checkpoint,
    )
    yield eng
    eng.shutdown()


# ------------------------------------------------------------------------------------------- the scheduler
def forked(prompt_len: int, n: int, block_size: int = 4) -> tuple[Scheduler, BlockManager, list[Sequence]]:
    """A request of n samples, its prompt prefilled in one step and forked as the loop's launch forks it."""
    blocks = BlockManager(16, block_size)
    scheduler = Scheduler(blocks, {}, max_batch_size=8, max_batched_tokens=64)
    request = Request(RequestKind.GENERATE, 0, lambda out: None, input_ids=list(range(prompt_len)))
    request.params = SamplingParams(n=n, seed=5)
    seq = Sequence(request, Session(0), detokenizer=_Detokenizer(), max_new_tokens=8, eos_ids=frozenset())
    scheduler.add(seq)
    assert scheduler.schedule() == [seq] and seq.num_scheduled == prompt_len
    forks = scheduler.fork(seq)
    seq.num_computed += seq.num_scheduled
    samples = [seq, *forks]
    for s in samples:
        s.token_ids.append(7)  # each drew its first token
    return scheduler, blocks, samples


class _Detokenizer:
    def fresh(self) -> "_Detokenizer":
        return _Detokenizer()


def test_forked_samples_share_the_prompts_blocks_and_copy_the_partly_filled_one_when_written():
    scheduler, blocks, samples = forked(prompt_len=10, n=3)  # blocks of 4: 4 + 4 + 2 tokens
    parent, *forks = samples
    assert [s.index for s in samples] == [0, 1, 2] and [s.seed for s in samples] == [5, 6, 7]
    prompt_blocks = list(parent.block_table)
    assert all(s.block_table == prompt_blocks for s in samples) and blocks.num_free == 16 - 3
    assert [blocks.ref_counts[b] for b in prompt_blocks] == [3, 3, 3]
    batch = scheduler.schedule()  # each writes its second token's KV into the third block
    assert sorted(s.index for s in batch) == [0, 1, 2] and all(s.num_scheduled == 1 for s in batch)
    tails = [s.block_table[2] for s in samples]
    assert len(set(tails)) == 3 and blocks.num_free == 16 - 5  # two copies; the last holder writes in place
    assert scheduler.copies == {t: prompt_blocks[2] for t in tails if t != prompt_blocks[2]}
    assert all(s.block_table[:2] == prompt_blocks[:2] for s in samples)
    assert [blocks.ref_counts[b] for b in prompt_blocks[:2]] == [3, 3] and blocks.ref_counts[prompt_blocks[2]] == 1
    for s in samples:
        scheduler.remove(s)
        blocks.release(s.block_table)
    assert blocks.num_free == 16


def test_samples_of_a_prompt_that_fills_its_blocks_copy_nothing():
    scheduler, blocks, samples = forked(prompt_len=8, n=3)
    scheduler.schedule()  # each starts a block of its own
    assert scheduler.copies == {} and blocks.num_free == 16 - 2 - 3
    assert len({s.block_table[2] for s in samples}) == 3


def test_a_request_of_n_samples_waits_until_all_of_them_fit_in_the_batch():
    blocks = BlockManager(64, 4)
    scheduler = Scheduler(blocks, {}, max_batch_size=4, max_batched_tokens=64)
    running = [Request(RequestKind.GENERATE, 0, lambda out: None, input_ids=[1, 2]) for _ in range(2)]
    for request in running:
        scheduler.add(Sequence(request, Session(0), None, 8, frozenset()))
    scheduler.schedule()
    request = Request(RequestKind.GENERATE, 0, lambda out: None, input_ids=[3, 4], params=SamplingParams(n=3))
    waiting = Sequence(request, Session(0), None, 8, frozenset())
    scheduler.add(waiting)
    assert waiting not in scheduler.schedule()  # 2 running + 3 samples > 4
    scheduler.remove(scheduler.running[0])
    assert waiting in scheduler.schedule()
    later = Sequence(
        Request(RequestKind.GENERATE, 0, lambda out: None, input_ids=[5]), Session(0), None, 8, frozenset()
    )
    scheduler.add(later)
    assert later not in scheduler.schedule()  # the two samples still to fork hold their places in the batch
    scheduler.remove(waiting)  # ended before it forked: they never will
    assert later in scheduler.schedule()


# ------------------------------------------------------------------------------------------- the engine
def test_each_sample_equals_a_request_with_its_seed_and_the_prompt_is_computed_once(engine):
    prompt_len = len(engine.tokenizer.encode(PROMPT))
    params = dict(temperature=0.9, max_new_tokens=6, ignore_eos=True)
    before = engine.info().computed_tokens
    samples = engine.generate_samples(PROMPT, SamplingParams(n=4, seed=11, **params))
    # The prompt once; each sample computes the KV of its tokens but the last (which is only drawn).
    assert engine.info().computed_tokens - before == prompt_len + 4 * (6 - 1)
    assert [s.index for s in samples] == [0, 1, 2, 3]
    for i, sample in enumerate(samples):
        alone = engine.generate(PROMPT, SamplingParams(seed=11 + i, **params))
        assert (sample.token_ids, sample.text, sample.finish_reason) == (
            alone.token_ids,
            alone.text,
            alone.finish_reason,
        )
        assert sample.usage.prompt_tokens == prompt_len and sample.usage.completion_tokens == 6
    assert len({tuple(s.token_ids) for s in samples}) > 1  # seeds apart draw apart
    greedy = engine.generate_samples(PROMPT, SamplingParams(n=2, max_new_tokens=8))
    assert (
        greedy[0].token_ids
        == greedy[1].token_ids
        == engine.generate(PROMPT, SamplingParams(max_new_tokens=8)).token_ids
    )
    assert_idle(engine)


def test_each_sample_ends_on_its_own_and_the_stream_after_the_last(engine):
    """Stop strings and lengths end samples at different tokens: each sample's last output has its reason and
    usage, and only the request's last one ends the stream."""
    params = SamplingParams(n=5, seed=3, temperature=1.0, max_new_tokens=12, stop=(" the",))
    outputs = list(engine.submit(PROMPT, params))
    ends = [o for o in outputs if o.finish_reason is not None]
    assert sorted(o.index for o in ends) == [0, 1, 2, 3, 4]
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert all(o.usage is not None for o in ends)
    for end in ends:
        tokens = [t for o in outputs if o.index == end.index for t in o.token_ids]
        assert end.usage.completion_tokens == len(tokens)
    assert_idle(engine)


def test_cancelling_a_request_of_n_samples_ends_them_all_and_frees_every_block(engine):
    first = threading.Event()
    stream = engine.submit(PROMPT, SamplingParams(n=4, seed=1, temperature=1.0, max_new_tokens=400, ignore_eos=True))
    outputs = []
    for out in stream:
        outputs.append(out)
        if not first.is_set():
            first.set()
            assert stream.cancel()
    ends = [o for o in outputs if o.finish_reason is not None]
    assert outputs[-1].finished and all(o.finish_reason is FinishReason.CANCELLED for o in ends)
    assert sum(len(o.token_ids) for o in outputs) < 4 * 400
    assert_idle(engine)


def test_samples_preempted_for_lack_of_blocks_still_equal_their_seeded_requests(checkpoint):
    """A cache of 12 blocks of 16 tokens: 4 samples of 60 tokens each past a 12-token prompt cannot all hold
    their KV, so some are preempted and recomputed; none of their tokens changes."""
    engine = Engine(
        EngineConfig(dtype="float32", kv_cache_tokens=192, block_size=16, max_batch_size=8), checkpoint=checkpoint
    )
    try:
        params = dict(temperature=0.8, max_new_tokens=60, ignore_eos=True)
        samples = engine.generate_samples(PROMPT, SamplingParams(n=4, seed=21, **params))
        assert engine.info().preemptions > 0
        assert_idle(engine)
        for i, sample in enumerate(samples):
            assert sample.token_ids == engine.generate(PROMPT, SamplingParams(seed=21 + i, **params)).token_ids
    finally:
        engine.shutdown()


def test_n_is_refused_where_it_cannot_run(engine):
    session = engine.start_session()
    with pytest.raises(InvalidRequest, match="stateless"):
        engine.submit(PROMPT, SamplingParams(n=2), session_id=session)
    with pytest.raises(InvalidRequest, match="exceeds the batch"):
        engine.submit(PROMPT, SamplingParams(n=engine.config.max_batch_size + 1))
    with pytest.raises(InvalidRequest, match="n must be"):
        SamplingParams(n=0)
    engine.end_session(session)
    assert_idle(engine)


# ------------------------------------------------------------------------------------------- prompt logprobs, logit bias
def test_prompt_logprobs_equal_the_logprobs_of_the_same_tokens_generated(checkpoint):
    """Two paths to one number: the greedy continuation's logprobs as it is drawn (decode rows), and the same
    tokens' as prompt logprobs of prompt + continuation (prefill rows, in chunks of 8, no prefix cache)."""
    engine = Engine(EngineConfig(dtype="float32", kv_cache_tokens=2048, max_batched_tokens=8), checkpoint=checkpoint)
    try:
        ids = engine.tokenizer.encode(PROMPT)
        drawn = engine.generate(ids, SamplingParams(max_new_tokens=10, logprobs=2, ignore_eos=True))
        both = ids + drawn.token_ids
        scored = engine.generate(both, SamplingParams(max_new_tokens=1, prompt_logprobs=2))
        scored_again = engine.generate(both, SamplingParams(max_new_tokens=1, prompt_logprobs=0))
        assert [lp.token_id for lp in scored.prompt_logprobs] == both[1:]
        tail = scored.prompt_logprobs[len(ids) - 1 :]
        assert [lp.logprob for lp in tail] == pytest.approx([lp.logprob for lp in drawn.logprobs], abs=1e-4)
        assert [[t for t, _ in lp.top] for lp in tail] == [[t for t, _ in lp.top] for lp in drawn.logprobs]
        assert [lp.logprob for lp in scored_again.prompt_logprobs] == [lp.logprob for lp in scored.prompt_logprobs]
        assert all(lp.top == [] for lp in scored_again.prompt_logprobs)
        with pytest.raises(InvalidRequest, match="stateless"):
            engine.submit(ids, SamplingParams(prompt_logprobs=1), session_id=engine.start_session())
    finally:
        engine.shutdown()


def test_logit_bias_moves_the_greedy_choice(engine):
    greedy = engine.generate(PROMPT, SamplingParams(max_new_tokens=3, logprobs=1))
    first = greedy.token_ids[0]
    banned = engine.generate(PROMPT, SamplingParams(max_new_tokens=3, logit_bias=((first, -100.0),)))
    assert banned.token_ids[0] != first
    forced = engine.generate(PROMPT, SamplingParams(max_new_tokens=3, logit_bias=((42, 100.0),)))
    assert forced.token_ids == [42, 42, 42]
    with pytest.raises(InvalidRequest, match="vocabulary"):
        engine.submit(PROMPT, SamplingParams(logit_bias=((engine.vocab_size, 1.0),)))
    with pytest.raises(InvalidRequest, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias=((1, 101.0),))
    assert_idle(engine)


# ------------------------------------------------------------------------------------------- lmgate.v1
@pytest.fixture(params=["server", "process_ranks_server"])
def any_server(request):
    return request.getfixturevalue(request.param)


def test_lmgate_v1_streams_each_sample_with_its_index(any_server):
    sampling = pb.SamplingParams(n=3, seed=9, temperature=1.0, max_new_tokens=8, logprobs=1, prompt_logprobs=1)
    request = pb.GenerateRequest(prompt=PROMPT, sampling=sampling)
    messages = list(any_server.stub().Generate(request, timeout=GUARD))
    assert {m.index for m in messages} == {0, 1, 2}
    assert [m.index for m in messages if m.finish_reason].count(0) == 1 and messages[-1].finish_reason
    assert len([m for m in messages if m.prompt_logprobs]) == 1 and messages[0].index == 0
    prompt_len = len(any_server.engine.tokenizer.encode(PROMPT))
    assert len(messages[0].prompt_logprobs) == prompt_len - 1
    for i in range(3):
        alone = pb.SamplingParams(seed=9 + i, temperature=1.0, max_new_tokens=8, logprobs=1)
        reference = list(any_server.stub().Generate(pb.GenerateRequest(prompt=PROMPT, sampling=alone), timeout=GUARD))
        mine = [m for m in messages if m.index == i]
        assert [t for m in mine for t in m.token_ids] == [t for m in reference for t in m.token_ids]
        assert "".join(m.text for m in mine) == "".join(m.text for m in reference)
        assert [lp.token for m in mine for lp in m.logprobs] == [lp.token for m in reference for lp in m.logprobs]
        assert mine[-1].usage.completion_tokens == reference[-1].usage.completion_tokens
    info = any_server.engine.info()
    assert info.kv_blocks_free == info.kv_blocks_total


def test_a_long_prompts_logprobs_go_ahead_in_messages_under_the_limit():
    scored = [TokenLogprob(5, -1.5, [(t, -2.0) for t in range(20)]) for _ in range(12000)]
    first = RequestOutput("r", 0, token_ids=[7], text="x", prompt_logprobs=scored)
    messages = convert.responses([first, RequestOutput("r", 0, token_ids=[8], text="y")], lambda t: "tok")
    assert len(messages) > 2 and all(m.ByteSize() <= convert.MAX_MESSAGE_BYTES for m in messages)
    *heads, last = messages
    assert all(not m.token_ids for m in heads) and list(last.token_ids) == [7, 8] and not last.prompt_logprobs
    assert sum(len(m.prompt_logprobs) for m in heads) == 12000


def test_lmgate_v1_refuses_n_on_a_session_turn(server):
    session = server.stub().Start(pb.StartRequest()).session_id
    request = pb.GenerateRequest(session_id=session, prompt=PROMPT, sampling=pb.SamplingParams(n=2))
    with pytest.raises(grpc.RpcError) as err:
        list(server.stub().Generate(request, timeout=GUARD))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    server.stub().End(pb.EndRequest(session_id=session))
