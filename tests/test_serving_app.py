"""The HTTP API against a real uvicorn server on a free loopback port, through the official `openai` client and raw
httpx: chat, completions, streaming, handoffs (applied / fallback / none), edited history, bad inputs, eviction,
a client that disconnects mid-stream, and concurrent sessions."""

from __future__ import annotations

import copy
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import hypothesis
import jsonschema
import openai
import pytest
import schemathesis
import torch
from transformers import GenerationConfig

from _serving_support import AGENT_CONTEXT, GatedModel, chat_ids, reference_answer, running, tiny_family, wait_for
from kvhandoff.runtime.switch.pair import SwitchSettings
from kvhandoff.serving.app import create_app
from kvhandoff.serving.decoding import GenerationDefaults
from kvhandoff.serving.engine import Engine
from kvhandoff.serving.middleware import field_path
from kvhandoff.serving.settings import ServeConfig

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


def expected(model_name, messages, max_tokens=8, context: int = 512) -> str:
    models, _ = tiny_family(context)
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


def test_a_request_that_leaves_sampling_out_gets_the_models_generation_config():
    # as vLLM's --generation-config auto: top_k 1 makes any temperature greedy, max_new_tokens is the answer limit
    models, mappers = tiny_family()
    small, tokenizer = models["small"]
    configured = copy.copy(small)  # the shared family's model is never changed
    configured.generation_config = GenerationConfig(top_k=1, temperature=1.9, max_new_tokens=5, do_sample=True)
    family = {"small": (configured, tokenizer), "large": models["large"]}
    messages = [{"role": "user", "content": USER_TURNS[0]}]
    greedy = expected("small", messages, 5)
    with running(family, mappers) as server:
        client = client_of(server)
        left_out = [client.chat.completions.create(model="small", messages=messages, seed=seed) for seed in range(4)]
        assert {answer.choices[0].message.content for answer in left_out} == {greedy}
        assert all(answer.usage.completion_tokens <= 5 for answer in left_out)
        given = {client.chat.completions.create(model="small", messages=messages, seed=seed, max_tokens=8,
                                                extra_body={"top_k": 0}).choices[0].message.content
                 for seed in range(6)}
        assert len(given) > 1  # a field the request gives wins over the config
        assert server.engine.generation_defaults("large") == server.engine.generation_defaults("nope") == \
            GenerationDefaults()
    with running(family, mappers, generation_config="vllm") as server:
        client = client_of(server)
        answers = {client.chat.completions.create(model="small", messages=messages, seed=seed,
                                                  max_tokens=8).choices[0].message.content for seed in range(6)}
        assert len(answers) > 1  # the server's own defaults: temperature 1, every token


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


def test_guard_escalating_hands_the_switch_over_again():
    with running(guard=True, guard_signal="entropy_gain", guard_threshold=-1e9,
                 guard_action="escalate:recent:100%") as server:
        client = client_of(server)
        messages = [{"role": "user", "content": USER_TURNS[0]}]
        messages += [{"role": "assistant", "content": chat(client, "small", messages, session="g")[0]},
                     {"role": "user", "content": USER_TURNS[1]}]
        text, headers, handoff, _ = chat(client, "large", messages, session="g")
        assert headers["x-kv-handoff"] == "escalated" and handoff["status"] == "escalated"
        assert headers["x-vsr-kv-transfer-status"] == "applied"
        assert handoff["guard"]["signal"] == "entropy_gain" and handoff["mapped_tokens"] > 0
        assert text == expected("large", messages)
        assert metric(server, 'kvhandoff_guard_escalations_total{from="small",to="large"}') == 1
        assert metric(server, 'kvhandoff_handoffs_total{from="small",status="escalated",to="large"}') == 1


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


def test_a_lone_surrogate_is_a_400_naming_its_field_and_every_response_is_counted(server):
    route = "/v1/chat/completions"
    counted = {status: metric(server, f'kvhandoff_requests_total{{endpoint="{route}",outcome="{status}"}}')
               for status in ("200", "400")}
    raw = b'{"model": "small", "messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}'
    response = httpx.post(server.url + route, content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages[0].content" and "surrogate" in error["message"]
    completion = httpx.post(server.url + "/v1/completions", content=b'{"model": "small", "prompt": "\\ud800"}',
                            headers={"content-type": "application/json"})
    assert completion.status_code == 400 and completion.json()["error"]["param"] == "prompt"
    httpx.post(server.url + route, json={"model": "small", "messages": [{"role": "user", "content": "hi"}],
                                         "max_tokens": 1})
    assert metric(server, f'kvhandoff_requests_total{{endpoint="{route}",outcome="400"}}') == counted["400"] + 1
    assert metric(server, f'kvhandoff_requests_total{{endpoint="{route}",outcome="200"}}') == counted["200"] + 1
    httpx.get(server.url + "/no/such/route")
    assert metric(server, 'kvhandoff_requests_total{endpoint="unmatched",outcome="404"}') >= 1


def test_a_body_past_the_limit_is_refused_before_it_is_read():
    with running(max_body_bytes=4096) as server:
        big = {"model": "small", "messages": [{"role": "user", "content": "x" * 8000}]}
        response = httpx.post(server.url + "/v1/chat/completions", json=big)
        assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
        assert "--max-body-bytes" in response.json()["error"]["message"]

        def chunks():  # no Content-Length: cut off as it arrives
            yield b'{"model": "small", "messages": [{"role": "user", "content": "'
            for _ in range(20):
                yield b"y" * 1000
            yield b'"}]}'

        response = httpx.post(server.url + "/v1/chat/completions", content=chunks(),
                              headers={"content-type": "application/json"})
        assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
        assert metric(server, 'kvhandoff_requests_total{endpoint="/v1/chat/completions",outcome="413"}') == 2
        small = {"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        assert httpx.post(server.url + "/v1/chat/completions", json=small).status_code == 200


def test_an_over_long_text_is_refused_without_its_exact_count(server):
    from kvhandoff.serving.prompts import LENGTH_CHUNK_CHARS

    text = "ab " * LENGTH_CHUNK_CHARS  # several chunks, far past the 512-token window
    response = httpx.post(server.url + "/v1/completions", json={"model": "small", "prompt": text}, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and "more than 512 tokens" in error["message"]
    response = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                          json={"model": "small", "messages": [{"role": "user", "content": text}]})
    assert response.status_code == 400 and "more than 512 tokens" in response.json()["error"]["message"]


def test_field_path_leaves_out_union_tags():
    assert field_path(("body", "messages", 0, "content")) == "messages[0].content"
    assert field_path(("body", "prompt", "list[int]", 2)) == "prompt[2]"
    assert field_path(("body", "messages", 0, "content", "str")) == "messages[0].content"
    assert field_path(("body",)) is None


def test_cache_memory_limit_evicts_the_least_recently_used_session():
    per_token = 3 * 2 * 2 * 16 * 4  # layers × (K, V) × KV heads × head dim × float32 bytes, one model
    with running(cache_memory_bytes=per_token * 80) as server:  # room for about one conversation
        client = client_of(server)
        first = [{"role": "user", "content": USER_TURNS[0]}]
        second = [{"role": "user", "content": USER_TURNS[1]}]
        chat(client, "small", first, session="a")
        assert httpx.get(server.url + "/health").json()["sessions"] == 1
        chat(client, "small", second, session="b")  # over the limit: a, the least recently used, goes
        health = httpx.get(server.url + "/health").json()
        assert health["sessions"] == 1 and 0 < health["cache_bytes"] <= per_token * 80
        assert metric(server, 'kvhandoff_evictions_total{reason="memory"}') == 1
        assert server.engine.session_tokens("a") is None and server.engine.session_tokens("b")
        # a's next request re-prefills and says so
        text, headers, _, usage = chat(client, "large", first, session="a")
        assert headers["x-kv-handoff"] == "none" and usage.prompt_tokens_details.cached_tokens == 0
        assert text == expected("large", first)


def test_full_server_answers_429_and_503_and_health_while_busy():
    models, _ = tiny_family()
    model, tokenizer = models["small"]
    gated = GatedModel(model, free=0)
    with running({"m": (gated, tokenizer)}, {}, max_sessions=1, max_queue=1, admission_wait_s=0.2) as server:
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
        assert refused.headers["retry-after"] == "1"
        queued = threading.Thread(target=post, args=("c",))  # stateless: waits in the queue
        queued.start()
        wait_for(lambda: httpx.get(server.url + "/health").json()["models"]["m"]["queued"] == 1, "a queued request")
        overloaded = httpx.post(server.url + "/v1/chat/completions", json=body)
        assert overloaded.status_code == 503 and overloaded.json()["error"]["type"] == "server_error"
        assert overloaded.headers["retry-after"] == "1"
        gated.gate.set()
        busy.join(60)
        queued.join(60)
        assert results["a"].status_code == 200 and results["c"].status_code == 200
        assert results["a"].json()["choices"][0]["message"]["content"] == results["c"].json()["choices"][0][
            "message"]["content"]


def test_a_new_session_waits_for_a_busy_one_to_end_instead_of_a_429():
    models, _ = tiny_family()
    model, tokenizer = models["small"]
    gated = GatedModel(model, free=0)
    with running({"m": (gated, tokenizer)}, {}, max_sessions=1, admission_wait_s=30) as server:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
        results = {}

        def post(name):
            results[name] = httpx.post(server.url + "/v1/chat/completions", json=body,
                                       headers={"X-Session-ID": name}, timeout=60)

        threads = [threading.Thread(target=post, args=(name,)) for name in ("a", "b")]
        threads[0].start()
        wait_for(gated.waiting.is_set, "the worker to be busy")
        threads[1].start()  # every session busy: b waits for a to end
        wait_for(lambda: server.engine.sessions.waiting() == 1, "b to wait for a session")
        gated.gate.set()
        for thread in threads:
            thread.join(60)
        assert results["a"].status_code == results["b"].status_code == 200
        assert server.engine.session_count() == 1 and server.engine.session_tokens("b")


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
    workers = [server.engine.hosted(name).worker for name in ("small", "large")]
    before = [(worker.steps, worker.batched_reads) for worker in workers]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda i: conversation(i, "together"), range(16)))
    assert together == alone
    assert len({tuple(a) for a in alone}) > 1  # the conversations differ, so leakage would show
    steps = sum(worker.steps - done for worker, (done, _) in zip(workers, before, strict=True))
    reads = sum(worker.batched_reads - done for worker, (_, done) in zip(workers, before, strict=True))
    assert reads > steps  # concurrent answers shared decode forwards


# -- the agent surface: tools, structured output, the sampling fields, log-probs, the tokenizer routes, the key ------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city for some days",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, CLOCK)}
ASK_WEATHER = [{"role": "system", "content": "You call tools."},
               {"role": "user", "content": "The weather in Oslo for two days?"}]


def check_calls(calls, names) -> None:
    """Every call names one of ``names``, has an id, and its arguments validate against its tool's schema."""
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.fixture(scope="module")
def agent_server():
    """The tiny family with a context that holds tool schemas."""
    with running(*tiny_family(AGENT_CONTEXT)) as server:
        yield server


def test_required_and_named_tool_calls_always_parse_and_fit_their_schema(agent_server):
    client = client_of(agent_server)
    named = {"type": "function", "function": {"name": "get_time"}}
    for tool_choice, names in (("required", set(SCHEMAS)), (named, {"get_time"})):
        for seed in range(3):
            result = client.chat.completions.create(
                model="small", messages=[{"role": "user", "content": f"question {seed}"}], tools=[WEATHER, CLOCK],
                tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=300, temperature=1.0, seed=seed)
            choice = result.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            check_calls(choice.message.tool_calls, names)
            assert len(choice.message.tool_calls) == 1  # parallel_tool_calls false: one call


def test_streamed_tool_calls_equal_the_whole_answer(agent_server):
    client = client_of(agent_server)
    request = {"model": "large", "messages": ASK_WEATHER, "tools": [WEATHER, CLOCK], "tool_choice": "required",
               "max_tokens": 300, "temperature": 0}
    whole = client.chat.completions.create(**request).choices[0]
    calls, finish, first = {}, None, None
    for chunk in client.chat.completions.create(**request, stream=True):
        first = first or chunk.model_extra.get("kv_handoff")
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": delta.id, "name": delta.function.name, "arguments": ""})
                call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and first["status"] == "none"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_a_tool_round_trip_across_small_large_small_is_handed_over_exactly(agent_server):
    """call (small) → tool result → answer (large, handed over) → another call (small, handed back): each switch is
    `applied`, and on the exactly related pair every answer equals the one a re-prefill gives."""
    client = client_of(agent_server)

    def conversation(session: str, mode: str) -> list:
        def ask(model, messages, max_tokens=300, **extra):
            raw = client.chat.completions.with_raw_response.create(
                model=model, messages=messages, tools=[WEATHER, CLOCK], max_tokens=max_tokens, temperature=0,
                extra_headers={"X-Session-ID": session}, extra_body={"kv_handoff": {"mode": mode}}, **extra)
            return raw.parse(), raw.headers

        messages = list(ASK_WEATHER)
        call_answer, _ = ask("small", messages, tool_choice={"type": "function", "function": {"name": "get_weather"}})
        call = call_answer.choices[0].message.tool_calls[0]
        messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "rain", "celsius": 4}'}]
        answer, headers = ask("large", messages, tool_choice="none", max_tokens=8)
        text = answer.choices[0].message.content
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "And the time in CET?"}]
        again, back_headers = ask("small", messages, tool_choice="required", parallel_tool_calls=False)
        calls = again.choices[0].message.tool_calls
        check_calls(calls, set(SCHEMAS))
        statuses = [headers["x-kv-handoff"], back_headers["x-kv-handoff"]]
        return [(call.function.name, call.function.arguments), text,
                [(c.function.name, c.function.arguments) for c in calls], statuses]

    handed, reprefilled = conversation("tools-mapped", "auto"), conversation("tools-reprefill", "reprefill")
    assert handed[3] == ["applied", "applied"] and reprefilled[3] == ["reprefill", "reprefill"]
    assert handed[:3] == reprefilled[:3]


def test_json_schema_and_json_object_answers_always_parse(agent_server):
    client = client_of(agent_server)
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
        "required": ["name", "age", "tags"], "additionalProperties": False}
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    for seed in range(3):
        result = client.chat.completions.create(model="small", messages=[{"role": "user", "content": "a person"}],
                                                response_format=response_format, max_tokens=300, temperature=1.0,
                                                seed=seed)
        assert result.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(result.choices[0].message.content), schema)
    result = client.chat.completions.create(model="large", messages=[{"role": "user", "content": "JSON"}],
                                            response_format={"type": "json_object"}, max_tokens=400,
                                            temperature=0)
    assert isinstance(json.loads(result.choices[0].message.content), dict)


def test_several_choices_logprobs_and_the_sampling_fields(agent_server):
    client = client_of(agent_server)
    messages = [{"role": "user", "content": "Count with me."}]
    result = client.chat.completions.create(model="small", messages=messages, n=3, max_tokens=6, temperature=1.0,
                                            seed=5, logprobs=True, top_logprobs=2)
    assert [choice.index for choice in result.choices] == [0, 1, 2]
    assert len({choice.message.content for choice in result.choices}) > 1  # one seed, different answers
    assert result.usage.completion_tokens == sum(len(choice.logprobs.content) for choice in result.choices)
    for entry in result.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob <= entry.top_logprobs[0].logprob + 1e-6 and entry.bytes == list(entry.token.encode())
    greedy = client.chat.completions.create(model="small", messages=messages, n=2, max_tokens=6, temperature=0)
    answers = [choice.message.content for choice in greedy.choices]
    assert answers == [expected("small", messages, 6, AGENT_CONTEXT)] * 2
    z = tiny_family(AGENT_CONTEXT)[0]["small"][1]("z")["input_ids"][0]
    forced = client.chat.completions.create(model="small", messages=messages, max_tokens=5, temperature=0,
                                            logit_bias={str(z): 100})
    assert forced.choices[0].message.content == "zzzzz"
    never = client.chat.completions.create(model="small", messages=messages, max_tokens=5, temperature=0,
                                           extra_body={"min_tokens": 5, "ignore_eos": True, "top_k": 1})
    assert never.usage.completion_tokens == 5 and never.choices[0].finish_reason == "length"


def test_completions_echo_scores_the_prompt(agent_server):
    models, _ = tiny_family(AGENT_CONTEXT)
    model, tokenizer = models["large"]
    prompt = "The tide comes in."
    ids = tokenizer(prompt)["input_ids"]
    result = httpx.post(agent_server.url + "/v1/completions", json={
        "model": "large", "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0}, timeout=30).json()
    choice = result["choices"][0]
    assert choice["text"] == prompt and result["usage"]["completion_tokens"] == 0
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) and logprobs["token_logprobs"][0] is None
    with torch.no_grad():
        reference = model(input_ids=torch.tensor([ids])).logits[0].log_softmax(-1)
    assert logprobs["token_logprobs"][1:] == pytest.approx([float(reference[i - 1, ids[i]])
                                                            for i in range(1, len(ids))], abs=1e-4)
    assert logprobs["text_offset"][:2] == [0, len(logprobs["tokens"][0])]
    answered = httpx.post(agent_server.url + "/v1/completions", json={
        "model": "large", "prompt": prompt, "echo": True, "max_tokens": 3, "temperature": 0}, timeout=30).json()
    assert answered["choices"][0]["text"].startswith(prompt)


def test_nulls_are_defaults_and_unknown_fields_are_ignored(agent_server):
    body = {"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": None,
            "top_p": None, "n": None, "stream": None, "stop": None, "seed": None, "tools": None,
            "tool_choice": None, "response_format": None, "logprobs": None, "stream_options": None,
            "a_field_from_the_future": {"x": 1}}
    response = httpx.post(agent_server.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] is not None


def test_context_overflow_is_a_400_context_length_exceeded(server):
    with pytest.raises(openai.BadRequestError) as caught:
        client_of(server).chat.completions.create(model="small", messages=[{"role": "user", "content": "x" * 600}])
    assert caught.value.code == "context_length_exceeded" and "maximum context length" in caught.value.message


def test_model_tokenizer_and_version_routes(agent_server):
    client = client_of(agent_server)
    assert client.models.retrieve("large").id == "large"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    models, _ = tiny_family(AGENT_CONTEXT)
    tokenizer = models["small"][1]
    tokens = httpx.post(agent_server.url + "/tokenize", json={"model": "small", "prompt": "hello"}).json()
    assert tokens["tokens"] == tokenizer("hello")["input_ids"] and tokens["count"] == len(tokens["tokens"])
    chat_tokens = httpx.post(agent_server.url + "/tokenize", json={"model": "small", "messages": USER_MESSAGES}).json()
    assert chat_tokens["tokens"] == chat_ids(tokenizer, USER_MESSAGES)
    assert httpx.post(agent_server.url + "/detokenize", json={"model": "small", "tokens": tokens["tokens"]}).json() == {
        "prompt": "hello"}
    assert httpx.post(agent_server.url + "/detokenize", json={"model": "small", "tokens": [10**6]}).status_code == 400
    assert httpx.get(agent_server.url + "/version").json()["version"]


USER_MESSAGES = [{"role": "user", "content": "hi there"}]


def test_router_headers_and_the_litellm_session_key(agent_server):
    client = client_of(agent_server)
    messages = [{"role": "user", "content": USER_TURNS[0]}]
    headers = {"x-litellm-session-id": "router-1"}
    first = client.chat.completions.with_raw_response.create(model="small", messages=messages, max_tokens=4,
                                                             temperature=0, extra_headers=headers)
    assert first.headers["x-vsr-kv-transfer-status"] == "unsupported" and "x-vsr-kv-mapper-id" not in first.headers
    messages += [{"role": "assistant", "content": first.parse().choices[0].message.content},
                 {"role": "user", "content": USER_TURNS[1]}]
    second = client.chat.completions.with_raw_response.create(model="large", messages=messages, max_tokens=4,
                                                              temperature=0, extra_headers=headers)
    assert second.headers["x-kv-handoff"] == "applied" and second.headers["x-vsr-kv-transfer-status"] == "applied"
    assert second.headers["x-vsr-kv-mapper-id"] == agent_server.engine.mapper_id("small", "large")
    assert second.headers["x-vsr-kv-cache-id"] == first.headers["x-vsr-kv-cache-id"]
    forced = client.chat.completions.with_raw_response.create(
        model="small", messages=messages, max_tokens=4, temperature=0, extra_headers=headers,
        extra_body={"kv_handoff": {"mode": "reprefill"}})
    assert forced.headers["x-vsr-kv-transfer-status"] == "fallback_reprefill"


def test_an_api_key_guards_every_route_and_the_probes_unless_they_are_opened():
    key = {"Authorization": "Bearer sesame"}
    with running(api_key="sesame") as server:
        assert httpx.get(server.url + "/v1/models").status_code == 401
        refused = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client_of(server).models.list()
        keyed = openai.OpenAI(base_url=server.url + "/v1", api_key="sesame", max_retries=0, timeout=30)
        assert [m.id for m in keyed.models.list()] == ["small", "large"]
        assert httpx.get(server.url + "/health").status_code == httpx.get(server.url + "/metrics").status_code == 401
        assert httpx.get(server.url + "/health", headers=key).status_code == 200
        assert httpx.get(server.url + "/metrics", headers=key).status_code == 200
    with running(api_key="sesame", open_probes=True) as server:
        assert httpx.get(server.url + "/health").status_code == httpx.get(server.url + "/metrics").status_code == 200


def test_a_router_naming_the_cache_pins_the_session_and_gets_the_name_back(agent_server):
    client = client_of(agent_server)
    messages = [{"role": "user", "content": USER_TURNS[0]}]
    headers = {"x-vsr-kv-cache-id": "router-cache-7"}
    first = client.chat.completions.with_raw_response.create(model="large", messages=messages, max_tokens=4,
                                                             temperature=0, extra_headers=headers)
    assert first.headers["x-vsr-kv-cache-id"] == "router-cache-7"
    messages += [{"role": "assistant", "content": first.parse().choices[0].message.content},
                 {"role": "user", "content": USER_TURNS[1]}]
    second = client.chat.completions.with_raw_response.create(
        model="small", messages=messages, max_tokens=4, temperature=0, extra_headers=headers,
        extra_body={"kv_handoff": {"mode": "reprefill"}})
    assert second.headers["x-kv-handoff"] == "reprefill" and "x-vsr-kv-mapper-id" not in second.headers


# -- the OpenAPI document is the contract: schemathesis against a real server -----------------------------------------
def openapi_document(**settings) -> dict:
    """The app's OpenAPI document, built without serving (the routes do not depend on the engine's state); the
    schema is read at collection, the live server's URL given to each call. ``settings``: `ServeConfig`'s."""
    models, mappers = tiny_family()
    engine = Engine(models, mappers, ServeConfig(switch=SwitchSettings(guard=False), **settings))
    try:
        return create_app(engine).openapi()
    finally:
        engine.close()


#: every check schemathesis has, as `st run --checks all` runs them (max_response_time is a time budget, not part of
#: the contract: off), on requests that fit the document and requests that do not (generation mode "all": positive
#: and negative). One adjustment, a fact of the API rather than a failure: rules between fields, or against the
#: model, that a JSON schema cannot state (a prompt or messages on /tokenize, a tool message's content and
#: tool_call_id, a function named twice, best_of equal to n, top_logprobs with logprobs, token ids within the
#: vocabulary, the context window) make 400 a right
#: answer to a schema-valid request (positive_data_acceptance). object_level_authorization finds nothing to test
#: (the server holds no objects a caller owns); ignored_auth tests the keyed server's document (`KEYED_SCHEMA`).
SCHEMA_CONFIG = {
    "checks": {"enabled": True,
               "positive_data_acceptance": {"expected-statuses": ["2xx", "400", "404", "429", "503"]}},
    "generation": {"mode": "all"},
}
SCHEMA = schemathesis.openapi.from_dict(
    openapi_document(), config=schemathesis.config.SchemathesisConfig.from_dict(SCHEMA_CONFIG))
#: the key of the keyed server the keyed document is checked against
KEY = "sesame"
#: a keyed server's document (a bearer security scheme on every route, 401 documented), the key sent as it says
KEYED_SCHEMA = schemathesis.openapi.from_dict(
    openapi_document(api_key=KEY), config=schemathesis.config.SchemathesisConfig.from_dict(
        {**SCHEMA_CONFIG, "auth": {"openapi": {"apiKey": {"bearer": KEY}}}}))
#: the settings of every schemathesis test: bounded and the same each run (derandomized, no example database)
BOUNDED = {"deadline": None, "database": None, "derandomize": True,
           "suppress_health_check": list(hypothesis.HealthCheck)}


@pytest.fixture(scope="module")
def keyed_server():
    with running(api_key=KEY) as server:
        yield server


def cheap(case) -> None:
    """A generated request that reaches a hosted model (tiny token budgets): past the model lookup, quick to run. A
    request meant not to fit the document is left as generated (refused before any work, or a failure to report)."""
    body = case.body
    if case.meta is not None and not case.meta.generation.mode.is_positive:
        return
    if isinstance(body, dict):
        if isinstance(body.get("model"), str) and body["model"]:
            body["model"] = "small"
        for key in ("max_tokens", "max_completion_tokens"):
            if type(body.get(key)) is int and body[key] > 4:
                body[key] = 4
        if type(body.get("n")) is int and body["n"] > 2:
            body["n"] = 2


@SCHEMA.parametrize()
@hypothesis.settings(max_examples=8, phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate], **BOUNDED)
def test_the_server_keeps_to_its_openapi_document(case, server):
    """Every schemathesis check on every route: the coverage phase's edge cases (every boundary of the document, a
    required field missing, a method no route takes) and 8 generated requests per route."""
    cheap(case)
    case.call_and_validate(base_url=server.url, timeout=30)


@KEYED_SCHEMA.parametrize()
@hypothesis.settings(max_examples=4, phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate], **BOUNDED)
def test_a_keyed_server_keeps_to_its_openapi_document(case, keyed_server):
    """The same on a server with an API key, whose document declares it: ignored_auth sends each request without the
    key and with a wrong one as well, and expects a 401."""
    cheap(case)
    case.call_and_validate(base_url=keyed_server.url, timeout=30)


def test_the_server_keeps_to_its_openapi_document_across_its_links(server):
    """schemathesis' stateful phase: sequences of calls that follow the document's links (a listed model looked up,
    tokenized ids detokenized), every check on every response; bounded (20 sequences of at most 4 calls)."""
    links = [name for ops in SCHEMA.raw_schema["paths"].values() for op in ops.values()
             for response in op["responses"].values() for name in response.get("links", {})]
    assert sorted(links) == ["detokenize", "listed"]

    class Linked(SCHEMA.as_state_machine()):
        def before_call(self, case):
            cheap(case)

        def get_call_kwargs(self, case):
            return {"base_url": server.url, "timeout": 30}

    Linked.run(settings=hypothesis.settings(max_examples=20, stateful_step_count=4, **BOUNDED))


def test_the_openapi_document_states_errors_streams_and_metrics_as_sent(server):
    for method, path, body in (("POST", "/v1/chat/completions", None),  # no body: 400
                               ("POST", "/v1/completions", {"model": "nope", "prompt": "hi", "max_tokens": 1}),
                               ("POST", "/v1/chat/completions", {"model": "small", "max_tokens": 1, "stream": True,
                                                                 "messages": [{"role": "user", "content": "hi"}]}),
                               ("GET", "/metrics", None), ("GET", "/v1/models/nope", None)):
        operation = SCHEMA[path.replace("/v1/models/nope", "/v1/models/{model_id}")][method]
        case = operation.Case(body=body) if body is not None else operation.Case()
        if path.startswith("/v1/models/"):
            case.path_parameters = {"model_id": "nope"}
        case.call_and_validate(base_url=server.url, timeout=30)
    document = SCHEMA.raw_schema
    assert all("422" not in op["responses"] for ops in document["paths"].values() for op in ops.values())
    not_allowed = httpx.request("TRACE", server.url + "/health")
    assert not_allowed.status_code == 405 and not_allowed.headers["allow"] == "GET"
    lax = {"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for field, value in (("n", "2"), ("n", True), ("temperature", "0.5"), ("frequency_penalty", False)):
        assert httpx.post(server.url + "/v1/chat/completions", json={**lax, field: value}).status_code == 400, field
    assert httpx.post(server.url + "/v1/chat/completions", json={**lax, "max_tokens": 1.0, "n": 1.0}).status_code == 200


def test_every_route_is_a_handler_of_its_own_in_one_flat_table():
    """`ROUTES` is what the app serves, and a handler answers when called alone with a request that carries the
    engine (no app machinery in between)."""
    import asyncio

    from starlette.requests import Request

    from kvhandoff.serving import app as app_module

    models, mappers = tiny_family()
    engine = Engine(models, mappers, ServeConfig(switch=SwitchSettings(guard=False)))
    try:
        served = create_app(engine)
        paths = [(next(iter(r.methods)), r.path) for r in served.router.routes if getattr(r, "endpoint", None)
                 in {route.handler for route in app_module.ROUTES}]
        assert paths == [(route.method, route.path) for route in app_module.ROUTES]
        request = Request({"type": "http", "app": served, "headers": [], "method": "GET", "path": "/v1/models"})
        listed = asyncio.run(app_module.models(request))
        assert [card["id"] for card in listed["data"]] == engine.model_names()
        health = asyncio.run(app_module.health(request))
        assert health.status_code == 200 and json.loads(health.body)["status"] == "ok"
    finally:
        engine.close()
