"""Each served pair's recompute policy: configured for every pair, recorded with the pair's mapper, or the default;
said at start-up, shown on /health, and the one each pair's switches run under."""

from __future__ import annotations

import logging
from dataclasses import replace

import httpx
import pytest

from _serving_support import running, tiny_family, with_record
from kvhandoff.errors import ConfigError
from kvhandoff.mapper.manifest import RecomputeChoice, TradeoffPoint
from kvhandoff.runtime.plan import HandoffPlan, recorded_recompute
from kvhandoff.runtime.policy import DEFAULT_RECOMPUTE, LeadingLayers, Recent
from kvhandoff.runtime.switch.pair import ServedRecompute, SwitchSettings, served_recompute
from kvhandoff.serving.engine import Engine
from kvhandoff.serving.settings import ServeConfig

from conftest import pair_guards, pair_recomputes

FORWARD, BACKWARD = ("small", "large"), ("large", "small")


def choice(spec: str = "recent:20%") -> RecomputeChoice:
    return RecomputeChoice(spec, "fastest_at_min_retention", 0.97, "generative", ("coqa_gen", "boolq_long"), "dev",
                           24, 0.98, 2048, 3.1)


def family_with_a_recorded_forward_recompute(chosen: RecomputeChoice | None = None):
    models, mappers = tiny_family()
    return models, {**mappers, FORWARD: with_record(mappers[FORWARD], recompute=chosen or choice())}


def test_each_pair_takes_the_configured_policy_its_recorded_one_or_the_default():
    _, mappers = family_with_a_recorded_forward_recompute()
    chosen = pair_recomputes(SwitchSettings(), mappers)
    assert chosen[FORWARD] == ServedRecompute(Recent(0.2), "recorded", choice())
    assert chosen[BACKWARD] == ServedRecompute(DEFAULT_RECOMPUTE, "default")
    configured = pair_recomputes(SwitchSettings(recompute="layers:25%"), mappers)
    assert {c.policy for c in configured.values()} == {LeadingLayers(0.25)}
    assert {c.source for c in configured.values()} == {"configured"}
    assert recorded_recompute(object()) is None  # a stand-in without a manifest
    assert "recent:20% (recorded with its mapper: chosen as the fastest with mean retention >= 0.97" in \
        chosen[FORWARD].describe("small", "large")
    assert "(the default: none recorded with its mapper; `kvhandoff-lab eval-switch --sweep-recompute" in \
        chosen[BACKWARD].describe("large", "small")
    assert chosen[FORWARD].to_dict()["recorded"]["spec"] == "recent:20%"
    with pytest.raises(ConfigError, match=r"small → large \('nearby:20%'\) cannot be read.*--recompute"):
        served_recompute(SwitchSettings(), choice("nearby:20%"), "small → large")
    with pytest.raises(ConfigError, match="source"):
        ServedRecompute(Recent(0.1), "guessed")


def test_the_server_hands_each_pair_over_under_its_own_policy_and_says_so(caplog):
    models, mappers = family_with_a_recorded_forward_recompute()
    caplog.set_level(logging.INFO, logger="kvhandoff.serving.engine")
    engine = Engine(models, mappers, ServeConfig(switch=SwitchSettings(guard=False)))
    try:
        assert engine.policies[FORWARD].plan.recompute == Recent(0.2)
        assert engine.policies[BACKWARD].plan.recompute == DEFAULT_RECOMPUTE
        assert engine.policies[FORWARD].plan.prefix_store is engine.prefix_store  # the rest of the plan is the server's
        session = engine._new_session("tenant")  # the pair's plan, its openings kept in the tenant's share
        assert {pair: replace(plan, prefix_store=engine.prefix_store) for pair, plan in session.pair_plans.items()} \
            == {pair: p.plan for pair, p in engine.policies.items()}
        assert {plan.prefix_store.namespace for plan in session.pair_plans.values()} == {"tenant"}
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("recompute for")]
        assert len(lines) == 2 and any("small → large: recent:20% (recorded" in line for line in lines)
    finally:
        engine.close()
    # a guard recorded under the pair's own policy carries no note
    guards = pair_guards(SwitchSettings(), mappers)
    assert guards[FORWARD].note is None or "measured under recompute" not in guards[FORWARD].note


def test_a_switch_runs_under_the_pairs_policy_and_health_shows_it(monkeypatch):
    from kvhandoff.runtime import session_handover as session_module

    used = []
    for name in ("map_for_target", "catch_up"):
        real = getattr(session_module, name)

        def spy(*args, real=real, **kwargs):
            plan = next(a for a in (*args, *kwargs.values()) if isinstance(a, HandoffPlan))
            used.append(plan.recompute)
            return real(*args, **kwargs)

        monkeypatch.setattr(session_module, name, spy)
    models, mappers = family_with_a_recorded_forward_recompute(choice("recent:50%"))
    with running(models, mappers) as server:
        health = httpx.get(server.url + "/health", timeout=30).json()["recompute"]
        assert health["small → large"]["policy"] == "recent:50%" and health["small → large"]["source"] == "recorded"
        assert health["large → small"] == {"policy": DEFAULT_RECOMPUTE.spec, "source": "default"}
        messages = [{"role": "user", "content": "tell me a story about a cat and a dog"}]
        for model in ("small", "large", "small"):
            body = {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0}
            reply = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"X-Session-ID": "s1"},
                               timeout=60)
            assert reply.status_code == 200, reply.text
            messages = [*messages, reply.json()["choices"][0]["message"], {"role": "user", "content": "and then?"}]
    assert used == [Recent(0.5), DEFAULT_RECOMPUTE]  # small → large, then large → small


def test_a_policy_that_reads_the_new_turn_gets_all_of_it_when_the_prompt_is_read_in_chunks(monkeypatch):
    from kvhandoff.runtime.seam import TransformersCache

    seen = []
    real = TransformersCache.read_turn
    monkeypatch.setattr(TransformersCache, "read_turn",
                        lambda cache, model, turn, *rest: seen.append(turn.shape[1]) or real(cache, model, turn, *rest))
    with running(recompute="turn_attention:20%", prefill_chunk=8) as server:
        messages = [{"role": "user", "content": "tell me a story about a cat and a dog"}]
        headers = {"X-Session-ID": "chunks"}
        first = httpx.post(server.url + "/v1/chat/completions", headers=headers, timeout=60, json={
            "model": "small", "messages": messages, "max_tokens": 4, "temperature": 0}).json()
        messages += [first["choices"][0]["message"],
                     {"role": "user", "content": "and what did the dog do after the cat ran away?"}]
        reply = httpx.post(server.url + "/v1/chat/completions", headers=headers, timeout=60, json={
            "model": "large", "messages": messages, "max_tokens": 4, "temperature": 0})
        assert reply.status_code == 200, reply.text
        handoff = reply.json()["kv_handoff"]
    assert handoff["status"] == "applied" and len(seen) == 1
    assert seen[0] == handoff["read_tokens"] > 8  # the whole new turn, though it was read 8 tokens at a time


TRADEOFF = (TradeoffPoint("recent:5%", 0.93, 10.6), TradeoffPoint("recent:10%", 0.95, 8.8),
            TradeoffPoint("recent:50%", 0.97, 2.1))


def traded(spec: str = "recent:10%", min_speedup: float = 5.0) -> RecomputeChoice:
    """A record chosen at ``min_speedup`` or faster from a trade-off of three measured points."""
    point = next(p for p in TRADEOFF if p.spec == spec)
    return RecomputeChoice(spec, "fastest_at_min_retention", 0.97, "generative", ("coqa_gen", "boolq_long"), "dev",
                           24, point.mean_retention, 2048, point.speedup, min_speedup, TRADEOFF)


def test_bounds_choose_each_pairs_policy_again_from_its_recorded_tradeoff():
    slower = served_recompute(SwitchSettings(min_speedup=2.0), traded(), "small → large")
    assert (slower.policy, slower.source, slower.recorded.spec, slower.recorded.min_speedup) == (
        Recent(0.5), "tradeoff", "recent:50%", 2.0)
    assert "recent:50% (from the trade-off recorded with its mapper, chosen as the fastest of 3 measured at 2x or " \
           "faster with mean retention >= 0.97" in slower.describe("small", "large")
    assert served_recompute(SwitchSettings(min_retention=0.9), traded(), "s → l").policy == Recent(0.05)
    assert served_recompute(SwitchSettings(), traded(), "s → l") == ServedRecompute(Recent(0.1), "recorded", traded())
    with pytest.raises(ConfigError, match=r"small → large: .*recorded without the trade-off.*--recompute"):
        served_recompute(SwitchSettings(min_speedup=2.0), choice(), "small → large")
    with pytest.raises(ConfigError, match=r"no recompute trade-off is recorded with the mapper of large → small.*"
                                          r"record-recompute.*--recompute"):
        served_recompute(SwitchSettings(min_speedup=2.0), None, "large → small")
    for bad in ({"min_speedup": -1.0}, {"min_retention": float("nan")}, {"min_speedup": "fast"},
                {"min_speedup": 3.0, "recompute": "recent:5%"}):
        with pytest.raises(ConfigError, match=r"min_speedup|min_retention"):
            SwitchSettings(**bad)


def test_a_server_given_a_speed_floor_serves_the_point_it_chooses_and_health_shows_the_record():
    models, mappers = tiny_family()
    both = {FORWARD: with_record(mappers[FORWARD], recompute=traded()),
            BACKWARD: with_record(mappers[BACKWARD], recompute=traded("recent:5%", 10.0))}
    with running(models, both, min_speedup=2.0) as server:
        health = httpx.get(server.url + "/health", timeout=30).json()["recompute"]
        messages = [{"role": "user", "content": "tell me a story about a cat and a dog"}]
        for model in ("small", "large"):
            reply = httpx.post(server.url + "/v1/chat/completions", headers={"X-Session-ID": "floor"}, timeout=60,
                               json={"model": model, "messages": messages, "max_tokens": 4, "temperature": 0})
            assert reply.status_code == 200, reply.text
            messages = [*messages, reply.json()["choices"][0]["message"], {"role": "user", "content": "and then?"}]
        assert server.engine.policies[FORWARD].plan.recompute == Recent(0.5)
    assert health["small → large"]["policy"] == health["large → small"]["policy"] == "recent:50%"
    assert health["small → large"]["source"] == "tradeoff"
    assert health["small → large"]["recorded"]["min_speedup"] == 2.0
    assert len(health["small → large"]["recorded"]["tradeoff"]) == 3
    assert reply.json()["kv_handoff"]["status"] == "applied"
    with pytest.raises(ConfigError, match="no recompute trade-off is recorded with the mapper of large → small"):
        Engine(models, {**both, BACKWARD: mappers[BACKWARD]},
               ServeConfig(switch=SwitchSettings(guard=False, min_speedup=2.0)))
