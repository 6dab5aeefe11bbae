"""The engine without HTTP (driven from asyncio), and the `SwitchingSession` methods it relies on: truncate,
read_logprobs, reprefill, cache_bytes."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import threading
import time

import pytest
import torch

from _serving_support import chat_ids, reference_answer, tiny_family
from kvhandoff.errors import ConfigError
from kvhandoff.mapper.manifest import GUARD_RULES, GuardCalibration
from kvhandoff.runtime.plan import HandoffPlan
from kvhandoff.runtime.policy import DEFAULT_RECOMPUTE, Sinks
from kvhandoff.runtime.session import SwitchingSession
from kvhandoff.runtime.switch.guard import Fallback
from kvhandoff.runtime.switch.pair import SwitchSettings
from kvhandoff.runtime.switch.turn import common_prefix
from kvhandoff.serving.chat import DEFAULT_CHAT_TEMPLATE
from kvhandoff.serving.decoding import SamplingParams
from kvhandoff.serving.engine import Engine
from kvhandoff.serving.prefix_tree import DEFAULT_NAMESPACE
from kvhandoff.serving.prompts import LENGTH_CHUNK_CHARS, surely_longer
from kvhandoff.serving.requests import GenerationRequest, RequestError
from kvhandoff.serving.settings import ServeConfig

pytestmark = pytest.mark.timeout(120)


def two_way():
    family, mappers = tiny_family()
    return {name: model for name, (model, _) in family.items()}, mappers


def test_truncate_rolls_every_cache_back_to_a_common_prefix():
    models, mappers = two_way()
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    session = SwitchingSession(models, mappers, plan=HandoffPlan(0))
    session.read("small", ids[:20])
    session.read("large", ids[20:30])  # large: 30 positions; small keeps its 20
    session.truncate(25)
    assert session.tokens == ids[:25] and session.owner == "large"
    assert session.cache("large").get_seq_length() == 25 and session.cache("small").get_seq_length() == 20
    session.truncate(10)
    assert session.cache("small").get_seq_length() == 10
    got = session.read_logprobs("small", ids[10:40])  # back to small: 10 own positions, nothing to map
    alone = models["small"](input_ids=torch.tensor([ids])).logits[0, -1].log_softmax(-1)
    torch.testing.assert_close(got[-1], alone, atol=1e-4, rtol=0)
    session.truncate(0)
    assert session.tokens == [] and session.owner is None and session.cache("small") is None
    with pytest.raises(ConfigError, match="truncate"):
        session.truncate(1)


def test_read_logprobs_reprefill_and_cache_bytes():
    models, mappers = two_way()
    ids = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    session = SwitchingSession(models, mappers)
    last = session.read_logprobs("small", ids[:20], keep=5)
    assert last.shape == (5, models["small"].config.vocab_size) and session.tokens == ids[:20]
    full = models["small"](input_ids=torch.tensor([ids[:20]])).logits[0, -5:].float().log_softmax(-1)
    torch.testing.assert_close(last, full, atol=1e-4, rtol=0)
    per_model = 3 * 2 * 2 * 16 * 4  # layers × (K, V) × KV heads × head dim × float32 bytes
    assert session.cache_bytes() == 20 * per_model
    session.read_logprobs("large", ids[20:])  # mapped: the layers are views of one buffer, counted once
    assert session.cache_bytes() >= 50 * per_model
    own = session.reprefill("large")
    torch.testing.assert_close(own, models["large"](input_ids=torch.tensor([ids])).logits[0, -1].log_softmax(-1),
                               atol=1e-4, rtol=0)
    assert session.owner == "large" and session.cache("large").get_seq_length() == 30
    with pytest.raises(ConfigError, match="unknown model"):
        session.reprefill("huge")
    with pytest.raises(ConfigError, match="at least one token"):
        session.read_logprobs("small", [])


def test_surely_longer_counts_a_long_text_a_chunk_at_a_time():
    tokenizer = tiny_family()[0]["small"][1]
    calls = []

    class Counting:
        def __call__(self, text, **kwargs):
            calls.append(len(text))
            return tokenizer(text, **kwargs)

    long_text = "ab " * (LENGTH_CHUNK_CHARS * 4)
    assert surely_longer(Counting(), long_text, 512)
    assert len(calls) == 1 and calls[0] == LENGTH_CHUNK_CHARS  # refused after one chunk, not tokenized whole
    assert not surely_longer(tokenizer, "ab " * 100, 5)  # within one chunk: the exact count decides
    assert not surely_longer(tokenizer, long_text, 10**9)


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([1, 2], [1, 2]) == 2


def test_engine_refuses_an_incomplete_family():
    family, mappers = tiny_family()
    with pytest.raises(ConfigError, match="large → small"):
        Engine(family, {("small", "large"): mappers[("small", "large")]})
    with pytest.raises(ConfigError, match="not hosted"):
        Engine({"small": family["small"]}, {("small", "large"): mappers[("small", "large")]})
    with pytest.raises(ConfigError, match="at least one model"):
        Engine({}, {})
    with pytest.raises(ConfigError, match="past the hosted models' window"):
        Engine(family, mappers, ServeConfig(max_context=10**6))


async def ask(engine, model, prompt=None, messages=None, session=None, max_tokens=24, **sampling):
    """``model``'s answer on ``engine``: messages as (role, text) pairs; sampling settings (default greedy) as
    `SamplingParams` fields."""
    if messages is not None:
        messages = tuple({"role": role, "content": text} for role, text in messages)
    request = GenerationRequest(model=model, prompt=prompt, messages=messages, max_tokens=max_tokens,
                                sampling=SamplingParams(**{"temperature": 0.0, **sampling}), session_id=session)
    generation = await engine.start(request)
    return await generation.text(), generation.report, generation


def test_greedy_decoding_equals_generate_on_the_same_prompt():
    family, mappers = tiny_family()
    model, tokenizer = family["large"]

    async def main():
        engine = Engine(family, mappers, ServeConfig(switch=SwitchSettings(guard=False)))
        try:
            first = [("user", "Write a haiku about the sea.")]
            text, report, generation = await ask(engine, "large", messages=tuple(first), session="s")
            ids = chat_ids(tokenizer, [{"role": r, "content": c} for r, c in first])
            assert text == reference_answer(model, tokenizer, ids, 24) and report.status == "none"
            assert generation.completion_tokens <= 24 and generation.finish_reason in ("stop", "length")
            second = (*first, ("assistant", text), ("user", "Again, please."))
            text, report, _ = await ask(engine, "large", messages=second, session="s")  # on its own cache
            ids = chat_ids(tokenizer, [{"role": r, "content": c} for r, c in second])
            assert text == reference_answer(model, tokenizer, ids, 24) and report.cached_tokens > 0
            text, _, _ = await ask(engine, "small", prompt=tuple(ids), max_tokens=30)  # token ids, stateless
            assert text == reference_answer(family["small"][0], tokenizer, ids, 30)
        finally:
            engine.close()

    asyncio.run(main())


def test_conversations_that_open_alike_share_the_exact_prefix_at_a_switch():
    """The engine's prefix store: the first switch of an opening recomputes the exact prefix, later ones copy it
    (health shows the store); the answers are the same."""
    family, mappers = tiny_family()

    async def main():
        engine = Engine(family, mappers, ServeConfig(switch=SwitchSettings(guard=False)))
        try:
            answers = []
            for session in ("a", "b"):
                first = [("user", "Tell me about the tides.")]
                text, _, _ = await ask(engine, "small", messages=tuple(first), session=session, max_tokens=4)
                second = (*first, ("assistant", text), ("user", "And the moon?"))
                answers.append((await ask(engine, "large", messages=second, session=session, max_tokens=6))[0])
            assert answers[0] == answers[1]
            store = engine.health()["prefix_store"]
            assert store == {"openings": 1, "bytes": engine.prefix_store.bytes(), "hits": 1, "misses": 1}
            assert store["bytes"] > 0 and engine.cache_bytes() >= store["bytes"]
        finally:
            engine.close()

    asyncio.run(main())


def test_the_engine_and_its_sessions_hold_the_settings_parsed_once():
    """ServeConfig parses the recompute spec where it enters; the engine builds one plan from it (with its prefix
    store) and every session holds that plan: policy objects below the edge, never a spec."""
    family, mappers = tiny_family()
    config = ServeConfig(switch=SwitchSettings(guard=False, exact_prefix=2, recompute="sinks:10%"))
    assert config.switch.recompute == Sinks(0.1) and config.to_dict()["recompute"] == "sinks:10%"
    assert SwitchSettings().recompute is None  # None: per pair
    assert SwitchSettings().served_recompute is DEFAULT_RECOMPUTE
    assert ServeConfig().to_dict()["recompute"] is None
    assert ServeConfig(switch=SwitchSettings(guard=False, exact_prefix=2, recompute=Sinks(0.1))) == config
    engine = Engine(family, mappers, config)
    try:
        assert engine.plan == HandoffPlan(2, Sinks(0.1), engine.prefix_store)
        session = engine._new_session()  # the engine's plan, its openings kept in the default tenant's share
        assert dataclasses.replace(session.plan, prefix_store=engine.prefix_store) == engine.plan
        assert session.plan.prefix_store.namespace == DEFAULT_NAMESPACE and session.handover == config.handover
    finally:
        engine.close()


def evictions(engine, reason: str) -> float:
    return engine.metrics.registry.get_sample_value("kvhandoff_evictions_total", {"reason": reason})


def test_ttl_and_session_limit_evict_idle_sessions_least_recently_used_first():
    family, mappers = tiny_family()

    async def main():
        engine = Engine(family, mappers, ServeConfig(max_sessions=2, session_ttl_s=0.05,
                                                     switch=SwitchSettings(guard=False)))
        try:
            await ask(engine, "small", prompt="one", session="a", max_tokens=2)
            await asyncio.sleep(0.1)  # past the TTL: a goes when the next request arrives
            await ask(engine, "small", prompt="two", session="b", max_tokens=2)
            assert engine.session_tokens("a") is None and engine.session_tokens("b")
            assert evictions(engine, "ttl") == 1
            engine.config = ServeConfig(max_sessions=2, switch=SwitchSettings(guard=False))  # no TTL from here on
            await ask(engine, "small", prompt="three", session="c", max_tokens=2)
            await ask(engine, "small", prompt="two more", session="b", max_tokens=2)  # b is now the most recent
            await ask(engine, "small", prompt="four", session="d", max_tokens=2)  # full: c, the LRU, goes
            assert engine.session_tokens("c") is None and engine.session_tokens("b") and engine.session_count() == 2
            assert evictions(engine, "sessions") == 1
        finally:
            engine.close()

    asyncio.run(main())


class BrokenMapper:
    """Refuses to map (an error in the middle of a handoff)."""

    exact_prefix = 0

    def transfer(self, *args, **kwargs):
        raise RuntimeError("mapper broke")


def test_an_error_mid_handoff_answers_an_error_and_resets_the_session():
    family, mappers = tiny_family()

    async def main():
        engine = Engine(family, {**mappers, ("small", "large"): BrokenMapper()},
                        ServeConfig(switch=SwitchSettings(guard=False)))
        try:
            await ask(engine, "small", prompt="hello there", session="s", max_tokens=3)
            with pytest.raises(RequestError) as caught:
                await ask(engine, "large", prompt="hello there, again", session="s", max_tokens=3)
            assert caught.value.kind == "internal" and "mapper broke" in caught.value.message
            assert engine.session_tokens("s") == []  # forgotten, not half-mapped
            _, report, _ = await ask(engine, "large", prompt="hello there, again", session="s", max_tokens=3)
            assert report.status == "none" and report.cached_tokens == 0
            with pytest.raises(RequestError) as caught:
                await ask(engine, "medium", prompt="x")
            assert caught.value.kind == "not_found" and caught.value.param == "model"
        finally:
            engine.close()

    asyncio.run(main())


def noisy_with_guard(mapper, guard: GuardCalibration, scale: float = 1.0, seed: int = 0):
    """A copy of ``mapper`` with noise of ``scale`` × its weights' std on its weights and ``guard`` recorded in its
    (in-memory) manifest."""
    copied = copy.deepcopy(mapper)
    weight, _ = copied.map_tensors()
    weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(seed)) * weight.std() * scale)
    copied.manifest = copied.manifest.with_guard(guard)
    return copied


#: a recorded guard that always falls back: every switch maps a share > 0
ALWAYS_FALL_BACK = GuardCalibration("mapped_share", 0.0, None, "answer_changed", GUARD_RULES[0], None, 1, 0, None,
                                    0.0, 1, DEFAULT_RECOMPUTE.spec, 64)


def test_a_fallback_keeps_the_receiving_models_own_turns_and_reads_only_the_rest():
    """small → large → small: large serves its turn mapped (no guard for small → large), the return switch is mapped
    with a noisy mapper whose recorded guard falls back. small re-reads only what it does not hold exactly: its own
    first turn stays, the turn mapped for it is read again — the cache ends as a prefill's and the answer is the
    re-prefill's."""
    family, mappers = tiny_family()
    small, tokenizer = family["small"]
    back = noisy_with_guard(mappers["large", "small"], ALWAYS_FALL_BACK)

    async def main():
        engine = Engine(family, {**mappers, ("large", "small"): back}, ServeConfig())
        try:
            assert engine.policies["small", "large"].guard.source == "none"
            assert engine.policies["large", "small"].guard.source == "recorded"
            first = (("user", "Tell me about the tides, please."),)
            text, report, _ = await ask(engine, "small", messages=first, session="s", max_tokens=8)
            second = (*first, ("assistant", text), ("user", "And the moon?"))
            text, report, _ = await ask(engine, "large", messages=second, session="s", max_tokens=8)
            assert report.status == "applied" and report.guard is None  # no guard: served mapped
            session = engine.sessions.state("default", "s").session
            own = session.own_length("small")
            third = (*second, ("assistant", text), ("user", "Why?"))
            ids = chat_ids(tokenizer, [{"role": r, "content": c} for r, c in third])
            opening = len(chat_ids(tokenizer, [{"role": r, "content": c} for r, c in first]))
            text, report, generation = await ask(engine, "small", messages=third, session="s", max_tokens=12)
            assert report.status == "fallback" and report.guard["source"] == "recorded"
            assert report.guard["signal"] == "mapped_share" and report.mapped_tokens > 0
            assert opening <= report.cached_tokens <= own  # small's own first turn (and answer) kept
            assert report.read_tokens == len(ids) - report.cached_tokens < len(ids)
            assert report.prompt_tokens == len(ids)
            assert text == reference_answer(small, tokenizer, ids, 12)
            prefill = small(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
            for layer, exact in zip(session.cache("small").layers, prefill.layers, strict=True):
                torch.testing.assert_close(layer.values[:, :, :len(ids)], exact.values, atol=1e-4, rtol=0)
            # the same conversation re-prefilled in full (mode "reprefill"): the same answer, token for token
            for messages in (first, second):
                await ask(engine, "small" if messages is first else "large", messages=messages, session="r",
                          max_tokens=8)
            request = GenerationRequest(model="small", messages=tuple({"role": r, "content": c} for r, c in third),
                                        max_tokens=12, sampling=SamplingParams(temperature=0.0), session_id="r",
                                        handoff_mode="reprefill")
            full = await engine.start(request)
            assert await full.text() == text and full.completion_tokens == generation.completion_tokens
            assert full.report.status == "reprefill" and full.report.read_tokens == len(ids)
        finally:
            engine.close()

    asyncio.run(main())


def test_an_escalation_hands_the_flagged_switch_over_again_with_a_larger_budget():
    """small → large with a noisy mapper whose recorded guard flags every switch and escalates with everything
    recomputed: the handover is made again under recent:100%, so large answers as a prefill of the whole
    conversation would, from a cache that ends as a prefill's; the report says so and counts the mapped positions
    as served from the cache."""
    family, mappers = tiny_family()
    large, tokenizer = family["large"]
    bad = noisy_with_guard(mappers["small", "large"], dataclasses.replace(ALWAYS_FALL_BACK,
                                                                         action="escalate:recent:100%"))

    async def main():
        engine = Engine(family, {**mappers, ("small", "large"): bad}, ServeConfig())
        try:
            first = (("user", "Tell me about the tides, please."),)
            text, report, _ = await ask(engine, "small", messages=first, session="s", max_tokens=8)
            second = (*first, ("assistant", text), ("user", "And the moon?"))
            ids = chat_ids(tokenizer, [{"role": r, "content": c} for r, c in second])
            text, report, _ = await ask(engine, "large", messages=second, session="s", max_tokens=12)
            assert report.status == "escalated" and report.guard["signal"] == "mapped_share"
            assert report.mapped_tokens > 0 and report.cached_tokens == report.mapped_tokens
            assert report.read_tokens == len(ids) - report.cached_tokens
            assert text == reference_answer(large, tokenizer, ids, 12)
            session = engine.sessions.state("default", "s").session
            prefill = large(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
            for layer, exact in zip(session.cache("large").layers, prefill.layers, strict=True):
                torch.testing.assert_close(layer.values[:, :, :len(ids)], exact.values, atol=1e-4, rtol=0)
            escalations = engine.metrics.registry.get_sample_value("kvhandoff_guard_escalations_total",
                                                                   {"from": "small", "to": "large"})
            assert escalations == 1
        finally:
            engine.close()

    asyncio.run(main())


def test_an_escalation_is_refused_where_a_handover_cannot_be_made_again():
    with pytest.raises(ConfigError, match="needs handover 'incremental'"):
        ServeConfig(handover="all", switch=SwitchSettings(guard_action="escalate:recent:35%"))
    with pytest.raises(ConfigError, match="'fallback' or 'escalate:RULE:BUDGET'"):
        ServeConfig(switch=SwitchSettings(guard_action="escalate"))
    escalating = ServeConfig(switch=SwitchSettings(guard_action="escalate:recent:35%"))
    assert escalating.to_dict()["guard_action"] == "escalate:recent:35%"
    assert SwitchSettings().guard_action is None  # each pair's recorded action, else a fallback
    assert SwitchSettings(guard_action="fallback").guard_action == Fallback()


def test_the_family_renders_with_one_template_so_a_switch_keeps_the_whole_history(caplog):
    """Two models whose templates differ (one character in the system turn) would part after a few tokens; the
    engine renders every turn with the first model's template and says so."""
    family, mappers = tiny_family()
    other = copy.deepcopy(family["large"][1])
    other.chat_template = DEFAULT_CHAT_TEMPLATE.replace("<|im_start|>", "<|im_start|> ", 1)
    models = {"small": family["small"], "large": (family["large"][0], other)}

    async def main():
        with caplog.at_level(logging.WARNING, logger="kvhandoff.serving.engine"):
            engine = Engine(models, mappers, ServeConfig(switch=SwitchSettings(guard=False)))
        assert "large differ from small's" in caplog.text
        try:
            first = [("user", "Tell me about the tides.")]
            text, _, _ = await ask(engine, "small", messages=tuple(first), session="s", max_tokens=4)
            second = (*first, ("assistant", text), ("user", "And the moon?"))
            _, report, _ = await ask(engine, "large", messages=second, session="s", max_tokens=4)
            assert report.status == "applied" and report.mapped_tokens > len(chat_ids(family["small"][1], [
                {"role": "user", "content": "Tell me about the tides."}])) - 2
        finally:
            engine.close()

    asyncio.run(main())


def test_the_worker_batches_decode_steps_and_runs_prefill_chunks_between_them():
    """Two jobs: A decodes (a `Read` per step), B prefills in chunks (None per chunk), then decodes. A's steps go on
    between B's chunks, and once both decode, their steps share one forward."""
    from kvhandoff.serving.worker import ModelWorker, Read

    log, done = [], threading.Event()

    def step(reads):
        log.append(("step", tuple(read.token for read in reads)))
        return [torch.zeros(2) for _ in reads]

    def job_a():
        for token in range(8):
            yield Read(None, token)

    def job_b():
        for chunk in range(3):
            log.append(("chunk", chunk))
            yield None
        for token in (10, 11):
            yield Read(None, token)
        done.set()

    gate = threading.Event()

    def hold():  # keeps the worker busy until both jobs are queued
        gate.wait(5)
        yield None

    worker = ModelWorker("m", max_queue=4, step=step, max_batch=4)
    worker.submit(hold)
    worker.submit(job_a)
    worker.submit(job_b)
    gate.set()
    assert done.wait(10)
    worker.close()
    chunks = [i for i, event in enumerate(log) if event[0] == "chunk"]
    assert all(log[i + 1][0] == "step" for i in chunks[:-1])  # A stepped after each of B's chunks
    assert any(event[0] == "step" and 10 in event[1] and len(event[1]) == 2 for event in log)  # one forward for both
    assert worker.batched_reads > worker.steps


def test_a_failed_batched_step_is_retried_one_read_at_a_time_and_close_ends_running_jobs():
    from kvhandoff.serving.worker import ModelWorker, Read

    got, ended = {}, threading.Event()

    def step(reads):
        if len(reads) > 1 or reads[0].token == 13:
            raise RuntimeError("no room")
        return [torch.full((2,), float(reads[0].token))]

    def job(name, token):
        def run():
            try:
                got[name] = yield Read(None, token)
            except RuntimeError as exc:
                got[name] = exc
            yield Read(None, 99) if name == "stuck" else None
        return run

    def stuck():
        try:
            yield Read(None, 1)
            while True:
                yield None
        finally:
            ended.set()

    gate = threading.Event()

    def hold():
        gate.wait(5)
        yield None

    worker = ModelWorker("m", max_queue=8, step=step, max_batch=8)
    for queued in (hold, job("good", 7), job("bad", 13), stuck):
        worker.submit(queued)
    gate.set()
    deadline = time.monotonic() + 10
    while len(got) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert float(got["good"][0]) == 7.0 and isinstance(got["bad"], RuntimeError)  # only its own step failed
    worker.close()
    assert ended.is_set()  # the job still running was closed: its cleanup ran


def test_read_together_equals_reading_each_session_alone():
    models, mappers = two_way()
    sessions, alone = [], []
    for seed, length in ((4, 12), (5, 20)):
        ids = torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
        for kept in (sessions, alone):
            kept.append(SwitchingSession(models, mappers))
            kept[-1].read_logprobs("small", ids)
    together = SwitchingSession.read_together("small", [(sessions[0], 7), (sessions[1], 9)])
    apart = torch.stack([alone[0].read_logprobs("small", [7])[-1], alone[1].read_logprobs("small", [9])[-1]])
    torch.testing.assert_close(together, apart, atol=1e-4, rtol=0)
    assert [s.tokens for s in sessions] == [s.tokens for s in alone]
    assert all(s.own_length("small") == len(s.tokens) for s in sessions)
    with pytest.raises(ConfigError, match="already be served"):
        SwitchingSession.read_together("large", [(sessions[0], 1)])


def test_a_prompt_read_in_small_chunks_answers_as_one_read():
    family, mappers = tiny_family()
    tokenizer = family["small"][1]
    messages = [{"role": "user", "content": "Tell me a long story about a cat and a dog, please."}]

    async def scenario():
        engine = Engine(family, mappers, ServeConfig(prefill_chunk=4, switch=SwitchSettings(guard=False)))
        try:
            generation = await engine.start(GenerationRequest(model="small", messages=tuple(messages), max_tokens=6,
                                                              sampling=SamplingParams(temperature=0)))
            return await generation.text()
        finally:
            engine.close()

    reference = reference_answer(family["small"][0], tokenizer, chat_ids(tokenizer, messages), 6)
    assert asyncio.run(scenario()) == reference


@pytest.fixture(scope="module")
def llama_cpp_family(tmp_path_factory):
    """The tiny family served by llama.cpp from GGUFs of its models (f32 caches), with its exact mappers."""
    pytest.importorskip("llama_cpp")
    from _llama_support import llama_model

    family, mappers = tiny_family()
    folder = tmp_path_factory.mktemp("llama")
    served = {name: (llama_model(model, folder, name, sequences=24, context=2048,
                                 generation_config=model.generation_config), tokenizer)
              for name, (model, tokenizer) in family.items()}
    yield served, mappers
    for model, _ in served.values():
        model.close()


@pytest.mark.parametrize("settings", [{"recompute": "recent:10%"}, {"recompute": "turn_attention:10%"},
                                      {"recompute": "turn_attention:10%", "guard": True,
                                       "guard_signal": "entropy_gain", "guard_threshold": 1e9}],
                         ids=["recent", "turn_attention", "turn_attention_guarded"])
def test_a_llama_cpp_family_serves_a_switching_conversation_as_the_target_alone(llama_cpp_family, settings,
                                                                                monkeypatch):
    """Under each rule llama.cpp serves; turn_attention reads each switch's turn once in llama.cpp (a guard's
    preview of the turn serving the ranking too)."""
    import openai

    from _serving_support import running
    from kvhandoff.runtime.llama_cpp.backend import LlamaCppCache

    reads = []
    real_read = LlamaCppCache.read_turn
    monkeypatch.setattr(LlamaCppCache, "read_turn", lambda *args: reads.append(1) or real_read(*args))
    served, mappers = llama_cpp_family
    family, _ = tiny_family()
    messages = [{"role": "user", "content": "Tell me a story about a cat."}]
    with running(served, mappers, **settings) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        for turn, name in enumerate(("small", "large", "small")):
            raw = client.chat.completions.with_raw_response.create(
                model=name, messages=messages, max_tokens=6, temperature=0, extra_headers={"X-Session-ID": "c"})
            answer = raw.parse()
            model, tokenizer = family[name]
            assert answer.choices[0].message.content == reference_answer(model, tokenizer,
                                                                         chat_ids(tokenizer, messages), 6)
            assert raw.headers["x-kv-handoff"] == ("none" if turn == 0 else "applied")
            messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                         {"role": "user", "content": f"And turn {turn + 2}?"}]
        echoed = client.completions.create(model="large", prompt="abc", max_tokens=1, echo=True, logprobs=1)
        assert echoed.choices[0].logprobs.tokens[:3] == ["a", "b", "c"]
    assert len(reads) == (2 if settings["recompute"].startswith("turn_attention") else 0)


def test_a_llama_cpp_family_refuses_a_recompute_rule_it_cannot_rank_by(llama_cpp_family):
    served, mappers = llama_cpp_family
    for spec in ("deviation:10%", "layers:25%"):
        with pytest.raises(ConfigError, match=spec + r".*none, sinks, recent"):
            Engine(served, mappers, ServeConfig(switch=SwitchSettings(recompute=spec, guard=False)))
    engine = Engine(served, mappers, ServeConfig(max_batch=4, max_sessions=100, switch=SwitchSettings(guard=False)))
    assert engine.config.max_sessions == 24 - 4 - 2


def test_a_llama_cpp_family_serves_a_pair_whose_recorded_rule_it_cannot_rank_by_under_the_default(
        llama_cpp_family, caplog):
    from _serving_support import with_record
    from kvhandoff.mapper.manifest import RecomputeChoice

    served, mappers = llama_cpp_family
    recorded = RecomputeChoice("source_attention:5%", "fastest_at_min_retention", 0.97, "generative",
                               ("coqa_gen",), "dev", 12, 0.98, 2048, 8.2)
    marked = {**mappers, ("small", "large"): with_record(mappers["small", "large"], recompute=recorded)}
    caplog.set_level(logging.WARNING, logger="kvhandoff.serving.engine")
    engine = Engine(served, marked, ServeConfig(max_batch=4, max_sessions=8, switch=SwitchSettings(guard=False)))
    assert engine.policies["small", "large"].recompute.policy == DEFAULT_RECOMPUTE
    assert engine.policies["small", "large"].plan.recompute == DEFAULT_RECOMPUTE
    assert "recorded for small → large (source_attention:5%) ranks positions with a transformers model" in caplog.text
    assert "does not serve the one recorded with its mapper, source_attention:5%" in \
        engine.policies["small", "large"].recompute.describe("small", "large")
    assert engine.policies["small", "large"].recompute.to_dict()["recorded"]["spec"] == "source_attention:5%"
    with pytest.raises(ConfigError, match=r"source_attention:5%.*none, sinks, recent, turn_attention"):
        Engine(served, marked, ServeConfig(switch=SwitchSettings(recompute="source_attention:5%", guard=False)))


def test_a_llama_cpp_family_serves_the_recorded_turn_attention_rule(llama_cpp_family):
    """llama.cpp reads a turn's attention (its callback shows the queries): the recorded rule is served as it is."""
    from _serving_support import with_record
    from kvhandoff.mapper.manifest import RecomputeChoice
    from kvhandoff.runtime.policy import TurnAttention

    served, mappers = llama_cpp_family
    recorded = RecomputeChoice("turn_attention:10%", "fastest_at_min_retention", 0.97, "generative", ("coqa_gen",),
                               "dev", 12, 0.98, 2048, 8.2)
    marked = {pair: with_record(mapper, recompute=recorded) for pair, mapper in mappers.items()}
    engine = Engine(served, marked, ServeConfig(max_batch=4, max_sessions=8, switch=SwitchSettings(guard=False)))
    assert engine.policies["small", "large"].plan.recompute == TurnAttention(0.1)
    assert engine.policies["large", "small"].recompute.policy == TurnAttention(0.1)


def test_a_llama_cpp_family_serves_a_point_chosen_from_the_recorded_tradeoff_it_cannot_rank_by_under_the_default(
        llama_cpp_family, caplog):
    from _serving_support import with_record
    from kvhandoff.mapper.manifest import RecomputeChoice, TradeoffPoint

    served, mappers = llama_cpp_family
    points = (TradeoffPoint("deviation:10%", 0.95, 8.8), TradeoffPoint("deviation:20%", 0.97, 3.5))
    recorded = RecomputeChoice("deviation:10%", "fastest_at_min_retention", 0.97, "generative", ("coqa_gen",),
                               "dev", 24, 0.95, 2048, 8.8, 5.0, points)
    marked = {pair: with_record(mapper, recompute=recorded) for pair, mapper in mappers.items()}
    caplog.set_level(logging.WARNING, logger="kvhandoff.serving.engine")
    engine = Engine(served, marked, ServeConfig(max_batch=4, max_sessions=8,
                                                switch=SwitchSettings(guard=False, min_speedup=3.0)))
    assert engine.policies["small", "large"].recompute.policy == DEFAULT_RECOMPUTE
    assert engine.policies["small", "large"].plan.recompute == DEFAULT_RECOMPUTE
    assert "chosen from the trade-off recorded for small → large (deviation:20%) ranks positions" in caplog.text


def test_a_named_session_whose_instructions_changed_keeps_its_history_at_the_new_offset():
    """An agent handoff inside one named session: the large model's prompt opens with other instructions; the
    history the small model read is reused at its new offset (mapped), every row recomputed, and answers as the
    large model reading it all; the same with offset reuse off reads it all."""
    family, mappers = tiny_family()
    model, tokenizer = family["large"]
    history = (("user", "My order 1234 came late and the box was open, what now?"),
               ("assistant", "Sorry! Order 1234 shipped May 2 by ground."), ("user", "Refund the shipping?"))
    clerk, analyst = (("system", "You are the clerk; hand hard cases on."), *history), \
        (("system", "Analyst: answer exactly."), *history)

    async def main(offset_reuse: bool):
        settings = SwitchSettings(guard=False, offset_reuse=offset_reuse, offset_recompute="recent:100%")
        engine = Engine(family, mappers, ServeConfig(switch=settings))
        try:
            await ask(engine, "small", messages=clerk, session="s", max_tokens=4)
            text, report, _ = await ask(engine, "large", messages=analyst, session="s", max_tokens=8)
            ids = chat_ids(tokenizer, [{"role": r, "content": c} for r, c in analyst])
            assert text == reference_answer(model, tokenizer, ids, 8)
            return report
        finally:
            engine.close()

    reused = asyncio.run(main(True))
    assert (reused.reuse, reused.status, reused.source) == ("offset", "applied", "small")
    assert reused.approximate_tokens >= 64 and reused.cached_tokens >= reused.approximate_tokens
    plain = asyncio.run(main(False))
    assert plain.reuse != "offset" and plain.cached_tokens < reused.cached_tokens
