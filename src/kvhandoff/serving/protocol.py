"""Request bodies of the server's OpenAI-compatible API (pydantic models in OpenAI's shapes; the responses'
are `response_models`).

Requests accept what OpenAI accepts, explicit nulls included, and refuse by field name what the server cannot do
(non-text content parts and output modalities, the deprecated ``functions``). Fields the server does not know are
ignored, as OpenAI and vLLM do; `unknown_fields` names them so the server can log each once.
"""

from __future__ import annotations

import contextlib
import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kvhandoff.runtime.switch.turn import TURN_MODES
from kvhandoff.serving.tools import MAX_TOOLS, NAME_PATTERN

#: roles a chat message may have ("developer" reads as "system")
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
#: at most this many stop strings (OpenAI's limit)
MAX_STOP_STRINGS = 4
#: at most this many characters in one stop string (each is looked for after every token)
MAX_STOP_CHARS = 1000
#: a logit_bias key is a token id of at most this many ASCII digits (past any vocabulary)
MAX_TOKEN_ID_DIGITS = 9
#: at most this many characters in a session key (prompt_cache_key, X-Session-ID and the other session headers) and
#: in a tenant mark (user, cache_salt)
MAX_KEY_CHARS = 256
#: at most this many choices per request
MAX_CHOICES = 16
#: at most this many alternatives per position in log-probs (OpenAI's limits: chat 20, completions 5)
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5


def _whole_number(value):
    return int(value) if isinstance(value, float) and value.is_integer() else value


#: an integer as JSON Schema has it: 1.0 is one; true, "2" and 1.5 are not
JsonInt = Annotated[StrictInt, BeforeValidator(_whole_number)]


def _bounded(**bounds):
    """`JsonInt` within ``bounds`` (pydantic's ge, le, gt): the bounds sit on the integer itself, so the JSON schema
    states them in its own terms (minimum, maximum, exclusiveMinimum), not under pydantic's names."""
    return Annotated[StrictInt, Field(**bounds), BeforeValidator(_whole_number)]


#: a token id: a non-negative integer
TokenId = _bounded(ge=0)
#: a count of tokens that may be zero (min_tokens; a completion's max_tokens: 0 with echo scores a prompt)
TokenCount = _bounded(ge=0)
#: a count of tokens to generate (a chat's max_tokens, max_completion_tokens)
AnswerTokens = _bounded(gt=0)
TopK = _bounded(ge=-1)
Choices = _bounded(ge=1, le=MAX_CHOICES)
TopLogprobs = _bounded(ge=0, le=MAX_TOP_LOGPROBS)
CompletionLogprobCount = _bounded(ge=0, le=MAX_COMPLETION_LOGPROBS)


def unknown_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """Names of the fields of ``model`` (and of its nested request models) that no model declares."""
    names = [f"{prefix}{name}" for name in (model.model_extra or {})]
    for name in type(model).model_fields:
        value = getattr(model, name)
        for index, item in enumerate(value if isinstance(value, list) else [value]):
            if isinstance(item, BaseModel) and item.model_config.get("extra") == "allow":
                where = f"{prefix}{name}[{index}]." if isinstance(value, list) else f"{prefix}{name}."
                names += unknown_fields(item, where)
    return names


#: a session key is echoed in a response header: printable ASCII only (no line breaks, no NUL)
PRINTABLE_ASCII = "^[ -~]*$"
_SESSION_KEY = re.compile(PRINTABLE_ASCII)
#: a tenant mark (user, cache_salt) is never echoed: any text without control characters
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
_TOKEN_ID = re.compile(f"[0-9]{{1,{MAX_TOKEN_ID_DIGITS}}}")

# schemas of fields whose rules a validator checks (with a message naming the fix), stated for the OpenAPI document
STOP_STRING = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
STOP_SCHEMA = {"anyOf": [STOP_STRING, {"type": "array", "items": STOP_STRING, "maxItems": MAX_STOP_STRINGS},
                         {"type": "null"}]}
LOGIT_BIAS_SCHEMA = {"anyOf": [{"type": "object", "propertyNames": {"pattern": f"^[0-9]{{1,{MAX_TOKEN_ID_DIGITS}}}$"},
                                "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
                               {"type": "null"}]}
SESSION_KEY_SCHEMA = {"anyOf": [{"type": "string", "maxLength": MAX_KEY_CHARS, "pattern": PRINTABLE_ASCII},
                                {"type": "null"}]}
TENANT_MARK_SCHEMA = {"anyOf": [{"type": "string", "maxLength": MAX_KEY_CHARS,
                                 "pattern": "^[^\\u0000-\\u001f\\u007f-\\u009f]*$"}, {"type": "null"}]}
#: a tool as `tools.parse_tools` takes it (what a schema cannot say, it checks: parameters a valid JSON schema, names
#: given once)
TOOL_SCHEMA = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": f"^{NAME_PATTERN.pattern}$"}, "description": {"type": "string"},
        "parameters": {"type": "object"}}}}}
TOOLS_SCHEMA = {"anyOf": [{"type": "array", "items": TOOL_SCHEMA, "maxItems": MAX_TOOLS}, {"type": "null"}]}
REFUSED = {"type": "null", "description": "not supported: only null (or leaving it out) is accepted"}
TEXT_ONLY = {"anyOf": [{"type": "array", "items": {"const": "text"}, "minItems": 1, "maxItems": 1},
                       {"type": "null"}]}


class Lenient(BaseModel):
    """A request part: unknown fields kept aside (`unknown_fields`) and otherwise ignored."""

    model_config = ConfigDict(extra="allow")


#: the validation error of a string that is not Unicode (JSON's ``"\ud800"``): a 400 naming the field
LONE_SURROGATE = "lone_surrogate"
_SURROGATE = re.compile("[\ud800-\udfff]")


def surrogate_path(value, path: str = "") -> str | None:
    """Where in a parsed JSON ``value`` a string holds a lone UTF-16 surrogate (JSON allows ``"\ud800"``, Unicode
    text does not), e.g. ``messages[0].content``; None when every string is valid. Searched in the value's JSON text
    first (fast), then walked without recursion (a body may nest as deep as the JSON parser allows) to name it."""
    with contextlib.suppress(TypeError, ValueError, RecursionError):  # anything json cannot write is walked
        if not _SURROGATE.search(json.dumps(value, ensure_ascii=False)):
            return None
    pending = [(value, path, None)]  # (value, its path, the path of its object when its own key is not Unicode)
    while pending:
        value, path, bad_key = pending.pop()
        if bad_key is not None:
            return bad_key or "body"
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return path or "body"
            continue
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        children = []
        for key, item in items:
            where = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)
            children.append((item, where, path if isinstance(key, str) and _SURROGATE.search(key) else None))
        pending.extend(reversed(children))
    return None


def session_key_problem(key: str, name: str) -> str | None:
    """Why ``key`` cannot name a session (it is echoed in a response header), as a message for the field or header
    ``name``; None when it can: at most `MAX_KEY_CHARS` printable ASCII characters."""
    if len(key) > MAX_KEY_CHARS:
        return (f"{name} is {len(key)} characters long, past the limit of {MAX_KEY_CHARS}; send a shorter key (e.g. "
                "a hash of it)")
    if not _SESSION_KEY.fullmatch(key):
        return (f"{name} must be printable ASCII (it is echoed in a response header): no line breaks, control or "
                "non-ASCII characters; send e.g. a hex or base64url key")
    return None


class RequestBody(Lenient):
    """A whole request body: any string in it must be valid Unicode (a lone surrogate is refused naming its
    field, before anything reads it)."""

    @model_validator(mode="before")
    @classmethod
    def _unicode_only(cls, value):
        path = surrogate_path(value)
        if path is not None:
            raise PydanticCustomError(LONE_SURROGATE, "{path}: the text holds a lone UTF-16 surrogate (e.g. "
                                      "\\ud800 without its pair), which is not Unicode; send valid UTF-8 text",
                                      {"path": path})
        return value


class TextPart(Lenient):
    type: Literal["text"]
    text: str


class FunctionCall(Lenient):
    name: str = Field(min_length=1)
    arguments: str


class ToolCallIn(Lenient):
    """A tool call of an earlier assistant turn, as the client sends it back."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value):
        if isinstance(value, list):
            for index, part in enumerate(value):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in (None, "text"):
                    raise ValueError(f"content part {index} is of type {kind!r}: this server reads text parts only")
        return value

    @model_validator(mode="after")
    def _content_where_needed(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (only an assistant turn with tool_calls may have "
                             "null content)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def text(self) -> str | None:
        """The message's text (text parts joined; None for a tool-calling turn without content)."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def template_message(self) -> dict:
        """The message in OpenAI's plain shape (content as text), for the chat template (`chat.template_messages`)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": "function",
                                      "function": {"name": call.function.name, "arguments": call.function.arguments}}
                                     for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class StreamOptions(Lenient):
    include_usage: StrictBool | None = False


class HandoffOptions(BaseModel):
    """The body's ``kv_handoff`` extension (the openai client sends it with ``extra_body``): ``mode`` "auto" (the
    server's rules: map at a switch, the guard may fall back), "reprefill" (at a switch the receiving model
    re-prefills the whole conversation instead of mapping; reported as status "reprefill") or "exact" (only the
    model's own exact cache serves: no mapped position is used, what it lacks is read again; reported as "reprefill"
    where another model served last, else "none")."""

    model_config = ConfigDict(extra="forbid")
    mode: Literal[TURN_MODES] = "auto"


class SamplingRequest(RequestBody):
    """Fields chat and text completions share. None stands for the field's default wherever OpenAI allows null."""

    model: str = Field(min_length=1)
    max_tokens: AnswerTokens | None = None
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=2.0, description=(
        "0, or any value below 1e-5 (too small to divide by), is greedy"))
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0, description=(
        "the smallest set of most likely tokens whose probability reaches top_p is sampled from; it always holds the "
        "most likely token, so a tiny top_p (e.g. 1e-300, 0 in float32) is greedy"))
    top_k: TopK | None = None
    min_p: StrictFloat | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: StrictFloat | None = Field(default=None, gt=0.0, le=2.0)
    presence_penalty: StrictFloat | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: Annotated[dict[str, StrictFloat] | None, WithJsonSchema(LOGIT_BIAS_SCHEMA)] = None
    min_tokens: TokenCount | None = None
    ignore_eos: StrictBool | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: JsonInt | None = None
    stop: Annotated[str | list[str] | None, WithJsonSchema(STOP_SCHEMA)] = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: Annotated[str | None, WithJsonSchema(TENANT_MARK_SCHEMA)] = None
    prompt_cache_key: Annotated[str | None, WithJsonSchema(SESSION_KEY_SCHEMA)] = None
    cache_salt: Annotated[str | None, WithJsonSchema(TENANT_MARK_SCHEMA)] = None
    n: Choices | None = None
    kv_handoff: HandoffOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value):
        strings = [value] if isinstance(value, str) else list(value or [])
        if len(strings) > MAX_STOP_STRINGS or any(not s for s in strings):
            raise ValueError(f"stop must be up to {MAX_STOP_STRINGS} non-empty strings")
        longest = max(strings, key=len, default="")
        if len(longest) > MAX_STOP_CHARS:
            raise ValueError(f"a stop string is {len(longest)} characters long, past the limit of {MAX_STOP_CHARS}; "
                             "send shorter stop strings")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_biases(cls, value):
        for key, bias in (value or {}).items():
            if not _TOKEN_ID.fullmatch(key):
                shown = key if len(key) <= 32 else key[:32] + "…"
                raise ValueError(f"logit_bias keys are token ids written in ASCII digits (at most "
                                 f"{MAX_TOKEN_ID_DIGITS}, e.g. \"50256\"), got {shown!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in -100..100, got {bias} for token {key}")
        return value

    @field_validator("prompt_cache_key")
    @classmethod
    def _session_key(cls, value, info):
        problem = None if value is None else session_key_problem(value, info.field_name)
        if problem is not None:
            raise ValueError(problem)
        return value

    @field_validator("user", "cache_salt")
    @classmethod
    def _tenant_mark(cls, value, info):
        if value is not None and len(value) > MAX_KEY_CHARS:
            raise ValueError(f"{info.field_name} is {len(value)} characters long, past the limit of {MAX_KEY_CHARS}; "
                             "send a shorter one (e.g. a hash of it)")
        if value is not None and _CONTROL.search(value):
            raise ValueError(f"{info.field_name} holds a control character (a line break, NUL, ...); send printable "
                             "text")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def streams(self) -> bool:
        return bool(self.stream)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def handoff_mode(self) -> str:
        return self.kv_handoff.mode if self.kv_handoff else "auto"

    def choices(self) -> int:
        return self.n or 1

    def sampling_fields(self) -> dict:
        """The sampling settings given (nulls dropped), under `decoding.SamplingParams`' names."""
        fields = {name: getattr(self, name) for name in (
            "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
            "min_tokens", "ignore_eos", "seed")}
        fields = {name: value for name, value in fields.items() if value is not None}
        if self.logit_bias:
            fields["logit_bias"] = tuple((int(key), float(bias)) for key, bias in self.logit_bias.items())
        if self.stop_token_ids:
            fields["stop_token_ids"] = tuple(self.stop_token_ids)
        return fields


class JsonSchemaFormat(Lenient):
    name: str = "response"
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("a json_schema response_format needs json_schema.schema")
        return self


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: AnswerTokens | None = None
    tools: Annotated[list[dict] | None, WithJsonSchema(TOOLS_SCHEMA)] = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: ResponseFormat | None = None
    logprobs: StrictBool | None = None
    top_logprobs: TopLogprobs | None = None
    functions: Annotated[list | None, WithJsonSchema(REFUSED)] = None
    function_call: Annotated[Any, WithJsonSchema(REFUSED)] = None
    audio: Annotated[Any, WithJsonSchema(REFUSED)] = None
    modalities: Annotated[list | None, WithJsonSchema(TEXT_ONLY)] = None

    @field_validator("functions", "function_call")
    @classmethod
    def _deprecated_functions(cls, value, info):
        if value is not None:
            raise ValueError(f"{info.field_name} is OpenAI's deprecated form of function calling; send tools and "
                             "tool_choice instead")
        return value

    @field_validator("audio")
    @classmethod
    def _no_audio(cls, value):
        if value is not None:
            raise ValueError("this server answers in text only (no audio)")
        return value

    @field_validator("modalities")
    @classmethod
    def _text_modality(cls, value):
        if value is not None and list(value) != ["text"]:
            raise ValueError("only the text modality is supported")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value, info):
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    def answer_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprob_alternatives(self) -> int | None:
        """Alternatives per position to report (None: no log-probs)."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingRequest):
    prompt: str | list[TokenId] | list[str] = Field(min_length=1)
    # OpenAI's default for text completions; 0 with echo scores a prompt without answering
    max_tokens: TokenCount | None = 16
    echo: StrictBool | None = False
    logprobs: CompletionLogprobCount | None = None
    suffix: Annotated[str | None, WithJsonSchema({"anyOf": [{"type": "string", "maxLength": 0},
                                                             {"type": "null"}]})] = None
    best_of: JsonInt | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and value and isinstance(value[0], str):
            if len(value) != 1:
                raise ValueError("only one prompt per request is supported")
            return value[0]
        if isinstance(value, list) and any(token < 0 for token in value):
            raise ValueError("token ids must be >= 0")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value):
        if value:
            raise ValueError("suffix (insertion) is not supported by this server")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value, info):
        if value is not None and value != (info.data.get("n") or 1):
            raise ValueError("best_of other than n is not supported by this server")
        return value

    def answer_limit(self) -> int | None:
        return 16 if self.max_tokens is None else self.max_tokens

    def logprob_alternatives(self) -> int | None:
        return self.logprobs


class TokenizeRequest(RequestBody):
    """vLLM's ``/tokenize``: a ``prompt`` or chat ``messages`` (the chat template applied)."""

    model: str = Field(min_length=1)
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: Annotated[list[dict] | None, WithJsonSchema(TOOLS_SCHEMA)] = None
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(RequestBody):
    model: str = Field(min_length=1)
    tokens: list[TokenId]
