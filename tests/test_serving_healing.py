"""Healing in the server's idle time (`serving.healing`): after a switch, the model that answered reads its
approximate rows again on its own, so the next turn runs on its own cache — a named session's and a prefix-cache
conversation's — within the budget, in chunks, never while a request waits; `ModelWorker`'s idle work."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from _serving_support import chat_ids, reference_answer, running, tiny_family
from kvhandoff.errors import ConfigError
from kvhandoff.serving.prefix_tree import DEFAULT_NAMESPACE
from kvhandoff.serving.settings import HealSettings, ServeConfig
from kvhandoff.serving.worker import ModelWorker

pytestmark = pytest.mark.timeout(120)

TURNS = ["Tell me a story about a cat.", "Now make it shorter!", "And a title?"]


def ask(server, model, messages, headers=None):
    """(answer, kv_handoff, usage) of one greedy chat request."""
    response = httpx.post(server.url + "/v1/chat/completions", headers=headers or {}, timeout=60,
                          json={"model": model, "messages": messages, "max_tokens": 8, "temperature": 0})
    assert response.status_code == 200, response.text
    data = response.json()
    return data["choices"][0]["message"]["content"], data["kv_handoff"], data["usage"]


def healed(server, seconds: float = 30) -> dict:
    """Wait (bounded) until no conversation waits to be healed; the health's healing figures."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        health = httpx.get(server.url + "/health", timeout=10).json()
        if not server.engine.running() and not any(health["healing"]["waiting"].values()):
            return health["healing"]
        time.sleep(0.02)
    raise AssertionError("healing did not finish")


def metric(server, name: str, model: str) -> float:
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f'{name}{{model="{model}"}}'):
            return float(line.split()[-1])
    return 0.0


def switched(server, headers=None) -> tuple[list[dict], dict]:
    """small answers, then large (a switch); the conversation so far and the switch's handoff."""
    messages = [{"role": "user", "content": TURNS[0]}]
    answer, _, _ = ask(server, "small", messages, headers)
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": TURNS[1]}]
    answer, handoff, _ = ask(server, "large", messages, headers)
    assert handoff["status"] == "applied" and handoff["approximate_tokens"] > 0
    return [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": TURNS[2]}], handoff


@pytest.mark.parametrize("headers", [{}, {"X-Session-ID": "healing"}], ids=["by tokens", "named"])
def test_after_a_switch_idle_time_heals_the_conversation_and_the_next_turn_runs_on_the_models_own_rows(headers):
    with running(heal=HealSettings(4096, 16)) as server:
        messages, _ = switched(server, headers)
        figures = healed(server)
        assert figures["budget"] == 4096 and figures["chunk"] == 16
        positions = metric(server, "kvhandoff_healed_positions_total", "large")
        assert positions > 16  # more than one chunk
        assert metric(server, "kvhandoff_heal_seconds_total", "large") > 0
        answer, handoff, usage = ask(server, "large", messages, headers)
        assert handoff["status"] == "none" and handoff["approximate_tokens"] == 0  # all its own now
        assert 16 < usage["prompt_tokens_details"]["cached_tokens"] <= positions  # served from healed rows
        family, _ = tiny_family()
        model, tokenizer = family["large"]
        assert answer == reference_answer(model, tokenizer, chat_ids(tokenizer, messages), 8)
        engine = server.engine
        if headers:
            session = engine.sessions.state(DEFAULT_NAMESPACE, "healing").session
            healed(server)
            assert session.own_length("large") == session.cached_length("large") == len(session.tokens)
        else:
            ids = chat_ids(tokenizer, messages)
            own = engine.prefix_cache.tree.match(DEFAULT_NAMESPACE, ids, "large").own
            assert own.exact == own.length >= len(ids) - 8  # kept as exact rows in place of the mapped ones


def test_the_budget_bounds_what_one_request_heals_and_zero_heals_nothing():
    with running(heal=HealSettings(24, 8)) as server:
        switched(server, {"X-Session-ID": "bounded"})
        healed(server)
        assert metric(server, "kvhandoff_healed_positions_total", "large") == 24
        session = server.engine.sessions.state(DEFAULT_NAMESPACE, "bounded").session
        assert session.own_length("large") == 24 < session.cached_length("large")
    with running(heal=HealSettings(0)) as server:
        switched(server)
        assert not any(healed(server)["waiting"].values())
        assert metric(server, "kvhandoff_healed_positions_total", "large") == 0


def test_idle_work_runs_only_when_the_worker_has_nothing_else_and_a_request_waits_one_piece_at_most():
    order: list[str] = []
    gate = threading.Event()

    def idle_job():
        for piece in range(3):
            order.append(f"idle {piece}")
            if piece == 0:
                gate.wait(10)  # a request arrives while this piece runs
            yield

    def request():
        order.append("request")
        yield from ()

    worker = ModelWorker("m", max_queue=4, max_idle=2)
    try:
        worker.submit_idle(idle_job())
        deadline = time.monotonic() + 10
        while not order and time.monotonic() < deadline:
            time.sleep(0.005)
        worker.submit(request)
        gate.set()
        while len(order) < 4 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert order == ["idle 0", "request", "idle 1", "idle 2"]
        assert worker.idle_jobs() == 0
        closed = []

        def held(name):
            try:
                gate.clear()
                yield
            finally:
                closed.append(name)

        blocker = threading.Event()
        worker.submit(lambda: iter([blocker.wait(10)]))  # keeps the worker busy
        for name in ("a", "b", "c"):
            worker.submit_idle(held(name))
        assert worker.idle_jobs() == 2  # past max_idle the oldest is ended
        blocker.set()
    finally:
        worker.close()
    assert worker.idle_jobs() == 0


def test_bad_heal_settings_are_refused():
    for budget, chunk in ((-1, 8), (8, 0), (1.5, 8), (True, 8)):
        with pytest.raises(ConfigError, match="heal"):
            HealSettings(budget, chunk)
    with pytest.raises(ConfigError, match="HealSettings"):
        ServeConfig(heal={"budget": 8})
    assert ServeConfig().to_dict()["heal"] == {"budget": HealSettings.budget, "chunk": HealSettings.chunk}
