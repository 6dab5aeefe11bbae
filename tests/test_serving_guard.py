"""The quality guard: its signals, AUROC and the threshold choice, its measurement on dev conversations (an exact
mapper against a noisy one must separate), and each pair's guard in the server — recorded, configured or none — as
the start-up log, /health and each response show it."""

from __future__ import annotations

import copy
import dataclasses
import logging
import math

import httpx
import pytest
import torch

from _serving_support import EXACT_FIT, VOCAB, chat_ids, running, tiny_family, with_record
from kvhandoff import fit_mapper
from kvhandoff.errors import ConfigError
from kvhandoff.mapper.manifest import GUARD_RULES, GuardCalibration
from kvhandoff.runtime.policy import DEFAULT_RECOMPUTE, Recent
from kvhandoff.runtime.policy import parse as policy_of
from kvhandoff.runtime.switch.guard import (
    DEFAULT_GUARD_WINDOW,
    Escalate,
    Fallback,
    GuardPolicy,
    guard_score,
    needs_reference,
)
from kvhandoff.runtime.switch.pair import SwitchSettings
from kvhandoff.serving.calibrate import (
    GuardRecord,
    WithinTime,
    auroc,
    calibrate_guard,
    choose_threshold,
    flag_rates,
    guard_records_by_signal,
    measure_guard,
    record_guards,
    relabel,
    summarize_guard,
)
from kvhandoff.serving.engine import Engine
from kvhandoff.serving.settings import ServeConfig

from conftest import exactly_related, pair_guards, random_batches, tiny_model

pytestmark = pytest.mark.timeout(120)


def test_signals_are_zero_on_equal_distributions_and_grow_with_a_worse_one():
    gen = torch.Generator().manual_seed(0)
    reference = torch.randn(5, 11, generator=gen).log_softmax(-1)
    ids = [3, 1, 4, 1, 5]
    assert guard_score("logloss", reference, reference, ids) == pytest.approx(0.0)
    assert guard_score("kl", reference, reference, ids) == pytest.approx(0.0, abs=1e-6)
    worse = (reference + 3 * torch.randn(5, 11, generator=gen)).log_softmax(-1)
    assert guard_score("kl", worse, reference, ids) > 0.1
    # logloss: the served model's loss on the turn's next tokens minus the reference's
    following = torch.tensor(ids[1:])[:, None]
    expected = (-worse[:-1].gather(1, following).mean() + reference[:-1].gather(1, following).mean()).item()
    assert guard_score("logloss", worse, reference, ids) == pytest.approx(expected)
    # the last k positions of a longer turn predict its last k - 1 tokens
    assert guard_score("logloss", worse[-3:], reference[-3:], [9, 9, *ids]) == pytest.approx(
        (-worse[-3:-1].gather(1, following[-2:]).mean() + reference[-3:-1].gather(1, following[-2:]).mean()).item())
    assert guard_score("logloss", worse[:1], reference[:1], ids[:1]) is None  # nothing predicted inside the turn
    with pytest.raises(ConfigError, match="guard signal"):
        guard_score("vibes", worse, reference, ids)


def test_the_answer_entropy_and_mapped_share_signals():
    gen = torch.Generator().manual_seed(1)
    reference = torch.randn(4, 7, generator=gen).log_softmax(-1)
    served = torch.randn(4, 7, generator=gen).log_softmax(-1)
    ids = [1, 2, 3, 4]
    # kl_answer: the KL of the last position only (the distribution of the answer's first token)
    last = (reference[-1].exp() * (reference[-1] - served[-1])).sum().item()
    assert guard_score("kl_answer", served, reference, ids) == pytest.approx(last, rel=1e-5)
    # entropy: the served model's mean entropy, with or without a reference
    entropy = (-(served.exp() * served).sum(-1)).mean().item()
    assert guard_score("entropy", served, None, ids) == pytest.approx(entropy, rel=1e-5)
    uniform = torch.full((4, 7), 1 / 7).log()
    assert guard_score("entropy", uniform, None, ids) == pytest.approx(math.log(7), rel=1e-5)
    # entropy_gain: the served model's mean entropy minus the previous model's over its own cache
    own = (-(reference.exp() * reference).sum(-1)).mean().item()
    assert guard_score("entropy_gain", served, reference, ids) == pytest.approx(entropy - own, rel=1e-5)
    assert guard_score("entropy_gain", reference, reference, ids) == pytest.approx(0.0, abs=1e-6)
    assert guard_score("entropy_gain", reference, uniform, ids) < 0  # less surprised than the previous model
    assert guard_score("mapped_share", served, None, ids, mapped_share=0.25) == 0.25
    signals = ("logloss", "kl", "kl_answer", "entropy", "entropy_gain", "mapped_share")
    assert [needs_reference(s) for s in signals] == [True, True, True, False, True, False]
    with pytest.raises(ConfigError, match="reference"):
        guard_score("entropy_gain", served, None, ids)
    with pytest.raises(ConfigError, match="reference"):
        guard_score("kl", served, None, ids)
    with pytest.raises(ConfigError, match="share of positions"):
        guard_score("mapped_share", served, None, ids)


def test_auroc_and_threshold_choice():
    assert auroc([0.1, 0.2, 0.8, 0.9], [False, False, True, True]) == 1.0
    assert auroc([0.9, 0.8, 0.2, 0.1], [False, False, True, True]) == 0.0
    assert auroc([0.5, 0.5], [False, True]) == 0.5
    assert auroc([0.1, 0.2], [True, True]) is None
    threshold, catch, false = choose_threshold([0.1, 0.2, 0.8, 0.9], [False, False, True, True])
    assert 0.2 <= threshold < 0.8 and catch == 1.0 and false == 0.0
    threshold, catch, false = choose_threshold([0.1, 0.7, 0.6, 0.9], [False, False, True, True],
                                               max_false_fallback=0.0)
    assert threshold == 0.7 and catch == 0.5 and false == 0.0
    assert flag_rates([0.1, 0.7, 0.6, 0.9], [False, False, True, True], 0.65) == (0.5, 0.5)
    assert flag_rates([0.1, 0.9], [True, True], 0.5) == (0.5, None)  # no negatives: no false-fallback rate
    summary = summarize_guard([GuardRecord(0, 1, "a", "b", 5, s, y) for s, y in
                               ((0.1, False), (None, True), (0.9, True))], "kl")
    assert summary.handoffs == 2 and summary.changed == 1 and summary.auroc == 1.0
    assert summary.to_dict()["catch_rate"] == 1.0


def test_a_turn_attention_switch_under_a_relative_guard_reads_the_turn_once(monkeypatch):
    """The guard's reference and turn_attention's ranking are the previous model's one read of the new turn: the
    policy does not read it again, and the switch answers as it does without the guard."""
    from kvhandoff.runtime.seam import TransformersCache

    reads = []
    real_read = TransformersCache.read_turn
    monkeypatch.setattr(TransformersCache, "read_turn", lambda *args: reads.append(1) or real_read(*args))

    def switch(**guard) -> tuple[str, dict]:
        with running(recompute="turn_attention:20%", **guard) as server:
            messages, headers = [{"role": "user", "content": "tell me a story about a cat and a dog"}], {
                "X-Session-ID": "once"}
            for model in ("small", "large"):
                reply = httpx.post(server.url + "/v1/chat/completions", headers=headers, timeout=60, json={
                    "model": model, "messages": messages, "max_tokens": 6, "temperature": 0}).json()
                messages += [reply["choices"][0]["message"], {"role": "user", "content": "and the dog?"}]
        return reply["choices"][0]["message"]["content"], reply["kv_handoff"]

    plain, plain_handoff = switch()
    assert len(reads) == 1 and plain_handoff["guard"] is None
    guarded, handoff = switch(guard=True, guard_signal="entropy_gain", guard_threshold=1e9)
    assert len(reads) == 2  # one read of the turn: the guard's preview served the policy too
    assert handoff["status"] == "applied" and handoff["guard"]["score"] is not None
    assert guarded == plain and handoff["read_tokens"] == plain_handoff["read_tokens"]


def noisy(mapper, scale: float, seed: int = 0):
    """A copy of ``mapper`` with Gaussian noise of ``scale`` × its weights' std added to its weights."""
    copied = copy.deepcopy(mapper)
    weight, _ = copied.map_tensors()
    gen = torch.Generator().manual_seed(seed)
    weight.add_(torch.randn(weight.shape, generator=gen) * weight.std() * scale)
    return copied


@pytest.fixture(scope="module")
def confident_pair():
    """An exactly related pair whose next-token distributions are sharp (LM head × 20: random init is near uniform,
    where no signal can tell a good cache from a bad one), exact mappers both ways, and dev conversations whose turns
    the models predict well (sampled from them): two switches each, small → large → small."""
    small = tiny_model("qwen2", layers=3, vocab_size=VOCAB, seed=3)
    with torch.no_grad():
        small.lm_head.weight.mul_(20.0)
    large = exactly_related(small)
    mappers = {("small", "large"): fit_mapper(small, large, random_batches(), EXACT_FIT, progress=False),
               ("large", "small"): fit_mapper(large, small, random_batches(), EXACT_FIT, progress=False)}
    gen = torch.Generator().manual_seed(5)
    torch.manual_seed(0)

    def turn() -> list[int]:
        start = torch.randint(0, 256, (1, 4), generator=gen)
        out = small.generate(input_ids=start, attention_mask=torch.ones_like(start), max_new_tokens=16,
                             do_sample=True, temperature=1.0, top_k=0)
        return out[0].tolist()

    conversations = [[(server, turn()) for server in ("small", "large", "small")] for _ in range(3)]
    return {"small": small, "large": large}, mappers, conversations


@pytest.mark.parametrize("signal", ["logloss", "kl"])
def test_measured_guard_separates_an_exact_mapper_from_a_noisy_one(confident_pair, signal):
    models, mappers, conversations = confident_pair
    exact_summary, exact = measure_guard(models, mappers, conversations, signal, max_new_tokens=6)
    bad = {pair: noisy(mapper, 1.0, seed=i) for i, (pair, mapper) in enumerate(mappers.items())}
    _, degraded = measure_guard(models, bad, conversations, signal, max_new_tokens=6)
    assert len(exact) == len(degraded) == 6  # two switches per conversation
    assert not any(r.differs for r in exact)  # exact maps: the same answers as a re-prefill
    assert exact_summary.auroc is None and exact_summary.changed == 0
    assert all(abs(r.score) < 1e-3 for r in exact) and all(r.mapped_tokens > 0 for r in exact)
    assert sum(r.differs for r in degraded) >= 4
    assert min(r.score for r in degraded) > 0.5
    summary = summarize_guard(exact + degraded, signal)
    assert summary.auroc > 0.9 and summary.catch_rate == 1.0 and summary.false_fallback_rate <= 0.2
    assert max(r.score for r in exact) <= summary.threshold < min(r.score for r in degraded if r.differs)


def test_the_entropy_gain_of_an_exact_mapper_is_nil_and_a_noisy_ones_is_not(confident_pair):
    models, mappers, conversations = confident_pair
    _, exact = measure_guard(models, mappers, conversations, "entropy_gain", max_new_tokens=6)
    assert len(exact) == 6 and all(abs(r.score) < 1e-3 for r in exact)  # the reference pass reads the same turn
    bad = {pair: noisy(mapper, 1.0, seed=i) for i, (pair, mapper) in enumerate(mappers.items())}
    _, degraded = measure_guard(models, bad, conversations, "entropy_gain", max_new_tokens=6)
    assert max(abs(r.score) for r in degraded) > 0.1  # noise moves the entropy, either way on a random model


def test_records_carry_both_answers_and_an_escalated_one(confident_pair):
    models, mappers, conversations = confident_pair
    bad = {pair: noisy(mapper, 1.0, seed=i) for i, (pair, mapper) in enumerate(mappers.items())}
    records = guard_records_by_signal(models, bad, conversations[:2], ("entropy", "mapped_share"),
                                      max_new_tokens=6, escalate=Recent(1.0))
    assert len(records["entropy"]) == len(records["mapped_share"]) == 4
    for record in records["mapped_share"]:
        assert record.differs == (record.handed != record.own) and record.first_kl >= 0
        assert record.escalated == record.own  # everything recomputed: the target's own cache
        assert 0 < record.score <= 1
    with pytest.raises(ConfigError, match="RecomputePolicy"):  # a spec is read at the edge, not here
        guard_records_by_signal(models, bad, conversations[:1], ("entropy",), escalate="recent:100%")
    first, second = records["mapped_share"][:2]
    assert first.score == 1.0 and second.score < 1.0  # the second switch maps only the turn the model missed
    assert sum(r.differs for r in records["entropy"]) >= 2


def test_within_time_counts_what_started_and_stops_when_time_is_up(monkeypatch):
    timed = WithinTime(["a", "b", "c"], None)
    assert list(timed) == ["a", "b", "c"] and timed.started == 3
    clock = iter([0.0, 1.0, 5.0])  # begun at 0; checked at 1 (within 4 s), then at 5 (past it)
    monkeypatch.setattr("kvhandoff.serving.calibrate.time.monotonic", lambda: next(clock))
    timed = WithinTime(["a", "b", "c"], 4.0)
    assert list(timed) == ["a"] and timed.started == 1


# -- each pair's guard ------------------------------------------------------------------------------------------------
def recorded(signal: str = "entropy", threshold: float = 7.0, window: int = 32,
             recompute: str = DEFAULT_RECOMPUTE.spec) -> GuardCalibration:
    return GuardCalibration(signal, threshold, 0.8, "answer_changed", GUARD_RULES[0], None, 20, 8, 0.75, 0.1, 10,
                            recompute, window)


def family_with_a_recorded_forward_guard(guard: GuardCalibration | None = None):
    """The tiny family with ``guard`` (default `recorded()`) recorded for small → large and none for large → small."""
    models, mappers = tiny_family()
    return models, {**mappers, ("small", "large"): with_record(mappers["small", "large"], guard=guard or recorded())}


FORWARD, BACKWARD = ("small", "large"), ("large", "small")


def test_each_pair_takes_its_recorded_guard_a_configured_one_or_none():
    _, mappers = family_with_a_recorded_forward_guard()
    policies = pair_guards(SwitchSettings(), mappers)
    assert policies[FORWARD] == GuardPolicy("recorded", "entropy", 7.0, 32, None, recorded())
    assert policies[BACKWARD].source == "none" and not policies[BACKWARD].active
    assert "no guard recorded for large → small" in policies[BACKWARD].note
    assert policies[FORWARD].rejects(7.5) and not policies[FORWARD].rejects(7.0)
    assert not policies[FORWARD].rejects(None) and not policies[BACKWARD].rejects(1e9)
    assert policies[BACKWARD].report(1.0) is None
    assert policies[FORWARD].report(7.5) == {"signal": "entropy", "score": 7.5, "threshold": 7.0, "source": "recorded"}
    # a threshold given is every pair's, over the record
    for settings, expected in ((SwitchSettings(guard_threshold=1.0), ("entropy", 1.0, DEFAULT_GUARD_WINDOW)),
                               (SwitchSettings(guard_threshold=0.5, guard_signal="kl", guard_window=8),
                                ("kl", 0.5, 8))):
        for policy in pair_guards(settings, mappers).values():
            assert (policy.source, policy.signal, policy.threshold, policy.window) == ("configured", *expected)
            assert policy.needs_reference == (expected[0] == "kl")
    # a signal or window given without a threshold selects the record only when it is the record's
    assert pair_guards(SwitchSettings(guard_signal="entropy", guard_window=32), mappers)[FORWARD].source == "recorded"
    for config in (ServeConfig(switch=SwitchSettings(guard_signal="kl")),
                   ServeConfig(switch=SwitchSettings(guard_window=64))):
        policy = pair_guards(config.switch, mappers)[FORWARD]
        assert policy.source == "none" and "served mapped without a guard" in policy.note
    assert "signal entropy (configured: kl)" in pair_guards(SwitchSettings(guard_signal="kl"), mappers)[FORWARD].note
    # off for every pair
    assert {p.source for p in pair_guards(SwitchSettings(guard=False), mappers).values()} == {"none"}
    # a record measured under another recompute policy still serves, with a note saying so
    _, other = family_with_a_recorded_forward_guard(recorded(recompute="none"))
    policy = pair_guards(SwitchSettings(), other)[FORWARD]
    assert policy.source == "recorded" and "measured under recompute none, served under recent:5%" in policy.note
    # a stand-in mapper without a manifest has no record; a record of a signal this kvhandoff does not know serves none
    assert pair_guards(SwitchSettings(), {FORWARD: object()})[FORWARD].source == "none"
    _, unknown = family_with_a_recorded_forward_guard(recorded(signal="telepathy"))
    policy = pair_guards(SwitchSettings(), unknown)[FORWARD]
    assert policy.source == "none" and "'telepathy', a signal this kvhandoff does not know" in policy.note
    with pytest.raises(ConfigError, match="guard signal"):
        GuardPolicy("recorded", "vibes", 1.0)


def test_a_pair_acts_as_its_record_says_unless_an_action_is_configured():
    _, mappers = family_with_a_recorded_forward_guard()
    assert pair_guards(SwitchSettings(), mappers)[FORWARD].action == Fallback()  # a record without one falls back
    escalating = dataclasses.replace(recorded(), action="escalate:recent:35%")
    _, mappers = family_with_a_recorded_forward_guard(escalating)
    policy = pair_guards(SwitchSettings(), mappers)[FORWARD]
    assert policy.action == Escalate(Recent(0.35)) and policy.to_dict()["action"] == "escalate:recent:35%"
    assert "→ escalate:recent:35% (recorded" in policy.describe(*FORWARD)
    assert pair_guards(SwitchSettings(guard_action="fallback"), mappers)[FORWARD].action == Fallback()
    configured = pair_guards(SwitchSettings(guard_threshold=1.0, guard_action="escalate:sinks:50%"), mappers)
    assert {p.action for p in configured.values()} == {Escalate(policy_of("sinks:50%"))}
    _, unreadable = family_with_a_recorded_forward_guard(dataclasses.replace(recorded(), action="escalate:warp:9%"))
    policy = pair_guards(SwitchSettings(), unreadable)[FORWARD]
    assert policy.source == "none" and "acts by 'escalate:warp:9%'" in policy.note
    with pytest.raises(ConfigError, match="Fallback or an Escalate"):
        GuardPolicy("recorded", "entropy", 1.0, action="escalate:recent:35%")


def test_start_up_says_how_each_pair_is_guarded(caplog):
    models, mappers = family_with_a_recorded_forward_guard()
    caplog.set_level(logging.INFO, logger="kvhandoff.serving.engine")
    Engine(models, mappers, ServeConfig()).close()
    lines = [(r.levelno, r.getMessage()) for r in caplog.records
             if r.name == "kvhandoff.serving.engine" and "guard" in r.getMessage()]
    assert len(lines) == 2  # one line per pair
    assert (logging.INFO, "guard for small → large: entropy > 7 over the new turn's last 32 positions → fallback "
            "(recorded: "
            "AUROC 0.80 for answer_changed on 20 dev switches, recompute recent:5%)") in lines
    level, line = next(entry for entry in lines if "large → small" in entry[1])
    assert level == logging.WARNING
    assert line.startswith("no guard recorded for large → small: switches are served mapped without a guard; run "
                           "`kvhandoff guard-calibrate`")
    caplog.clear()
    Engine(models, mappers, ServeConfig(switch=SwitchSettings(guard=False))).close()
    assert [r.getMessage() for r in caplog.records if r.name == "kvhandoff.serving.engine"
            and not r.getMessage().startswith("recompute for")] == [
        "the quality guard is off (--guard off): every switch is served mapped"]


def test_health_and_each_response_show_the_pairs_guard():
    models, mappers = family_with_a_recorded_forward_guard(recorded(threshold=100.0, window=16))
    tokenizer = models["small"][1]
    with running(models, mappers, guard=True) as server:
        health = httpx.get(server.url + "/health", timeout=30).json()["guard"]
        assert health["small → large"] == {"source": "recorded", "signal": "entropy", "threshold": 100.0,
                                           "window": 16, "action": "fallback", "note": None,
                                           "recorded": recorded(threshold=100.0, window=16).to_dict()}
        assert health["large → small"]["source"] == "none" and health["large → small"]["threshold"] is None

        def turn(model: str, messages: list[dict]) -> dict:
            body = {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0}
            response = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"X-Session-ID": "g"},
                                  timeout=30)
            assert response.status_code == 200, response.text
            messages.append({"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]})
            return response.json()["kv_handoff"]

        messages = [{"role": "user", "content": "Tell me about the tides."}]
        assert turn("small", messages)["guard"] is None  # no switch
        messages.append({"role": "user", "content": "And the moon?"})
        handoff = turn("large", messages)
        assert handoff["status"] == "applied" and handoff["guard"]["source"] == "recorded"
        assert handoff["guard"]["threshold"] == 100.0 and 0 < handoff["guard"]["score"] < 100.0
        messages.append({"role": "user", "content": "Why?"})
        handoff = turn("small", messages)
        assert handoff["status"] == "applied" and handoff["guard"] is None  # large → small: no guard, served mapped
        assert len(chat_ids(tokenizer, messages[:-1])) > handoff["read_tokens"]
    with running(models, mappers, guard=True, guard_threshold=-1e9, guard_signal="mapped_share") as server:
        health = httpx.get(server.url + "/health", timeout=30).json()["guard"]
        assert {pair: row["source"] for pair, row in health.items()} == {"small → large": "configured",
                                                                        "large → small": "configured"}


def test_a_label_says_which_switches_are_bad():
    records = [GuardRecord(0, 1, "a", "b", 5, 0.1, True, first_kl=0.1), GuardRecord(1, 1, "a", "b", 5, 0.9, False,
                                                                                   first_kl=0.9)]
    assert [r.differs for r in relabel(records, "answer_changed")] == [True, False]
    assert [r.differs for r in relabel(records, "first_token_kl_above_0.5")] == [False, True]
    assert summarize_guard(relabel(records, "first_token_kl_above_0.5"), "kl").auroc == 1.0
    with pytest.raises(ConfigError, match="guard label"):
        relabel(records, "vibes")


def test_calibration_records_each_directions_dev_switches_and_needs_saved_mappers():
    models, mappers = tiny_family()
    guards = calibrate_guard(models, mappers, conversations=2, turns=2, max_new_tokens=3, story_chars=40)
    assert set(guards) == {FORWARD, BACKWARD}
    for guard in guards.values():  # one switch per direction; an exact mapper never changes an answer
        assert (guard.signal, guard.dev_switches, guard.bad_switches, guard.dev_conversations) == ("entropy", 1, 0, 1)
        assert guard.auroc is None and guard.catch_rate is None and guard.false_fallback_rate == 0.0
        assert guard.recompute == DEFAULT_RECOMPUTE.spec and guard.window == DEFAULT_GUARD_WINDOW
        assert guard.threshold > 1.0  # the tiny random models' entropy: the threshold that re-prefills none
    best = calibrate_guard(models, mappers, conversations=2, turns=2, max_new_tokens=3, story_chars=40,
                           signal="best", label="first_token_kl_above_0.5", target_rate=0.0)
    assert {g.signal for g in best.values()} == {"entropy"}  # no AUROC on one class: the default signal
    assert {(g.label, g.target_rate) for g in best.values()} == {("first_token_kl_above_0.5", 0.0)}
    assert calibrate_guard(models, mappers, conversations=2, turns=2, time_limit_s=1e-9) == {FORWARD: None,
                                                                                             BACKWARD: None}
    with pytest.raises(ConfigError, match="not saved in a folder: nothing recorded"):
        record_guards(mappers, guards)  # the tiny family's mappers live in memory only
    assert record_guards(mappers, {FORWARD: None, BACKWARD: None}) == {}
    for bad, match in (({"signal": "vibes"}, "guard signal"), ({"label": "vibes"}, "guard label"),
                       ({"target_rate": 1.5}, "target_rate"), ({"turns": 1}, "turns")):
        with pytest.raises(ConfigError, match=match):
            calibrate_guard(models, mappers, **{"conversations": 1, "turns": 2, **bad})
