"""Agent frameworks against a real kvhandoff server on a free loopback port (the tiny family of
`_serving_support`, with more positions): LangChain (`langchain_openai.ChatOpenAI`: forced tool calls, a tool result
sent back, structured output, streaming with the handoff headers), LiteLLM (a plain completion, a forced tool call,
session pinning, a router of two deployments, an over-long prompt as `ContextWindowExceededError`) and the official
`openai` client: a session pinned with `x-litellm-session-id` across small → large → small (the router vocabulary's
headers) and the README's agent loop (a tool call and its result handed over to the large model); LangGraph: two
agents with their own instructions on one message state, the history reused at its new offset.

The tiny models are random, so their free text is garbage: only what is valid by construction is checked — a
forced tool call (tool_choice required or named) and json_schema output follow their grammars, and the schemas'
strings have a maxLength so a random model finishes. Nothing here may leave the machine: a guard refuses every
connection that is not to the loopback interface, and LiteLLM is told to use its bundled model-cost map.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket

import jsonschema
import openai
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from _serving_support import AGENT_CONTEXT, running, tiny_family

# LiteLLM reads these when it is imported: the bundled model-cost map and no fetches of its own
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
os.environ["LITELLM_OFFLINE_MODE"] = "true"
import litellm  # after the settings above

pytestmark = [
    pytest.mark.timeout(120),
    # LiteLLM's own typed dicts, as pydantic sees them: noise of the installed packages, not of the server
    pytest.mark.filterwarnings("ignore:.*using the `ReadOnly` qualifier:UserWarning"),
]

#: the family's positions: a tool preamble rendered byte by byte (the chat tokenizer) takes about 700 tokens, past
#: the 512 of `_serving_support.tiny_family`, whose mappers refuse longer contexts at a switch
MAX_CONTEXT = AGENT_CONTEXT
#: enough answer tokens for one forced call of the tools below (≈ 90 bytes) or one structured answer
CALL_TOKENS = 160


class GetWeather(BaseModel):
    """The current weather in a city."""

    city: str = Field(min_length=1, max_length=8)
    unit: str = Field(max_length=1)


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class Verdict(BaseModel):
    title: str = Field(max_length=10)
    ok: bool


#: the same function as an OpenAI tool (for LiteLLM and the openai client)
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch):
    """Refuse every socket connection that is not to the loopback interface (the server under test)."""
    connect = socket.socket.connect

    def guarded(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            host = address[0]
            if host != "localhost" and not ipaddress.ip_address(host).is_loopback:
                raise AssertionError(f"a test tried to reach {address!r}: the framework tests must stay offline")
        return connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)


@pytest.fixture(scope="module")
def server():
    with running(*tiny_family(AGENT_CONTEXT)) as server:
        yield server


@pytest.fixture(scope="module", autouse=True)
def quiet_litellm():
    litellm.suppress_debug_info = True
    litellm.telemetry = False  # read by older LiteLLM releases (this one has no telemetry setting)
    yield


def chat_model(server, model="small", **settings) -> ChatOpenAI:
    return ChatOpenAI(base_url=server.url + "/v1", api_key="x", model=model, temperature=0, max_retries=0,
                      timeout=30, **{"max_tokens": CALL_TOKENS, **settings})


def handoff_headers(headers) -> dict[str, str | None]:
    """kvhandoff's and the router vocabulary's headers of a response (None: absent), from any headers mapping."""
    lower = {key.lower(): value for key, value in dict(headers).items()}
    return {name: lower.get(name) for name in ("x-kv-handoff", "x-kv-reuse", "x-vsr-kv-transfer-status",
                                               "x-vsr-kv-mapper-id", "x-vsr-kv-cache-id")}


# -- LangChain -----------------------------------------------------------------------------------------------------
def test_langchain_named_tool_call_is_a_valid_tool_call(server):
    """bind_tools with a pydantic tool and tool_choice naming it: the AIMessage's one tool call has the tool's name
    and arguments that validate against the tool."""
    bound = chat_model(server).bind_tools([GetWeather], tool_choice="GetWeather", parallel_tool_calls=False)
    message = bound.invoke("What is the weather in Paris?")
    assert isinstance(message, AIMessage)
    assert message.response_metadata["finish_reason"] == "tool_calls"
    assert not message.invalid_tool_calls
    [call] = message.tool_calls
    assert call["name"] == "GetWeather" and call["id"].startswith("call_")
    weather = GetWeather.model_validate(call["args"])
    assert 1 <= len(weather.city) <= 8


def test_langchain_required_tool_call_and_its_result_sent_back(server):
    """tool_choice "any" (sent as "required") with a @tool function: a call of it with valid integer arguments; the
    tool's ToolMessage goes back as a `role: "tool"` message after the assistant turn that has only tool_calls, and
    the server answers the next turn."""
    model = chat_model(server)
    bound = model.bind_tools([add], tool_choice="any", parallel_tool_calls=False)
    messages = [HumanMessage("Add 2 and 3.")]
    message = bound.invoke(messages)
    [call] = message.tool_calls
    assert call["name"] == "add"
    arguments = add.args_schema.model_validate(call["args"])
    assert isinstance(arguments.a, int) and isinstance(arguments.b, int)
    result = add.invoke(call)
    assert isinstance(result, ToolMessage) and result.tool_call_id == call["id"]
    answer = model.bind_tools([add]).invoke([*messages, message, result], max_tokens=8)
    assert isinstance(answer, AIMessage)
    assert answer.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")


def test_langchain_structured_output_json_schema_is_an_instance(server):
    """with_structured_output(method="json_schema"): the server's grammar makes the answer a Verdict."""
    verdict = chat_model(server).with_structured_output(Verdict, method="json_schema").invoke("Judge this: 2+2=4")
    assert isinstance(verdict, Verdict)
    assert len(verdict.title) <= 10


def test_langchain_streams_a_forced_tool_call(server):
    """.stream of a forced call: the streamed delta.tool_calls add up to one valid call."""
    bound = chat_model(server).bind_tools([GetWeather], tool_choice="GetWeather", parallel_tool_calls=False)
    total = None
    for chunk in bound.stream("Weather in Rome?"):
        total = chunk if total is None else total + chunk
    assert total.response_metadata["finish_reason"] == "tool_calls"
    [call] = total.tool_calls
    assert call["name"] == "GetWeather"
    GetWeather.model_validate(call["args"])


def test_langchain_streaming_reads_the_handoff_status_from_the_response_headers(server):
    """With include_response_headers=True, LangChain puts the response's headers in the first streamed chunk's
    response_metadata["headers"] (and so in the merged message's): the switch to large says applied there. The
    session is pinned by a default header."""
    session = {"X-Session-ID": "langchain-stream"}
    small = chat_model(server, "small", max_tokens=6, include_response_headers=True, default_headers=session)
    first = small.invoke("Hello there.")
    assert handoff_headers(first.response_metadata["headers"])["x-kv-handoff"] == "none"
    large = chat_model(server, "large", max_tokens=6, include_response_headers=True, default_headers=session)
    chunks = list(large.stream([HumanMessage("Hello there."), first, HumanMessage("And now?")]))
    assert "headers" in chunks[0].response_metadata
    total = chunks[0]
    for chunk in chunks[1:]:
        total = total + chunk
    headers = handoff_headers(total.response_metadata["headers"])
    assert headers["x-kv-handoff"] == "applied" and headers["x-vsr-kv-transfer-status"] == "applied"
    assert headers["x-vsr-kv-mapper-id"] == server.engine.mapper_id("small", "large")
    assert headers["x-vsr-kv-cache-id"] == handoff_headers(first.response_metadata["headers"])["x-vsr-kv-cache-id"]
    assert total.response_metadata["finish_reason"] in ("stop", "length")
    assert isinstance(total.content, str)


# -- LiteLLM -------------------------------------------------------------------------------------------------------
def litellm_chat(server, model, messages, **settings):
    return litellm.completion(model=f"openai/{model}", api_base=server.url + "/v1", api_key="x", messages=messages,
                              temperature=0, num_retries=0, timeout=30, **settings)


def provider_headers(response) -> dict[str, str | None]:
    """The handoff headers of a LiteLLM response (LiteLLM keeps the provider's headers, prefixed llm_provider-)."""
    headers = response._hidden_params["additional_headers"]
    return handoff_headers({key.removeprefix("llm_provider-"): value for key, value in headers.items()})


def test_litellm_plain_completion_and_session_pinning(server):
    """A plain completion through `openai/<model>` with api_base; pinned by x-litellm-session-id, the next turn on
    the large model is handed over (LiteLLM passes the provider's headers on in _hidden_params)."""
    session = {"x-litellm-session-id": "litellm-1"}
    messages = [{"role": "user", "content": "Say hi."}]
    response = litellm_chat(server, "small", messages, max_tokens=6, extra_headers=session)
    choice = response.choices[0]
    assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")
    assert response.usage.completion_tokens <= 6 and response.usage.prompt_tokens > 0
    assert provider_headers(response)["x-kv-handoff"] == "none"
    messages += [{"role": "assistant", "content": choice.message.content}, {"role": "user", "content": "Again."}]
    response = litellm_chat(server, "large", messages, max_tokens=6, extra_headers=session)
    headers = provider_headers(response)
    assert headers["x-kv-handoff"] == "applied" and headers["x-vsr-kv-transfer-status"] == "applied"


def test_litellm_passes_prompt_cache_key_on_as_the_session(server):
    """Without a session header, the body's prompt_cache_key (which LiteLLM passes on) names the session."""
    messages = [{"role": "user", "content": "Say hi."}]
    first = litellm_chat(server, "small", messages, max_tokens=4, prompt_cache_key="litellm-key-1")
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "?"}]
    second = litellm_chat(server, "large", messages, max_tokens=4, prompt_cache_key="litellm-key-1")
    assert provider_headers(second)["x-kv-handoff"] == "applied"
    assert provider_headers(second)["x-vsr-kv-cache-id"] == provider_headers(first)["x-vsr-kv-cache-id"] is not None


def test_litellm_named_tool_call_is_parsed_into_message_tool_calls(server):
    response = litellm_chat(server, "small", [{"role": "user", "content": "Weather in Oslo?"}], max_tokens=CALL_TOKENS,
                            tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                            parallel_tool_calls=False)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])


def test_litellm_router_of_two_deployments_hands_over_a_pinned_session(server):
    """A LiteLLM Router with two `openai/` deployments on the one kvhandoff base URL (docs/SERVING.md's model_list):
    a session pinned by x-litellm-session-id moves from one deployment to the other with its cache."""
    base = server.url + "/v1"
    router = litellm.Router(model_list=[
        {"model_name": "coder-small", "litellm_params": {"model": "openai/small", "api_base": base, "api_key": "x"}},
        {"model_name": "coder-large", "litellm_params": {"model": "openai/large", "api_base": base, "api_key": "x"}},
    ], num_retries=0)
    session = {"x-litellm-session-id": "litellm-router-1"}
    messages = [{"role": "user", "content": "Plan the next step."}]
    response = router.completion(model="coder-small", messages=messages, max_tokens=6, temperature=0,
                                 extra_headers=session)
    assert provider_headers(response)["x-kv-handoff"] == "none"
    messages += [{"role": "assistant", "content": response.choices[0].message.content},
                 {"role": "user", "content": "This one is hard."}]
    response = router.completion(model="coder-large", messages=messages, max_tokens=6, temperature=0,
                                 extra_headers=session)
    assert provider_headers(response)["x-kv-handoff"] == "applied"


def test_litellm_maps_an_over_long_prompt_to_context_window_exceeded(server):
    """The server's 400 (code context_length_exceeded, OpenAI's message) is LiteLLM's ContextWindowExceededError."""
    with pytest.raises(litellm.ContextWindowExceededError) as raised:
        litellm_chat(server, "small", [{"role": "user", "content": "x" * (MAX_CONTEXT + 100)}], max_tokens=4)
    assert raised.value.status_code == 400
    assert f"maximum context length is {MAX_CONTEXT} tokens" in str(raised.value)


# -- the openai client and the router vocabulary -------------------------------------------------------------------
def test_openai_client_pins_a_session_by_litellm_header_across_small_large_small(server):
    """x-litellm-session-id names the session: the first turn has no transfer (unsupported, no mapper), the switch to
    large and the one back are applied in both vocabularies and name the mapper of their direction (its manifest
    checksum); the cache id stays the session's and differs from another session's."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=30)
    engine = server.engine

    def turn(model, messages, session):
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=6, temperature=0,
            extra_headers={"x-litellm-session-id": session})
        return raw.parse().choices[0].message.content, handoff_headers(raw.headers), raw.headers

    messages, seen = [], []
    for model, user in zip(["small", "large", "small"], ["Read this log.", "Find the bug.", "Thanks."], strict=True):
        messages.append({"role": "user", "content": user})
        answer, headers, raw = turn(model, messages, "agent-7")
        assert raw["x-session-id"] == "agent-7"
        seen.append(headers)
        messages.append({"role": "assistant", "content": answer})
    first, switch, back = seen
    assert first["x-kv-handoff"] == "none" and first["x-vsr-kv-transfer-status"] == "unsupported"
    assert first["x-vsr-kv-mapper-id"] is None
    assert switch["x-kv-handoff"] == "applied" and switch["x-vsr-kv-transfer-status"] == "applied"
    assert switch["x-vsr-kv-mapper-id"] == engine.mapper_id("small", "large")
    assert back["x-kv-handoff"] == "applied" and back["x-vsr-kv-transfer-status"] == "applied"
    assert back["x-vsr-kv-mapper-id"] == engine.mapper_id("large", "small") != switch["x-vsr-kv-mapper-id"]
    assert first["x-vsr-kv-cache-id"] == switch["x-vsr-kv-cache-id"] == back["x-vsr-kv-cache-id"] is not None
    other = turn("small", [{"role": "user", "content": "Read this log."}], "agent-8")[1]
    assert other["x-vsr-kv-cache-id"] not in (None, first["x-vsr-kv-cache-id"])


def test_openai_client_agent_turns_hand_over_with_tool_calls_and_results(server):
    """The README's agent loop: a routine turn on small must call the tool; its call (an assistant turn with null
    content) and the tool's result (`role: "tool"`) go back, and the hard turn on large is handed over."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=30)
    session = {"X-Session-ID": "agent-tools"}
    tools = [WEATHER_TOOL]
    messages = [{"role": "user", "content": "Should I take an umbrella in Oslo?"}]
    reply = client.chat.completions.create(model="small", messages=messages, tools=tools, tool_choice="required",
                                           max_tokens=CALL_TOKENS, temperature=0, extra_headers=session)
    assert reply.choices[0].finish_reason == "tool_calls" and reply.choices[0].message.content is None
    call = reply.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    messages += [{"role": "assistant", "content": None,
                  "tool_calls": [{"id": call.id, "type": "function",
                                  "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                 {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "rain", "celsius": 9}'}]
    raw = client.chat.completions.with_raw_response.create(model="large", messages=messages, tools=tools,
                                                           max_tokens=8, temperature=0, extra_headers=session)
    headers, answer = handoff_headers(raw.headers), raw.parse()
    assert headers["x-kv-handoff"] == "applied" and headers["x-vsr-kv-transfer-status"] == "applied"
    assert headers["x-vsr-kv-mapper-id"] == server.engine.mapper_id("small", "large")
    handoff = answer.model_extra["kv_handoff"]
    assert handoff["from"] == "small" and handoff["mapped_tokens"] == answer.usage.prompt_tokens_details.cached_tokens
    assert handoff["mapped_tokens"] > reply.usage.prompt_tokens  # the first prompt and the call the small model wrote


# -- LangGraph -----------------------------------------------------------------------------------------------------
def test_langgraph_hand_over_between_agents_with_their_own_instructions_reuses_the_history(server):
    """A LangGraph graph of two agents on one message state, each with its own system prompt: the clerk on the small
    model answers, then the analyst on the large model reads the same history behind other instructions — found at
    its new offset (X-KV-Reuse: offset), mapped from the clerk's model."""
    from langchain_core.messages import SystemMessage
    from langgraph.graph import END, START, MessagesState, StateGraph

    clerk = chat_model(server, "small", max_tokens=8)
    analyst = chat_model(server, "large", max_tokens=8, include_response_headers=True)
    graph = StateGraph(MessagesState)
    graph.add_node("clerk", lambda state: {"messages": [clerk.invoke(
        [SystemMessage("You are the clerk. Look the order up, then pass it on."), *state["messages"]])]})
    graph.add_node("analyst", lambda state: {"messages": [analyst.invoke(
        [SystemMessage("Analyst: decide."), *state["messages"]])]})
    graph.add_edge(START, "clerk")
    graph.add_edge("clerk", "analyst")
    graph.add_edge("analyst", END)
    history = [HumanMessage("My order 5678 arrived damaged: the lid was cracked and two cups were broken."),
               AIMessage("I am sorry! Order 5678 shipped on June 3 with standard shipping, insured."),
               HumanMessage("Can you refund the broken cups?")]
    result = graph.compile().invoke({"messages": history})
    headers = handoff_headers(result["messages"][-1].response_metadata["headers"])
    assert headers["x-kv-reuse"] == "offset" and headers["x-kv-handoff"] == "applied"
