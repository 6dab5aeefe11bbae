"""The server holds under hostile input: requests that used to crash a route (500), drop the connection or freeze
the event loop are refused at the edge with a 400 in OpenAI's error shape naming the field, or (a tiny top_p)
served as the user means them. Against a real server of the tiny family on a loopback port."""

from __future__ import annotations

import logging
import threading
import time

import httpx
import pytest

from _serving_support import AGENT_CONTEXT, running, tiny_family
from kvhandoff.serving.parse import MAX_LOGGED_FIELDS, MAX_LOGGED_NAME_CHARS
from kvhandoff.serving.prompts import LENGTH_CHUNK_CHARS
from kvhandoff.serving.protocol import MAX_KEY_CHARS, MAX_STOP_CHARS, MAX_STOP_STRINGS
from kvhandoff.serving.tools import MAX_SCHEMA_CHARS, MAX_SCHEMA_DEPTH, MAX_TOOLS

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
