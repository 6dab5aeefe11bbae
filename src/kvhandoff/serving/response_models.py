"""Response bodies of the server's OpenAI-compatible API (pydantic models in OpenAI's shapes, with the ``kv_handoff``
report of what happened to the conversation's cache); `dump` writes one as JSON data with OpenAI's field names."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class GuardInfo(BaseModel):
    signal: str
    score: float | None
    threshold: float
    source: Literal["recorded", "configured"] | None = None  # the pair's guard: its mapper's record, or the config


class HandoffInfo(BaseModel):
    """What the server did with the conversation's cache for this request (also header X-KV-Handoff: status).

    status: "applied" (another model's cache was mapped and served), "escalated" (it was mapped, the guard rejected it,
    and it was handed over again with a larger recompute budget and served), "fallback" (it was mapped, the guard
    rejected it, the model re-prefilled), "reprefill" (another model served last and the request asked for
    ``kv_handoff.mode`` "reprefill" or "exact": nothing was mapped, the model re-prefilled), "none" (no switch: the
    model's own cache or a prefill). approximate_tokens: the prompt positions served from cached K/V that are not the
    model's own exact ones (mapped at this or an earlier switch, read on top of mapped ones, or reused at another
    offset); 0 when everything cached was its own. reuse: how the cached positions were found (also header
    X-KV-Reuse): "prefix" (the conversation's start), "offset" (its history, held by another conversation after
    another beginning such as another agent's instructions, moved to its new positions), "none" (nothing cached).
    """

    status: Literal["applied", "escalated", "fallback", "reprefill", "none"]
    from_: str | None = Field(default=None, serialization_alias="from")
    to: str
    mapped_tokens: int
    read_tokens: int
    approximate_tokens: int = 0
    guard: GuardInfo | None = None
    milliseconds: float
    reuse: Literal["prefix", "offset", "none"] = "none"


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    kv_handoff: HandoffInfo


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    kv_handoff: HandoffInfo | None = None


class CompletionLogprobs(BaseModel):
    """A text completion's log-probs (OpenAI's legacy shape): per token its text, log-prob (None for a prompt's first
    token), the alternatives, and where its text starts."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


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
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


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
