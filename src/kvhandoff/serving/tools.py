"""Function calling: the request's tools and tool choice, and the parsers that find tool calls in a model's answer
(whole, or streamed delta by delta)."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from kvhandoff.errors import ConfigError

#: OpenAI's rule for function names
NAME_PATTERN = re.compile(r"[a-zA-Z0-9_-]{1,64}")
#: at most this many tools per request (OpenAI's limit)
MAX_TOOLS = 128
#: a JSON schema the server reads (a tool's parameters, a response_format's schema) nests objects and arrays at most
#: this deep (``{"type": "object", "properties": {"a": {...}}}`` is two levels per property): jsonschema's checks and
#: llguidance's compiler recurse over it, and both fail past about 100 levels
MAX_SCHEMA_DEPTH = 64
#: and is at most this many characters as compact JSON
MAX_SCHEMA_CHARS = 128 * 1024

TOOL_CHOICE_MODES = ("auto", "none", "required", "named")


# -- the request side ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tool:
    """One function the model may call: its name, description and parameters (a JSON schema; None: not given)."""

    name: str
    description: str | None = None
    parameters: dict | None = None

    def to_dict(self) -> dict:
        """The OpenAI tool dict, as chat templates render it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    """What the model may do with the tools: "auto" (call or answer), "none" (answer), "required" (call at least
    one), "named" (call the function `name`)."""

    mode: str = "auto"
    name: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in TOOL_CHOICE_MODES:
            raise ConfigError(f"tool_choice: unknown mode {self.mode!r} (one of {', '.join(TOOL_CHOICE_MODES)})")
        if (self.mode == "named") != (self.name is not None):
            raise ConfigError("tool_choice: a function name goes with the 'named' mode, and only with it")


@dataclass(frozen=True)
class ToolSettings:
    """A request's function-calling settings: its tools, the tool choice and whether several calls may come in one
    answer."""

    tools: tuple[Tool, ...] = ()
    choice: ToolChoice = field(default_factory=lambda: ToolChoice("none"))
    parallel_tool_calls: bool = True

    def template_tools(self) -> list[dict] | None:
        """The tools as the chat template takes them (None: no tools)."""
        return [tool.to_dict() for tool in self.tools] or None

    @property
    def parses_calls(self) -> bool:
        """Whether the answer is searched for tool calls (tools given and tool_choice not "none")."""
        return bool(self.tools) and self.choice.mode != "none"


def _path(parts: Iterable[str | int]) -> str:
    """A place inside a JSON value, written as the request's fields are: `.key` and `[index]`."""
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in parts)


def check_schema_bounds(schema: Any, where: str) -> None:
    """A ConfigError naming ``where`` (e.g. ``tools[0].function.parameters``) when the JSON value ``schema`` nests
    deeper than `MAX_SCHEMA_DEPTH` or is longer than `MAX_SCHEMA_CHARS` as compact JSON. The depth is measured
    without recursion, before anything recursive reads the schema."""
    pending = [(schema, 1)]
    while pending:
        value, depth = pending.pop()
        if isinstance(value, dict | list):
            if depth > MAX_SCHEMA_DEPTH:
                raise ConfigError(f"{where}: the schema nests objects and arrays more than {MAX_SCHEMA_DEPTH} levels "
                                  "deep, past this server's limit; flatten it (e.g. with $defs and $ref)")
            pending.extend((item, depth + 1) for item in (value.values() if isinstance(value, dict) else value))
    size = len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False))
    if size > MAX_SCHEMA_CHARS:
        raise ConfigError(f"{where}: the schema is {size} characters as JSON, past this server's limit of "
                          f"{MAX_SCHEMA_CHARS}; send a shorter schema")


def _parse_tool(index: int, item: Any) -> Tool:
    where = f"tools[{index}]"
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: must be an object, got {type(item).__name__}")
    if item.get("type") != "function":
        raise ConfigError(f"{where}.type: must be 'function', got {item.get('type')!r}")
    function = item.get("function")
    if not isinstance(function, dict):
        raise ConfigError(f"{where}.function: must be an object with the function's name")
    name = function.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ConfigError(f"{where}.function.name: must match ^[a-zA-Z0-9_-]{{1,64}}$, got {name!r}")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ConfigError(f"{where}.function.description: must be a string")
    parameters = function.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise ConfigError(f"{where}.function.parameters: must be a JSON schema object")
        check_schema_bounds(parameters, f"{where}.function.parameters")
        try:
            jsonschema.validators.validator_for(parameters).check_schema(parameters)
        except jsonschema.exceptions.SchemaError as exc:
            path = _path(exc.path)
            raise ConfigError(f"{where}.function.parameters{path}: not a valid JSON schema: {exc.message}") from None
    return Tool(name, description, parameters)


def _parse_choice(tool_choice: Any, names: set[str]) -> ToolChoice:
    if tool_choice is None:
        return ToolChoice("auto" if names else "none")
    if isinstance(tool_choice, str):
        if tool_choice not in ("auto", "none", "required"):
            raise ConfigError(f"tool_choice: must be 'auto', 'none', 'required' or a function, got {tool_choice!r}")
        if tool_choice == "required" and not names:
            raise ConfigError("tool_choice: 'required' needs tools")
        return ToolChoice(tool_choice)
    if not isinstance(tool_choice, dict):
        raise ConfigError(f"tool_choice: must be a string or an object, got {type(tool_choice).__name__}")
    if tool_choice.get("type") != "function":
        raise ConfigError(f"tool_choice.type: must be 'function', got {tool_choice.get('type')!r}")
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ConfigError("tool_choice.function.name: missing (the function to call)")
    if name not in names:
        known = ", ".join(sorted(names)) or "none"
        raise ConfigError(f"tool_choice.function.name: {name!r} is not among the tools (they are: {known})")
    return ToolChoice("named", name)


def parse_tools(tools: Any = None, tool_choice: Any = None, parallel_tool_calls: Any = None) -> ToolSettings:
    """A request's `tools`, `tool_choice` and `parallel_tool_calls` (as JSON gives them; None: not given) checked
    and typed. Defaults as OpenAI's: without tools the choice is "none", with tools "auto"; parallel calls allowed.
    An empty tools list counts as none; at most `MAX_TOOLS`. Raises ConfigError naming the field at fault."""
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise ConfigError(f"tools: must be a list of tools, got {type(tools).__name__}")
    if len(tools) > MAX_TOOLS:
        raise ConfigError(f"tools: {len(tools)} tools given, past the limit of {MAX_TOOLS} per request; send only "
                          "the tools this turn may need")
    parsed: list[Tool] = []
    seen: dict[str, int] = {}
    for index, item in enumerate(tools):
        tool = _parse_tool(index, item)
        if tool.name in seen:
            raise ConfigError(f"tools[{index}].function.name: {tool.name!r} is given twice (also as "
                              f"tools[{seen[tool.name]}]); give each function once")
        seen[tool.name] = index
        parsed.append(tool)
    choice = _parse_choice(tool_choice, {tool.name for tool in parsed})
    if parallel_tool_calls is None:
        parallel_tool_calls = True
    if not isinstance(parallel_tool_calls, bool):
        raise ConfigError(f"parallel_tool_calls: must be a boolean, got {parallel_tool_calls!r}")
    return ToolSettings(tuple(parsed), choice, parallel_tool_calls)


# -- the answer side ----------------------------------------------------------------------------------------------


def new_call_id() -> str:
    """A fresh tool call id: "call_" and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: its id, the function's name and the arguments' JSON text as the model wrote it."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedAnswer:
    """An answer split into its text outside tool-call blocks (stripped; None when empty) and its calls."""

    content: str | None
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ContentDelta:
    """Streamed answer text."""

    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """Streamed part of tool call `index`: its first delta has the id and the name, later ones only argument text."""

    index: int
    id: str | None
    name: str | None
    arguments: str


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# Python's decoder takes NaN and Infinity, which JSON does not
_DECODER = json.JSONDecoder(parse_constant=_no_constant)
_SPACE = " \t\n\r"


def _members(text: str) -> dict[str, tuple[Any, str]] | None:
    """The members of the JSON object `text` (whitespace around it allowed): key → (value, the value's text as
    written); None when `text` is not exactly one JSON object. A repeated key keeps its last value, as json does."""
    index, end = 0, len(text)

    def skip(i: int) -> int:
        while i < end and text[i] in _SPACE:
            i += 1
        return i

    try:
        index = skip(index)
        if not text.startswith("{", index):
            return None
        members: dict[str, tuple[Any, str]] = {}
        index = skip(index + 1)
        if text.startswith("}", index):
            return members if skip(index + 1) == end else None
        while True:
            if not text.startswith('"', index):
                return None
            key, index = _DECODER.scan_once(text, index)
            index = skip(index)
            if not text.startswith(":", index):
                return None
            start = skip(index + 1)
            value, index = _DECODER.scan_once(text, start)
            members[key] = (value, text[start:index])
            index = skip(index)
            if text.startswith(",", index):
                index = skip(index + 1)
            elif text.startswith("}", index):
                return members if skip(index + 1) == end else None
            else:
                return None
    except (StopIteration, ValueError):  # scan_once: no JSON value here, or a malformed one
        return None


class HermesToolParser:
    """Hermes-style tool calls, the format of Qwen2.5's chat template: each call a block
    ``<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>`` in the answer. A block
    whose JSON does not parse, or has no string name, stays in the content as written; so does a block the answer
    leaves open. A call without "arguments" has the arguments "{}" (no arguments)."""

    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"

    def call(self, block: str) -> ToolCall | None:
        """The call a block's inner text holds (None: not a call)."""
        members = _members(block)
        if members is None or not isinstance(members.get("name", (None,))[0], str):
            return None
        arguments = members["arguments"][1] if "arguments" in members else "{}"
        return ToolCall(new_call_id(), members["name"][0], arguments)

    def parse(self, text: str) -> ParsedAnswer:
        """A whole answer's content and tool calls."""
        pieces, calls, index = [], [], 0
        while True:
            opened = text.find(self.start, index)
            if opened < 0:
                pieces.append(text[index:])
                break
            pieces.append(text[index:opened])
            closed = text.find(self.end, opened + len(self.start))
            if closed < 0:
                pieces.append(text[opened:])
                break
            call = self.call(text[opened + len(self.start):closed])
            index = closed + len(self.end)
            if call is None:
                pieces.append(text[opened:index])
            else:
                calls.append(call)
        return ParsedAnswer("".join(pieces).strip() or None, calls)

    def stream(self) -> ToolCallStream:
        """A parser of one answer streamed delta by delta."""
        return ToolCallStream(self)


class ToolCallStream:
    """Incremental `parse`: `feed` each text delta, then `finish`; each returns the events that text decided. Text
    that may be the start of a block is held back until it is decided, a block until it closes, and whitespace until
    content follows it (the content is stripped as `parse` strips it); the events add up to `parse`'s answer."""

    def __init__(self, parser: HermesToolParser) -> None:
        self.parser = parser
        self._buffer = ""  # undecided text: after a block's start tag when inside, else a possible start tag
        self._inside = False
        self._space = ""  # whitespace held until content follows it
        self._started = False  # whether any content went out (leading whitespace is dropped)
        self._calls = 0

    def feed(self, delta: str) -> list[ContentDelta | ToolCallDelta]:
        self._buffer += delta
        events: list[ContentDelta | ToolCallDelta] = []
        start, end = self.parser.start, self.parser.end
        while True:
            if self._inside:
                closed = self._buffer.find(end)
                if closed < 0:
                    return events
                block, self._buffer = self._buffer[:closed], self._buffer[closed + len(end):]
                self._inside = False
                call = self.parser.call(block)
                if call is None:
                    events += self._content(start + block + end)
                else:
                    events.append(ToolCallDelta(self._calls, call.id, call.name, call.arguments))
                    self._calls += 1
            else:
                opened = self._buffer.find(start)
                if opened >= 0:
                    events += self._content(self._buffer[:opened])
                    self._buffer = self._buffer[opened + len(start):]
                    self._inside = True
                    continue
                keep = _partial_suffix(self._buffer, start)
                events += self._content(self._buffer[:len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return events

    def finish(self) -> list[ContentDelta | ToolCallDelta]:
        """The events of the text still held: an open block, or a partial start tag, is content."""
        rest = (self.parser.start if self._inside else "") + self._buffer
        self._buffer, self._inside = "", False
        return self._content(rest)

    def _content(self, text: str) -> list[ContentDelta | ToolCallDelta]:
        text = self._space + text
        if not self._started:
            text = text.lstrip()
        body = text.rstrip()
        self._space = text[len(body):]
        if not body:
            return []
        self._started = True
        return [ContentDelta(body)]


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is the beginning of `tag` (but not all of it)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


#: tool-call parsers by name (vLLM's --tool-call-parser); qwen25 is the Hermes format under the model's name
TOOL_PARSERS: dict[str, type[HermesToolParser]] = {"hermes": HermesToolParser, "qwen25": HermesToolParser}


def tool_parser(name: str) -> HermesToolParser:
    """The tool-call parser called `name` (one of `TOOL_PARSERS`)."""
    if name not in TOOL_PARSERS:
        raise ConfigError(f"unknown tool-call parser {name!r} (known: {', '.join(TOOL_PARSERS)})")
    return TOOL_PARSERS[name]()


def validate_arguments(call: ToolCall, tools: Iterable[Tool] | ToolSettings) -> str | None:
    """Why `call` does not fit the tools (an unknown function, arguments that are not a JSON object or fail the
    function's parameters schema); None when it fits."""
    if isinstance(tools, ToolSettings):
        tools = tools.tools
    tool = next((tool for tool in tools if tool.name == call.name), None)
    if tool is None:
        return f"unknown function {call.name!r}"
    try:
        arguments = json.loads(call.arguments, parse_constant=_no_constant)
    except ValueError as exc:
        return f"{call.name}: arguments: not JSON ({exc})"
    if not isinstance(arguments, dict):
        return f"{call.name}: arguments: not a JSON object"
    if tool.parameters is None:
        return None
    validator = jsonschema.validators.validator_for(tool.parameters)(tool.parameters)
    error = jsonschema.exceptions.best_match(validator.iter_errors(arguments))
    if error is None:
        return None
    where = _path(error.absolute_path)
    return f"{call.name}: arguments{where}: {error.message}"

