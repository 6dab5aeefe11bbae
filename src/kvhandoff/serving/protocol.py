"""Request and response bodies of the server's OpenAI-compatible API (pydantic models in OpenAI's shapes).

Requests validate what the server supports and reject the rest by field name: several choices (n > 1), log-probs,
tools and function calls, logit bias, penalties, audio, a completion's suffix/echo/best_of. Unknown extra fields
are ignored, as OpenAI's API does for fields it does not know.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

#: roles a chat message may have ("developer" reads as "system")
CHAT_ROLES = ("system", "developer", "user", "assistant")
#: at most this many stop strings (OpenAI's limit)
MAX_STOP_STRINGS = 4
#: the request body's ``kv_handoff.mode``: "auto" (map at a switch, the guard deciding) or "reprefill" (at a switch
#: the receiving model re-prefills the conversation itself: the path without handoff, to compare against)
HANDOFF_MODES = ("auto", "reprefill")


def _unsupported(name: str, value: Any, allowed: Any = None) -> Any:
    if value is not None and value != allowed and value != [] and value is not False:
        raise ValueError(f"{name} is not supported by this server")
    return value


class TextPart(BaseModel):
    """One part of a message's content; only text parts are supported."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None
    tool_calls: list | None = None

    @field_validator("tool_calls")
    @classmethod
    def _no_tool_calls(cls, value):
        return _unsupported("tool_calls", value)

    def text(self) -> str:
        """The message's text (text parts joined)."""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)

    def template_role(self) -> str:
        return "system" if self.role == "developer" else self.role


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class HandoffOptions(BaseModel):
    """The body's ``kv_handoff`` extension (the openai client sends it with ``extra_body``): ``mode`` "auto" (the
    server's rules: map at a switch, the guard may fall back) or "reprefill" (at a switch the receiving model
    re-prefills the whole conversation instead of mapping; reported as status "reprefill")."""

    model_config = ConfigDict(extra="forbid")
    mode: Literal["auto", "reprefill"] = "auto"


class SamplingRequest(BaseModel):
    """Fields chat and text completions share."""

    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1)
    max_tokens: StrictInt | None = Field(default=None, gt=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    n: StrictInt = 1
    logprobs: Any = None
    top_logprobs: Any = None
    logit_bias: dict | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    kv_handoff: HandoffOptions | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only n=1 is supported")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value):
        strings = [value] if isinstance(value, str) else list(value or [])
        if len(strings) > MAX_STOP_STRINGS or any(not s for s in strings):
            raise ValueError(f"stop must be up to {MAX_STOP_STRINGS} non-empty strings")
        return value

    @field_validator("logprobs", "top_logprobs", "logit_bias")
    @classmethod
    def _no_logprobs(cls, value, info):
        return _unsupported(info.field_name, value)

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, value, info):
        return _unsupported(info.field_name, value, 0)

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def handoff_mode(self) -> str:
        return self.kv_handoff.mode if self.kv_handoff else "auto"


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, gt=0)
    tools: list | None = None
    tool_choice: Any = None
    functions: list | None = None
    function_call: Any = None
    response_format: dict | None = None
    audio: Any = None
    modalities: list | None = None

    @field_validator("tools", "tool_choice", "functions", "function_call", "audio")
    @classmethod
    def _no_tools(cls, value, info):
        return _unsupported(info.field_name, value, "none")

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value):
        if value is not None and value.get("type") != "text":
            raise ValueError("response_format other than text is not supported")
        return value

    @field_validator("modalities")
    @classmethod
    def _text_modality(cls, value):
        if value is not None and list(value) != ["text"]:
            raise ValueError("only the text modality is supported")
        return value

    def answer_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(SamplingRequest):
    prompt: str | list[StrictInt] | list[str] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(default=16, gt=0)  # OpenAI's default for text completions
    suffix: str | None = None
    echo: StrictBool = False
    best_of: StrictInt | None = None

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

    @field_validator("suffix", "echo", "best_of")
    @classmethod
    def _no_extras(cls, value, info):
        return _unsupported(info.field_name, value, 1 if info.field_name == "best_of" else None)

    def answer_limit(self) -> int | None:
        return self.max_tokens


# -- responses ------------------------------------------------------------------------------------------------------
class GuardInfo(BaseModel):
    signal: str
    score: float | None
    threshold: float


class HandoffInfo(BaseModel):
    """What the server did with the conversation's cache for this request (also header X-KV-Handoff: status).

    status: "applied" (another model's cache was mapped and served), "fallback" (it was mapped, the guard
    rejected it, the model re-prefilled), "reprefill" (another model served last and the request asked for
    ``kv_handoff.mode`` "reprefill": nothing was mapped, the model re-prefilled the conversation), "none" (no
    switch: the model's own cache or a prefill).
    """

    status: Literal["applied", "fallback", "reprefill", "none"]
    from_: str | None = Field(default=None, serialization_alias="from")
    to: str
    mapped_tokens: int
    read_tokens: int
    guard: GuardInfo | None = None
    milliseconds: float


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    kv_handoff: HandoffInfo


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    kv_handoff: HandoffInfo | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kv_handoff: HandoffInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvhandoff"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


def dump(model: BaseModel) -> dict:
    """A response model as JSON data, with OpenAI's field names ("from")."""
    return model.model_dump(mode="json", by_alias=True)
