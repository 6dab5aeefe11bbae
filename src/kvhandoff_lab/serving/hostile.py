"""A hostile mixed load on the server (`kvhandoff-lab load-hostile`): normal chat requests mixed with the hostile
inputs the server must hold under (tests/test_hostile_input.py), sent at once for a bounded time over loopback
HTTP, while /health is polled.

One client task per class of request (two for the normal chat traffic), each sending one request after another
until the time or the request budget is spent (none starts after it); every class's requests are built once:

- ``chat``: a short greedy chat turn, alternating between the hosted models (a 200 expected);
- ``tool_flood``: 40,000 tools in one body (about 1.9 MB; refused by count: 400);
- ``huge_logprobs``: ``n × max_tokens × (1 + top_logprobs)`` past the server's bound, on chat and on an echoed
  completion (refused before any work: 400), alternating with 16 choices × 20 alternatives within it (200);
- ``slow_body``: a body trickled a few bytes at a time for longer than ``--read-timeout`` (408, connection closed);
- ``half_sent``: half a body, then nothing (408 once ``--read-timeout`` has passed);
- ``disconnect``: a client that goes away before its answer — a non-streaming request whose connection is closed
  after a moment, or a stream closed after its first line (the server cancels the generation);
- ``bad_utf8``: a body that is not UTF-8 (400 invalid_json);
- ``deep_json``: JSON nested 100,000 arrays or 20,000 objects deep (400 invalid_json);
- ``long_keys``: a prompt_cache_key or X-Session-ID past 256 characters (400), or 100 unknown field names of 200
  characters each (ignored, logged boundedly: 200).

Reported: per class the requests sent, their seconds (p50, max) and each status the client saw (``disconnected``:
the client left first; ``closed``: the server closed the connection without an answer; ``timeout`` / ``error``: the
client's own), every status together, the server's own count of its answers by status (/metrics, the load's share),
the 5xx count (the server holds when it is 0), the /health latency (p50 / p99 / max over the polls, polls that did
not answer 200, and the idle latency before the load), and the process's RSS before the load (after one warm-up turn
per model), at its peak during the load, and after it settled (no request running, then ``settle_s`` seconds). The
server runs in this process (models included in the RSS), the clients and the /health poller in a child process.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import multiprocessing
import threading
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import httpx

import kvhandoff
from kvhandoff.errors import ConfigError
from kvhandoff.files import atomic_write_json
from kvhandoff.serving.engine import Engine
from kvhandoff.serving.parse import SESSION_HEADER
from kvhandoff.serving.protocol import MAX_CHOICES, MAX_KEY_CHARS, MAX_TOP_LOGPROBS
from kvhandoff.serving.server import serve_in_thread
from kvhandoff.serving.settings import ServeConfig
from kvhandoff_lab.serving.client import machine_facts, require_loopback
from kvhandoff_lab.serving.loadtest import current_rss, peak_rss, percentile

HOSTILE_FORMAT = "kvhandoff-serve-hostile/1"
#: the classes of request, in the report's order
CLASSES = ("chat", "tool_flood", "huge_logprobs", "slow_body", "half_sent", "disconnect", "bad_utf8", "deep_json",
           "long_keys")
CHAT = "/v1/chat/completions"
#: tools in one flooding body
FLOOD_TOOLS = 40_000
#: what the clients send of a slow body at a time, and how often at least (seconds)
TRICKLE_BYTES, TRICKLE_EVERY_S = 8, 0.25
#: /health requests timed one after another before the load (the idle latency)
IDLE_POLLS = 20
#: how long a disconnecting client waits before it goes away (seconds)
DISCONNECT_AFTER_S = 0.3


def _json(body: dict) -> bytes:
    return json.dumps(body).encode()


def _head(path: str, length: int, host: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


class Requests:
    """Every class's requests against a server hosting ``names``, built once; ``next(kind)`` the next one of a
    class (each class cycles through its variants)."""

    def __init__(self, names: list[str], max_tokens: int) -> None:
        first = names[0]
        hi = [{"role": "user", "content": "hi"}]
        chat = [{"model": name, "max_tokens": max_tokens, "temperature": 0,
                 "messages": [{"role": "user", "content": f"Say something about the number {i}."}]}
                for i, name in zip(range(8), itertools.cycle(names))]
        tools = [{"type": "function", "function": {"name": f"t{i}"}} for i in range(FLOOD_TOOLS)]
        past_bound = {"model": first, "messages": hi, "n": MAX_CHOICES, "logprobs": True,
                      "top_logprobs": MAX_TOP_LOGPROBS, "max_tokens": 4000}
        echoed = {"model": first, "prompt": list(range(3, 253)) * 12, "echo": True, "logprobs": 5, "n": MAX_CHOICES,
                  "max_tokens": 1}
        within = {"model": first, "messages": hi, "n": MAX_CHOICES, "logprobs": True,
                  "top_logprobs": MAX_TOP_LOGPROBS, "max_tokens": 2}
        long_fields = {f"field_{i}_" + "x" * 190: 1 for i in range(100)}
        self.variants = {
            "chat": [("POST", CHAT, _json(body), {}) for body in chat],
            "tool_flood": [("POST", CHAT, _json({"model": first, "messages": hi, "max_tokens": 1, "tools": tools}),
                            {})],
            "huge_logprobs": [("POST", CHAT, _json(past_bound), {}), ("POST", CHAT, _json(within), {}),
                              ("POST", "/v1/completions", _json(echoed), {})],
            "slow_body": [_json({"model": first, "messages": hi, "max_tokens": 1, "padding": "p" * 200})],
            "half_sent": [_json({"model": first, "messages": hi, "max_tokens": 1})],
            "disconnect": [("raw", _json({"model": first, "messages": hi, "max_tokens": 200, "temperature": 0,
                                          "ignore_eos": True})),
                           ("stream", {"model": first, "messages": hi, "max_tokens": 200, "temperature": 0,
                                       "ignore_eos": True, "stream": True})],
            "bad_utf8": [("POST", CHAT, b'{"model": "%s", "messages": [{"role": "user", "content": "caf\xe9"}]}'
                          % first.encode(), {})],
            "deep_json": [("POST", CHAT, b"[" * 100_000 + b"]" * 100_000, {}),
                          ("POST", CHAT, b'{"a": ' * 20_000 + b"1" + b"}" * 20_000, {})],
            "long_keys": [("POST", CHAT, _json({"model": first, "messages": hi, "max_tokens": 1,
                                                "prompt_cache_key": "k" * (MAX_KEY_CHARS + 1)}), {}),
                          ("POST", CHAT, _json({"model": first, "messages": hi, "max_tokens": 1}),
                           {SESSION_HEADER: "h" * (MAX_KEY_CHARS + 1)}),
                          ("POST", CHAT, _json({"model": first, "messages": hi, "max_tokens": 1, **long_fields}), {})],
        }
        self._cycles = {kind: itertools.cycle(variants) for kind, variants in self.variants.items()}

    def next(self, kind: str):
        return next(self._cycles[kind])


async def _send(http: httpx.AsyncClient, method: str, path: str, body: bytes, headers: dict) -> str:
    response = await http.request(method, path, content=body,
                                  headers={"Content-Type": "application/json", **headers})
    return str(response.status_code)


async def _status_of(reader: asyncio.StreamReader, timeout_s: float) -> str:
    """The status of the answer ``reader`` receives (its head), ``closed`` when the server closes the connection
    without one."""
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout_s)
    except (asyncio.IncompleteReadError, ConnectionError):
        return "closed"
    parts = head.split(maxsplit=2)
    return parts[1].decode() if len(parts) > 1 and parts[0].startswith(b"HTTP/") else "closed"


async def _trickle(address: tuple[str, int], body: bytes, fraction: float, timeout_s: float,
                   every_s: float = TRICKLE_EVERY_S) -> str:
    """Send ``body``'s head, then its first ``fraction`` a few bytes at a time (`TRICKLE_BYTES` every ``every_s``
    seconds; ``fraction`` below 1: that share at once, then nothing); the answer's status."""
    reader, writer = await asyncio.open_connection(*address)
    sent = int(len(body) * fraction)

    async def send():
        with contextlib.suppress(ConnectionError, OSError):
            writer.write(_head(CHAT, len(body), address[0]))
            if fraction < 1:
                writer.write(body[:sent])
                await writer.drain()
                return
            for start in range(0, len(body), TRICKLE_BYTES):
                writer.write(body[start:start + TRICKLE_BYTES])
                await writer.drain()
                await asyncio.sleep(every_s)

    sender = asyncio.create_task(send())
    try:
        return await _status_of(reader, timeout_s)
    finally:
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sender
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()


async def _disconnect(http: httpx.AsyncClient, address: tuple[str, int], variant) -> str:
    """A client that goes away before its answer: ``raw`` closes its connection `DISCONNECT_AFTER_S` after sending a
    whole request, ``stream`` after the stream's first line."""
    how, body = variant
    if how == "raw":
        reader, writer = await asyncio.open_connection(*address)
        try:
            writer.write(_head(CHAT, len(body), address[0]) + body)
            await writer.drain()
            with contextlib.suppress(TimeoutError):
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), DISCONNECT_AFTER_S)
                return head.split()[1].decode()  # answered before the client left
            return "disconnected"
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()
    async with http.stream("POST", CHAT, json=body) as response:
        if response.status_code != 200:
            return str(response.status_code)
        async for _ in response.aiter_lines():
            break
    return "disconnected"


async def _one(kind: str, requests: Requests, http: httpx.AsyncClient, address: tuple[str, int],
               read_timeout_s: float, timeout_s: float) -> str:
    """Send the next request of class ``kind`` (a slow body trickled over twice the server's ``read_timeout_s`` at
    least); what the client saw (a status, or how it ended)."""
    try:
        if kind == "slow_body":
            body = requests.next(kind)
            every = max(TRICKLE_EVERY_S, 2 * read_timeout_s * TRICKLE_BYTES / len(body))
            return await _trickle(address, body, 1.0, timeout_s, every)
        if kind == "half_sent":
            return await _trickle(address, requests.next(kind), 0.5, timeout_s)
        if kind == "disconnect":
            return await _disconnect(http, address, requests.next(kind))
        return await _send(http, *requests.next(kind))
    except (TimeoutError, httpx.TimeoutException):
        return "timeout"
    except (httpx.HTTPError, OSError) as exc:
        return f"error:{type(exc).__name__}"


def _poll_health(url: str, stop: threading.Event, waits: list[float], statuses: Counter, every_s: float,
                 timeout_s: float) -> None:
    """Ask /health every ``every_s`` seconds (one at a time, on a thread of its own: the load's event loop does not
    delay it) until ``stop``: each answer's seconds and status."""
    with httpx.Client(base_url=url, timeout=timeout_s) as http:
        while not stop.is_set():
            asked = time.perf_counter()
            try:
                status = str(http.get("/health").status_code)
            except httpx.HTTPError as exc:
                status = f"error:{type(exc).__name__}"
            waits.append(time.perf_counter() - asked)
            statuses[status] += 1
            stop.wait(every_s)


def _sample_rss(samples: list[int], stop: threading.Event, every_s: float = 0.1) -> None:
    while not stop.is_set():
        rss = current_rss()
        if rss is not None:
            samples.append(rss)
        stop.wait(every_s)


def server_outcomes(metrics_text: str) -> Counter:
    """The server's answers by status, summed over its routes (``kvhandoff_requests_total`` of /metrics)."""
    counts: Counter = Counter()
    for line in metrics_text.splitlines():
        if line.startswith("kvhandoff_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            outcome = labels.split('outcome="', 1)[1].split('"', 1)[0]
            counts[outcome] += int(float(value))
    return counts


async def _load(url: str, names: list[str], duration_s: float, max_requests: int, max_tokens: int,
                read_timeout_s: float, health_every_s: float, timeout_s: float, classes: tuple[str, ...]) -> dict:
    where = urlsplit(url)
    address = (where.hostname, where.port)
    requests = Requests(names, max_tokens)
    sent: dict[str, Counter] = {kind: Counter() for kind in classes}
    seconds: dict[str, list[float]] = {kind: [] for kind in classes}
    budget = itertools.count()
    waits: list[float] = []
    health: Counter = Counter()
    stop = threading.Event()
    idle = _idle_health(url, IDLE_POLLS, timeout_s)
    limits = httpx.Limits(max_connections=len(CLASSES) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as http:
        deadline = time.monotonic() + duration_s

        async def client(kind: str) -> None:
            while time.monotonic() < deadline and next(budget) < max_requests:
                asked = time.perf_counter()
                sent[kind][await _one(kind, requests, http, address, read_timeout_s, timeout_s)] += 1
                seconds[kind].append(time.perf_counter() - asked)

        started = time.monotonic()
        poller = threading.Thread(target=_poll_health, args=(url, stop, waits, health, health_every_s, timeout_s))
        poller.start()
        try:
            await asyncio.gather(*(client(kind) for kind in clients_of(classes)))
        finally:
            wall = time.monotonic() - started
            stop.set()
            poller.join()
    statuses = sum(sent.values(), Counter())
    return {
        "wall_s": wall,
        "requests": sum(statuses.values()),
        "served_2xx": sum(n for status, n in statuses.items() if status.startswith("2")),
        "five_xx": sum(n for status, n in statuses.items() if status.startswith("5")),
        "classes": {kind: {"sent": sum(counts.values()), "statuses": dict(sorted(counts.items())),
                           "seconds_p50": percentile(seconds[kind], 0.5),
                           "seconds_max": max(seconds[kind], default=None)} for kind, counts in sent.items()},
        "statuses": dict(sorted(statuses.items())),
        "health": {"polls": len(waits), "statuses": dict(sorted(health.items())),
                   "p50_s": percentile(waits, 0.5), "p99_s": percentile(waits, 0.99),
                   "max_s": max(waits) if waits else None,
                   "idle_p50_s": percentile(idle, 0.5), "idle_p99_s": percentile(idle, 0.99)},
    }


def clients_of(classes) -> list[str]:
    """One client task per class, two for the normal chat traffic."""
    return [kind for kind in classes for _ in range(2 if kind == "chat" else 1)]


def _idle_health(url: str, polls: int, timeout_s: float) -> list[float]:
    """The seconds of ``polls`` /health requests one after another before the load (the server idle)."""
    waits = []
    with httpx.Client(base_url=url, timeout=timeout_s) as http:
        for _ in range(polls):
            asked = time.perf_counter()
            http.get("/health")
            waits.append(time.perf_counter() - asked)
    return waits


def hostile_over_http(url: str, names: list[str], duration_s: float = 60.0, max_requests: int = 5000,
                      max_tokens: int = 8, read_timeout_s: float = 2.0, health_every_s: float = 0.1,
                      timeout_s: float = 120.0, classes=CLASSES) -> dict:
    """The clients' side of the hostile mixed load (module docstring) against the server at ``url`` (loopback only)
    hosting ``names``, for ``duration_s`` seconds or ``max_requests`` requests, whichever ends first (none starts
    after; each waits ``timeout_s`` at most); ``read_timeout_s``: the server's (a slow body is trickled for longer).
    ``classes``: which of `CLASSES` to send. What the clients saw: per class the statuses, every status together,
    the /health latency under the load and, before it, at idle (`IDLE_POLLS` polls)."""
    url = require_loopback(url)
    if duration_s <= 0 or max_requests < 1 or max_tokens < 1 or read_timeout_s <= 0 or health_every_s <= 0:
        raise ConfigError("duration_s, max_requests, max_tokens, read_timeout_s and health_every_s must be positive")
    classes = tuple(classes)
    unknown = sorted(set(classes) - set(CLASSES))
    if unknown or not classes:
        raise ConfigError(f"classes: one or more of {', '.join(CLASSES)}, got {', '.join(unknown) or 'none'}")
    return asyncio.run(_load(url, names, duration_s, max_requests, max_tokens, read_timeout_s, health_every_s,
                             timeout_s, classes))


def run_hostile_load(models, mappers, config: ServeConfig = ServeConfig(),  # noqa: B008 - frozen
                     duration_s: float = 60.0, max_requests: int = 5000, max_tokens: int = 8,
                     health_every_s: float = 0.1, settle_s: float = 5.0, timeout_s: float = 120.0,
                     classes=CLASSES, out: str | Path | None = None) -> dict:
    """Serve ``models`` on a free loopback port in this process (``config``: its settings, ``read_timeout_s``
    included) and run the hostile mixed load against it from a child process (`hostile_over_http`: the clients and
    the /health poller share no interpreter with the server, so what they do neither slows its answers nor counts in
    its RSS); this process's RSS sampled meanwhile. Writes the report to ``out`` (JSON) when given and returns it."""
    if settle_s < 0:
        raise ConfigError("settle_s must be >= 0")
    engine = Engine(models, mappers, config)
    names = engine.model_names()
    samples: list[int] = []
    stop = threading.Event()
    with serve_in_thread(engine, host="127.0.0.1") as server, httpx.Client(base_url=server.url,
                                                                          timeout=timeout_s) as http:
        for name in names:  # warm-up: one turn per model, so the RSS before counts what a first request takes
            http.post(CHAT, json={"model": name, "messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 1})
        before = server_outcomes(http.get("/metrics").text)
        gc.collect()
        rss_before = current_rss()
        sampler = threading.Thread(target=_sample_rss, args=(samples, stop))
        sampler.start()
        try:
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as clients:
                report = clients.submit(hostile_over_http, server.url, names, duration_s, max_requests,
                                        max_tokens, config.read_timeout_s, health_every_s, timeout_s,
                                    tuple(classes)).result()
        finally:
            stop.set()
            sampler.join()
        settling = time.monotonic()
        while engine.running() and time.monotonic() - settling < timeout_s:
            time.sleep(0.05)
        time.sleep(settle_s)
        gc.collect()
        rss_after = current_rss()
        after = server_outcomes(http.get("/metrics").text)
    server_statuses = after - before
    report = {
        "format": HOSTILE_FORMAT,
        "kvhandoff_version": kvhandoff.__version__,
        "settings": {"duration_s": duration_s, "max_requests": max_requests, "max_tokens": max_tokens,
                     "read_timeout_s": config.read_timeout_s, "health_every_s": health_every_s, "settle_s": settle_s,
                     "timeout_s": timeout_s, "models": names,
                     "clients": dict(Counter(clients_of(classes))),
                     "max_body_bytes": config.max_body_bytes, "max_batch": config.max_batch,
                     "guard": config.switch.guard},
        **report,
        "server_five_xx": sum(n for status, n in server_statuses.items() if status.startswith("5")),
        "server_statuses": dict(sorted(server_statuses.items())),
        "memory": {"rss_before_bytes": rss_before, "rss_peak_during_load_bytes": max(samples) if samples else None,
                   "rss_after_settling_bytes": rss_after, "peak_rss_bytes": peak_rss(samples),
                   "note": "RSS of the process serving (models included; the clients run in a child process); "
                           "before: after one warm-up turn per model; peak during load: sampled every 0.1 s; after "
                           "settling: no request running, then settle_s seconds; peak_rss: over the process's life "
                           "(loading included)"},
        "machine": machine_facts(),
    }
    if out is not None:
        atomic_write_json(Path(out), report)
    return report


def hostile_summary(report: dict) -> str:
    """The hostile load's totals in three lines: requests and statuses, /health, memory."""
    health, memory = report["health"], report["memory"]
    gib = 2**30
    return "\n".join((
        f"{report['requests']} requests in {report['wall_s']:.1f} s: {report['served_2xx']} served 2xx, 5xx "
        f"{report['five_xx']} (the server counted {report['server_five_xx']}); statuses {report['statuses']}",
        f"/health over {health['polls']} polls: p50 {health['p50_s'] * 1000:.1f} ms, p99 {health['p99_s'] * 1000:.1f} "
        f"ms, max {health['max_s'] * 1000:.1f} ms (idle before: p50 {health['idle_p50_s'] * 1000:.1f} ms); not 200: "
        f"{sum(n for status, n in health['statuses'].items() if status != '200')}",
        f"RSS {memory['rss_before_bytes'] / gib:.3f} GiB before, {memory['rss_peak_during_load_bytes'] / gib:.3f} GiB "
        f"at the peak, {memory['rss_after_settling_bytes'] / gib:.3f} GiB after settling"))


def hostile_table(report: dict):
    """A rich table of the hostile load: per class the requests sent, their seconds (p50, max) and the statuses the
    clients saw."""
    from rich.table import Table  # rich is only needed to print, not to measure

    table = Table(title="hostile load: requests per class")
    for column in ("class", "sent", "s p50", "s max", "statuses"):
        table.add_column(column, justify="left" if column in ("class", "statuses") else "right")
    for kind, row in report["classes"].items():
        timed = [f"{row[key]:.2f}" if row[key] is not None else "-" for key in ("seconds_p50", "seconds_max")]
        table.add_row(kind, str(row["sent"]), *timed,
                      ", ".join(f"{status}: {n}" for status, n in row["statuses"].items()))
    return table
