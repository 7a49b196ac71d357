"""Overlap scheduling (engine_loop.py): each step goes to the device before the previous step's draws are read.

On the CPU the device is the host, so nothing overlaps in time, but every path of the pipeline runs: decodes
whose input is a draw the host has not read yet, sequences that end a step late (their extra token dropped),
cancels and session ends between a step's launch and its read, preemption. Each test compares with the same
engine run one step at a time."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from lmgate.engine.config import EngineConfig
from lmgate.engine.engine import Engine
from lmgate.engine.gateway.request import FinishReason
from lmgate.engine.sampling.sampler import SamplingParams
from tests.test_engine import assert_idle, chat

MIXED = [
    SamplingParams(max_new_tokens=40, ignore_eos=True),
    SamplingParams(max_new_tokens=64),  # greedy until EOS, for the chat prompts
    SamplingParams(max_new_tokens=30, temperature=0.8, seed=7),
    SamplingParams(max_new_tokens=30, temperature=0.9, top_p=0.9, top_k=40, min_p=0.02, seed=11),
    SamplingParams(max_new_tokens=50, stop=("\n",)),
    SamplingParams(max_new_tokens=25, logprobs=2),
    SamplingParams(max_new_tokens=20, repetition_penalty=1.3, frequency_penalty=0.5),
    SamplingParams(max_new_tokens=30, min_new_tokens=12, temperature=1.0, seed=3),
]


def outcome(out) -> tuple:
    return out.token_ids, out.text, out.finish_reason, [(lp.token_id, lp.logprob) for lp in out.logprobs]


def run_mixed(checkpoint, prompts: list[list[int]], overlap: str, max_batch_size: int) -> list[tuple]:
    """Every prompt with every kind of sampling, all submitted at once."""
    config = EngineConfig(
        dtype="float32", max_batch_size=max_batch_size, max_batched_tokens=64, overlap_scheduling=overlap
    )
    with Engine(config, checkpoint=checkpoint) as engine:
        with ThreadPoolExecutor(16) as pool:
            outs = list(pool.map(lambda job: engine.generate(*job), [(p, s) for p in prompts for s in MIXED]))
        assert all(loop.overlap == (overlap == "on") for loop in engine.loops)
        assert_idle(engine)
    return [outcome(o) for o in outs]


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [
        tokenizer.encode(t)
        for t in (
            "Once upon a time",
            "def fibonacci(n):\n    ",
            chat(tokenizer, ("user", "Name three colours.")),
        )
    ]


def test_one_sequence_at_a_time_every_bit_equals_one_step_at_a_time(checkpoint, tokenizer, prompts):
    """A batch of one: the same rows in every step either way, so the same numbers. Seeded draws, banned ids
    (min_new_tokens) and logprobs of a step whose input was still on the device, each way a stream ends found
    a step late: all as without overlap."""
    overlapped = run_mixed(checkpoint, prompts, "on", max_batch_size=1)
    assert overlapped == run_mixed(checkpoint, prompts, "off", max_batch_size=1)
    reasons = [o[2] for o in overlapped]
    assert FinishReason.LENGTH in reasons
    assert any(o[2] is FinishReason.STOP and o[0][-1] in tokenizer.eos_token_ids for o in overlapped)
    assert any(o[2] is FinishReason.STOP and "\n" not in o[1] and len(o[0]) < 50 for o in overlapped[4 :: len(MIXED)])


def test_a_changing_batch_gives_the_greedy_tokens_of_one_step_at_a_time(checkpoint, prompts):
    """More streams than a batch: sequences join and leave the running batch at every step, some a step late.
    A batch's make-up changes the float sums a little (so sampled draws may part ways); greedy tokens do not."""
    overlapped = run_mixed(checkpoint, prompts, "on", max_batch_size=8)
    sequential = run_mixed(checkpoint, prompts, "off", max_batch_size=8)
    greedy = [i for i, params in enumerate(MIXED * len(prompts)) if params.greedy]
    assert [overlapped[i][:3] for i in greedy] == [sequential[i][:3] for i in greedy]
    for run in (overlapped, sequential):  # a sampled stream may end at EOS in one run only: each run on its own
        assert all(
            len(o[0]) == p.max_new_tokens for o, p in zip(run, MIXED * len(prompts)) if o[2] is FinishReason.LENGTH
        )


def session_turns(checkpoint, tokenizer, overlap: str) -> list[tuple]:
    """Two chat sessions of three turns each, turns ending at EOS (the session then holds KV the extra step
    computed), one cancelled after its first tokens, and a session ended while it generates. How far the
    cancelled turn got depends on when the cancel landed, so the turn after it is checked against a stateless
    request on the conversation as it went, in the same run."""
    config = EngineConfig(dtype="float32", overlap_scheduling=overlap)
    greedy = SamplingParams(max_new_tokens=48)
    results = []
    conversation = []  # session 11's
    with Engine(config, checkpoint=checkpoint) as engine:
        for sid in (11, 12):
            engine.start_session(sid)
            for turn in ("Hi! Who are you?", "Say that in five words.", "Thanks. Now count to five."):
                results.append(outcome(engine.generate([{"role": "user", "content": turn}], greedy, session_id=sid)))
                if sid == 11:
                    conversation += [
                        {"role": "user", "content": turn},
                        {"role": "assistant", "content": results[-1][1]},
                    ]
        story = {"role": "user", "content": "Tell me a long story about a dragon."}
        stream = engine.submit([story], SamplingParams(max_new_tokens=200, ignore_eos=True), session_id=11)
        first = next(iter(stream))
        engine.cancel(stream.request)
        rest = list(stream)
        results.append((len(first.token_ids) > 0, rest[-1].finish_reason))
        conversation += [story, {"role": "assistant", "content": first.text + "".join(r.text for r in rest)}]
        ended = engine.submit(
            "Count from one to a hundred.", SamplingParams(max_new_tokens=200, ignore_eos=True), session_id=12
        )
        next(iter(ended))
        engine.end_session(12)
        results.append(list(ended)[-1].finish_reason)
        last = {"role": "user", "content": "And one more word?"}
        after = engine.generate([last], greedy, session_id=11)
        results.append(after.token_ids == engine.generate(conversation + [last], greedy).token_ids)
        engine.end_session(11)
        assert_idle(engine)
    return results


def test_session_turns_cancels_and_ends_equal_one_step_at_a_time(checkpoint, tokenizer):
    overlapped = session_turns(checkpoint, tokenizer, "on")
    assert overlapped == session_turns(checkpoint, tokenizer, "off")
    assert overlapped[6] == (True, FinishReason.CANCELLED) and overlapped[7] is FinishReason.CANCELLED
    assert overlapped[8] is True  # the turn after the cancelled one continued its conversation
    assert any(turn[2] is FinishReason.STOP for turn in overlapped[:6])


@pytest.mark.parametrize("round_", range(2))
def test_preemption_with_draws_on_the_device(checkpoint, tokenizer, round_):
    """A cache too small for the batch: the scheduler preempts sequences whose last draw is still on the
    device. Every stream runs to its length and every block comes back."""
    config = EngineConfig(dtype="float32", kv_cache_tokens=256, max_batch_size=8, overlap_scheduling="on")
    params = SamplingParams(max_new_tokens=40 + 8 * round_, ignore_eos=True)
    with Engine(config, checkpoint=checkpoint) as engine:
        prompts = [tokenizer.encode(f"Story number {i} begins") for i in range(8)]
        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda p: engine.generate(p, params), prompts))
        assert engine.info().preemptions > 0
        assert_idle(engine)
    assert all(len(o.token_ids) == params.max_new_tokens and o.finish_reason is FinishReason.LENGTH for o in outs)


def test_overlap_setting_is_checked():
    with pytest.raises(Exception, match="overlap_scheduling must be one of auto, on, off"):
        EngineConfig(overlap_scheduling="sometimes")


@pytest.mark.parametrize("overlap", ["on", "off"])
def test_generated_blocks_are_shared_by_a_later_prompt(checkpoint, tokenizer, overlap):
    """A block is filled by a step whose input token the host has not read yet: its prefix-cache key waits
    for that token. Every full block of a generation, keyed by the tokens it holds, serves a later prompt
    that repeats the generation."""
    with Engine(EngineConfig(dtype="float32", overlap_scheduling=overlap), checkpoint=checkpoint) as engine:
        prompt = tokenizer.encode("Once upon a time")
        first = engine.generate(prompt, SamplingParams(max_new_tokens=60, ignore_eos=True))
        history = prompt + first.token_ids
        again = engine.generate(history, SamplingParams(max_new_tokens=4, ignore_eos=True))
        block = engine.config.block_size
        assert again.usage.cached_tokens == (len(history) - 1) // block * block
        assert_idle(engine)


@pytest.mark.parametrize("overlap", ["on", "off"])
def test_no_kv_of_replaced_weights_is_keyed_after_the_reset(checkpoint, tokenizer, overlap):
    """New weights land (UpdateWeights installs them from another thread: a new weights version) while a
    prompt's prefill is on the device. That KV is the old weights': the prefix cache, reset for the new
    ones, must not offer it to the next request with the same prompt."""
    with Engine(EngineConfig(dtype="float32", overlap_scheduling=overlap), checkpoint=checkpoint) as engine:
        loop = engine.loops[0]
        runner, forward, calls = loop.runner, loop.runner.forward, []

        def forward_then_install(*args, **kwargs):
            out = forward(*args, **kwargs)
            calls.append(1)
            if len(calls) == 1:  # right after the prefill was queued, as LocalWeights' install does
                runner.weights_version += 1
            return out

        runner.forward = forward_then_install
        prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 5)
        params = SamplingParams(max_new_tokens=4, ignore_eos=True)
        engine.generate(prompt, params)
        assert engine.generate(prompt, params).usage.cached_tokens == 0
        assert engine.generate(prompt, params).usage.cached_tokens > 0  # keyed again, by the new weights
        assert_idle(engine)


@pytest.mark.parametrize("overlap", ["on", "off"])
def test_a_turn_cancelled_while_its_first_chunk_runs_leaves_a_session_that_goes_on(checkpoint, tokenizer, overlap):
    """A session turn's first prefill chunk (two whole blocks) is launched, then the turn is cancelled. Its
    session once kept that chunk's KV; with overlap its blocks were not keyed yet (the step was unread), and
    the next turn's prefix lookup failed: every stream of the loop ended INTERNAL. A turn cancelled before its
    first token now leaves the history as it was (its KV freed, launched step or not): the next turn runs as
    a stateless request on its own input does."""
    config = EngineConfig(dtype="float32", overlap_scheduling=overlap, max_batched_tokens=32)
    with Engine(config, checkpoint=checkpoint) as engine:
        runner = engine.loops[0].runner
        forward, turns, submitted = runner.forward, [], threading.Event()

        def forward_then_cancel(*args, **kwargs):
            out = forward(*args, **kwargs)
            runner.forward = forward
            submitted.wait()
            turns[0].cancel()
            return out

        first = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 6)
        second = tokenizer.encode(" And then?")
        params = SamplingParams(max_new_tokens=6, ignore_eos=True)
        engine.start_session(21)
        runner.forward = forward_then_cancel
        turns.append(engine.submit(first, params, session_id=21))
        submitted.set()
        cancelled = list(turns[0])[-1]
        assert cancelled.finish_reason is FinishReason.CANCELLED and cancelled.usage.completion_tokens == 0
        assert len(first) > config.max_batched_tokens
        after = engine.generate(second, params, session_id=21)
        assert after.token_ids == engine.generate(second, params).token_ids
        assert after.usage.prompt_tokens == len(second)
        engine.end_session(21)
        assert_idle(engine)
