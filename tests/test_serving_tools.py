"""Function calling: tools and tool_choice checked, tool calls parsed from answers, whole and streamed."""

from __future__ import annotations

import itertools
import json
import random
import re
from pathlib import Path

import pytest

from kvhandoff.errors import ConfigError
from kvhandoff.serving.tools import (
    MAX_SCHEMA_CHARS,
    MAX_SCHEMA_DEPTH,
    MAX_TOOLS,
    TOOL_PARSERS,
    ContentDelta,
    HermesToolParser,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    check_schema_bounds,
    parse_tools,
    tool_parser,
    validate_arguments,
)

QWEN = Path("/root/.cache/kvhandoff/models/qwen2.5-coder-0.5b")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}


def fn(**function):
    return {"type": "function", "function": function}


# -- tools and tool_choice ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("tools", "choice", "parallel", "field"), [
    ("get_weather", None, None, "tools"),
    ({"a": 1}, None, None, "tools"),
    ([WEATHER, "get_time"], None, None, "tools[1]"),
    ([{"type": "code_interpreter"}], None, None, "tools[0].type"),
    ([{"function": {"name": "f"}}], None, None, "tools[0].type"),
    ([WEATHER, {"type": "function"}], None, None, "tools[1].function"),
    ([WEATHER, fn(description="no name")], None, None, "tools[1].function.name"),
    ([WEATHER, fn(name="get weather")], None, None, "tools[1].function.name"),
    ([fn(name="a" * 65)], None, None, "tools[0].function.name"),
    ([fn(name="f\n")], None, None, "tools[0].function.name"),
    ([fn(name="")], None, None, "tools[0].function.name"),
    ([WEATHER, CLOCK, WEATHER], None, None, "tools[2].function.name"),
    ([fn(name="f", description=3)], None, None, "tools[0].function.description"),
    ([fn(name="f", parameters="object")], None, None, "tools[0].function.parameters"),
    ([fn(name="f", parameters={"type": "objekt"})], None, None, "tools[0].function.parameters.type"),
    ([fn(name="f", parameters={"type": "object", "properties": {"a": {"type": 5}}})], None, None,
     "tools[0].function.parameters.properties.a.type"),
    ([WEATHER], "sometimes", None, "tool_choice"),
    ([WEATHER], 3, None, "tool_choice"),
    (None, "required", None, "tool_choice"),
    ([], "required", None, "tool_choice"),
    (None, fn(name="get_weather"), None, "tool_choice.function.name"),
    ([CLOCK], fn(name="get_weather"), None, "tool_choice.function.name"),
    ([CLOCK], {"type": "function"}, None, "tool_choice.function.name"),
    ([CLOCK], {"type": "function", "function": "get_time"}, None, "tool_choice.function.name"),
    ([CLOCK], {"type": "tool", "function": {"name": "get_time"}}, None, "tool_choice.type"),
    ([CLOCK], None, "yes", "parallel_tool_calls"),
    ([CLOCK], None, 1, "parallel_tool_calls"),
])
def test_parse_tools_refusals_name_the_field(tools, choice, parallel, field):
    with pytest.raises(ConfigError) as caught:
        parse_tools(tools, choice, parallel)
    assert str(caught.value).startswith(field + ": "), str(caught.value)


def nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_tools_and_their_schemas_are_bounded():
    parse_tools([fn(name=f"t{i}") for i in range(MAX_TOOLS)])
    with pytest.raises(ConfigError, match=rf"^tools: {MAX_TOOLS + 1} tools given, past the limit of {MAX_TOOLS}"):
        parse_tools([fn(name=f"t{i}") for i in range(MAX_TOOLS + 1)])
    with pytest.raises(ConfigError, match=r"tools\[2\]\.function\.name: 'a' is given twice \(also as tools\[0\]\)"):
        parse_tools([fn(name="a"), fn(name="b"), fn(name="a")])
    parse_tools([fn(name="f", parameters=nested(MAX_SCHEMA_DEPTH // 2 - 1))])  # 63 levels
    for parameters, limit in ((nested(MAX_SCHEMA_DEPTH // 2), MAX_SCHEMA_DEPTH), (nested(5000), MAX_SCHEMA_DEPTH),
                              ({"description": "x" * MAX_SCHEMA_CHARS}, MAX_SCHEMA_CHARS)):
        with pytest.raises(ConfigError, match=rf"^tools\[0\]\.function\.parameters: .*{limit}"):
            parse_tools([fn(name="f", parameters=parameters)])
    deep_list: list = []
    for _ in range(10_000):  # measured without recursion
        deep_list = [deep_list]
    with pytest.raises(ConfigError, match=r"^where: .*levels"):
        check_schema_bounds({"enum": deep_list}, "where")


def test_parse_tools_defaults_and_forms():
    none = parse_tools()
    assert (none.tools, none.choice, none.parallel_tool_calls) == ((), ToolChoice("none"), True)
    assert not none.parses_calls and none.template_tools() is None
    assert parse_tools([], None, None).choice == ToolChoice("none")

    settings = parse_tools([WEATHER, CLOCK], None, False)
    assert settings.choice == ToolChoice("auto") and settings.parses_calls and settings.parallel_tool_calls is False
    assert settings.tools == (Tool("get_weather", "The weather in a city", WEATHER["function"]["parameters"]),
                              Tool("get_time"))
    assert settings.template_tools() == [WEATHER, CLOCK]

    assert parse_tools([CLOCK], "none").choice == ToolChoice("none")
    assert not parse_tools([CLOCK], "none").parses_calls
    assert parse_tools([CLOCK], "auto").choice.mode == "auto"
    assert parse_tools([CLOCK], "required").choice == ToolChoice("required")
    named = parse_tools([WEATHER, CLOCK], fn(name="get_time")).choice
    assert (named.mode, named.name) == ("named", "get_time")
    assert parse_tools(None, "none").choice.mode == "none"
    assert parse_tools(None, "auto").choice.mode == "auto"  # nothing to call: the server answers with text
    # extra fields OpenAI knows (strict) are accepted
    assert parse_tools([fn(name="f", strict=True, parameters={"type": "object"})]).tools[0].parameters == {
        "type": "object"}


def test_tool_choice_refuses_unknown_modes():
    with pytest.raises(ConfigError, match="tool_choice"):
        ToolChoice("sometimes")
    with pytest.raises(ConfigError, match="tool_choice"):
        ToolChoice("named")
    with pytest.raises(ConfigError, match="tool_choice"):
        ToolChoice("auto", "f")


# -- parsers ------------------------------------------------------------------------------------------------------


def block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def test_parser_registry():
    assert next(iter(TOOL_PARSERS)) == "hermes"
    assert TOOL_PARSERS["qwen25"] is TOOL_PARSERS["hermes"] is HermesToolParser
    assert isinstance(tool_parser("qwen25"), HermesToolParser)
    with pytest.raises(ConfigError, match=r"'mistral'.*hermes, qwen25"):
        tool_parser("mistral")


def test_parse_without_blocks():
    parser = tool_parser("hermes")
    assert parser.parse("  Hello there.\n") == parser.parse("Hello there.")
    answer = parser.parse("  Hello there.\n")
    assert (answer.content, answer.tool_calls) == ("Hello there.", [])
    assert parser.parse("").content is None and parser.parse(" \n\t").content is None
    assert parser.parse("a <tool_call without a tag").content == "a <tool_call without a tag"
    assert parser.parse("stray </tool_call> close").content == "stray </tool_call> close"


def test_parse_one_block():
    answer = tool_parser("hermes").parse(block('{"name": "get_weather", "arguments": {"city": "Paris"}}'))
    assert answer.content is None
    [call] = answer.tool_calls
    assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Paris"}')


def test_parse_keeps_the_arguments_as_written():
    parser = tool_parser("hermes")
    written = '{ "city" :"Paris",\n  "days": 1.50, "note": "\\u00e9 \\"q\\"" }'
    [call] = parser.parse(block('{"arguments": ' + written + ' , "name":"get_weather"}')).tool_calls
    assert call.arguments == written
    assert json.loads(call.arguments) == {"city": "Paris", "days": 1.5, "note": 'é "q"'}
    # arguments given as a JSON string stay that string's JSON text (validate_arguments will say why it is wrong)
    [call] = parser.parse(block('{"name": "f", "arguments": "{\\"a\\": 1}"}')).tool_calls
    assert call.arguments == '"{\\"a\\": 1}"'
    # a call without arguments has none
    [call] = parser.parse(block('{"name": "get_time"}')).tool_calls
    assert (call.name, call.arguments) == ("get_time", "{}")
    # a repeated key counts once, the last, as JSON parsers read it
    [call] = parser.parse(block('{"name": "a", "arguments": {}, "name": "b", "arguments": {"x": 1}}')).tool_calls
    assert (call.name, call.arguments) == ("b", '{"x": 1}')


def test_parse_two_blocks_and_content_around_them():
    text = ("I'll look both up.\n" + block('{"name": "get_weather", "arguments": {"city": "Paris"}}') + "\n"
            + block('{"name": "get_weather", "arguments": {"city": "Lyon", "days": 2}}') + "\nDone. ")
    answer = tool_parser("hermes").parse(text)
    assert answer.content == "I'll look both up.\n\n\nDone."
    assert [(c.name, c.arguments) for c in answer.tool_calls] == [
        ("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Lyon", "days": 2}')]
    assert answer.tool_calls[0].id != answer.tool_calls[1].id


@pytest.mark.parametrize("body", [
    '{"name": "get_weather", "arguments": {"city": "Paris"}',  # unbalanced
    '{"name": "get_weather", "arguments": {"city": "Paris"},}',  # trailing comma
    '{"name": "get_weather", "arguments": {"city": Paris}}',
    '{"name": "get_weather", "arguments": {"x": NaN}}',  # not JSON, though Python reads it
    '{"name": "get_weather", "arguments": {}} and more',
    '{"name": 5, "arguments": {}}',
    '{"arguments": {}}',
    '["get_weather", {}]',
    '"get_weather"',
    "",
])
def test_broken_blocks_stay_in_the_content_as_written(body):
    good = block('{"name": "get_time", "arguments": {}}')
    answer = tool_parser("hermes").parse("Before " + block(body) + good + " after")
    assert answer.content == "Before " + block(body) + " after"
    assert [(c.name, c.arguments) for c in answer.tool_calls] == [("get_time", "{}")]


def test_an_unclosed_block_is_content():
    text = "Let me see. " + block('{"name": "get_time", "arguments": {}}') + "<tool_call>\n" + '{"name": "get_time"'
    answer = tool_parser("hermes").parse(text)
    assert answer.content == 'Let me see. <tool_call>\n{"name": "get_time"'
    assert len(answer.tool_calls) == 1


def test_validate_arguments():
    tools = parse_tools([WEATHER, CLOCK]).tools

    def check(name, arguments):
        return validate_arguments(ToolCall("call_x", name, arguments), tools)

    assert check("get_weather", '{"city": "Paris"}') is None
    assert check("get_weather", '{"city": "Paris", "days": 3}') is None
    assert check("get_time", '{"anything": true}') is None  # no parameters schema given
    assert "unknown function 'get_wether'" in check("get_wether", "{}")
    assert check("get_weather", '{"days": 3}') == "get_weather: arguments: 'city' is a required property"
    assert check("get_weather", '{"city": "Paris", "days": "three"}') == (
        "get_weather: arguments.days: 'three' is not of type 'integer'")
    assert "'x'" in check("get_weather", '{"city": "Paris", "x": 1}')  # additionalProperties
    assert "not JSON" in check("get_weather", '{"city": "Paris"')
    assert "not JSON" in check("get_weather", '{"city": NaN}')
    assert "arguments: not a JSON object" in check("get_weather", '"{\\"city\\": \\"Paris\\"}"')
    assert validate_arguments(ToolCall("c", "get_time", "{}"), parse_tools([CLOCK])) is None


# -- streaming ----------------------------------------------------------------------------------------------------


ANSWERS = [
    "",
    "   ",
    "Plain text, no calls.",
    "  leading and trailing space \n\n",
    "a < b and <tool_ but no call <tool_cal",
    block('{"name": "get_weather", "arguments": {"city": "Paris"}}'),
    "I'll check.\n" + block('{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}')
    + "\n" + block('{"name": "get_time", "arguments": {}}') + "\n\n",
    "x" + block('{"name": "get_time"}') + "  middle  " + block('{"name": "get_time", "arguments": {"a":1}}') + "y",
    "Broken: " + block('{"name": "get_weather", "arguments": {') + " then " + block('{"name": "get_time"}'),
    "<tool_call><tool_call>\n" + '{"name": "f", "arguments": {}}' + "\n</tool_call>",
    block('{"name": "f", "arguments": {"s": "</tool_"}}') + "<<tool_call>>",
    "Unclosed " + "<tool_call>\n" + '{"name": "get_time", "arguments": {}}' + "\n</tool_ca",
    "ends with a partial tag <tool_c",
    "\n<tool_call>\n\n</tool_call>\n",
]


def streamed(parser, pieces):
    """The content and calls the stream's events add up to, checking the events have OpenAI's shape."""
    stream = parser.stream()
    events = [event for piece in pieces for event in stream.feed(piece)] + stream.finish()
    content, calls = "", []
    for event in events:
        if isinstance(event, ContentDelta):
            assert event.text
            content += event.text
        else:
            assert isinstance(event, ToolCallDelta)
            if event.index == len(calls):  # a call's first delta: its id and name
                assert event.id and re.fullmatch(r"call_[0-9a-f]{24}", event.id) and event.name
                calls.append([event.name, event.arguments])
            else:
                assert event.index == len(calls) - 1 and event.id is None and event.name is None
                calls[-1][1] += event.arguments
    return content or None, [tuple(call) for call in calls]


def whole(parser, text):
    answer = parser.parse(text)
    return answer.content, [(call.name, call.arguments) for call in answer.tool_calls]


def random_split(text, rng):
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(8, len(text) - 1)))) if len(text) > 1 else []
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("text", ANSWERS)
def test_streaming_equals_parse_for_random_splits(text):
    parser = tool_parser("hermes")
    expected = whole(parser, text)
    rng = random.Random(f"stream {text}")
    for _ in range(150):
        assert streamed(parser, random_split(text, rng)) == expected
    assert streamed(parser, list(text)) == expected  # one character at a time
    assert streamed(parser, [text]) == expected
    for cut in range(len(text) + 1):  # every two-piece split, including each cut inside a tag
        assert streamed(parser, [text[:cut], text[cut:]]) == expected


def test_streaming_tokens_with_the_tag_in_one_piece():
    parser = tool_parser("qwen25")
    pieces = ["I'll", " check", ".", "\n", "<tool_call>", "\n", '{"', "name", '":', ' "', "get", "_weather", '",',
              ' "', "arguments", '":', ' {"', "city", '":', ' "', "Paris", '"}}', "\n", "</tool_call>"]
    stream = parser.stream()
    events = [stream.feed(piece) for piece in pieces]
    assert events[:3] == [[ContentDelta("I'll")], [ContentDelta(" check")], [ContentDelta(".")]]
    assert all(not e for e in events[3:-1])  # the newline waits for more content, the block for its end
    [call] = events[-1]
    assert (call.index, call.name, call.arguments) == (0, "get_weather", '{"city": "Paris"}') and call.id
    assert stream.finish() == []
    assert streamed(parser, pieces) == whole(parser, "".join(pieces))


def test_streaming_holds_back_only_a_possible_tag():
    stream = tool_parser("hermes").stream()
    assert stream.feed("a <tool") == [ContentDelta("a")]
    assert stream.feed("bar") == [ContentDelta(" <toolbar")]
    assert stream.feed(" <") == []
    assert stream.feed("b>") == [ContentDelta(" <b>")]
    assert stream.feed("<tool_call>") == []
    assert stream.finish() == [ContentDelta("<tool_call>")]


@pytest.mark.skipif(not (QWEN / "tokenizer.json").is_file(), reason="the Qwen2.5 tokenizer is not here")
def test_streaming_the_real_tokenizers_pieces():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(QWEN)
    parser = tool_parser("hermes")
    text = ANSWERS[6] + "Ünïcode ✓ " + block('{"name": "get_time", "arguments": {"tz": "Europe/Zürich"}}')
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_tokens_to_ids("<tool_call>") in ids
    pieces, done = [], ""
    for end in range(1, len(ids) + 1):  # incremental decoding, as a server streams tokens
        decoded = tokenizer.decode(ids[:end], skip_special_tokens=True)
        if not decoded.endswith("\ufffd"):
            pieces.append(decoded[len(done):])
            done = decoded
    assert "<tool_call>" in pieces and "".join(pieces) == text
    assert streamed(parser, pieces) == whole(parser, text)
    assert len(whole(parser, text)[1]) == 3
