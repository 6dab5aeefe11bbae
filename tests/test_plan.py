"""A pair's recompute policy recorded with its mapper, read once into each pair's plan."""

from __future__ import annotations

import pytest

from _serving_support import tiny_family, with_record
from kvhandoff.errors import ConfigError
from kvhandoff.mapper.manifest import RecomputeChoice
from kvhandoff.runtime.plan import DEFAULT_PLAN, HandoffPlan, recorded_plans, recorded_policy, recorded_recompute
from kvhandoff.runtime.policy import TurnAttention

FORWARD, BACKWARD = ("small", "large"), ("large", "small")


def choice(spec: str) -> RecomputeChoice:
    return RecomputeChoice(spec, "fastest_at_min_retention", 0.97, "generative", ("coqa_gen",), "dev", 12, 0.98,
                           2048, 8.2)


def test_only_the_pairs_that_record_a_policy_get_a_plan_of_their_own():
    _, mappers = tiny_family()
    recorded = {**mappers, FORWARD: with_record(mappers[FORWARD], recompute=choice("turn_attention:5%"))}
    plans = recorded_plans(HandoffPlan(3), recorded)
    assert plans == {FORWARD: HandoffPlan(3, TurnAttention(0.05))}  # the exact prefix of the plan it is given
    assert recorded_plans(DEFAULT_PLAN, mappers) == {}
    assert recorded_recompute(recorded[FORWARD]) == choice("turn_attention:5%")
    assert recorded_recompute(object()) is None and recorded_policy(None) is None


def test_a_record_this_kvhandoff_cannot_read_is_refused_naming_the_pair_and_the_fix():
    _, mappers = tiny_family()
    recorded = {**mappers, BACKWARD: with_record(mappers[BACKWARD], recompute=choice("nearby:5%"))}
    with pytest.raises(ConfigError, match=r"large → small \('nearby:5%'\) cannot be read.*--record-recompute"):
        recorded_plans(DEFAULT_PLAN, recorded)
