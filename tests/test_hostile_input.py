"""The server holds under hostile input: requests that used to crash a route (500), drop the connection or freeze
the event loop are refused at the edge with a 400 in OpenAI's error shape naming the field, or (a tiny top_p)
served as the user means them; a client that goes away or sends its body slowly holds nothing; tenants learn
nothing of each other's openings. Against a real server of the tiny family on a loopback port."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest
import torch

from _serving_support import AGENT_CONTEXT, GatedModel, running, tiny_family, wait_for
from kvhandoff.runtime.seam import new_cache
from kvhandoff.serving.answers import ECHO_CHUNK, echo
from kvhandoff.serving.parse import MAX_LOGGED_FIELDS, MAX_LOGGED_NAME_CHARS
from kvhandoff.serving.prompts import LENGTH_CHUNK_CHARS
from kvhandoff.serving.protocol import MAX_KEY_CHARS, MAX_STOP_CHARS, MAX_STOP_STRINGS
from kvhandoff.serving.requests import MAX_LOGPROB_ENTRIES, GenerationRequest, token_entry
from kvhandoff.serving.tools import MAX_SCHEMA_CHARS, MAX_SCHEMA_DEPTH, MAX_TOOLS
from kvhandoff.serving.worker import HostedModel

pytestmark = pytest.mark.timeout(120)

CHAT = "/v1/chat/completions"
BASE = {"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
#: a schema whose required property recurses without end: it compiles, but no answer can begin
ENDLESS = {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}},
           "$ref": "#/$defs/n"}


@pytest.fixture(scope="module")
def server():
    with running(*tiny_family(AGENT_CONTEXT)) as server:  # a context that holds tool schemas in the prompt
        yield server


def post(server, body: dict, path: str = CHAT, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60, **kwargs)


def refused(response: httpx.Response, param: str, *words: str) -> dict:
    """The error of a 400 naming ``param``, in OpenAI's shape, its message holding each of ``words``."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    for word in words:
        assert word in error["message"], error["message"]
    return error


def nested(levels: int) -> dict:
    """An object schema ``levels`` properties deep (two JSON levels each)."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def tool(name: str, parameters: dict | None = None) -> dict:
    function = {"name": name} if parameters is None else {"name": name, "parameters": parameters}
    return {"type": "function", "function": function}


def test_a_tiny_top_p_is_greedy_instead_of_a_500(server):
    greedy = post(server, {**BASE, "temperature": 0, "max_tokens": 6})
    assert greedy.status_code == 200, greedy.text
    for top_p in (1e-300, 5e-324, 1e-40):  # 0 (or subnormal) in float32
        tiny = post(server, {**BASE, "temperature": 1.0, "top_p": top_p, "max_tokens": 6, "seed": 3})
        assert tiny.status_code == 200, tiny.text
        assert tiny.json()["choices"][0]["message"]["content"] == greedy.json()["choices"][0]["message"]["content"]
    refused(post(server, {**BASE, "top_p": 0}), "top_p")


@pytest.mark.parametrize("key", ["²", "1" * 5000, "-1", " 7", "٣", "1e3", ""])
def test_logit_bias_keys_are_ascii_token_ids(server, key):
    refused(post(server, {**BASE, "logit_bias": {key: 5}}), "logit_bias", "ASCII digits")


def test_logit_bias_keys_within_the_vocabulary_are_served(server):
    assert post(server, {**BASE, "logit_bias": {"299": 5, "007": -5}}).status_code == 200
    refused(post(server, {**BASE, "logit_bias": {"300": 5}}), "logit_bias", "vocabulary")


def test_a_deeply_nested_schema_is_refused_naming_the_limit(server):
    too_deep = nested(MAX_SCHEMA_DEPTH // 2)  # two levels a property, and one for the leaf: past the limit
    refused(post(server, {**BASE, "tools": [tool("f", too_deep)]}), "tools[0].function.parameters",
            str(MAX_SCHEMA_DEPTH))
    refused(post(server, {**BASE, "tools": [tool("f", nested(100))]}), "tools[0].function.parameters")
    refused(post(server, {**BASE, "response_format": json_schema(nested(100))}), "response_format",
            str(MAX_SCHEMA_DEPTH))
    deep_enough = nested(MAX_SCHEMA_DEPTH // 2 - 1)
    assert post(server, {**BASE, "tools": [tool("f", deep_enough)]}).status_code == 200
    assert post(server, {**BASE, "response_format": json_schema(deep_enough)}).status_code == 200


def test_a_schema_no_answer_can_begin_is_a_400(server):
    pattern = {"type": "string", "pattern": "^a{1000000}$"}
    for schema in (ENDLESS, pattern):
        refused(post(server, {**BASE, "response_format": json_schema(schema)}), "response_format",
                "cannot begin an answer")
    forced = {**BASE, "tools": [tool("f", ENDLESS)], "tool_choice": "required"}
    refused(post(server, forced), "tool_choice", "cannot begin an answer")
    assert post(server, {**BASE, "response_format": json_schema({"type": "object"})}).status_code == 200


@pytest.mark.parametrize(("field", "value"), [
    ("prompt_cache_key", "日本"), ("prompt_cache_key", "a\r\nb"), ("prompt_cache_key", "a\x00b"),
    ("prompt_cache_key", "k" * (MAX_KEY_CHARS + 1)), ("user", "a\nb"), ("user", "u" * (MAX_KEY_CHARS + 1)),
    ("cache_salt", "s\x00"), ("cache_salt", "s" * (MAX_KEY_CHARS + 1)),
])
def test_keys_that_cannot_be_echoed_or_kept_are_refused(server, field, value):
    refused(post(server, {**BASE, field: value}), field)


def test_session_keys_are_echoed_safely(server):
    key = "conversation-7:" + "k" * (MAX_KEY_CHARS - 15)
    answered = post(server, {**BASE, "prompt_cache_key": key, "user": "José"})
    assert answered.status_code == 200 and answered.headers["x-session-id"] == key
    refused(post(server, BASE, headers={"X-Session-ID": "h" * (MAX_KEY_CHARS + 1)}), "X-Session-ID")
    refused(post(server, BASE, headers={"x-litellm-session-id": b"caf\xe9"}), "x-litellm-session-id", "ASCII")


def test_a_tool_flood_is_refused_at_once_and_the_server_stays_responsive(server):
    flood = {**BASE, "tools": [tool(f"t{i}") for i in range(40_000)]}  # about 1.9 MB
    answer: dict = {}

    def send():
        answer["response"] = post(server, flood)

    sender = threading.Thread(target=send)
    started = time.perf_counter()
    sender.start()
    waits = []
    while True:  # /health while the flood is in flight (at least once)
        asked = time.perf_counter()
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        waits.append(time.perf_counter() - asked)
        if not sender.is_alive():
            break
    sender.join()
    assert max(waits) < 3.0, waits  # well under a second alone; the suite shares two cores with other workers
    refused(answer["response"], "tools", str(MAX_TOOLS))
    assert time.perf_counter() - started < 10
    refused(post(server, {**BASE, "tools": [tool(f"t{i}") for i in range(MAX_TOOLS + 1)]}), "tools", str(MAX_TOOLS))
    refused(post(server, {**BASE, "tools": [tool("a"), tool("b"), tool("a")]}), "tools[2].function.name",
            "given twice", "tools[0]")
    big = {"type": "object", "description": "x" * MAX_SCHEMA_CHARS}
    refused(post(server, {**BASE, "tools": [tool("f", big)]}), "tools[0].function.parameters", str(MAX_SCHEMA_CHARS))


def test_stop_strings_are_bounded_in_count_and_length(server):
    refused(post(server, {**BASE, "stop": ["a"] * (MAX_STOP_STRINGS + 1)}), "stop", str(MAX_STOP_STRINGS))
    refused(post(server, {**BASE, "stop": "z" * (MAX_STOP_CHARS + 1)}), "stop", str(MAX_STOP_CHARS))
    refused(post(server, {**BASE, "stop": ["a", "z" * (MAX_STOP_CHARS + 1)]}), "stop", str(MAX_STOP_CHARS))
    longest = [c * MAX_STOP_CHARS for c in "wxyz"][:MAX_STOP_STRINGS]
    assert post(server, {**BASE, "stop": longest, "max_tokens": 8}).status_code == 200


def test_tokenize_refuses_a_text_past_any_context_without_counting_it_whole(server):
    text = "ab " * LENGTH_CHUNK_CHARS  # several chunks, far past the window
    error = refused(post(server, {"model": "small", "prompt": text}, "/tokenize"), "prompt", "maximum context length")
    assert error["code"] == "context_length_exceeded"
    refused(post(server, {"model": "small", "messages": [{"role": "user", "content": text}]}, "/tokenize"),
            "messages", "maximum context length")
    refused(post(server, {"model": "small", "prompt": "hi", "tools": [tool(f"t{i}") for i in range(MAX_TOOLS + 1)]},
                 "/tokenize"), "tools", str(MAX_TOOLS))
    counted = post(server, {"model": "small", "prompt": "hello"}, "/tokenize")
    assert counted.status_code == 200 and counted.json()["count"] == len(counted.json()["tokens"])


def test_unknown_field_names_are_logged_boundedly(caplog):
    with running() as server, caplog.at_level(logging.WARNING, logger="kvhandoff.serving.parse"):
        for batch in range(3):
            body = {**BASE, **{f"field_{batch}_{i}_" + "x" * 200: 1 for i in range(MAX_LOGGED_FIELDS)}}
            assert post(server, body).status_code == 200
    lines = [record.getMessage() for record in caplog.records if record.name == "kvhandoff.serving.parse"]
    named = [line for line in lines if "requests carry the field" in line]
    assert len(named) == MAX_LOGGED_FIELDS
    assert all(len(line.split("'")[1]) == MAX_LOGGED_NAME_CHARS for line in named)
    assert sum("not logged any more" in line for line in lines) == 1


# -- nothing heavy on the event loop ------------------------------------------------------------------------------
def health_waits(server, busy: threading.Thread) -> list[float]:
    """How long each /health took while ``busy`` ran (asked at least once)."""
    waits = []
    while True:
        asked = time.perf_counter()
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        waits.append(time.perf_counter() - asked)
        if not busy.is_alive():
            return waits
        time.sleep(0.02)


def test_a_response_past_the_logprob_bound_is_refused_before_any_work(server):
    before = [server.engine.hosted(name).worker.steps for name in ("small", "large")]
    started = time.perf_counter()
    huge = post(server, {**BASE, "n": 16, "logprobs": True, "top_logprobs": 20, "max_tokens": 4000})
    error = refused(huge, "top_logprobs", "n × max_tokens × (1 + top_logprobs)", f"{MAX_LOGPROB_ENTRIES:,}")
    assert error["code"] == "response_too_large" and time.perf_counter() - started < 3
    prompt = list(range(3, 253)) * 12  # 3,000 ids: echoed into each of 16 choices with 1 + 5 entries a position
    echoed = post(server, {"model": "small", "prompt": prompt, "echo": True, "logprobs": 5, "n": 16, "max_tokens": 1},
                  "/v1/completions")
    refused(echoed, "logprobs", "echoed prompt", "lower n, max_tokens or logprobs")
    assert [server.engine.hosted(name).worker.steps for name in ("small", "large")] == before  # nothing ran
    assert post(server, {**BASE, "n": 16, "logprobs": True, "top_logprobs": 20}).status_code == 200  # 16 × 2 × 21


def test_a_large_answer_is_written_while_health_answers(server):
    body = {**BASE, "n": 4, "logprobs": True, "top_logprobs": 20, "max_tokens": 300, "ignore_eos": True, "seed": 1}
    answer: dict = {}
    sender = threading.Thread(target=lambda: answer.update(response=post(server, body)))
    sender.start()
    waits = health_waits(server, sender)
    sender.join()
    assert answer["response"].status_code == 200, answer["response"].text
    choices = answer["response"].json()["choices"]
    assert len(choices) == 4 and all(len(c["logprobs"]["content"]) == 300 for c in choices)
    assert all(len(entry["top_logprobs"]) == 20 for entry in choices[0]["logprobs"]["content"])
    assert max(waits) < 3.0, waits  # well under a second alone; the suite shares two cores with other workers


# -- clients that go away, clients that dawdle ------------------------------------------------------------------------
def raw_request(url: str, head: bytes, body: bytes = b"") -> socket.socket:
    """A connection to ``url``'s server that has sent ``head`` (the request line and headers) and ``body``."""
    where = urlsplit(url)
    connection = socket.create_connection((where.hostname, where.port), timeout=30)
    connection.sendall(head + b"\r\n\r\n" + body)
    return connection


def post_head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: kvhandoff\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}").encode()


def metric_lines(server, key=None) -> list[str]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(server.url + "/metrics", headers=headers, timeout=10).text.splitlines()


@pytest.mark.parametrize("key", [None, "sesame"])  # with a key, the connection is watched through its check
def test_a_client_that_goes_away_cancels_its_non_streaming_generation(key):
    models, _ = tiny_family()
    model, tokenizer = models["small"]
    gated = GatedModel(model, free=3)  # the prefill and two decoding steps, then the worker waits
    with running({"m": (gated, tokenizer)}, {}, api_key=key) as server:
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
                           "temperature": 0, "ignore_eos": True}).encode()
        head = post_head("/v1/chat/completions", len(body)) + (f"\r\nAuthorization: Bearer {key}".encode() if key
                                                               else b"")
        connection = raw_request(server.url, head, body)
        wait_for(gated.waiting.is_set, "the generation to be decoding")
        connection.close()  # the client goes away before its answer
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        health = lambda: httpx.get(server.url + "/health", headers=headers, timeout=10).json()  # noqa: E731
        wait_for(lambda: health()["cancelling"] == 1, "the server to see the client go")
        gated.gate.set()
        wait_for(lambda: health()["running"] == 0, "the generation to stop")
        assert gated.calls < 10  # it stopped at its next token, not after 200
        lines = metric_lines(server, key)
        assert "kvhandoff_cancelled_total 1.0" in lines
        assert 'kvhandoff_requests_total{endpoint="/v1/chat/completions",outcome="499"} 1.0' in lines


def test_a_body_that_arrives_too_slowly_is_answered_408_and_the_connection_closed():
    with running(read_timeout_s=0.5) as server:
        started = time.perf_counter()
        connection = raw_request(server.url, post_head("/v1/chat/completions", 100), b'{"model": "small"')
        assert httpx.get(server.url + "/health", timeout=3).status_code == 200  # the server answers meanwhile
        answer = b""
        while chunk := connection.recv(65536):  # until the server closes the connection
            answer += chunk
        connection.close()
        assert time.perf_counter() - started < 10
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower()
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "request_timeout"
        assert "--read-timeout" in error["message"]
        assert post(server, BASE).status_code == 200  # a client that sends its body in time is served


# -- memory: an echo's log-probs are read in chunks -----------------------------------------------------------------
def one_pass_entries(model, tokenizer, ids: list[int], alternatives: int) -> list:
    """The echo's entries as one forward over the whole prompt computes them (every position's logits held)."""
    with torch.inference_mode():
        logprobs = new_cache(model).read(model, torch.tensor([ids]), 0)[0].float().log_softmax(-1)
    return [token_entry(tokenizer, None, ids[0], 0)] + [
        token_entry(tokenizer, logprobs[i - 1], ids[i], alternatives) for i in range(1, len(ids))]


def test_an_echo_reads_its_prompt_in_chunks_and_reports_the_one_pass_entries(server):
    model, tokenizer = tiny_family(AGENT_CONTEXT)[0]["small"]
    ids = [(7 * i) % 250 + 3 for i in range(2 * ECHO_CHUNK + 90)]  # three chunks
    expected = one_pass_entries(model, tokenizer, ids, 3)
    hosted = HostedModel("small", model, tokenizer, frozenset(), 300, None)
    request = GenerationRequest(model="small", prompt=tuple(ids), logprobs=3, echo=True)
    with torch.inference_mode():
        reading = echo(hosted, request, ids, chunk=37)
        chunks = 0
        try:
            while True:
                next(reading)
                chunks += 1
        except StopIteration as done:
            _, entries = done.value
    assert chunks == -(-(len(ids) - 1) // 37)  # one forward per chunk of the positions that need logits
    assert [(e.token, e.bytes, [t for t, _, _ in e.top]) for e in entries] == \
        [(e.token, e.bytes, [t for t, _, _ in e.top]) for e in expected]
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in expected], abs=1e-5, nan_ok=True)
    answered = post(server, {"model": "small", "prompt": ids, "echo": True, "logprobs": 3, "max_tokens": 0},
                    "/v1/completions")
    assert answered.status_code == 200, answered.text
    logprobs = answered.json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [e.token for e in expected]
    assert logprobs["token_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:] == pytest.approx([e.logprob for e in expected[1:]], abs=1e-5)
    assert [set(top) for top in logprobs["top_logprobs"][1:]] == [{t for t, _, _ in e.top} for e in expected[1:]]


# -- tenants: the openings store is per tenant, the probes need a key ----------------------------------------------
def switch(server, key: str, session: str) -> None:
    """One conversation of tenant ``key``: a turn on small, the next on large (a switch: the opening is looked up)."""
    headers = {"Authorization": f"Bearer {key}", "X-Session-ID": session}
    messages = [{"role": "user", "content": "Tell me about the tides."}]
    first = post(server, {"model": "small", "messages": messages, "max_tokens": 3, "temperature": 0}, headers=headers)
    assert first.status_code == 200, first.text
    messages += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And the moon?"}]
    second = post(server, {"model": "large", "messages": messages, "max_tokens": 3, "temperature": 0},
                  headers=headers)
    assert second.status_code == 200 and second.headers["x-kv-handoff"] == "applied", second.text


def test_a_tenant_never_finds_another_tenants_opening_and_the_probes_need_a_key():
    with running(api_key=("key-a", "key-b"), exact_prefix=4) as server:
        keyed = {"Authorization": "Bearer key-a"}
        store = lambda: httpx.get(server.url + "/health", headers=keyed, timeout=10).json()["prefix_store"]  # noqa: E731
        switch(server, "key-a", "one")
        assert store()["hits"] == 0 and store()["openings"] == 1
        switch(server, "key-b", "two")  # the same opening under another key: not found, kept apart
        assert store()["hits"] == 0 and store()["misses"] == 2 and store()["openings"] == 2
        switch(server, "key-a", "three")  # the first tenant's own opening serves it
        assert store()["hits"] == 1 and store()["openings"] == 2
        health = httpx.get(server.url + "/health", headers=keyed, timeout=10).json()
        assert health["cache_bytes"] >= health["prefix_store"]["bytes"] > 0  # under --cache-memory
        for probe in ("/health", "/metrics"):
            answer = httpx.get(server.url + probe, timeout=10)
            assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
        assert "kvhandoff_cache_bytes" in "\n".join(metric_lines(server, "key-b"))
    with running(api_key="key-a", open_probes=True) as server:
        stranger = httpx.get(server.url + "/health", timeout=10)
        assert stranger.status_code == 200
        assert set(stranger.json()) == {"status", "models", "running", "cancelling"}  # liveness, no cache figures
        tenant = httpx.get(server.url + "/health", headers={"Authorization": "Bearer key-a"}, timeout=10).json()
        assert {"prefix_store", "prefix_cache", "cache_bytes", "sessions"} <= set(tenant)
        assert httpx.get(server.url + "/metrics", timeout=10).status_code == 200


# -- the contract ---------------------------------------------------------------------------------------------------
def test_head_health_answers_and_unreadable_bodies_are_invalid_json(server):
    head = httpx.head(server.url + "/health", timeout=10)
    assert head.status_code == 200 and head.content == b""
    for body, why in ((b'{"model": "small", "messages": [{"role": "user", "content": "caf\xe9"}]}', "UTF-8"),
                      (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
                      (b'{"a": ' * 20_000 + b"1" + b"}" * 20_000, "nested too deeply")):
        answer = httpx.post(server.url + CHAT, content=body, headers={"Content-Type": "application/json"}, timeout=30)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["code"] == "invalid_json" and error["param"] is None and why in error["message"], error


def test_the_openapi_document_states_integer_bounds_as_json_schema_does(server):
    document = httpx.get(server.url + "/openapi.json", timeout=10).json()
    schemas = document["components"]["schemas"]

    def integer(schema: dict) -> dict:
        return next(option for option in schema.get("anyOf", [schema]) if option.get("type") == "integer")

    chat, completion = schemas["ChatCompletionRequest"]["properties"], schemas["CompletionRequest"]["properties"]
    assert integer(chat["n"]) == {"type": "integer", "minimum": 1, "maximum": 16}
    assert integer(chat["max_tokens"]) == {"type": "integer", "exclusiveMinimum": 0}
    assert integer(chat["top_logprobs"]) == {"type": "integer", "minimum": 0, "maximum": 20}
    assert integer(completion["logprobs"]) == {"type": "integer", "minimum": 0, "maximum": 5}
    assert integer(completion["max_tokens"]) == {"type": "integer", "minimum": 0}
    assert schemas["DetokenizeRequest"]["properties"]["tokens"]["items"] == {"type": "integer", "minimum": 0}
    text = json.dumps(document)
    assert not any(f'"{name}":' in text for name in ("ge", "le", "gt", "lt"))  # pydantic's names, not JSON Schema's
