"""A session whose beginning changed: the run it holds at another offset is reused (the serving model's own rows
moved, or the last model's mapped), with every row recomputed equal to the model's own read; nothing changes when
the prompt shares more as a prefix, or when no run is long enough."""

from __future__ import annotations

import torch

from _runtime_support import exact_pair
from kvhandoff.runtime.plan import HandoffPlan
from kvhandoff.runtime.rebase import rebase
from kvhandoff.runtime.session import SwitchingSession

OPEN = 1
CLERK, ANALYST = [OPEN, *range(20, 50), 2], [OPEN, *range(60, 66), 2]
HISTORY = [OPEN, *range(70, 110), 2, OPEN, *range(126, 106, -1), 2]  # the tiny models have 128 token ids
TURN = [OPEN, *range(3, 12), 2]  # a new turn longer than a generation prompt
EVERY_ROW = HandoffPlan.of(recompute="recent:100%")


def session_on(model_name: str):
    source, target, mapper = exact_pair()
    session = SwitchingSession({"small": source, "large": target}, {("small", "large"): mapper})
    session.read(model_name, CLERK + HISTORY)
    return session


def own_read(session, server, prompt):
    return session.models[server](input_ids=torch.tensor([prompt])).logits[0, -1].log_softmax(-1)


def test_the_history_behind_new_instructions_is_reused_from_the_model_itself_or_mapped_from_the_last_one():
    prompt = ANALYST + HISTORY + TURN
    for held_by in ("large", "small"):
        session = session_on(held_by)
        reused = rebase(session, "large", prompt, [OPEN], EVERY_ROW, min_length=32)
        assert reused is not None and reused.source == held_by and reused.length == len(HISTORY)
        assert session.tokens == ANALYST + HISTORY and session.owner == "large"
        logprobs = session.read("large", TURN)
        torch.testing.assert_close(logprobs, own_read(session, "large", prompt), atol=1e-4, rtol=0)


def test_a_turn_attention_plan_ranks_the_run_by_the_holders_read_of_the_rest_of_the_prompt():
    prompt = ANALYST + HISTORY + TURN
    for held_by in ("large", "small"):
        session = session_on(held_by)
        reused = rebase(session, "large", prompt, [OPEN], HandoffPlan.of(recompute="turn_attention:100%"),
                        min_length=32)
        assert reused is not None and reused.source == held_by
        torch.testing.assert_close(session.read("large", TURN), own_read(session, "large", prompt), atol=1e-4, rtol=0)
        session = session_on(held_by)
        quarter = rebase(session, "large", prompt, [OPEN], HandoffPlan.of(recompute="turn_attention:25%"),
                         min_length=32)
        assert quarter.length == len(HISTORY)
        assert quarter.mapped.pending.shape[1] == len(ANALYST) - quarter.known + len(HISTORY) // 4


def test_a_longer_shared_prefix_or_a_short_run_leaves_the_session_as_it_was():
    session = session_on("large")
    assert rebase(session, "large", CLERK + HISTORY + TURN, [OPEN], EVERY_ROW, min_length=32) is None
    assert rebase(session, "large", ANALYST + HISTORY[:20] + TURN, [OPEN], EVERY_ROW, min_length=32) is None
    assert session.tokens == CLERK + HISTORY and session.reused is None
