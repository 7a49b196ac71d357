"""The conversation a resumable session keeps on the client, and how it is replayed as one turn."""

from __future__ import annotations

import pytest

from lmgate.client.history import History
from lmgate.client.wire import Delta


def delta(text: str, ids: list[int]) -> Delta:
    return Delta("r", 1, ids, text, [], None, None)


def test_prompt_turns_replay_as_the_whole_text():
    h = History()
    turn = h.turn_input("Hi.", None, None)
    h.record(turn, [delta(" Hello", [1]), delta("!", [2])])
    assert h.replay(h.turn_input(" More?", None, None))["prompt"] == "Hi. Hello! More?"


def test_message_turns_replay_with_the_assistant_replies():
    h = History()
    turn = h.turn_input(None, [{"role": "user", "content": "Hi"}], None)
    h.record(turn, [delta("Hello", [5])])
    replay = h.replay(h.turn_input(None, [{"role": "user", "content": "More"}], None))
    assert replay["messages"] == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "More"},
    ]


def test_token_turns_replay_inputs_and_outputs():
    h = History()
    turn = h.turn_input(None, None, [7, 8])
    h.record(turn, [delta("a", [9]), delta("b", [10])])
    assert h.replay(h.turn_input(None, None, [11]))["token_ids"] == [7, 8, 9, 10, 11]


def test_a_stopped_turn_keeps_what_came_back():
    h = History()
    h.record(h.turn_input("Hi.", None, None), [])
    assert h.text == "Hi."


def test_turns_of_another_kind_are_refused():
    h = History()
    h.record(h.turn_input("Hi.", None, None), [delta(" Yo", [1])])
    with pytest.raises(ValueError, match="one kind of input"):
        h.turn_input(None, None, [1])


def test_a_turn_cancelled_before_its_first_token_leaves_no_trace():
    """As on the server: such a turn's input does not join the history."""
    h = History()
    h.record(h.turn_input("Hi.", None, None), [delta(" Hello", [1])])
    h.record(h.turn_input(" Long story?", None, None), [Delta("r", 1, [], "", [], "cancelled", None)])
    assert h.text == "Hi. Hello"
