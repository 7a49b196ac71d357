"""Chat sessions: each turn renders the whole conversation, so a session turn given as messages equals a
stateless request on the conversation so far (no default system prompt inserted again), and only the tokens
past what the session holds are prefilled. On the embedded SmolLM2 and on tiny models whose templates add a
default system prompt, or render earlier turns differently once more follow."""

from __future__ import annotations

import pytest

from lmgate.engine.text.chat import common_prefix, render_ids
from lmgate.engine.config import EngineConfig
from lmgate.engine.engine import Engine
from lmgate.engine.errors import InvalidRequest
from lmgate.engine.sampling.sampler import SamplingParams

QUESTIONS = ["What is the capital of Italy?", "And of Spain?", "Which of the two is bigger?"]
PARAMS = SamplingParams(max_new_tokens=12)  # stops at <|im_end|>, as a chat turn does
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM"

# Marks the newest message, so a turn's rendering of earlier turns differs from what the session holds.
MARK_LATEST = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}{% if loop.last %} (latest){% endif %}\n"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def engine(checkpoint):
    with Engine(EngineConfig(dtype="float32", kv_cache_tokens=4096), checkpoint=checkpoint) as eng:
        yield eng


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def run_chat(engine: Engine, params: SamplingParams = PARAMS) -> list[tuple]:
    """Three message turns on one session, each beside a stateless request on the whole conversation.
    Returns (session output, stateless output, conversation) per turn; the session is ended."""
    sid = engine.start_session()
    conversation, turns = [], []
    for question in QUESTIONS:
        got = engine.generate(user(question), params, session_id=sid)
        conversation += user(question)
        want = engine.generate(conversation, params)
        turns.append((got, want, list(conversation)))
        conversation.append({"role": "assistant", "content": got.text})  # the reply as its client received it
    engine.end_session(sid)
    return turns


def assert_turns_equal_stateless(engine: Engine, turns: list[tuple]) -> None:
    for got, want, conversation in turns:
        assert got.token_ids == want.token_ids
        assert got.usage.prompt_tokens == want.usage.prompt_tokens == len(render_ids(engine.tokenizer, conversation))
    info = engine.info()
    assert info.kv_blocks_free == info.kv_blocks_total and info.active_sessions == 0


def test_chat_session_turns_equal_stateless_and_reuse_kv(engine):
    turns = run_chat(engine)
    assert_turns_equal_stateless(engine, turns)
    rendered = engine.tokenizer.decode(render_ids(engine.tokenizer, turns[-1][2]), skip_special_tokens=False)
    assert rendered.count(DEFAULT_SYSTEM) == 1
    for (prev, _, _), (got, _, _) in zip(turns, turns[1:]):
        assert got.usage.cached_tokens >= prev.usage.prompt_tokens  # the earlier turns were not prefilled again


def test_chat_session_sampled_with_seed_equals_stateless(engine):
    turns = run_chat(engine, SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.9, seed=7))
    assert_turns_equal_stateless(engine, turns)


def test_chat_session_remembers_a_reply_cut_at_its_stop_string_as_it_was_received(engine):
    """A stop string ends a turn inside its last token; the client never sees it, nor what followed it in
    that token. The session's next turn renders the reply as received, as a client sending the whole
    conversation would."""
    turns = run_chat(engine, SamplingParams(max_new_tokens=12, stop=(",", ".", "!")))
    assert [got.finish_reason.value for got, _, _ in turns].count("stop") >= 2
    assert_turns_equal_stateless(engine, turns)


@pytest.mark.parametrize("params", [PARAMS, SamplingParams(max_new_tokens=12, stop=(",", ".", "!"))])
def test_chat_session_over_rank_processes_remembers_the_reply_as_it_was_received(process_ranks_server, params):
    """A rank process leaves a chat turn's text and stop strings to the serving process, and decodes the reply
    once, at the turn's end, for its session: the next turns render it as the client received it (cut at a
    stop string the serving process found, though the rank may have drawn a token past it)."""
    engine = process_ranks_server.engine
    turns = run_chat(engine, params)
    for got, want, conversation in turns:
        assert (got.token_ids, got.text) == (want.token_ids, want.text)
        assert got.usage.prompt_tokens == want.usage.prompt_tokens == len(render_ids(engine.tokenizer, conversation))
    if params.stop:
        assert [got.finish_reason.value for got, _, _ in turns].count("stop") >= 2


@pytest.mark.parametrize("template", ["default system prompt", "marks the latest message"])
def test_chat_session_on_tiny_model_equals_stateless(template, tiny_models):
    with Engine(EngineConfig(dtype="float32", model=tiny_models("llama").path, kv_cache_tokens=2048)) as eng:
        if template == "marks the latest message":
            eng.tokenizer.chat_template = MARK_LATEST
        turns = run_chat(eng, SamplingParams(max_new_tokens=8, ignore_eos=True))
        assert_turns_equal_stateless(eng, turns)
        first, second = turns[0][0], turns[1][0]
        held = render_ids(eng.tokenizer, turns[0][2]) + first.token_ids
        shared = common_prefix(held, render_ids(eng.tokenizer, turns[1][2]))
        assert second.usage.cached_tokens == min(shared, len(held) - 1)
        if template == "marks the latest message":
            assert shared < first.usage.prompt_tokens  # the first question renders differently: recomputed


def test_chat_messages_refused_on_a_session_of_token_turns(engine):
    sid = engine.start_session()
    engine.generate(engine.tokenizer.encode("Hello there"), SamplingParams(max_new_tokens=3), session_id=sid)
    with pytest.raises(InvalidRequest, match="every turn is messages"):
        engine.generate(user("Hi"), PARAMS, session_id=sid)
    after = engine.generate(engine.tokenizer.encode(" again"), SamplingParams(max_new_tokens=3), session_id=sid)
    assert after.usage.cached_tokens > 0  # the refused turn changed nothing
    engine.end_session(sid)


def test_chat_token_turn_may_follow_message_turns(engine):
    sid = engine.start_session()
    first = engine.generate(user("Name a colour."), PARAMS, session_id=sid)
    more = engine.tokenizer.encode(
        "<|im_start|>user\nAnother?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    second = engine.generate(more, PARAMS, session_id=sid)
    assert second.usage.prompt_tokens == first.usage.prompt_tokens + len(first.token_ids) + len(more)
    with pytest.raises(InvalidRequest):
        engine.generate(user("And a third?"), PARAMS, session_id=sid)
    engine.end_session(sid)


@pytest.mark.parametrize("messages", [[{"role": "wizard", "content": "hi"}], [{"content": "no role"}]])
def test_chat_bad_messages_refused_and_leave_session_unchanged(engine, messages):
    sid = engine.start_session()
    with pytest.raises(InvalidRequest):
        engine.submit(messages, PARAMS, session_id=sid)
    turns = engine.generate(user("Hi"), PARAMS, session_id=sid)
    assert turns.usage.prompt_tokens == len(render_ids(engine.tokenizer, user("Hi")))
    engine.end_session(sid)


# Refuses tool results that answer no call: a guard that looks at the conversation, as real templates have.
TOOL_AFTER_A_CALL = (
    "{% if messages[0]['role'] == 'tool' %}{{ raise_exception('tool results must follow a call') }}"
    "{% endif %}" + MARK_LATEST.replace("{% if loop.last %} (latest){% endif %}", "")
)


def test_a_turn_of_tool_results_is_checked_with_its_conversation(tiny_models):
    """A session turn of tool results alone would fail the template's guard; with the conversation before it,
    which its loop renders, it does not, and it equals a stateless request on the whole conversation. Tool
    results that open a session are refused by its loop, and the session is left as it was."""
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    tool = [{"role": "tool", "content": "42"}]
    with Engine(EngineConfig(dtype="float32", model=tiny_models("llama").path, kv_cache_tokens=2048)) as eng:
        eng.tokenizer.chat_template = TOOL_AFTER_A_CALL
        with pytest.raises(InvalidRequest, match="must follow a call"):
            eng.submit(tool, params)  # stateless: the template sees the tool results alone
        sid = eng.start_session()
        first = eng.generate(user("What is six times seven?"), params, session_id=sid)
        got = eng.generate(tool, params, session_id=sid)
        conversation = user("What is six times seven?") + [{"role": "assistant", "content": first.text}] + tool
        want = eng.generate(conversation, params)
        assert got.error is None and got.token_ids == want.token_ids
        assert got.usage.prompt_tokens == want.usage.prompt_tokens
        eng.end_session(sid)
        sid = eng.start_session()
        with pytest.raises(InvalidRequest, match="must follow a call"):  # from the loop, through the stream
            eng.generate(tool, params, session_id=sid)
        after = eng.generate(user("Hi"), params, session_id=sid)
        assert after.usage.prompt_tokens == len(render_ids(eng.tokenizer, user("Hi")))
        eng.end_session(sid)
        info = eng.info()
        assert info.kv_blocks_free == info.kv_blocks_total and info.active_sessions == 0
