"""An agent handoff through the server with the OpenAI Agents SDK (`kvhandoff-lab bench-handoff`): how much of the
receiving agent's prompt a cache serves when its instructions differ, how soon it answers, and whether it answers
as well as when it reads the history itself.

Each problem is a CoQA conversation's first question (the held-out split, `coqa.split_of`) asked of a two-agent
desk, unmodified SDK code (`Agent`, `Runner`, `OpenAIChatCompletionsModel` on an `AsyncOpenAI` pointed at the
server): a clerk on the small model looks the case up with a function tool (forced, one call; the SDK stops at the
tool's result, so the story is the tool's output in the history), then, at the member's question, hands off with
the SDK's own ``transfer_to_analyst`` (forced, one call) to an analyst on the large model, with other instructions
and no tools, who answers from the history the SDK hands over (its input filter leaves out the transfer's own call
and output, so the question is the last message).

Conditions, each in a tenant of its own (the request's ``user``), problems in the same order: "offset" — the server
as it serves (``kv_handoff.mode`` "auto": the analyst's history found at another offset); "prefix" — the same
requests with ``kv_handoff.mode`` "reprefill", which reuses prefixes only (what a prefix cache gives). Measured at
the analyst's request (one per problem): the share of its prompt served from a cache (usage's cached tokens /
prompt tokens), the client's time to the first streamed bytes (the server answers headers once the first token's
distribution is known), the server's `kv_handoff` report, and the answer's F1 against CoQA's references. The first
problem a server sees pays for the analyst's instructions once; the summary also gives the rest alone.

The JSON (`HANDOFF_FORMAT`): ``settings``, ``problems`` (per problem and condition: each request's model, prompt and
cached tokens, first-bytes seconds and report; the answer and its F1) and ``summary`` (`summarize_handoff`); written
after every problem; a rerun with the same file and settings continues.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import httpx
import numpy as np

from kvhandoff.coqa import coqa_places, load_coqa_conversations, split_of
from kvhandoff.files import atomic_write_json
from kvhandoff.serving.engine import Engine
from kvhandoff.serving.server import serve_in_thread
from kvhandoff.serving.settings import ServeConfig
from kvhandoff_lab.evaluation.metrics import paired_bootstrap, token_f1
from kvhandoff_lab.evaluation.switch import paired_difference
from kvhandoff_lab.resume import stored_part

logger = logging.getLogger(__name__)

HANDOFF_FORMAT = "kvhandoff-agent-handoff/1"
#: each condition's kv_handoff.mode
CONDITIONS = {"offset": "auto", "prefix": "reprefill"}
CLERK_INSTRUCTIONS = ("You are the front desk of a reading club's help line. Open the calling member's case with "
                      "lookup_case, then hand every question about its document to the analyst.")
ANALYST_INSTRUCTIONS = ("You are the club's analyst. The conversation holds a document a colleague looked up. Answer "
                        "the member's last question from that document in as few words as possible: a name, a "
                        "number, a short phrase, or yes or no.")
CLERK_TOKENS = 96  # a forced call without arguments fits, even byte by byte
ANSWER_TOKENS = 24


#: the longest story a problem looks up, in characters (a few hundred tokens, as a looked-up record is)
MAX_STORY_CHARS = 2500


def handoff_problems(count: int, split: str = "heldout", max_chars: int = MAX_STORY_CHARS) -> list:
    """The first ``count`` CoQA conversations of ``split`` (stories the guard was never calibrated on) whose story
    has at most ``max_chars`` characters."""
    places = coqa_places()
    conversations = sorted(load_coqa_conversations(min_turns=1, num_turns=1), key=lambda c: c.id)
    return [c for c in conversations if split_of(places[c.id]) == split and len(c.story) <= max_chars][:count]


def without_transfer(data):
    """A handoff input filter (the SDK's `Handoff.input_filter`): the history as it is, less the handoff's own call
    and output, so the receiving agent reads the member's question last."""
    from agents.items import HandoffCallItem, HandoffOutputItem

    def kept(items):
        return None if items is None else tuple(item for item in items
                                                if not isinstance(item, HandoffCallItem | HandoffOutputItem))

    return data.clone(new_items=kept(data.new_items), input_items=kept(data.input_items))


class _Recorder(httpx.AsyncBaseTransport):
    """A transport that passes every request through and keeps, per chat completion, its model, the seconds to
    its first streamed bytes, its ``kv_handoff`` report and usage (read from the stream as it passes)."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.requests: list[dict] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        record = {"model": body.get("model"), "first_bytes_s": None, "kv_handoff": None, "usage": None}
        self.requests.append(record)
        started = time.perf_counter()
        response = await self.inner.handle_async_request(request)
        record["headers_s"] = round(time.perf_counter() - started, 4)
        record["reuse"] = response.headers.get("x-kv-reuse")
        stream = response.stream

        async def relayed():
            buffer = b""
            async for chunk in stream:
                if record["first_bytes_s"] is None:
                    record["first_bytes_s"] = round(time.perf_counter() - started, 4)
                buffer += chunk
                yield chunk
            _read_events(buffer, record)

        return httpx.Response(response.status_code, headers=response.headers, stream=_Stream(relayed(), stream),
                              extensions=response.extensions)

    async def aclose(self) -> None:
        await self.inner.aclose()


class _Stream(httpx.AsyncByteStream):
    def __init__(self, chunks, inner) -> None:
        self.chunks, self.inner = chunks, inner

    async def __aiter__(self):
        async for chunk in self.chunks:
            yield chunk

    async def aclose(self) -> None:
        await self.inner.aclose()


def _read_events(body: bytes, record: dict) -> None:
    """The report and usage of a streamed (or plain) chat completion ``body`` into ``record``."""
    text = body.decode("utf-8", "replace")
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ") and line[6:] != "[DONE]"]
    for event in events or [text]:
        try:
            data = json.loads(event)
        except ValueError:
            continue
        if isinstance(data, dict):
            record["kv_handoff"] = record["kv_handoff"] or data.get("kv_handoff")
            record["usage"] = data.get("usage") or record["usage"]


async def _episode(url: str, small: str, large: str, problem, mode: str, tenant: str) -> dict:
    """One problem under one condition with the Agents SDK: the clerk's lookup, then its handoff and the analyst's
    answer; the analyst's request as the recorder saw it, the answer and its F1."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        handoff,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    recorder = _Recorder()
    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", http_client=httpx.AsyncClient(
        transport=recorder, timeout=600))
    extra = {"user": tenant, "kv_handoff": {"mode": mode}}

    @function_tool
    def lookup_case() -> str:
        """Open the calling member's case: the document filed under it."""
        return problem.story

    analyst = Agent(name="Analyst", instructions=ANALYST_INSTRUCTIONS,
                    model=OpenAIChatCompletionsModel(large, client),
                    model_settings=ModelSettings(temperature=0, max_tokens=ANSWER_TOKENS, include_usage=True,
                                                 extra_body=extra))
    clerk = Agent(name="Clerk", instructions=CLERK_INSTRUCTIONS, tools=[lookup_case],
                  handoffs=[handoff(analyst, input_filter=without_transfer)],
                  model=OpenAIChatCompletionsModel(small, client), tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(temperature=0, max_tokens=CLERK_TOKENS, tool_choice="lookup_case",
                                               parallel_tool_calls=False, include_usage=True, extra_body=extra))
    try:
        looked_up = await Runner.run(clerk, f"Hello, this is member {problem.id[:6]}. Please open my case.")
        handing = clerk.clone(tool_use_behavior="run_llm_again", model_settings=ModelSettings(
            temperature=0, max_tokens=CLERK_TOKENS, tool_choice="transfer_to_analyst", parallel_tool_calls=False,
            include_usage=True, extra_body=extra))
        question = {"role": "user", "content": problem.turns[0].question}
        streamed = Runner.run_streamed(handing, [*looked_up.to_input_list(), question])
        async for _ in streamed.stream_events():
            pass
        answer = str(streamed.final_output or "")
    finally:
        await client.close()
    analyst_requests = [r for r in recorder.requests if r["model"] == large]
    if not analyst_requests:
        raise RuntimeError(f"{problem.id}: the clerk never handed off to the analyst")
    request = analyst_requests[0]
    usage = request["usage"] or {}
    prompt = usage.get("prompt_tokens", 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"answer": answer, "f1": max(token_f1(answer, ref) for ref in problem.turns[0].answers),
            "prompt_tokens": prompt, "cached_tokens": cached, "share": cached / prompt if prompt else 0.0,
            "first_bytes_s": request["first_bytes_s"], "reuse": request["reuse"], "kv_handoff": request["kv_handoff"],
            "requests": recorder.requests}


def run_agent_handoff(url: str, small: str, large: str, problems: list, out: Path | None = None,
                      time_budget_s: float | None = None, settings: dict | None = None) -> dict:
    """Every problem under every condition against the server at ``url`` (see the module docstring)."""
    settings = {"format": HANDOFF_FORMAT, "small": small, "large": large, "conditions": CONDITIONS,
                **(settings or {})}
    result = {"settings": settings, "problems": stored_part(out, {"settings": settings}, "problems")}
    started, served = time.perf_counter(), 0
    for problem in problems:
        if problem.id in result["problems"]:
            continue
        if time_budget_s is not None and time.perf_counter() - started > time_budget_s:
            logger.info("time budget reached: %d problems left", len(problems) - len(result["problems"]))
            break
        entry = {name: asyncio.run(_episode(url, small, large, problem, mode, f"handoff-{name}"))
                 for name, mode in CONDITIONS.items()}
        entry["order"] = len(result["problems"])
        entry["first_of_server"] = not served  # the analyst's instructions were not cached yet
        served += 1
        result["problems"][problem.id] = entry
        logger.info("%s: %s", problem.id, {name: (round(entry[name]["share"], 2), entry[name]["first_bytes_s"],
                                                 round(entry[name]["f1"], 2)) for name in CONDITIONS})
        result["summary"] = summarize_handoff(result)
        if out is not None:
            atomic_write_json(out, result)
    result["summary"] = summarize_handoff(result)
    if out is not None:
        atomic_write_json(out, result)
    return result


def summarize_handoff(result: dict) -> dict:
    """Per condition: the analyst's mean cache share, mean first-bytes seconds and mean F1, over every problem and
    over those after the first a server saw (the analyst's instructions cached); the time ratio prefix / offset per
    problem (geometric mean) and F1 offset − prefix with its paired interval."""
    entries = sorted(result["problems"].values(), key=lambda entry: entry["order"])
    summary: dict = {"problems": len(entries)}
    if not entries:
        return summary
    warm = [entry for entry in entries if not entry["first_of_server"]]
    for scope, chosen in (("all", entries), ("after_first", warm)):
        if not chosen:
            continue
        part: dict = {name: {"share": float(np.mean([e[name]["share"] for e in chosen])),
                             "first_bytes_s": float(np.mean([e[name]["first_bytes_s"] for e in chosen])),
                             "f1": float(np.mean([e[name]["f1"] for e in chosen])),
                             "offset_reuses": sum(e[name]["reuse"] == "offset" for e in chosen)}
                      for name in CONDITIONS}
        ratios = np.array([e["prefix"]["first_bytes_s"] / e["offset"]["first_bytes_s"] for e in chosen])
        part["speedup"] = float(np.exp(np.log(ratios).mean()))
        part["speedup_ci"] = list(paired_bootstrap({"r": np.log(ratios)}, lambda s: float(np.exp(s["r"].mean()))))
        part["f1_offset_minus_prefix"] = paired_difference([e["offset"]["f1"] for e in chosen],
                                                           [e["prefix"]["f1"] for e in chosen])
        summary[scope] = part
    return summary


def run_handoff_bench(models, mappers, config: ServeConfig, problems: list, **options) -> dict:
    """Serve ``models`` (the first small, the second large) on a free loopback port in this process and run the
    handoff bench against it (`run_agent_handoff`'s ``options``)."""
    small, large = list(models)[:2]
    engine = Engine(models, mappers, config)
    with serve_in_thread(engine, host="127.0.0.1") as running:
        return run_agent_handoff(running.url, small, large, problems, **options)
