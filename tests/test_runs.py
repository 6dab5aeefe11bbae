"""`RunIndex`: a conversation's history found behind other instructions, the longest run chosen, never across tenants,
never a plain prefix, forgotten when removed, bad settings refused."""

from __future__ import annotations

import pytest

from kvhandoff.errors import ConfigError
from kvhandoff.runtime.runs import RunIndex, RunMatch

OPEN = 1  # the token that opens a message (<|im_start|>)


def message(words: list[int]) -> list[int]:
    return [OPEN, *words, 2]


CLERK = message(list(range(100, 130)))                     # the clerk agent's instructions
ANALYST = message(list(range(200, 212)))                   # the analyst's, shorter
HISTORY = message(list(range(300, 380))) + message(list(range(400, 450)))  # the conversation so far
TURN = message([7, 8, 9])


def index(**settings) -> RunIndex:
    return RunIndex([OPEN], **{"probe": 8, "min_length": 32, **settings})


def test_the_history_behind_other_instructions_is_found_where_it_sits():
    runs = index()
    runs.add("clerk-conversation", CLERK + HISTORY)
    prompt = ANALYST + HISTORY + TURN
    match = runs.find(prompt)
    assert match == RunMatch("clerk-conversation", len(ANALYST), len(CLERK), len(HISTORY))
    assert match.shift == len(ANALYST) - len(CLERK)
    assert prompt[match.prompt_start: match.prompt_start + match.length] == HISTORY


def test_the_longest_run_wins_and_short_ones_are_not_reported():
    runs = index()
    runs.add("part", CLERK + HISTORY[:60] + [9] * 40)  # the first 60 tokens of the history, then another turn
    runs.add("whole", CLERK + HISTORY)
    assert runs.find(ANALYST + HISTORY + TURN).key == "whole"
    runs.remove("whole")
    assert runs.find(ANALYST + HISTORY + TURN).length == 60
    runs.add("tiny", ANALYST + HISTORY[:20])
    runs.remove("part")
    assert runs.find(CLERK + HISTORY + TURN) is None  # 20 tokens: under min_length
    assert len(runs) == 1


def test_a_conversation_that_grows_is_held_once_and_the_oldest_go_past_the_bound():
    runs = index(max_held=2)
    runs.add("turn-1", CLERK + HISTORY[:60])
    runs.add("turn-2", CLERK + HISTORY)  # extends turn 1: turn 1 is forgotten
    assert len(runs) == 1 and runs.held("turn-1") is None and list(runs.held("turn-2")) == CLERK + HISTORY
    runs.add("other", message(list(range(600, 700))))
    runs.add("third", message(list(range(700, 800))))  # past max_held: the least recently added goes
    assert len(runs) == 2 and runs.held("turn-2") is None
    assert runs.find(ANALYST + HISTORY + TURN) is None


def test_a_plain_prefix_is_left_to_the_prefix_cache_but_the_same_offset_after_another_beginning_is_found():
    runs = index()
    runs.add("same", CLERK + HISTORY)
    assert runs.find(CLERK + HISTORY + TURN) is None
    other = message(list(range(500, 530)))  # instructions of the clerk's length: the history at the same offset
    match = runs.find(other + HISTORY + TURN)
    assert match is not None and match.shift == 0 and match.length == len(HISTORY)


def test_a_run_is_never_found_in_another_tenants_conversation():
    runs = index()
    runs.add("theirs", CLERK + HISTORY, tenant="tenant-a")
    assert runs.find(ANALYST + HISTORY + TURN, tenant="tenant-b") is None
    assert runs.find(ANALYST + HISTORY + TURN, tenant="tenant-a").key == "theirs"
    runs.add("theirs", ANALYST, tenant="tenant-a")  # replaced: the old anchors are gone
    assert runs.find(ANALYST + HISTORY + TURN, tenant="tenant-a") is None


@pytest.mark.parametrize(("settings", "message_part"), [
    ({"anchor_ids": []}, "token ids that open a message"),
    ({"max_held": 0}, "max_held"),
    ({"probe": 0}, "probe"),
    ({"probe": 16, "min_length": 8}, "at least its probe"),
])
def test_bad_settings_are_refused(settings, message_part):
    anchors = settings.pop("anchor_ids", [OPEN])
    with pytest.raises(ConfigError, match=message_part):
        RunIndex(anchors, **settings)


def test_the_new_turn_starts_at_the_last_message_not_at_the_generation_prompt():
    runs = index()
    generation_prompt = [OPEN, 5, 6]  # "<|im_start|>assistant\n"
    question = message(list(range(30, 50)))
    assert runs.new_turn_start(CLERK + HISTORY + question) == len(CLERK + HISTORY)
    assert runs.new_turn_start(CLERK + HISTORY + question + generation_prompt) == len(CLERK + HISTORY)
    assert runs.new_turn_start([5, 6, 7]) == 2  # no anchor: the last token
