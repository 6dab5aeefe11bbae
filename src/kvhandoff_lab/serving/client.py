"""A small asyncio client of the server for measurements (`serving.bench`, `serving.loadtest`): one streamed chat
request, timed from sending it to the first chunk (the handoff report, sent once the first token's distribution is
known) and to the first chunk with content (what a user sees), with the server's `kv_handoff` report and usage.

Measurements stay on this machine: `require_loopback` refuses any other address.
"""

from __future__ import annotations

import ipaddress
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

import httpx
import torch

from kvhandoff.errors import ConfigError
from kvhandoff.serving.parse import SESSION_HEADER
from kvhandoff.serving.respond import HANDOFF_HEADER


def require_loopback(url: str) -> str:
    """``url`` if its host is a loopback address (127.0.0.0/8, ::1, localhost); ConfigError otherwise."""
    host = urlsplit(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ConfigError(f"url: measurements run against a server on this machine only (127.0.0.1), got {url!r}")
    return url.rstrip("/")


@dataclass
class TurnResult:
    """One streamed chat request as the client saw it. Times in seconds from sending the request: ``first_chunk_s``
    (the first event: role and kv_handoff), ``ttft_s`` (the first event with content; None for an empty answer),
    ``total_s`` (the stream's end). ``status`` and ``handoff``: the server's report; ``error``: why it failed."""

    model: str
    status: str | None = None
    handoff: dict | None = None
    first_chunk_s: float | None = None
    ttft_s: float | None = None
    total_s: float | None = None
    text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


async def stream_chat(http: httpx.AsyncClient, model: str, messages: list[dict], session_id: str | None = None,
                      max_tokens: int = 16, mode: str = "auto", temperature: float = 0.0) -> TurnResult:
    """Send one streamed chat request (``kv_handoff.mode`` = ``mode``) through ``http`` (its base_url the server's)
    and read it to the end. Failures (a status other than 200, an error event, a transport error) are returned in
    ``error``, never raised."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}, "kv_handoff": {"mode": mode}}
    headers = {SESSION_HEADER: session_id} if session_id else {}
    result = TurnResult(model)
    started = time.perf_counter()
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:300]}"
                return result
            result.status = response.headers.get(HANDOFF_HEADER)
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.perf_counter() - started
                if line == "data: [DONE]":
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = f"error event: {event['error'].get('message')}"
                    break
                if result.first_chunk_s is None:
                    result.first_chunk_s = now
                if event.get("kv_handoff"):
                    result.handoff = event["kv_handoff"]
                    result.status = event["kv_handoff"]["status"]
                for choice in event.get("choices") or ():
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        if result.ttft_s is None:
                            result.ttft_s = now
                        result.text += content
                if event.get("usage"):
                    result.prompt_tokens = event["usage"]["prompt_tokens"]
                    result.completion_tokens = event["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.total_s = time.perf_counter() - started
    return result


def machine_facts() -> dict:
    """What a measurement ran on: platform, CPU count, torch version and threads."""
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads()}
