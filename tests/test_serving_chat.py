"""Rendering conversations: the default template (plain ChatML; Qwen2.5's tool layout), message conversion, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvhandoff.errors import ConfigError
from kvhandoff.serving.chat import DEFAULT_CHAT_TEMPLATE, render, template_messages
from kvhandoff.serving.tools import Tool

from conftest import chat_tokenizer

# engine.CHATML_TEMPLATE as it was when chat.py was written: the serving tests' saved references were rendered with
# it, so the default template must render plain conversations exactly as it does
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

QWEN = Path("/root/.cache/kvhandoff/models/qwen2.5-coder-0.5b")
needs_qwen = pytest.mark.skipif(not (QWEN / "tokenizer.json").is_file(), reason="the Qwen2.5 tokenizer is not here")

QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, «now»",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time"}}

PLAIN = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Grüße, 你好\nsecond line"}],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": "a"}, {"role": "system", "content": "late"},
     {"role": "user", "content": "b"}],
]

ROUND_TRIP = [
    {"role": "system", "content": "Answer with the tools."},
    {"role": "user", "content": "Weather in Paris and Lyon?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Lyon"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 °C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
    {"role": "user", "content": "And now?"},
]

TOOLS_TURN = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city, «now»", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n'
    "</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n"
)


def text_of(tokenizer, messages, tools=None, template=DEFAULT_CHAT_TEMPLATE):
    return tokenizer.apply_chat_template(template_messages(messages), tools=tools, chat_template=template,
                                         add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize("messages", PLAIN)
def test_default_template_renders_plain_conversations_as_chatml(messages):
    tokenizer = chat_tokenizer()
    assert not getattr(tokenizer, "chat_template", None)
    chatml = text_of(tokenizer, messages, template=CHATML_TEMPLATE)
    assert text_of(tokenizer, messages) == chatml
    assert render(tokenizer, messages) == tokenizer(chatml, add_special_tokens=False)["input_ids"]
    assert chatml.startswith(f"<|im_start|>{messages[0]['role']}\n")  # no system line of the template's own


def test_default_template_text_of_a_plain_conversation():
    assert text_of(chat_tokenizer(), PLAIN[1]) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nGrüße, 你好\nsecond line<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_tools_are_listed_in_the_system_turn():
    tokenizer = chat_tokenizer()
    user = [{"role": "user", "content": "Weather?"}]
    ending = "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n"
    assert text_of(tokenizer, [{"role": "system", "content": "Be brief."}, *user], [WEATHER]) == (
        "<|im_start|>system\nBe brief.\n\n" + TOOLS_TURN + ending)
    # without a system message the tools turn stands alone (Qwen's own template adds its default system line)
    assert text_of(tokenizer, user, [WEATHER]) == "<|im_start|>system\n" + TOOLS_TURN + ending
    two = text_of(tokenizer, user, [WEATHER, CLOCK])
    assert '\n{"type": "function", "function": {"name": "get_time", "description": "The time"}}\n</tools>' in two
    # render takes the typed tools as well as their dicts
    typed = [Tool("get_weather", WEATHER["function"]["description"], WEATHER["function"]["parameters"])]
    assert render(tokenizer, user, typed) == render(tokenizer, user, [WEATHER])
    assert render(tokenizer, user, []) == render(tokenizer, user)


def test_tool_round_trip():
    assert text_of(chat_tokenizer(), ROUND_TRIP, [WEATHER]) == (
        "<|im_start|>system\nAnswer with the tools.\n\n" + TOOLS_TURN +
        "<|im_start|>user\nWeather in Paris and Lyon?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny, 21 °C\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
        "<|im_end|>\n<|im_start|>user\nAnd now?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_assistant_text_with_calls_and_a_lone_tool_result():
    messages = [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": "Let me look.",
         "tool_calls": [{"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "12:00"},
    ]
    assert text_of(chat_tokenizer(), messages, [CLOCK]).endswith(
        "<|im_start|>user\nTime?<|im_end|>\n"
        '<|im_start|>assistant\nLet me look.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n12:00\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


WITH_TOOLS = [
    (ROUND_TRIP, [WEATHER]),
    (ROUND_TRIP, [WEATHER, CLOCK]),
    ([{"role": "system", "content": "S"}, {"role": "user", "content": "u"}], [CLOCK]),
    ([{"role": "developer", "content": "Be exact."}, {"role": "user", "content": "Time?"},
      {"role": "assistant", "content": "Checking.",
       "tool_calls": [{"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
      {"role": "tool", "tool_call_id": "c", "name": "get_time", "content": "12:00"},
      {"role": "assistant", "content": "It is noon."}, {"role": "system", "content": "late system"},
      {"role": "user", "content": "Thanks"}], [CLOCK]),
]


@needs_qwen
@pytest.mark.parametrize(("messages", "tools"), WITH_TOOLS)
def test_default_template_renders_tools_as_qwen_does(messages, tools):
    from transformers import AutoTokenizer

    qwen = AutoTokenizer.from_pretrained(QWEN)
    assert qwen.chat_template
    real = text_of(qwen, messages, tools, template=None)
    assert text_of(qwen, messages, tools) == real
    assert render(qwen, messages, tools) == qwen(real, add_special_tokens=False)["input_ids"]


@needs_qwen
def test_where_the_default_template_differs_from_qwens():
    """Only without a system message: Qwen's template writes its default system line, the default template none."""
    from transformers import AutoTokenizer

    qwen = AutoTokenizer.from_pretrained(QWEN)
    without_system = ROUND_TRIP[1:]
    default = text_of(qwen, without_system, [WEATHER])
    assert default.startswith("<|im_start|>system\n# Tools")
    assert text_of(qwen, without_system, [WEATHER], template=None) == default.replace(
        "<|im_start|>system\n", f"<|im_start|>system\n{QWEN_SYSTEM}\n\n", 1)
    for messages in PLAIN:
        default = text_of(qwen, messages)
        real = text_of(qwen, messages, template=None)
        if messages[0]["role"] == "system":
            assert real == default
        else:
            assert real == f"<|im_start|>system\n{QWEN_SYSTEM}<|im_end|>\n" + default


@needs_qwen
def test_tool_call_tags_are_single_tokens_of_the_qwen_prompt():
    from transformers import AutoTokenizer

    qwen = AutoTokenizer.from_pretrained(QWEN)
    ids = render(qwen, ROUND_TRIP, [WEATHER])
    start, end = qwen.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    # two in the instruction (the tags named, an example block), then the two calls
    assert ids.count(start) == 4 and ids.count(end) == 4


def test_template_messages_conversions():
    messages = [
        {"role": "developer", "content": "Be exact."},
        {"role": "user", "content": "Go", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": [1, 2], "y": "é"}'}},
            {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{not json"}},
            {"id": "c", "type": "function", "function": {"name": "h", "arguments": "[1, 2]"}}]},
        {"role": "tool", "tool_call_id": "a", "name": "f", "content": "ok"},
        {"role": "tool", "tool_call_id": "b", "content": None},
        {"role": "assistant", "content": "done", "tool_calls": []},
    ]
    original = json.loads(json.dumps(messages))
    converted = template_messages(messages)
    assert messages == original  # the request's messages are not changed
    assert converted == [
        {"role": "system", "content": "Be exact."},
        {"role": "user", "content": "Go"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": {"x": [1, 2], "y": "é"}}},
            {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{not json"}},
            {"id": "c", "type": "function", "function": {"name": "h", "arguments": "[1, 2]"}}]},
        {"role": "tool", "content": "ok", "tool_call_id": "a", "name": "f"},
        {"role": "tool", "content": "", "tool_call_id": "b"},
        {"role": "assistant", "content": "done"},
    ]
    assert template_messages(converted) == converted


def test_an_invalid_arguments_string_renders_as_a_string():
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{not json"}}]}]
    assert '{"name": "g", "arguments": "{not json"}' in text_of(chat_tokenizer(), messages)


def test_render_refuses_what_the_template_cannot_render():
    tokenizer = chat_tokenizer()
    with pytest.raises(ConfigError, match="the chat template cannot render these messages"):
        render(tokenizer, [{"role": "user", "content": ["a", "list"]}])
    with pytest.raises(ConfigError, match="the chat template cannot render these messages"):
        render(tokenizer, [])
    strict = chat_tokenizer()
    strict.chat_template = (
        "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}{{ message['content'] }}{% endfor %}"
    )
    assert render(strict, [{"role": "user", "content": "ab"}]) == tokenizer("ab", add_special_tokens=False)["input_ids"]
    with pytest.raises(ConfigError, match="roles must alternate"):
        render(strict, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
