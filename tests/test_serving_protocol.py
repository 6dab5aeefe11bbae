"""Request validation and response shapes (no server)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvhandoff.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    HandoffInfo,
    dump,
)

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
    assert [m.template_role() for m in request.messages] == ["system", "user"]
    assert request.messages[1].text() == "ab" and request.answer_limit() == 5
    assert request.stop_strings() == ("x",) and request.include_usage() and request.temperature == 1.0


@pytest.mark.parametrize(("fields", "field"), [
    ({"n": 2}, "n"), ({"logprobs": True}, "logprobs"), ({"top_logprobs": 1}, "top_logprobs"),
    ({"tools": [{"type": "function"}]}, "tools"), ({"function_call": "auto"}, "function_call"),
    ({"logit_bias": {"1": 2}}, "logit_bias"), ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"response_format": {"type": "json_object"}}, "response_format"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"), ({"seed": "7"}, "seed"), ({"temperature": -1}, "temperature"),
    ({"stop": [""]}, "stop"), ({"messages": []}, "messages"), ({"modalities": ["audio"]}, "modalities"),
])
def test_chat_request_refuses_what_the_server_does_not_support(fields, field):
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest(**{"model": "m", "messages": MESSAGES, **fields})
    assert field_of(caught.value) == field


def test_completion_request():
    assert CompletionRequest(model="m", prompt=["one"]).prompt == "one"
    assert CompletionRequest(model="m", prompt=[1, 2]).prompt == [1, 2]
    assert CompletionRequest(model="m", prompt="x").answer_limit() == 16  # OpenAI's default
    for fields, field in (({"prompt": ["a", "b"]}, "prompt"), ({"prompt": [-1]}, "prompt"),
                          ({"prompt": "x", "best_of": 2}, "best_of"), ({"prompt": "x", "echo": True}, "echo")):
        with pytest.raises(ValidationError) as caught:
            CompletionRequest(model="m", **fields)
        assert field_of(caught.value) == field


def test_handoff_info_is_written_with_openai_style_names():
    info = HandoffInfo(status="applied", from_="small", to="large", mapped_tokens=3, read_tokens=2,
                       milliseconds=1.5)
    assert dump(info) == {"status": "applied", "from": "small", "to": "large", "mapped_tokens": 3, "read_tokens": 2,
                          "guard": None, "milliseconds": 1.5}
