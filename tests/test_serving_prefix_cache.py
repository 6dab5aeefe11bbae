"""Conversations found by their tokens (`serving.prefix_cache`): the checkout/checkin of a `SwitchingSession`
against a `PrefixTree`, and a real loopback server that serves clients sending no session header — handoffs at
every switch, tenants kept apart, eviction under the memory bound, nodes of a request in flight kept."""

from __future__ import annotations

import time
from types import SimpleNamespace

import httpx
import pytest
import torch

from _serving_support import chat_ids, reference_answer, running, tiny_family
from kvhandoff.runtime.plan import HandoffPlan
from kvhandoff.runtime.session import SwitchingSession
from kvhandoff.serving.prefix_cache import PrefixCache
from kvhandoff.serving.prefix_tree import mapped_from

pytestmark = pytest.mark.timeout(120)

TURNS = ["Tell me a story about a cat.", "Now make it shorter!", "And a title?"]


def models_and_mappers():
    family, mappers = tiny_family()
    return {name: model for name, (model, _) in family.items()}, mappers


def new_session():
    models, mappers = models_and_mappers()
    return SwitchingSession(models, mappers, plan=HandoffPlan(0))


def ids(count: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 256, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


# -- checkout and checkin ------------------------------------------------------------------------------------------
def report(status="none", source=None, cached=0):
    """The parts of an `engine.TurnReport` a checkin reads."""
    return SimpleNamespace(status=status, source=source, cached_tokens=cached)


def test_checkout_restores_what_serves_and_checkin_keeps_exact_mapped_and_derived_rows():
    cache, tokens = PrefixCache(), ids(40)
    first = new_session()
    out = cache.checkout("t", tokens[:20], "small", first)
    assert first.tokens == [] and (out.length, out.exact) == (0, 0)  # a miss: nothing held
    first.read_logprobs("small", tokens[:20])
    cache.checkin(out, first, report())
    cache.release(out)
    stats = cache.tree.stats()
    assert stats.models["small"].nodes == 1 and stats.locked == 0

    second = new_session()  # the next turn, on the other model: small holds 20 of the prompt's first 29 positions
    out = cache.checkout("t", tokens[:30], "large", second)
    assert second.owner == "small" and second.tokens == tokens[:20] and second.own_length("small") == 20
    assert second.cached_length("large") == 0 and out.length == 0
    logprobs = second.read_logprobs("large", tokens[20:30])  # a handoff: small's 20 positions mapped for large
    alone = second.models["large"](input_ids=torch.tensor([tokens[:30]])).logits[0, -1].log_softmax(-1)
    torch.testing.assert_close(logprobs[-1], alone, atol=1e-4, rtol=0)
    cache.checkin(out, second, report("applied", "small", cached=20))
    cache.release(out)
    large = cache.tree.match("t", tokens[:30], "large").own
    assert (large.length, large.exact, large.sources, large.mapped_until) == (30, 0, ("small",), 20)

    third = new_session()  # back on small: large's derived rows 20..29 are handed over, its mapped ones are not
    out = cache.checkout("t", tokens[:36], "small", third)
    assert third.owner == "large" and third.cached_length("small") == 20 and third.tokens == tokens[:30]
    assert (out.length, out.exact, out.source) == (20, 20, None)
    third.read_logprobs("small", tokens[30:36])
    cache.checkin(out, third, report("applied", "large", cached=30))
    cache.release(out)
    small = cache.tree.match("t", tokens[:36], "small").own
    assert (small.length, small.exact, small.mapped_until) == (36, 20, 30)

    evicted = PrefixCache()  # a model holding only a mapper's output past the asked model's rows hands nothing over
    evicted.tree.insert("t", tokens[:10], "small", third.export("small", 0, 10))
    evicted.tree.insert("t", tokens[:20], "large", second.export("large", 0, 20), mapped_from("small"))
    fourth = new_session()
    out = evicted.checkout("t", tokens[:25], "small", fourth)
    assert fourth.owner == "small" and fourth.tokens == tokens[:10]  # its own 10 rows only: no second trip
    evicted.release(out)

    exact = new_session()  # exact only: large's mapped rows are not checked out
    out = cache.checkout("t", tokens[:35], "large", exact, exact_only=True)
    assert exact.tokens == [] and out.length == 0
    cache.release(out)
    elsewhere = new_session()  # another namespace holds nothing
    out = cache.checkout("u", tokens[:30], "large", elsewhere)
    assert elsewhere.tokens == []
    cache.release(out)


def test_a_failed_checkin_is_logged_and_the_path_still_released(caplog):
    cache, tokens = PrefixCache(), ids(12, seed=2)
    session = new_session()
    out = cache.checkout("t", tokens, "small", session)
    session.read_logprobs("small", tokens)
    session.export = None  # the rows cannot be read: the checkin fails
    cache.checkin(out, session, report())
    assert "could not be kept" in caplog.text
    cache.release(out)
    assert cache.tree.stats().locked == 0


def test_a_failed_checkout_leaves_nothing_pinned():
    cache, tokens = PrefixCache(), ids(12, seed=1)
    session = new_session()
    out = cache.checkout("t", tokens, "small", session)
    session.read_logprobs("small", tokens)
    cache.checkin(out, session, report())
    cache.release(out)
    busy = new_session()
    busy.read_logprobs("small", tokens[:3])  # restore needs a new session: this one is refused
    with pytest.raises(Exception, match="new session"):
        cache.checkout("t", [*tokens, 5], "small", busy)
    assert cache.tree.stats().locked == 0


# -- the server ----------------------------------------------------------------------------------------------------
def ask(server, model, messages, headers=None, **body):
    """(answer, kv_handoff, usage, response headers) of one greedy chat request sent with no session header."""
    response = httpx.post(server.url + "/v1/chat/completions", headers=headers or {}, timeout=60,
                          json={"model": model, "messages": messages, "max_tokens": 8, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    data = response.json()
    return data["choices"][0]["message"]["content"], data["kv_handoff"], data["usage"], response.headers


def expected(model, messages, max_tokens=8):
    family, _ = tiny_family()
    model_, tokenizer = family[model]
    return reference_answer(model_, tokenizer, chat_ids(tokenizer, messages), max_tokens)


def cached(usage) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_a_conversation_without_a_session_header_is_handed_over_at_every_switch():
    """small → large → small with no header at all: each switch `applied`, tokens served from caches, and on the
    exactly related pair the answers of a re-prefill."""
    with running() as server:
        messages = []
        for turn, (model, text) in enumerate(zip(["small", "large", "small"], TURNS, strict=True)):
            messages.append({"role": "user", "content": text})
            answer, handoff, usage, headers = ask(server, model, messages)
            assert answer == expected(model, messages)
            if turn:
                assert handoff["status"] == "applied" and headers["x-vsr-kv-transfer-status"] == "applied"
                assert handoff["from"] == ["small", "large"][turn - 1] and handoff["mapped_tokens"] > 0
                assert handoff["approximate_tokens"] == handoff["mapped_tokens"]  # the rest of its cache: its own
                assert cached(usage) > 0 and handoff["read_tokens"] == usage["prompt_tokens"] - cached(usage)
            messages.append({"role": "assistant", "content": answer})
        assert 0 < handoff["mapped_tokens"] < cached(usage)  # back on small: only large's turn was mapped
        health = httpx.get(server.url + "/health").json()
        stats = health["prefix_cache"]
        assert stats["models"]["small"]["hits_own"] >= 1 and stats["models"]["large"]["handoff_candidates"] >= 1
        assert health["sessions"] == 0 and stats["bytes"] > 0
        assert health["cache_bytes"] == stats["bytes"] + health["prefix_store"]["bytes"]  # and the openings
        scrape = httpx.get(server.url + "/metrics").text
        assert 'kvhandoff_prefix_cache_bytes{model="small"}' in scrape
        assert 'kvhandoff_prefix_cache_hits_total{kind="own",model="small"}' in scrape


def test_conversations_of_one_user_keep_their_own_caches():
    with running() as server:
        first = [{"role": "user", "content": TURNS[0]}]
        answer = ask(server, "small", first, user="alice")[0]
        other = [{"role": "user", "content": "A poem about rain, please."}]
        ask(server, "small", other, user="alice")
        ask(server, "small", [*other, {"role": "assistant", "content": "no"}, {"role": "user", "content": "Why?"}],
            user="alice")
        follow = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": TURNS[1]}]
        text, handoff, usage, _ = ask(server, "small", follow, user="alice")
        tokenizer = tiny_family()[0]["small"][1]
        assert cached(usage) >= len(chat_ids(tokenizer, first)) and handoff["status"] == "none"
        assert text == expected("small", follow)


def test_tenants_share_nothing():
    """The same prompt from two tenants (users, salts, API keys): the second gets no cached token."""
    with running(api_key=("key-one", "key-two")) as server:
        messages = [{"role": "user", "content": TURNS[0]}]
        one = {"Authorization": "Bearer key-one"}
        ask(server, "small", messages, one, user="u")
        assert cached(ask(server, "small", messages, one, user="u")[2]) > 0  # the same tenant: cached
        assert cached(ask(server, "small", messages, one, user="v")[2]) == 0
        assert cached(ask(server, "small", messages, one, user="u", cache_salt="s")[2]) == 0
        assert cached(ask(server, "small", messages, {"Authorization": "Bearer key-two"}, user="u")[2]) == 0
        # a session key lives inside its tenant: the same X-Session-ID under another key is another session
        ask(server, "small", messages, {**one, "X-Session-ID": "shared"})
        _, handoff, usage, _ = ask(server, "large", messages, {"Authorization": "Bearer key-two",
                                                               "X-Session-ID": "shared"})
        assert cached(usage) == 0 and handoff["status"] == "none"
        refused = httpx.post(server.url + "/v1/chat/completions", json={"model": "small", "messages": messages},
                             headers={"Authorization": "Bearer key-three"}, timeout=30)
        assert refused.status_code == 401


def test_exact_mode_never_serves_mapped_rows():
    with running() as server:
        messages = [{"role": "user", "content": TURNS[0]}]
        answer = ask(server, "small", messages)[0]
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": TURNS[1]}]
        exact = {"kv_handoff": {"mode": "exact"}}
        text, handoff, usage, _ = ask(server, "large", messages, **exact)  # large holds nothing of its own
        assert handoff["status"] == "none" and handoff["mapped_tokens"] == 0 and cached(usage) == 0
        assert text == expected("large", messages)
        ask(server, "small", [*messages, {"role": "assistant", "content": text}, {"role": "user", "content": "?"}])
        handoff = ask(server, "large", messages)[1]
        assert handoff["status"] == "none" and handoff["approximate_tokens"] == 0  # its own exact rows serve it


def settle(engine, seconds: float = 10) -> None:
    """Wait (bounded) until the engine has finished its requests: the answer reaches the client a moment before
    the request lets go of its nodes and the memory bound is applied."""
    deadline = time.monotonic() + seconds
    while (engine.running() or engine.prefix_cache.tree.stats().locked) and time.monotonic() < deadline:
        time.sleep(0.01)


def test_eviction_keeps_the_cache_in_bounds_and_spares_a_request_in_flight():
    limit = 60_000
    with running(cache_memory_bytes=limit) as server:
        engine = server.engine
        for index in range(6):
            ask(server, "small", [{"role": "user", "content": f"Conversation {index}: " + TURNS[0]}])
            settle(engine)
            assert engine.prefix_cache.tree.total_bytes() <= limit
        assert engine.prefix_cache.tree.stats().models["small"].evictions > 0

        messages = [{"role": "user", "content": TURNS[2]}]
        ask(server, "small", messages)
        held = []
        body = {"model": "small", "messages": messages, "max_tokens": 40, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))  # the request is running: its path pinned
            engine.prefix_cache.tree.evict(0)
            held.append(engine.prefix_cache.tree.total_bytes())
            list(lines)
        assert held[0] > 0  # the running request's nodes stayed
        settle(engine)
        engine.prefix_cache.tree.evict(0)
        assert engine.prefix_cache.tree.total_bytes() == 0


@pytest.mark.parametrize("headers", [{}, {"X-Session-ID": "continued"}], ids=["by tokens", "named"])
def test_a_model_going_on_over_a_mapped_cache_says_how_much_of_it_is_approximate(headers):
    with running() as server:
        messages = [{"role": "user", "content": TURNS[0]}]
        for model in ("small", "large", "large"):
            answer, handoff, usage, _ = ask(server, model, messages, headers)
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": TURNS[1]}]
        assert handoff["status"] == "none"
        assert handoff["approximate_tokens"] == cached(usage) > 0  # all of it mapped, or read on top of mapped rows


# -- reuse at another offset ---------------------------------------------------------------------------------------
CLERK = "You are the front-desk clerk. Look orders up and hand hard questions to the analyst."
ANALYST = "You are the analyst: answer exactly."
HISTORY = [{"role": "user", "content": "My order 1234 arrived late and the box was open."},
           {"role": "assistant", "content": "Sorry to hear that! Order 1234 shipped on May 2 by ground."},
           {"role": "user", "content": "Can I get a refund for the shipping?"}]
NEW_TURN = {"role": "user", "content": "Analyst: is a refund due?"}


def agent_prompts():
    """(the clerk's conversation, the analyst's prompt: other instructions, the same history, a new turn)."""
    return ([{"role": "system", "content": CLERK}, *HISTORY],
            [{"role": "system", "content": ANALYST}, *HISTORY, NEW_TURN])


def offset_cache(recompute: str = "recent:100%") -> PrefixCache:
    from kvhandoff.runtime.runs import RunIndex

    return PrefixCache(runs=RunIndex([259], probe=8, min_length=32),
                       offset_plan=lambda namespace: HandoffPlan.of(recompute=recompute))


def keep_clerk_conversation(cache: PrefixCache, clerk: list[int]) -> None:
    """The small model reads the clerk's prompt in tenant "t", kept by ``cache`` as a request's would be."""
    session = new_session()
    out = cache.checkout("t", clerk, "small", session)
    session.read_logprobs("small", clerk)
    cache.checkin(out, session, SimpleNamespace(status="none", source=None, cached_tokens=0, reuse="none"))
    cache.release(out)


def test_another_agents_history_is_reused_behind_other_instructions_and_kept_as_mapped_rows():
    cache, tokenizer = offset_cache(), tiny_family()[0]["small"][1]
    clerk, analyst = (chat_ids(tokenizer, messages) for messages in agent_prompts())
    keep_clerk_conversation(cache, clerk)

    second = new_session()
    out = cache.checkout("t", analyst, "large", second)
    run = out.offset
    assert run is not None and run.source == "small" and run.length >= 32 and out.length == run.known == 0
    assert second.owner == "large" and second.tokens == analyst[:run.beginning + run.length]
    logprobs = second.read_logprobs("large", analyst[len(second.tokens):])  # every reused row recomputed
    alone = second.models["large"](input_ids=torch.tensor([analyst])).logits[0, -1].log_softmax(-1)
    torch.testing.assert_close(logprobs[-1], alone, atol=1e-4, rtol=0)
    cache.checkin(out, second, SimpleNamespace(status="applied", source="small", cached_tokens=run.length,
                                               reuse="offset"))
    cache.release(out)
    large = cache.tree.match("t", analyst, "large").own
    assert (large.length, large.exact, large.sources) == (len(analyst), run.beginning, ("small",))
    assert cache.tree.stats().locked == 0
    # another tenant finds nothing; an exact-only checkout never reuses at another offset
    auditor = chat_ids(tokenizer, [{"role": "system", "content": "You audit."}, *HISTORY, NEW_TURN])
    for namespace, exact_only in (("u", False), ("t", True)):
        out = cache.checkout(namespace, auditor, "large", new_session(), exact_only=exact_only)
        assert out.offset is None
        cache.release(out)
    third = new_session()  # large's own exact rows of the beginning's start are copied in, the rest recomputed
    out = cache.checkout("t", auditor, "large", third)
    assert out.offset is not None and 0 < out.offset.known == out.exact < out.offset.beginning
    logprobs = third.read_logprobs("large", auditor[len(third.tokens):])
    alone = third.models["large"](input_ids=torch.tensor([auditor])).logits[0, -1].log_softmax(-1)
    torch.testing.assert_close(logprobs[-1], alone, atol=1e-4, rtol=0)
    cache.release(out)


def test_a_turn_attention_offset_plan_ranks_the_run_by_the_holders_read():
    """The clerk's model reads the rest of the analyst's prompt on the conversation it held; every reused row
    recomputed under that ranking, the analyst answers as the large model reading it all."""
    cache, tokenizer = offset_cache("turn_attention:100%"), tiny_family()[0]["small"][1]
    clerk, analyst = (chat_ids(tokenizer, messages) for messages in agent_prompts())
    keep_clerk_conversation(cache, clerk)
    session = new_session()
    out = cache.checkout("t", analyst, "large", session)
    assert out.offset is not None and out.offset.source == "small"
    assert session.reused.mapped.pending.shape[1] == out.offset.beginning + out.offset.length
    logprobs = session.read_logprobs("large", analyst[len(session.tokens):])
    alone = session.models["large"](input_ids=torch.tensor([analyst])).logits[0, -1].log_softmax(-1)
    torch.testing.assert_close(logprobs[-1], alone, atol=1e-4, rtol=0)
    cache.release(out)


def test_a_run_whose_rows_were_evicted_is_forgotten():
    cache, tokenizer = offset_cache(), tiny_family()[0]["small"][1]
    clerk, analyst = (chat_ids(tokenizer, messages) for messages in agent_prompts())
    keep_clerk_conversation(cache, clerk)
    assert len(cache.runs) == 1
    cache.tree.evict(0)
    out = cache.checkout("t", analyst, "large", new_session())
    assert out.offset is None and len(cache.runs) == 0
    cache.release(out)


def test_the_analyst_after_a_clerk_handoff_is_served_from_the_clerks_history():
    """Over a real server: the analyst (other instructions, on the other model) gets the clerk's history from the
    cache at its new offset — said in kv_handoff, the X-KV-Reuse header and the metrics — and with every reused row
    recomputed answers as the large model reading the whole prompt; an exact-mode request never gets it."""
    clerk, analyst = agent_prompts()
    with running(offset_recompute="recent:100%") as server:
        ask(server, "small", clerk, user="exact-user")
        exact = ask(server, "large", analyst, user="exact-user", kv_handoff={"mode": "exact"})
        assert exact[1]["reuse"] != "offset" and exact[1]["approximate_tokens"] == 0
        ask(server, "small", clerk)
        text, handoff, usage, headers = ask(server, "large", analyst)
        assert headers["X-KV-Reuse"] == "offset" and handoff["reuse"] == "offset"
        assert handoff["status"] == "applied" and handoff["from"] == "small"
        assert handoff["approximate_tokens"] == cached(usage) >= 64
        assert text == expected("large", analyst)
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
        assert 'kvhandoff_prefill_tokens_avoided_total{kind="offset"}' in metrics
        health = httpx.get(server.url + "/health", timeout=30).json()["offset_reuse"]
        assert health == {"recompute": "recent:100%", "conversations": 4}  # two tenants, two agents each
    with running(offset_reuse=False) as server:
        ask(server, "small", clerk)
        assert ask(server, "large", analyst)[1]["reuse"] != "offset"
        assert httpx.get(server.url + "/health", timeout=30).json()["offset_reuse"] is None
