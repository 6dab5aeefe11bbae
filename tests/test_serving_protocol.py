"""Request validation and response shapes (no server)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvhandoff.serving.protocol import (
    MAX_KEY_CHARS,
    MAX_STOP_CHARS,
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
    surrogate_path,
    unknown_fields,
)
from kvhandoff.serving.response_models import HandoffInfo, dump

pytestmark = pytest.mark.timeout(30)

MESSAGES = [{"role": "user", "content": "hi"}]


def field_of(error: ValidationError) -> str:
    return error.errors()[0]["loc"][0]


def test_chat_request_reads_openai_fields():
    request = ChatCompletionRequest(model="m", messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ], max_completion_tokens=5, stop="x", stream=True, stream_options={"include_usage": True}, user="u",
        tool_choice="none", unknown_field=1)
    assert [m.role for m in request.messages] == ["developer", "user"]
    assert request.messages[1].text() == "ab" and request.answer_limit() == 5
    assert request.stop_strings() == ("x",) and request.include_usage() and request.sampling_fields() == {}
    assert unknown_fields(request) == ["unknown_field"]


def test_nulls_stand_for_defaults_as_in_openai():
    request = ChatCompletionRequest(model="m", messages=MESSAGES, temperature=None, top_p=None, n=None, stream=None,
                                    max_tokens=None, stop=None, seed=None, logprobs=None, tools=None,
                                    tool_choice=None, response_format=None, stream_options=None)
    assert request.choices() == 1 and not request.streams() and request.sampling_fields() == {}
    assert request.logprob_alternatives() is None and request.answer_limit() is None
    assert CompletionRequest(model="m", prompt="x", max_tokens=None, echo=None).answer_limit() == 16


def test_tool_turns_and_their_template_shape():
    request = ChatCompletionRequest(model="m", messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ])
    assert request.messages[1].template_message() == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get", "arguments": '{"city": "Oslo"}'}}]}
    assert request.messages[2].template_message() == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


def test_sampling_fields_and_logprobs():
    request = ChatCompletionRequest(model="m", messages=MESSAGES, temperature=0, top_k=5, min_p=0.1,
                                    repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=-0.5,
                                    logit_bias={"7": -100}, stop_token_ids=[3], min_tokens=2, ignore_eos=True,
                                    seed=1, logprobs=True, top_logprobs=3, n=2.0)
    assert request.sampling_fields() == {
        "temperature": 0, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "min_tokens": 2, "ignore_eos": True, "seed": 1, "logit_bias": ((7, -100.0),),
        "stop_token_ids": (3,)}
    assert request.logprob_alternatives() == 3 and request.choices() == 2
    assert ChatCompletionRequest(model="m", messages=MESSAGES, logprobs=True).logprob_alternatives() == 0


@pytest.mark.parametrize(("fields", "field"), [
    ({"n": 0}, "n"), ({"n": 1.5}, "n"), ({"top_logprobs": 1}, "top_logprobs"), ({"function_call": "auto"},
                                                                                 "function_call"),
    ({"logit_bias": {"a": 2}}, "logit_bias"), ({"logit_bias": {"1": 200}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"), ({"seed": "7"}, "seed"), ({"temperature": -1}, "temperature"),
    ({"stop": [""]}, "stop"), ({"messages": []}, "messages"), ({"modalities": ["audio"]}, "modalities"),
    ({"audio": {"voice": "x"}}, "audio"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, "messages"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
])
def test_chat_request_refuses_what_the_server_cannot_do(fields, field):
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest(**{"model": "m", "messages": MESSAGES, **fields})
    assert field_of(caught.value) == field


@pytest.mark.parametrize(("fields", "field"), [
    ({"logit_bias": {"²": 1}}, "logit_bias"), ({"logit_bias": {"1" * 5000: 1}}, "logit_bias"),
    ({"logit_bias": {"٣": 1}}, "logit_bias"), ({"stop": "x" * (MAX_STOP_CHARS + 1)}, "stop"),
    ({"stop": ["a", "x" * (MAX_STOP_CHARS + 1)]}, "stop"), ({"prompt_cache_key": "日本"}, "prompt_cache_key"),
    ({"prompt_cache_key": "a\r\nb"}, "prompt_cache_key"), ({"prompt_cache_key": "a\x00"}, "prompt_cache_key"),
    ({"prompt_cache_key": "k" * (MAX_KEY_CHARS + 1)}, "prompt_cache_key"), ({"user": "a\nb"}, "user"),
    ({"user": "u" * (MAX_KEY_CHARS + 1)}, "user"), ({"cache_salt": "s" * (MAX_KEY_CHARS + 1)}, "cache_salt"),
])
def test_hostile_values_are_refused_by_field(fields, field):
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest(**{"model": "m", "messages": MESSAGES, **fields})
    assert field_of(caught.value) == field


def test_bounded_values_are_taken():
    request = ChatCompletionRequest(model="m", messages=MESSAGES, logit_bias={"007": 1.0}, stop=["x" * MAX_STOP_CHARS],
                                    prompt_cache_key="k" * MAX_KEY_CHARS, user="José", cache_salt="salt 1")
    assert request.sampling_fields()["logit_bias"] == ((7, 1.0),)


def test_a_lone_surrogate_is_found_at_any_depth():
    deep: list = ["\ud800"]
    for _ in range(5000):
        deep = [deep]
    assert surrogate_path({"a": deep}) == "a" + "[0]" * 5001
    assert surrogate_path({"a": [1, {"b": "ok", "\udc00": 2}]}) == "a[1]" and surrogate_path({"a": "ok"}) is None


def test_a_non_text_part_is_named_by_its_type():
    with pytest.raises(ValidationError, match="'image_url'"):
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}])


def test_completion_request():
    assert CompletionRequest(model="m", prompt=["one"]).prompt == "one"
    assert CompletionRequest(model="m", prompt=[1, 2]).prompt == [1, 2]
    assert CompletionRequest(model="m", prompt="x").answer_limit() == 16  # OpenAI's default
    scoring = CompletionRequest(model="m", prompt="x", echo=True, logprobs=1, max_tokens=0)
    assert scoring.answer_limit() == 0 and scoring.logprob_alternatives() == 1
    assert CompletionRequest(model="m", prompt="x", n=2, best_of=2).choices() == 2
    for fields, field in (({"prompt": ["a", "b"]}, "prompt"), ({"prompt": [-1]}, "prompt"),
                          ({"prompt": "x", "best_of": 2}, "best_of"), ({"prompt": "x", "suffix": "y"}, "suffix"),
                          ({"prompt": "x", "logprobs": 6}, "logprobs")):
        with pytest.raises(ValidationError) as caught:
            CompletionRequest(model="m", **fields)
        assert field_of(caught.value) == field


def test_tokenize_request_takes_a_prompt_or_messages():
    assert TokenizeRequest(model="m", prompt="x").messages is None
    with pytest.raises(ValidationError, match="either prompt or messages"):
        TokenizeRequest(model="m")


def test_handoff_info_is_written_with_openai_style_names():
    info = HandoffInfo(status="applied", from_="small", to="large", mapped_tokens=3, read_tokens=2,
                       milliseconds=1.5)
    assert dump(info) == {"status": "applied", "from": "small", "to": "large", "mapped_tokens": 3, "read_tokens": 2,
                          "approximate_tokens": 0, "guard": None, "milliseconds": 1.5, "reuse": "none"}
