"""The HTTP API against a real uvicorn server on a free loopback port, through the official `openai` client and raw
httpx: chat, completions, streaming, handoffs (applied / fallback / none), edited history, bad inputs, eviction,
a client that disconnects mid-stream, and concurrent sessions."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from _serving_support import chat_ids, reference_answer, running, tiny_family
from kvhandoff.serving.app import field_path

pytestmark = pytest.mark.timeout(120)

USER_TURNS = ["Tell me a story about a cat.", "Now make it shorter!", "And a title?"]


@pytest.fixture(scope="module")
def server():
    with running() as server:
        yield server


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def chat(client, model, messages, session=None, max_tokens=8, **extra):
    """(answer text, response headers, kv_handoff, usage) of one greedy chat request."""
    headers = {"X-Session-ID": session} if session else {}
    raw = client.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=max_tokens,
                                                           temperature=0, extra_headers=headers, **extra)
    result = raw.parse()
    return result.choices[0].message.content, raw.headers, result.model_extra["kv_handoff"], result.usage


def expected(model_name, messages, max_tokens=8) -> str:
    models, _ = tiny_family()
    model, tokenizer = models[model_name]
    return reference_answer(model, tokenizer, chat_ids(tokenizer, messages), max_tokens)


def metric(server, name: str) -> float:
    """The value of a sample line of /metrics (``name`` with its labels as rendered), 0 when absent."""
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_stateless_chat_and_completion_equal_generate(server):
    client = client_of(server)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": USER_TURNS[0]}]
    text, headers, handoff, usage = chat(client, "small", messages, max_tokens=12)
    assert text == expected("small", messages, 12)
    assert headers["x-kv-handoff"] == "none" and handoff["status"] == "none" and handoff["from"] is None
    assert usage.prompt_tokens == len(chat_ids(tiny_family()[0]["small"][1], messages))
    assert usage.prompt_tokens_details.cached_tokens == 0 and handoff["read_tokens"] == usage.prompt_tokens

    models, _ = tiny_family()
    model, tokenizer = models["large"]
    completion = client.completions.create(model="large", prompt="def fibonacci(n):", max_tokens=10, temperature=0)
    assert completion.choices[0].text == reference_answer(model, tokenizer, tokenizer("def fibonacci(n):")["input_ids"],
                                                          10)
    assert completion.model_extra["kv_handoff"]["status"] == "none"
    ids = tokenizer("def fibonacci(n):")["input_ids"]
    by_ids = client.completions.create(model="large", prompt=ids, max_tokens=10, temperature=0)
    assert by_ids.choices[0].text == completion.choices[0].text
    listed = client.models.list()
    assert sorted(m.id for m in listed.data) == ["large", "small"]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_sampling_is_seeded_and_stop_strings_cut(server):
    client = client_of(server)
    messages = [{"role": "user", "content": USER_TURNS[1]}]
    first = client.chat.completions.create(model="small", messages=messages, max_tokens=12, temperature=1.3, top_p=0.9,
                                           seed=7)
    again = client.chat.completions.create(model="small", messages=messages, max_tokens=12, temperature=1.3, top_p=0.9,
                                           seed=7)
    assert first.choices[0].message.content == again.choices[0].message.content
    greedy = expected("small", messages, 12)
    stop = greedy[3:5]
    cut = client.chat.completions.create(model="small", messages=messages, max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].message.content == greedy[: greedy.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_streaming_chat_and_completion(server):
    client = client_of(server)
    messages = [{"role": "user", "content": USER_TURNS[0]}]
    stream = client.chat.completions.create(model="small", messages=messages, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].model_extra["kv_handoff"]["status"] == "none"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected("small", messages, 12)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices

    body = {"model": "small", "prompt": "abc", "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-kv-handoff"] == "none"
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert all(e["object"] == "text_completion" for e in events)
    streamed = "".join(e["choices"][0]["text"] for e in events)
    plain = client_of(server).completions.create(model="small", prompt="abc", max_tokens=6, temperature=0)
    assert streamed == plain.choices[0].text


def test_small_large_small_conversation_hands_over_exactly(server):
    """Each switch is `applied` (mapped, not re-prefilled); with an exactly related pair the handed-over answers equal
    the re-prefill answers token for token; coming back, small keeps its own cache and maps only what it missed."""
    client = client_of(server)
    messages, cached = [], 0
    for turn, (model, user) in enumerate(zip(["small", "large", "small"], USER_TURNS, strict=True)):
        messages.append({"role": "user", "content": user})
        text, headers, handoff, usage = chat(client, model, messages, session="conversation-1")
        assert text == expected(model, messages)
        status = "none" if turn == 0 else "applied"
        assert headers["x-kv-handoff"] == status and handoff["status"] == status
        assert handoff["to"] == model and handoff["milliseconds"] >= 0
        if turn:
            assert handoff["from"] == ["small", "large"][turn - 1]
            if turn == 1:  # large had no cache of this session: all of it was mapped
                assert usage.prompt_tokens_details.cached_tokens == handoff["mapped_tokens"] > cached
            assert handoff["read_tokens"] == usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens
        cached = usage.prompt_tokens_details.cached_tokens
        messages.append({"role": "assistant", "content": text})
    # the last switch mapped only large's turn: small had cached the first turn itself
    assert 0 < handoff["mapped_tokens"] < usage.prompt_tokens_details.cached_tokens
    assert metric(server, 'kvhandoff_handoffs_total{from="small",status="applied",to="large"}') >= 1
    # the body's prompt_cache_key (then user) names a session too
    messages2 = [{"role": "user", "content": USER_TURNS[0]}]
    chat(client, "large", messages2, prompt_cache_key="conversation-2")
    messages2 += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": USER_TURNS[1]}]
    assert chat(client, "small", messages2, prompt_cache_key="conversation-2")[2]["status"] == "applied"
    chat(client, "large", messages2, user="conversation-3")
    assert chat(client, "small", messages2, user="conversation-3")[2]["status"] == "applied"


def test_per_request_reprefill_override_re_prefills_at_a_switch_and_says_so(server):
    """kv_handoff.mode "reprefill" (sent by the openai client with extra_body): at a switch nothing is mapped, the
    receiving model re-prefills the conversation, status "reprefill" names the previous model; without a switch the
    override changes nothing."""
    client = client_of(server)
    reprefill = {"kv_handoff": {"mode": "reprefill"}}
    messages = [{"role": "user", "content": USER_TURNS[0]}]
    text, headers, handoff, _ = chat(client, "small", messages, session="override", extra_body=reprefill)
    assert headers["x-kv-handoff"] == "none" and handoff["status"] == "none"  # no switch: nothing to override
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": USER_TURNS[1]}]
    text, headers, handoff, usage = chat(client, "large", messages, session="override", extra_body=reprefill)
    assert headers["x-kv-handoff"] == "reprefill" and handoff["status"] == "reprefill"
    assert handoff["from"] == "small" and handoff["to"] == "large" and handoff["guard"] is None
    assert handoff["mapped_tokens"] == 0 and handoff["read_tokens"] == usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert text == expected("large", messages)
    assert metric(server, 'kvhandoff_handoffs_total{from="small",status="reprefill",to="large"}') == 1
    assert metric(server, 'kvhandoff_time_to_first_token_seconds_count{status="reprefill"}') >= 1
    # "auto" (the default) maps again at the next switch
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": USER_TURNS[2]}]
    text, headers, handoff, _ = chat(client, "small", messages, session="override",
                                     extra_body={"kv_handoff": {"mode": "auto"}})
    assert headers["x-kv-handoff"] == "applied" and handoff["mapped_tokens"] > 0
    assert text == expected("small", messages)
    # completions take it too
    body = {"model": "small", "prompt": "abcdef", "max_tokens": 2, "temperature": 0}
    httpx.post(server.url + "/v1/completions", json=body, headers={"X-Session-ID": "override-2"}, timeout=30)
    response = httpx.post(server.url + "/v1/completions", json={**body, "model": "large", "prompt": "abcdefgh",
                                                                **reprefill},
                          headers={"X-Session-ID": "override-2"}, timeout=30)
    assert response.headers["x-kv-handoff"] == "reprefill" and response.json()["kv_handoff"]["mapped_tokens"] == 0


def test_guard_forced_to_fall_back_re_prefills():
    with running(guard=True, guard_signal="logloss", guard_threshold=-1e9) as server:
        client = client_of(server)
        messages = [{"role": "user", "content": USER_TURNS[0]}]
        first = chat(client, "small", messages, session="g")[0]
        messages += [{"role": "assistant", "content": first}, {"role": "user", "content": USER_TURNS[1]}]
        text, headers, handoff, usage = chat(client, "large", messages, session="g")
        assert headers["x-kv-handoff"] == "fallback" and handoff["status"] == "fallback"
        assert handoff["guard"]["signal"] == "logloss" and handoff["guard"]["threshold"] == -1e9
        assert handoff["guard"]["score"] > -1e9
        assert text == expected("large", messages)
        assert usage.prompt_tokens_details.cached_tokens == 0 and handoff["read_tokens"] == usage.prompt_tokens
        assert metric(server, 'kvhandoff_guard_fallbacks_total{from="small",to="large"}') == 1
    with running(guard=True, guard_signal="kl", guard_threshold=1e-3) as server:  # an exact map passes
        client = client_of(server)
        messages = [{"role": "user", "content": USER_TURNS[0]}]
        messages += [{"role": "assistant", "content": chat(client, "small", messages, session="g")[0]},
                     {"role": "user", "content": USER_TURNS[1]}]
        text, headers, handoff, _ = chat(client, "large", messages, session="g")
        assert headers["x-kv-handoff"] == "applied" and 0 <= handoff["guard"]["score"] < 1e-3
        assert text == expected("large", messages)
    with running(guard=True, guard_signal="mapped_share", guard_threshold=0.5) as server:  # no reference pass
        client = client_of(server)
        messages = [{"role": "user", "content": USER_TURNS[0]}]
        messages += [{"role": "assistant", "content": chat(client, "small", messages, session="g")[0]},
                     {"role": "user", "content": USER_TURNS[1]}]
        text, headers, handoff, _ = chat(client, "large", messages, session="g")
        assert headers["x-kv-handoff"] == "fallback" and handoff["guard"]["score"] == 1.0  # all of it mapped
        assert text == expected("large", messages)


def test_edited_and_dropped_history_is_never_served_from_stale_kv(server):
    client = client_of(server)
    messages = [{"role": "user", "content": USER_TURNS[0]}]
    messages += [{"role": "assistant", "content": chat(client, "small", messages, session="edit")[0]},
                 {"role": "user", "content": USER_TURNS[1]}]
    text, _, _, usage = chat(client, "small", messages, session="edit")
    assert text == expected("small", messages)
    full = usage.prompt_tokens
    edited = [{"role": "user", "content": "Tell me a story about a dog."}, *messages[1:]]  # the first turn edited
    text, headers, _, usage = chat(client, "small", edited, session="edit")
    assert text == expected("small", edited) and headers["x-kv-handoff"] == "none"
    tokenizer = tiny_family()[0]["small"][1]
    a, b = chat_ids(tokenizer, messages), chat_ids(tokenizer, edited)
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert usage.prompt_tokens_details.cached_tokens == common < full
    dropped = edited[:1]  # the client dropped the later turns
    text, _, _, usage = chat(client, "large", dropped, session="edit")  # and switched model
    assert text == expected("large", dropped)


BAD_REQUESTS = [
    ({"model": "small"}, 400, "messages"),
    ({"model": "small", "messages": []}, 400, "messages"),
    ({"model": "small", "messages": "hello"}, 400, "messages"),
    ({"model": "small", "messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0]"),
    ({"model": "small", "messages": [{"role": "critic", "content": "x"}]}, 400, "messages[0].role"),
    ({"model": "small", "messages": [{"role": "user"}]}, 400, "messages[0]"),
    ({"model": "small", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400,
     "messages[0].content"),
    ({"model": 5, "messages": [{"role": "user", "content": "x"}]}, 400, "model"),
    ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ({"model": "small", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "small", "messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": "small", "messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n"),
    ({"model": "small", "messages": [{"role": "user", "content": "x"}], "n": 17}, 400, "n"),
    ({"model": "small", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ({"model": "small", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 21, "logprobs": True}, 400,
     "top_logprobs"),
    ({"model": "small", "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "bad name"}}]}, 400, "tools[0].function.name"),
    ({"model": "small", "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {
          "type": "function", "function": {"name": "g"}}}, 400, "tool_choice.function.name"),
    ({"model": "small", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400,
     "tool_choice"),
    ({"model": "small", "messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}, 400,
     "functions"),
    ({"model": "small", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
     400, "response_format"),
    ({"model": "small", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
     400, "response_format.type"),
    ({"model": "small", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"model": "small", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"100000": 1}}, 400,
     "logit_bias"),
    ({"model": "small", "messages": [{"role": "user", "content": "x"}], "stop_token_ids": [100000]}, 400,
     "stop_token_ids"),
    ({"model": "small", "messages": [{"role": "user", "content": "x"}], "presence_penalty": 3}, 400,
     "presence_penalty"),
    ({"model": "small", "messages": [{"role": "user", "content": "x"}], "temperature": 3}, 400, "temperature"),
    ({"model": "small", "messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400, "top_p"),
    ({"model": "small", "messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}, 400,
     "stop"),
    ({"model": "small", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}, 400, "stream"),
    ({"model": "small", "messages": [{"role": "user", "content": "x" * 600}]}, 400, "messages"),
    ({"model": "small", "messages": [{"role": "user", "content": "x"}], "kv_handoff": {"mode": "never"}}, 400,
     "kv_handoff.mode"),
    ({"model": "small", "messages": [{"role": "user", "content": "x"}], "kv_handoff": "reprefill"}, 400,
     "kv_handoff"),
    ({"model": "small", "messages": [{"role": "user", "content": "x"}], "kv_handoff": {"mode": "auto", "to": 1}},
     400, "kv_handoff.to"),
]
BAD_COMPLETIONS = [
    ({"model": "small", "prompt": ["one", "two"]}, 400, "prompt"),
    ({"model": "small", "prompt": [1, 2, 100000]}, 400, "prompt"),
    ({"model": "small", "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ({"model": "small", "prompt": "x", "best_of": 2}, 400, "best_of"),
    ({"model": "small", "prompt": "x", "logprobs": 6}, 400, "logprobs"),
    ({"model": "small", "prompt": ""}, 400, "prompt"),
    ({"model": "large", "prompt": "x" * 600}, 400, "prompt"),
    ({"model": "small", "prompt": "x", "kv_handoff": {"mode": 1}}, 400, "kv_handoff.mode"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"),
                         [("/v1/chat/completions", *case) for case in BAD_REQUESTS]
                         + [("/v1/completions", *case) for case in BAD_COMPLETIONS])
def test_bad_input_gets_an_openai_error_object_naming_the_field(server, path, body, status, param):
    response = httpx.post(server.url + path, json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    assert set(error) == {"message", "type", "param", "code"}


def test_malformed_json_and_unknown_routes_get_error_objects(server):
    response = httpx.post(server.url + "/v1/chat/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
    response = httpx.get(server.url + "/v1/nothing")
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"
    with pytest.raises(openai.NotFoundError):
        client_of(server).chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client_of(server).chat.completions.create(model="small", messages=[{"role": "user", "content": "x"}], n=17)


def test_field_path_leaves_out_union_tags():
    assert field_path(("body", "messages", 0, "content")) == "messages[0].content"
    assert field_path(("body", "prompt", "list[int]", 2)) == "prompt[2]"
    assert field_path(("body", "messages", 0, "content", "str")) == "messages[0].content"
    assert field_path(("body",)) is None


def test_cache_memory_limit_evicts_the_least_recently_used_session():
    per_token = 3 * 2 * 2 * 16 * 4  # layers × (K, V) × KV heads × head dim × float32 bytes, one model
    with running(cache_memory_bytes=per_token * 120) as server:  # room for about one conversation
        client = client_of(server)
        first = [{"role": "user", "content": USER_TURNS[0]}]
        second = [{"role": "user", "content": USER_TURNS[1]}]
        chat(client, "small", first, session="a")
        assert httpx.get(server.url + "/health").json()["sessions"] == 1
        chat(client, "small", second, session="b")  # over the limit: a, the least recently used, goes
        health = httpx.get(server.url + "/health").json()
        assert health["sessions"] == 1 and 0 < health["cache_bytes"] <= per_token * 120
        assert metric(server, 'kvhandoff_evictions_total{reason="memory"}') == 1
        assert server.engine.session_tokens("a") is None and server.engine.session_tokens("b")
        # a's next request re-prefills and says so
        text, headers, _, usage = chat(client, "large", first, session="a")
        assert headers["x-kv-handoff"] == "none" and usage.prompt_tokens_details.cached_tokens == 0
        assert text == expected("large", first)


class GatedModel:
    """A model whose forward passes wait on `gate` once `free` calls have gone through (the worker is then busy)."""

    def __init__(self, model, free: int) -> None:
        self.model, self.free, self.calls = model, free, 0
        self.gate, self.waiting = threading.Event(), threading.Event()

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls > self.free:
            self.waiting.set()
            assert self.gate.wait(30), "the test never opened the gate"
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def wait_for(condition, what: str, tries: int = 1000) -> None:
    """Poll ``condition`` (bounded: tries × 10 ms) — the server acts on another thread."""
    for _ in range(tries):
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_full_server_answers_429_and_503_and_health_while_busy():
    models, _ = tiny_family()
    model, tokenizer = models["small"]
    gated = GatedModel(model, free=0)
    with running({"m": (gated, tokenizer)}, {}, max_sessions=1, max_queue=1) as server:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
        results = {}

        def post(name, headers=None):
            results[name] = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers or {},
                                       timeout=60)

        busy = threading.Thread(target=post, args=("a", {"X-Session-ID": "a"}))
        busy.start()
        wait_for(gated.waiting.is_set, "the worker to be busy")
        health = httpx.get(server.url + "/health", timeout=5).json()  # answers while the model computes
        assert health["running"] == 1 and health["sessions"] == 1
        refused = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"X-Session-ID": "b"})
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_sessions"
        queued = threading.Thread(target=post, args=("c",))  # stateless: waits in the queue
        queued.start()
        wait_for(lambda: httpx.get(server.url + "/health").json()["models"]["m"]["queued"] == 1, "a queued request")
        overloaded = httpx.post(server.url + "/v1/chat/completions", json=body)
        assert overloaded.status_code == 503 and overloaded.json()["error"]["type"] == "server_error"
        gated.gate.set()
        busy.join(60)
        queued.join(60)
        assert results["a"].status_code == 200 and results["c"].status_code == 200
        assert results["a"].json()["choices"][0]["message"]["content"] == results["c"].json()["choices"][0][
            "message"]["content"]


def test_client_disconnect_mid_stream_cancels_and_keeps_the_session_consistent():
    models, _ = tiny_family()
    model, tokenizer = models["small"]
    gated = GatedModel(model, free=6)  # the prefill and five decoding steps, then the worker waits
    with running({"m": (gated, tokenizer)}, {}) as server:
        messages = [{"role": "user", "content": USER_TURNS[0]}]
        body = {"model": "m", "messages": messages, "max_tokens": 200, "temperature": 0, "stream": True}
        received = ""
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                          headers={"X-Session-ID": "d"}, timeout=30) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    received += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                    if len(received) >= 2:
                        break  # the client goes away
        def seen() -> bool:  # the worker stopped at its next token, or waits at the gate with the cancel noted
            health = httpx.get(server.url + "/health").json()
            return health["running"] == 0 or health["cancelling"] == 1

        wait_for(seen, "the server to see the client go")
        gated.gate.set()
        wait_for(lambda: httpx.get(server.url + "/health").json()["running"] == 0, "the generation to stop")
        assert metric(server, "kvhandoff_cancelled_total") == 1
        prompt = chat_ids(tokenizer, messages)
        kept = server.engine.session_tokens("d")
        assert kept[: len(prompt)] == prompt and len(kept) <= len(prompt) + 6
        # the conversation goes on from what the client received
        messages += [{"role": "assistant", "content": received}, {"role": "user", "content": USER_TURNS[1]}]
        text, _, _, usage = chat(client_of(server), "m", messages, session="d")
        assert text == reference_answer(model, tokenizer, chat_ids(tokenizer, messages), 8)
        assert usage.prompt_tokens_details.cached_tokens >= len(prompt)


def test_sixteen_concurrent_sessions_answer_as_one_at_a_time(server):
    client = client_of(server)

    def conversation(i: int, prefix: str) -> list[str]:
        messages, answers = [], []
        for model, user in zip(["small", "large", "small"], USER_TURNS, strict=True):
            messages.append({"role": "user", "content": f"{user} (#{i})"})
            answers.append(chat(client, model, messages, session=f"{prefix}-{i}", max_tokens=6)[0])
            messages.append({"role": "assistant", "content": answers[-1]})
        return answers

    alone = [conversation(i, "alone") for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda i: conversation(i, "together"), range(16)))
    assert together == alone
    assert len({tuple(a) for a in alone}) > 1  # the conversations differ, so leakage would show
