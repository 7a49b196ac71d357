"""The engine through its Python API, on the embedded SmolLM2-135M GGUF.

  * greedy tokens equal transformers' `generate` on the same GGUF, alone and batched;
  * a request's tokens do not depend on what shares its batch (greedy and seeded sampling);
  * KV blocks all come back after finished, cancelled and preempted requests and ended sessions;
  * chunked prefill, session turns, bad input, sampling features and streaming detokenization.

One roomy engine serves the module; tests that need a small KV budget, a small context or a small
token budget build their own engine from the shared checkpoint (cheap: the weights are read once).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import threading
import time

import pytest
import torch
import transformers

from lmgate.engine.config import EngineConfig
from lmgate.engine.text.detokenizer import IncrementalDetokenizer
from lmgate.engine.engine import Engine
from lmgate.engine.errors import (
    ContextOverflow,
    InternalError,
    InvalidRequest,
    SessionBusy,
    SessionNotFound,
    SessionStale,
    Unavailable,
)
from lmgate.engine.gateway.request import FinishReason, RequestKind
from lmgate.engine.sampling.sampler import SamplingParams

REPLACEMENT = "\ufffd"
NEW = 32  # tokens per reference-equivalence request

GREEDY = SamplingParams(max_new_tokens=NEW, ignore_eos=True)


# ------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def engine(checkpoint):
    eng = Engine(EngineConfig(dtype="float32"), checkpoint=checkpoint)
    yield eng
    eng.shutdown()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation, not stopping at (nor banning) EOS."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    tokens = out[0, len(ids) :].tolist()
    assert len(tokens) == n  # transformers really did not stop at EOS
    return tokens


def collect(stream) -> list:
    return list(stream)


def tokens_of(outputs) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def text_of(outputs) -> str:
    return "".join(o.text for o in outputs)


def chat(tokenizer, *messages: tuple[str, str]) -> str:
    return tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in messages])


def assert_idle(engine: Engine) -> None:
    info = engine.info()
    assert info.kv_blocks_free == info.kv_blocks_total
    assert info.running_sequences == 0 and info.waiting_sequences == 0


@pytest.fixture(scope="module")
def reference_prompts(tokenizer) -> list[list[int]]:
    texts = [
        "The capital of France is",
        "Once upon a time, there was a little",
        "def fibonacci(n):\n    ",
        chat(tokenizer, ("user", "What is 2+2?")),
        chat(tokenizer, ("system", "You are a helpful assistant."), ("user", "Write a haiku about the sea.")),
    ]
    return [tokenizer.encode(t) for t in texts]


# ---------------------------------------------------------------------------------- 1. reference
def test_engine_greedy_matches_transformers_alone_and_concurrent(engine, hf_model, reference_prompts):
    expected = [hf_greedy(hf_model, ids, NEW) for ids in reference_prompts]
    alone = [engine.generate(ids, GREEDY) for ids in reference_prompts]
    streams = [engine.submit(ids, GREEDY) for ids in reference_prompts]
    together = [collect(s) for s in streams]
    for ids, exp, one, outs in zip(reference_prompts, expected, alone, together):
        assert one.token_ids == exp, f"alone, prompt of {len(ids)} tokens"
        assert tokens_of(outs) == exp, f"concurrent, prompt of {len(ids)} tokens"
        assert one.finish_reason is FinishReason.LENGTH
        assert one.usage.prompt_tokens == len(ids) and one.usage.completion_tokens == NEW
    # The chat prompts run past the model's end of turn: the check covers tokens after EOS too.
    assert any(t in engine.tokenizer.eos_token_ids for exp in expected for t in exp)
    assert_idle(engine)


# ----------------------------------------------------------------------------- 2. batch invariance
def test_engine_tokens_do_not_depend_on_batch(engine, tokenizer):
    probe = tokenizer.encode("The three most important inventions in history are")
    greedy = SamplingParams(max_new_tokens=24, ignore_eos=True)
    seeded = SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    other_seed = SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9, top_k=50, seed=4321, ignore_eos=True)
    greedy_alone = engine.generate(probe, greedy).token_ids
    seeded_alone = engine.generate(probe, seeded).token_ids
    other_alone = engine.generate(probe, other_seed).token_ids
    assert len(seeded_alone) == len(other_alone) == 24
    assert seeded_alone != other_alone  # different seeds, different samples (equal with tiny odds)
    assert seeded_alone != greedy_alone

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()

    def crowd_request(i: int):
        prompt = tokenizer.encode(f"Story {i}: " + " ".join(words[: 1 + (i * 5) % len(words)] * (1 + i % 4)))
        if i % 3 == 0:  # some sampled rows (unseeded) in the batch too
            params = SamplingParams(max_new_tokens=12 + i, temperature=1.0, top_k=20)
        else:
            params = SamplingParams(max_new_tokens=12 + i, ignore_eos=True)
        return prompt, params

    early = [engine.submit(*crowd_request(i)) for i in range(8)]
    next(iter(early[0]))  # the crowd is decoding before the probes arrive
    probes = [engine.submit(probe, greedy), engine.submit(probe, seeded)]
    late: list = []

    def submit_late():
        for i in range(8, 16):
            time.sleep(0.03 * (i - 7))  # join at different steps of the probes' decode
            late.append(engine.submit(*crowd_request(i)))

    t = threading.Thread(target=submit_late)
    t.start()
    max_running = 0
    probe_outputs = []
    for out in probes[0]:
        max_running = max(max_running, engine.info().running_sequences)
        probe_outputs.append(out)
    seeded_crowd = tokens_of(collect(probes[1]))
    t.join()
    assert len(late) == 8
    crowd = [collect(s) for s in early + late]
    assert max_running > 2  # the probe really shared its batch
    assert tokens_of(probe_outputs) == greedy_alone
    assert seeded_crowd == seeded_alone
    assert all(o[-1].finish_reason is not None for o in crowd)
    assert_idle(engine)


# ------------------------------------------------------------------------------- 3. KV accounting
def test_engine_kv_blocks_all_free_after_preemption_cancel_and_sessions(engine, checkpoint, tokenizer):
    small = Engine(
        EngineConfig(dtype="float32", kv_cache_tokens=512, block_size=16, max_batch_size=16), checkpoint=checkpoint
    )
    try:
        info = small.info()
        assert info.kv_blocks_total == 32 and info.kv_blocks_free == 32
        topics = ["the ocean", "mountains", "a city at night", "old books", "coffee", "trains", "the moon", "gardens"]
        prompts = [
            tokenizer.encode(f"Write a long, detailed essay about {t}. " + f"Describe {t} in depth. " * (14 + i))
            for i, t in enumerate(topics)
        ]
        params = [SamplingParams(max_new_tokens=16, ignore_eos=True) for _ in prompts]
        params[3] = SamplingParams(max_new_tokens=16, temperature=0.9, top_k=40, seed=77, ignore_eos=True)
        # Each request alone fits; together they need far more than the 32 blocks (each ~8).
        assert all(len(p) + 16 <= 512 for p in prompts)
        assert sum(-(-(len(p) + 16) // 16) for p in prompts) > 2 * info.kv_blocks_total
        # References from the roomy module engine, where nothing is preempted (batch invariance is
        # checked above, so running them together there is as good as one by one).
        expected = [tokens_of(collect(s)) for s in [engine.submit(p, sp) for p, sp in zip(prompts, params)]]
        assert engine.info().preemptions == 0

        sid = small.start_session()
        turn1 = tokenizer.encode(chat(tokenizer, ("user", "Name a fruit.")))
        first = small.generate(turn1, SamplingParams(max_new_tokens=8, ignore_eos=True), session_id=sid)
        assert small.info().kv_blocks_free < small.info().kv_blocks_total  # the idle session keeps its KV

        streams = [small.submit(p, sp) for p, sp in zip(prompts, params)]
        queued = small.submit(prompts[0], SamplingParams(max_new_tokens=16))
        assert queued.cancel()  # before it starts (or, racing the loop, right after)
        midway = small.submit(prompts[1], SamplingParams(max_new_tokens=200, ignore_eos=True))
        it = iter(midway)
        started = [next(it) for _ in range(2)]
        assert midway.cancel()
        rest = started + list(it)
        outputs = [collect(s) for s in streams]

        assert small.info().preemptions > 0
        for i, (outs, exp) in enumerate(zip(outputs, expected)):
            assert tokens_of(outs) == exp, f"request {i} changed under preemption"
            assert outs[-1].finish_reason is FinishReason.LENGTH
        q = collect(queued)
        assert q[-1].finish_reason is FinishReason.CANCELLED and len(tokens_of(q)) < 16
        assert rest[-1].finish_reason is FinishReason.CANCELLED
        assert 2 <= len(tokens_of(rest)) < 200

        # The session's KV may have been dropped under pressure; its next turn must still be right.
        turn2 = tokenizer.encode("<|im_end|>\n<|im_start|>user\nAnd a vegetable?<|im_end|>\n<|im_start|>assistant\n")
        second = small.generate(turn2, SamplingParams(max_new_tokens=8, ignore_eos=True), session_id=sid)
        stateless = engine.generate(turn1 + first.token_ids + turn2, SamplingParams(max_new_tokens=8, ignore_eos=True))
        assert second.token_ids == stateless.token_ids
        assert small.info().kv_blocks_free < small.info().kv_blocks_total
        small.end_session(sid)
        assert_idle(small)
        assert small.info().active_sessions == 0
    finally:
        small.shutdown()


# ------------------------------------------------------------------------------ 4. chunked prefill
@pytest.fixture(scope="module")
def long_prompt(tokenizer) -> list[int]:
    text = " ".join(
        f"Chapter {i}. The traveller reached town number {i * 7 % 31} and wrote about its {w} in the diary."
        for i, w in enumerate(["river", "market", "bridge", "castle", "harbour", "library", "square"] * 8)
    )
    ids = tokenizer.encode(text)
    assert len(ids) >= 600
    return ids[:600]


@pytest.fixture(scope="module")
def chunked_references(hf_model, long_prompt, tokenizer):
    short = tokenizer.encode("The best way to learn a language is")
    return short, hf_greedy(hf_model, long_prompt, 12), hf_greedy(hf_model, short, 12)


@pytest.mark.parametrize("budget", [128, 100])  # 100: chunks that end inside a KV block
def test_engine_chunked_prefill_matches_transformers(checkpoint, long_prompt, chunked_references, budget):
    short, expected, short_alone = chunked_references
    eng = Engine(EngineConfig(dtype="float32", kv_cache_tokens=2048, max_batched_tokens=budget), checkpoint=checkpoint)
    try:
        params = SamplingParams(max_new_tokens=12, ignore_eos=True)
        # The 600-token prompt prefills in chunks while a decoding stream shares every step.
        short_stream = iter(eng.submit(short, params))
        short_out = [next(short_stream)]
        long_out = collect(eng.submit(long_prompt, params))
        short_out += list(short_stream)
        assert tokens_of(long_out) == expected
        assert tokens_of(short_out) == short_alone
        assert long_out[-1].usage.prompt_tokens == 600
        assert_idle(eng)
    finally:
        eng.shutdown()


# ------------------------------------------------------------------------------------- 5. sessions
def test_engine_session_turn_reuses_kv_and_equals_stateless(engine, tokenizer):
    sid = engine.start_session()
    turn1 = tokenizer.encode(chat(tokenizer, ("user", "What is the capital of Italy?")))
    turn2 = tokenizer.encode("<|im_end|>\n<|im_start|>user\nAnd of Spain?<|im_end|>\n<|im_start|>assistant\n")
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    first = engine.generate(turn1, params, session_id=sid)
    assert first.usage.cached_tokens % 16 == 0  # at most the prefix cache's full blocks of the system prompt
    held = engine.info()
    assert held.kv_blocks_free < held.kv_blocks_total and held.active_sessions == 1
    second = engine.generate(turn2, params, session_id=sid)
    history = turn1 + first.token_ids
    stateless = engine.generate(history + turn2, params)
    assert second.token_ids == stateless.token_ids
    assert 0 < second.usage.cached_tokens <= len(history)
    assert second.usage.prompt_tokens == len(history) + len(turn2)
    engine.end_session(sid)
    assert_idle(engine)
    assert engine.info().active_sessions == 0
    with pytest.raises(SessionNotFound):
        engine.submit(turn2, params, session_id=sid)
    with pytest.raises(SessionNotFound):
        engine.submit(turn2, params, session_id=987654321)  # never started


def test_a_sessions_first_text_turn_gets_the_bos_a_stateless_prompt_gets(tiny_models, tmp_path):
    """A model whose tokenizer adds a BOS (Llama, Mistral): a session's first text turn starts with it, as the
    same text sent stateless does, and equals it; a later turn continues the context, with no BOS inside it."""
    path = tmp_path / "bos"
    shutil.copytree(tiny_models("llama").path, path)
    config_file = path / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "add_bos_token": True}))
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    with Engine(EngineConfig(dtype="float32", model=str(path), kv_cache_tokens=1024)) as eng:
        bos, text = eng.tokenizer.bos_token_id, eng.tokenizer.encode("The river", add_special_tokens=False)
        assert bos is not None and eng.tokenizer.encode("The river") == [bos] + text
        stateless = eng.generate("The river", params)
        eng.start_session(3)
        first = eng.generate("The river", params, session_id=3)
        second = eng.generate(" flows", params, session_id=3)
        history = eng.loops[0].sessions[3].token_ids
        eng.end_session(3)
        assert first.token_ids == stateless.token_ids
        assert first.usage.prompt_tokens == stateless.usage.prompt_tokens == 1 + len(text)
        more = eng.tokenizer.encode(" flows", add_special_tokens=False)
        assert second.usage.prompt_tokens == 1 + len(text) + 6 + len(more)
        assert history == [bos] + text + first.token_ids + more + second.token_ids and history.count(bos) == 1
        # The BOS counts against the context window when the turn is submitted, not later as a stream error.
        eng.start_session(4)
        with pytest.raises(ContextOverflow):
            eng.submit("The river", SamplingParams(max_new_tokens=eng.max_context_length - len(text)), session_id=4)
        eng.end_session(4)
        with pytest.raises(InvalidRequest, match="empty"):  # an empty text is no prompt, though it encodes to a BOS
            eng.submit("", params)
        assert_idle(eng)


def test_a_session_turn_cancelled_before_its_first_token_leaves_no_trace(checkpoint, tokenizer):
    """Cancelled in its prefill (many chunks of 16 tokens), a turn leaves the history as it was, as one
    cancelled while still queued does: the next turn's context never depends on when the Cancel came."""
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    with Engine(
        EngineConfig(dtype="float32", max_batched_tokens=16, kv_cache_tokens=4096), checkpoint=checkpoint
    ) as eng:
        sid = eng.start_session()
        eng.generate("Hi.", params, session_id=sid)
        history = list(eng.loops[0].sessions[sid].token_ids)
        stream = eng.submit("word " * 1500, params, session_id=sid)
        guard = time.monotonic() + 60  # a hang guard, not a timing
        while eng.info().running_sequences == 0:
            assert time.monotonic() < guard, "the turn never started"
        assert stream.cancel()
        outs = collect(stream)
        assert outs[-1].finish_reason is FinishReason.CANCELLED and not tokens_of(outs)
        after = eng.generate(" Bye.", params, session_id=sid)
        assert after.usage.prompt_tokens == len(history) + len(tokenizer.encode(" Bye.", add_special_tokens=False))
        assert eng.loops[0].sessions[sid].token_ids[: len(history)] == history
        eng.end_session(sid)
        assert_idle(eng)


def test_a_cancel_after_the_last_output_cancels_nothing(engine, tokenizer):
    """The server's Cancel may come after the engine handed over a stream's end and before the client read
    it: it answers false (the proto: true only if a generation was running or queued and now is cancelled)."""
    stream = engine.submit(tokenizer.encode("Hello"), SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert list(stream)[-1].finish_reason is FinishReason.LENGTH
    assert stream.cancel() is False
    running = engine.submit(tokenizer.encode("Hello"), SamplingParams(max_new_tokens=300, ignore_eos=True))
    outputs = iter(running)
    next(outputs)
    assert running.cancel() is True and running.cancel() is False
    assert list(outputs)[-1].finish_reason is FinishReason.CANCELLED
    assert_idle(engine)


def test_a_turn_naming_another_copy_of_its_session_is_refused_and_changes_nothing(engine, tokenizer):
    sid = engine.start_session()
    epoch = engine.session_epoch(sid)
    prompt, params = tokenizer.encode("Hello"), SamplingParams(max_new_tokens=3, ignore_eos=True)
    with pytest.raises(SessionStale):
        engine.submit(prompt, params, session_id=sid, session_epoch=epoch ^ 1)
    assert engine.info().queued_requests == 0
    assert (
        list(engine.submit(prompt, params, session_id=sid, session_epoch=epoch))[-1].finish_reason
        is FinishReason.LENGTH
    )
    assert list(engine.submit(prompt, params, session_id=sid))[-1].finish_reason is FinishReason.LENGTH  # None: any
    engine.end_session(sid)
    engine.start_session(sid)
    assert engine.session_epoch(sid) != epoch  # a copy started again is another copy
    engine.end_session(sid)
    assert_idle(engine)


def test_sessions_idle_past_the_timeout_are_ended_and_busy_ones_kept(engine, tokenizer):
    """Clients that vanish without End: a session with no turn for the timeout is ended as End would end it
    (its next turn NOT_FOUND, its KV freed); one that is generating, or whose turn just ended, is kept."""
    before = engine.info().active_sessions
    idle, busy = engine.start_session(), engine.start_session()
    prompt, params = tokenizer.encode("Hello"), SamplingParams(max_new_tokens=3, ignore_eos=True)
    list(engine.submit(prompt, params, session_id=idle))
    stream = iter(engine.submit(prompt, SamplingParams(max_new_tokens=300, ignore_eos=True), session_id=busy))
    next(stream)
    now = time.monotonic()
    assert engine.expire_idle_sessions(3600, now) == []
    assert engine.expire_idle_sessions(3600, now + 7200) == [idle]
    with pytest.raises(SessionNotFound):
        engine.submit(prompt, params, session_id=idle)
    assert engine.cancel_session(busy)
    assert list(stream)[-1].finish_reason is FinishReason.CANCELLED
    assert engine.expire_idle_sessions(3600, time.monotonic()) == []  # idle from the end of its turn
    assert engine.expire_idle_sessions(3600, time.monotonic() + 3601) == [busy]
    list(engine.submit(prompt, params))  # queued behind the loop's kills of the two
    assert_idle(engine)
    assert engine.info().active_sessions == before


def test_engine_session_busy_and_end_during_stream_cancels(engine, tokenizer):
    sid = engine.start_session()
    prompt = tokenizer.encode(chat(tokenizer, ("user", "Tell me a long story.")))
    stream = engine.submit(prompt, SamplingParams(max_new_tokens=300, ignore_eos=True), session_id=sid)
    it = iter(stream)
    got = [next(it)]
    with pytest.raises(SessionBusy):
        engine.submit(prompt, SamplingParams(max_new_tokens=4), session_id=sid)
    engine.end_session(sid)
    got += list(it)
    assert got[-1].finish_reason is FinishReason.CANCELLED
    assert 1 <= len(tokens_of(got)) < 300
    assert_idle(engine)
    assert engine.info().active_sessions == 0
    with pytest.raises(SessionNotFound):
        engine.submit(prompt, SamplingParams(max_new_tokens=4), session_id=sid)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_stream_interval_gathers_tokens_without_changing_them(engine, checkpoint, tokenizer, overlap):
    """stream_interval 4: the first token alone (its latency), then four a message, the end with the rest; the
    same tokens, text and logprobs as one a message, a stop string cut at the same place; a cancelled stream's
    last output carries the tokens held back, so every drawn token reaches the client. With overlap scheduling
    too (the default on CUDA), where the draw after a stop is dropped."""
    prompt = tokenizer.encode("Once upon a time, there was a little")
    params = SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=2)
    each = collect(engine.submit(prompt, params))
    stop = text_of(each)[len(text_of(each)) // 2 :][:3]  # a stop string in the middle of the text
    stopped = collect(engine.submit(prompt, SamplingParams(max_new_tokens=10, ignore_eos=True, stop=(stop,))))
    config = EngineConfig(dtype="float32", kv_cache_tokens=1024, stream_interval=4, overlap_scheduling=overlap)
    with Engine(config, checkpoint=checkpoint) as eng:
        gathered = collect(eng.submit(prompt, params))
        assert [len(o.token_ids) for o in gathered] == [1, 4, 4, 1]
        assert tokens_of(gathered) == tokens_of(each) and text_of(gathered) == text_of(each)
        assert [lp.token_id for o in gathered for lp in o.logprobs] == tokens_of(each)
        cut = collect(eng.submit(prompt, SamplingParams(max_new_tokens=10, ignore_eos=True, stop=(stop,))))
        assert (tokens_of(cut), text_of(cut)) == (tokens_of(stopped), text_of(stopped))
        assert cut[-1].finish_reason is FinishReason.STOP and len(tokens_of(cut)) < 10

        stream = eng.submit(prompt, SamplingParams(max_new_tokens=400, ignore_eos=True))
        it = iter(stream)
        got = [next(it), next(it)]
        stream.cancel()
        got += list(it)
        assert got[-1].finish_reason is FinishReason.CANCELLED
        assert len(tokens_of(got)) == got[-1].usage.completion_tokens >= 5  # 5: the cancel came before a 6th
        assert_idle(eng)


def test_engine_end_cancels_a_queued_turn_before_its_id_is_reused(checkpoint):
    """End while the session's turn still waits in the queue (the one batch slot is taken), then Start with
    the same id on the same loop: the old turn ends CANCELLED with no tokens and never enters the new session.
    Kills overtake queued turns, so End used to return first and the old turn ran inside the new session."""
    with Engine(EngineConfig(dtype="float32", kv_cache_tokens=512, max_batch_size=1), checkpoint=checkpoint) as eng:
        busy = eng.submit([504, 3575, 282], SamplingParams(max_new_tokens=400, ignore_eos=True))
        next(iter(busy))  # it holds the batch's only slot until cancelled
        eng.start_session(5)
        queued = eng.submit(list(range(1000, 1010)), SamplingParams(max_new_tokens=4, ignore_eos=True), session_id=5)
        eng.end_session(5)
        eng.start_session(5)
        busy.cancel()
        list(busy)
        outs = list(queued)
        assert outs[-1].finish_reason is FinishReason.CANCELLED and not tokens_of(outs)
        turn = eng.generate([7, 8, 9], SamplingParams(max_new_tokens=2, ignore_eos=True), session_id=5)
        assert turn.usage.prompt_tokens == 3  # the new session's history is its own turn only
        eng.end_session(5)
        assert_idle(eng)


def test_engine_wakeup_that_cannot_allocate_the_kv_cache_fails_and_can_be_retried(checkpoint):
    """A Wakeup whose KV cache cannot be allocated again (on a GPU: another process took the memory during
    sleep; here the allocation is made to raise) answers with an error instead of waiting forever under the
    admin lock, leaves the cache asleep and admission closed, and a later Wakeup restores it."""
    with Engine(EngineConfig(dtype="float32", kv_cache_tokens=512), checkpoint=checkpoint) as eng:
        prompt, params = [504, 3575, 282, 4649, 314], SamplingParams(max_new_tokens=8, ignore_eos=True)
        before = eng.generate(prompt, params).token_ids
        runner = eng.loops[0].runner
        eng.sleep(1)

        def out_of_memory() -> None:
            raise RuntimeError("out of memory")

        runner.allocate_kv_cache = out_of_memory
        failed: list[BaseException] = []
        waker = threading.Thread(target=lambda: failed.extend(_raised(eng.wakeup, ["kv_cache"])), daemon=True)
        waker.start()
        waker.join(120)  # a guard against the old endless wait, not a timing
        assert not waker.is_alive(), "Wakeup never returned"
        assert len(failed) == 1 and isinstance(failed[0], InternalError) and "out of memory" in str(failed[0])
        assert eng.sleeping == {"kv_cache"}  # nothing changed
        with pytest.raises(Unavailable):
            eng.submit(prompt, params)
        del runner.allocate_kv_cache  # the memory is back
        eng.wakeup()
        assert not eng.sleeping and eng.generate(prompt, params).token_ids == before
        assert_idle(eng)


def test_a_turn_that_a_sleep_overtook_ends_cancelled_instead_of_running_without_a_kv_cache(checkpoint):
    """A rank in a process of its own has no admission gates (the serving process keeps them), and a SLEEP
    never waits behind generates: a turn queued behind a full batch can be popped after the sleep freed the
    loop's KV cache. It ends CANCELLED, as a sleep ends every stream; it must not run with no cache at all."""
    with Engine(EngineConfig(dtype="float32", kv_cache_tokens=512), checkpoint=checkpoint) as eng:
        prompt, params = [504, 3575, 282, 4649, 314], SamplingParams(max_new_tokens=8, ignore_eos=True)
        before = eng.generate(prompt, params).token_ids
        eng.gateway.control(RequestKind.SLEEP)  # what a rank process's gateway does with SLEEP: no gate closes
        late = eng.generate(prompt, params)
        assert late.finish_reason is FinishReason.CANCELLED and late.token_ids == []
        eng.gateway.control(RequestKind.WAKE_KV)
        assert eng.generate(prompt, params).token_ids == before
        assert_idle(eng)


def test_a_turn_that_ended_in_a_step_that_then_failed_stays_in_its_session(checkpoint):
    """A step fails after its kUpdate gave a session turn its last output (here the prefix-cache keying that
    follows raises): the client saw the turn end, so the session's history keeps it; the KV the failed step
    may have written is dropped, and the next turn recomputes it."""
    with Engine(EngineConfig(dtype="float32", kv_cache_tokens=512), checkpoint=checkpoint) as eng:
        blocks = eng.loops[0].blocks
        keyed = blocks.cache_full_blocks

        def fails_after_the_end(seqs) -> None:
            if any(seq.finish_reason is not None for seq in seqs):
                raise RuntimeError("keying failed")
            keyed(seqs)

        eng.start_session(4)
        prompt, params = [504, 3575, 282, 4649, 314], SamplingParams(max_new_tokens=4, ignore_eos=True)
        blocks.cache_full_blocks = fails_after_the_end
        first = eng.generate(prompt, params, session_id=4)
        blocks.cache_full_blocks = keyed
        assert first.finish_reason is FinishReason.LENGTH and len(first.token_ids) == 4
        second = eng.generate([7, 8], params, session_id=4)
        assert second.usage.prompt_tokens == len(prompt) + 4 + 2 and second.usage.cached_tokens == 0
        eng.end_session(4)
        with pytest.raises(InvalidRequest, match="empty"):  # an empty text is no prompt, though it encodes to a BOS
            eng.submit("", params)
        assert_idle(eng)


def test_an_engine_loop_that_fails_by_itself_reports_it_and_ends_every_stream(checkpoint):
    """An error outside any step (here the loop's pop raises) stops the engine: the streams end UNAVAILABLE
    (not as if their clients had cancelled them: a client retries elsewhere), and the failure reaches the
    listeners (the server then reports NOT_SERVING and exits non-zero) instead of leaving a server that
    refuses everything while looking healthy; a listener that comes after the failure hears of it at once."""
    with Engine(EngineConfig(dtype="float32", kv_cache_tokens=512), checkpoint=checkpoint) as eng:
        reasons: list[str] = []
        eng.on_failure(reasons.append)
        running = eng.submit([504, 3575, 282], SamplingParams(max_new_tokens=400, ignore_eos=True))
        next(iter(running))  # it runs
        pop = eng.gateway.pop

        def broken_pop(*args):
            raise RuntimeError("the queue broke")

        eng.gateway.pop = broken_pop
        with pytest.raises(Unavailable, match="the queue broke"):
            list(running)  # a hang here is the bug
        eng.gateway.pop = pop
        assert eng.failure == reasons[0] and "the queue broke" in reasons[0] and len(reasons) == 1
        late: list[str] = []
        eng.on_failure(late.append)
        assert late == reasons
        with pytest.raises(Unavailable):
            eng.submit([504], SamplingParams(max_new_tokens=1))


def _raised(call, *args) -> list[BaseException]:
    try:
        call(*args)
    except Exception as exc:
        return [exc]
    return []


# ------------------------------------------------------------------------------------ 6. bad input
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-1.0),
        dict(temperature=float("inf")),
        dict(top_p=float("nan")),
        dict(top_p=1.5),
        dict(top_k=-3),
        dict(min_p=-0.1),
        dict(repetition_penalty=float("inf")),
        dict(repetition_penalty=-1.0),
        dict(presence_penalty=float("nan")),
        dict(frequency_penalty=3.0),
        dict(max_new_tokens=-1),
        dict(min_new_tokens=10, max_new_tokens=5),
        dict(logprobs=1000),
        dict(logprobs=-1),
        dict(seed=-1),
        dict(stop=("",)),
        dict(stop_token_ids=(-1,)),
        dict(stop_token_ids=tuple(range(257))),
    ],
)
def test_sampling_params_rejects_bad_values(kwargs):
    with pytest.raises(InvalidRequest):
        SamplingParams(**kwargs)


def test_engine_bad_input_raises_and_leaves_no_state(engine, tokenizer):
    before = engine.info()
    vocab = engine.tokenizer.vocab_size
    ok = tokenizer.encode("Hello")
    with pytest.raises(InvalidRequest):
        engine.submit("")
    with pytest.raises(InvalidRequest):
        engine.submit([])
    with pytest.raises(InvalidRequest):
        engine.submit(ok + [vocab])
    with pytest.raises(InvalidRequest):
        engine.submit(ok + [-1])
    with pytest.raises(InvalidRequest):
        engine.submit(ok, SamplingParams(stop_token_ids=(vocab,)))
    with pytest.raises(ContextOverflow):
        engine.submit(ok, SamplingParams(max_new_tokens=engine.max_context_length))
    assert engine.info() == before
    out = engine.generate(ok, SamplingParams(max_new_tokens=2, ignore_eos=True))  # still serves
    assert len(out.token_ids) == 2
    assert dataclasses.replace(engine.info(), computed_tokens=before.computed_tokens) == before  # as it was


def test_engine_says_when_it_serves_less_context_than_asked_for(checkpoint, caplog):
    """--max-context-length past the model's (8192) or the KV cache's is clamped, and the log says so."""
    with caplog.at_level(logging.WARNING, logger="lmgate.engine.engine"):
        with Engine(EngineConfig(dtype="float32", max_context_length=100_000, kv_cache_tokens=1024), checkpoint) as eng:
            assert eng.max_context_length == 1024
    said = [r.getMessage() for r in caplog.records if "max_context_length" in r.getMessage()]
    assert said == [
        "max_context_length 100000 is past what can be served: the context is 1024 tokens (the model "
        "takes 8192, the KV cache holds 1024)"
    ]


def test_engine_context_window_limits(checkpoint, tokenizer):
    with Engine(
        EngineConfig(dtype="float32", max_context_length=256, kv_cache_tokens=1024), checkpoint=checkpoint
    ) as eng:
        assert eng.max_context_length == 256
        before = eng.info()
        filler = tokenizer.encode("word " * 400)
        assert len(filler) >= 300
        with pytest.raises(ContextOverflow):
            eng.submit(filler[:300])  # longer than the context
        with pytest.raises(ContextOverflow):
            eng.submit(filler[:256])  # fills it: no room for one new token
        with pytest.raises(ContextOverflow):
            eng.submit(filler[:200], SamplingParams(max_new_tokens=57))  # 257 > 256
        assert eng.info() == before
        # exactly at the limit is fine; with no max_new_tokens the window bounds the default
        out = eng.generate(filler[:250], SamplingParams(max_new_tokens=6, ignore_eos=True))
        assert len(out.token_ids) == 6 and out.finish_reason is FinishReason.LENGTH
        out = eng.generate(filler[:253], SamplingParams(ignore_eos=True))
        assert len(out.token_ids) == 3 and out.finish_reason is FinishReason.LENGTH
        # a session whose history leaves no room for the next turn: the error arrives on the stream
        sid = eng.start_session()
        eng.generate(filler[:200], SamplingParams(max_new_tokens=40, ignore_eos=True), session_id=sid)
        with pytest.raises(ContextOverflow):
            collect(eng.submit(filler[:30], SamplingParams(max_new_tokens=4), session_id=sid))
        assert eng.info().running_sequences == 0 and eng.info().waiting_sequences == 0
        eng.end_session(sid)
        assert (
            dataclasses.replace(eng.info(), prefix_cache_queried_tokens=0, prefix_cache_hit_tokens=0, computed_tokens=0)
            == before
        )


# ------------------------------------------------------------------------------ 7. sampling features
def test_engine_stop_string_cuts_text_before_it(engine, tokenizer):
    prompt = tokenizer.encode("Once upon a time, there was a little")
    ref = engine.generate(prompt, GREEDY)
    full = ref.text
    assert full == tokenizer.decode(ref.token_ids)
    # a stop string spanning token boundaries, taken from the middle of the greedy text
    at = len(full) // 2
    stop = full[at : at + 7]
    cut = full.find(stop)
    assert cut > 0
    outs = collect(
        engine.submit(prompt, SamplingParams(max_new_tokens=NEW, ignore_eos=True, stop=(stop, "zzzz-never")))
    )
    text = text_of(outs)
    assert outs[-1].finish_reason is FinishReason.STOP
    assert text == full[:cut]
    assert stop not in text
    ids = tokens_of(outs)
    assert ids == ref.token_ids[: len(ids)] and len(ids) < NEW


def test_engine_stop_string_revealed_by_the_last_token_ends_with_stop(engine, tokenizer):
    """A last token that completes a character and starts another is held back whole while it streams; the
    final decode reveals a stop string in it, and the reason is STOP, not LENGTH."""
    prompt = tokenizer.encode(" ".join(["Да добро"] * 6))
    ref = engine.generate(prompt, GREEDY).token_ids
    for k in range(1, len(ref)):
        detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
        emitted = "".join(detokenizer.step([t])[0] for t in ref[: k + 1])
        held = tokenizer.decode(ref[: k + 1]).rstrip("\ufffd")[len(emitted) :]
        if held and held not in emitted:
            break
    else:
        pytest.fail(f"no token in {ref} holds back complete text")
    outs = collect(engine.submit(prompt, SamplingParams(max_new_tokens=k + 1, ignore_eos=True, stop=(held,))))
    assert outs[-1].finish_reason is FinishReason.STOP
    assert text_of(outs) == emitted
    assert tokens_of(outs) == ref[: k + 1]


def test_a_cancel_after_the_loops_last_word_ends_the_stream_cancelled(engine, tokenizer):
    """A Cancel that lands after the loop finished the turn, while its last output still waits for delivery,
    says it cancelled: the stream ends CANCELLED too (with every token, which the history keeps), never
    LENGTH after a Cancel that answered True."""
    first_seen, go_on, outs = threading.Event(), threading.Event(), []

    def on_output(out) -> None:
        outs.append(out)
        if len(outs) == 1:  # the signal thread waits here: the turn's last output queues behind
            first_seen.set()
            go_on.wait()

    request = engine.submit(
        tokenizer.encode("Once upon a time"), SamplingParams(max_new_tokens=2, ignore_eos=True), on_output=on_output
    )
    try:
        assert first_seen.wait(60)  # a guard against a hang only
        deadline = time.monotonic() + 60
        while not engine.gateway._signals:  # the loop has handed over the last output
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert engine.cancel(request)
    finally:
        go_on.set()  # the module's engine delivers again, whatever failed
    deadline = time.monotonic() + 60
    while not (outs and outs[-1].finished):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert outs[-1].finish_reason is FinishReason.CANCELLED
    assert sum(len(o.token_ids) for o in outs) == 2


def test_engine_stop_token_ids_end_generation(engine, tokenizer):
    prompt = tokenizer.encode("Once upon a time, there was a little")
    ref = engine.generate(prompt, GREEDY).token_ids
    k = 10
    stop_id = ref[k]
    k = ref.index(stop_id)  # its first occurrence
    out = engine.generate(prompt, SamplingParams(max_new_tokens=NEW, stop_token_ids=(stop_id,)))
    assert out.finish_reason is FinishReason.STOP
    assert out.token_ids == ref[: k + 1]
    assert out.text == tokenizer.decode(ref[:k])  # its text left out, as vLLM does


def test_engine_max_new_tokens_finishes_with_length(engine, tokenizer):
    out = engine.generate(
        tokenizer.encode("Count: one, two, three,"), SamplingParams(max_new_tokens=5, ignore_eos=True)
    )
    assert out.finish_reason is FinishReason.LENGTH
    assert len(out.token_ids) == 5 and out.usage.completion_tokens == 5


def test_engine_min_new_tokens_and_ignore_eos_hold_off_eos(engine, tokenizer):
    prompt = tokenizer.encode(chat(tokenizer, ("user", "What is 2+2?")))
    eos = engine.tokenizer.eos_token_ids
    plain, at_least, ignoring = [
        engine.submit(prompt, p)
        for p in (
            SamplingParams(max_new_tokens=40),
            SamplingParams(max_new_tokens=40, min_new_tokens=24),
            SamplingParams(max_new_tokens=24, ignore_eos=True),
        )
    ]
    plain, at_least, ignoring = tokens_of(collect(plain)), tokens_of(collect(at_least)), tokens_of(collect(ignoring))
    # the plain answer ends early with EOS
    assert plain[-1] in eos and len(plain) < 24
    n = len(plain) - 1
    # min_new_tokens: EOS banned for 24 tokens, the answer before it unchanged
    assert len(at_least) >= 24
    assert not any(t in eos for t in at_least[:24])
    assert at_least[:n] == plain[:n]
    # ignore_eos: EOS is generated but does not stop
    assert len(ignoring) == 24 and ignoring[: n + 1] == plain


def test_min_new_tokens_beyond_the_default_length_is_honoured_or_refused(checkpoint, tokenizer):
    """With max_new_tokens unset, the default length (here 16) gives way to a larger min_new_tokens; one that
    cannot fit in the context is OUT_OF_RANGE at once, not cut short."""
    config = EngineConfig(dtype="float32", kv_cache_tokens=512, max_context_length=64, default_max_new_tokens=16)
    with Engine(config, checkpoint=checkpoint) as eng:
        prompt = tokenizer.encode(chat(tokenizer, ("user", "What is 2+2?")))
        out = eng.generate(prompt, SamplingParams(min_new_tokens=20))
        assert len(out.token_ids) == 20 and out.finish_reason is FinishReason.LENGTH
        assert len(eng.generate(prompt, SamplingParams()).token_ids) <= 16
        with pytest.raises(ContextOverflow, match="exceed the context window"):
            eng.submit(prompt, SamplingParams(min_new_tokens=64 - len(prompt) + 1))
        eng.start_session(3)
        eng.generate(prompt, SamplingParams(max_new_tokens=4), session_id=3)  # a history of len(prompt) + 4
        more = [504, 3575]
        late = eng.submit(more, SamplingParams(min_new_tokens=64 - len(prompt) - 4 - len(more) + 1), session_id=3)
        with pytest.raises(ContextOverflow, match="exceed the context window"):  # fits alone, not after the history
            list(late)
        assert (
            eng.generate(
                more, SamplingParams(min_new_tokens=64 - len(prompt) - 4 - len(more)), session_id=3
            ).finish_reason
            is FinishReason.LENGTH
        )
        eng.end_session(3)
        assert_idle(eng)


def test_engine_logprobs_top_n_and_greedy_choice(engine, tokenizer):
    out = engine.generate(
        tokenizer.encode("The capital of France is"), SamplingParams(max_new_tokens=8, logprobs=3, ignore_eos=True)
    )
    assert len(out.logprobs) == len(out.token_ids) == 8
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok
        assert len(lp.top) == 3
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert lp.top[0][0] == tok
        assert math.isclose(lp.logprob, max(values), abs_tol=1e-6)
        assert sum(math.exp(v) for v in values) <= 1 + 1e-5


def test_engine_penalties_change_repetitive_greedy_output(engine, tokenizer):
    prompt = tokenizer.encode("one two one two one two one two one two")
    variants = [
        SamplingParams(max_new_tokens=16, ignore_eos=True),
        SamplingParams(max_new_tokens=16, ignore_eos=True, repetition_penalty=1.5),
        SamplingParams(max_new_tokens=16, ignore_eos=True, presence_penalty=1.5),
        SamplingParams(max_new_tokens=16, ignore_eos=True, frequency_penalty=1.5),
    ]
    streams = [engine.submit(prompt, p) for p in variants]
    base, *penalized = [tokens_of(collect(s)) for s in streams]
    assert len(set(base)) < len(base) // 2  # the unpenalized output repeats itself
    for p, toks in zip(variants[1:], penalized):
        assert toks != base, p
        assert len(set(toks)) > len(set(base)), p


# ----------------------------------------------------------------------- 8. streaming detokenization
def _stream_deltas(engine, prompt, n):
    outs = collect(engine.submit(prompt, SamplingParams(max_new_tokens=n)))
    return [o.text for o in outs], tokens_of(outs)


def test_engine_streams_emoji_and_cjk_without_broken_characters(engine, tokenizer):
    prompts = [
        chat(tokenizer, ("user", "Repeat exactly: 你好世界 🎉🎉 こんにちは")),
        chat(tokenizer, ("system", "You repeat the user's message verbatim."), ("user", "你好世界 🎉🎉 こんにちは")),
    ]
    split_tokens = 0
    for prompt in prompts:
        deltas, ids = _stream_deltas(engine, prompt, 32)
        full = tokenizer.decode(ids)
        assert "".join(deltas) == full
        assert REPLACEMENT not in full
        assert not any(REPLACEMENT in d for d in deltas)
        split_tokens += sum(REPLACEMENT in tokenizer.decode([t]) for t in ids)
    assert split_tokens > 0  # some characters really were split across tokens


def test_engine_streams_cjk_continuation_equal_to_decode(engine, tokenizer):
    # Plain continuation of CJK text; the model may emit byte sequences that never complete, and a
    # LENGTH cut can fall inside a character: whatever it emits, the deltas concatenate to the decode.
    deltas, ids = _stream_deltas(engine, "你好世界 🎉🎉 こんにちは\n" * 3, 32)
    full = tokenizer.decode(ids)
    assert "".join(deltas) == full
    assert any(ord(c) > 0x2E80 and c != REPLACEMENT for c in full)


def test_engine_reply_after_a_split_character_is_decode_past_the_prompt(engine, hf_tokenizer_dir):
    """Prompts whose last id is part of a character, stateless and as session turns: each reply is
    transformers' decode of everything before it plus the reply, past its decode of what came before."""
    hf = transformers.AutoTokenizer.from_pretrained(hf_tokenizer_dir)
    prompts = ["日本語", "I love 🐍", "東京は"]
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)

    def assert_reply(before: list[int], out) -> None:
        text = hf.decode(before + out.token_ids)[len(hf.decode(before)) :]
        assert out.text == text and not out.text.startswith(REPLACEMENT)

    for prompt in prompts:
        assert_reply(engine.tokenizer.encode(prompt), engine.generate(prompt, params))
    sid = engine.start_session()
    history: list[int] = []
    for prompt in prompts:
        out = engine.generate(prompt, params, session_id=sid)
        history += engine.tokenizer.encode(prompt, add_special_tokens=not history)
        assert_reply(history, out)
        history += out.token_ids
    engine.end_session(sid)
