"""A load test of the server (`kvhandoff-lab load-test`): concurrent agent-like conversations over loopback HTTP.

Each conversation is a CoQA story with its questions (real text, `workload.coqa_dialogues`): the first user turn is
the story and the first question, every later turn the next question, each turn streamed with the answers sent
back as history. The serving model switches every 2 or 3 turns (conversation i: every 2 + i % 2 turns, starting
with hosted model i % 2), so the server hands conversations over while others decode. All conversations run at
once (asyncio, one session each, named by the X-Session-ID header; or, with ``session_header`` False, sent as
most clients send them: no header, the server finding each conversation by its tokens); no turn starts after the
time limit.

Reported: requests and generated tokens per second of wall time, the time to first token (the client's, to the
first chunk with content) at p50 / p95 per handoff status, with the server's own milliseconds, errors (and the first
few messages), and memory: the process's peak RSS over its life (getrusage; the server runs in this process, so it
includes the models) and the RSS sampled during the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import resource
import statistics
import sys
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

import httpx

import kvhandoff
from kvhandoff.errors import ConfigError
from kvhandoff.files import atomic_write_json
from kvhandoff.serving.engine import Engine
from kvhandoff.serving.server import serve_in_thread
from kvhandoff.serving.settings import ServeConfig
from kvhandoff_lab.serving.client import TurnResult, machine_facts, require_loopback, stream_chat
from kvhandoff_lab.serving.workload import coqa_dialogues

LOAD_FORMAT = "kvhandoff-serve-load/1"


def schedule(index: int, turns: int, names: list[str]) -> list[str]:
    """The model serving each turn of conversation ``index``: it starts on ``names[index % 2]`` and switches every
    2 + index % 2 turns (between the first two hosted models)."""
    every = 2 + index % 2
    first, second = (names[0], names[1]) if index % 2 == 0 else (names[1], names[0])
    return [first if (t // every) % 2 == 0 else second for t in range(turns)]


def user_turns(conversation, turns: int, story_chars: int | None = None) -> list[str]:
    """The user's turns of one conversation: the story (its first ``story_chars`` characters when given) with the
    first question, then the next questions."""
    questions = [t.question for t in conversation.turns[:turns]]
    if len(questions) < turns:
        raise ConfigError(f"conversation {conversation.id} has {len(questions)} questions, fewer than {turns} turns")
    story = conversation.story if story_chars is None else conversation.story[:story_chars]
    return [f"{story}\n\nQ: {questions[0]}", *(f"Q: {q}" for q in questions[1:])]


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def current_rss() -> int | None:
    """This process's resident set size in bytes (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def peak_rss(seen: Iterable[int | None] = ()) -> int:
    """This process's peak RSS over its life, in bytes: getrusage's (KiB on Linux, bytes on macOS), or a larger
    RSS ``seen`` by sampling or now — the kernel updates its high-water mark lazily, so a sample can exceed it."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = peak if sys.platform == "darwin" else peak * 1024
    return max([peak, *(rss for rss in (*seen, current_rss()) if rss is not None)])


async def _conversation(http, index: int, models: list[str], texts: list[str], max_tokens: int, deadline: float,
                        results: list, session_header: bool = True) -> int:
    """Run one conversation's turns (none starts after ``deadline``); returns the turns left out."""
    session = f"load-{index}-{uuid.uuid4().hex[:8]}" if session_header else None
    messages: list[dict] = []
    for turn, (model, text) in enumerate(zip(models, texts, strict=True)):
        if time.monotonic() > deadline:
            return len(models) - turn
        messages.append({"role": "user", "content": text})
        result = await stream_chat(http, model, messages, session, max_tokens)
        results.append((index, turn, result))
        if result.error:
            return len(models) - turn - 1  # the conversation cannot go on without its answer
        messages.append({"role": "assistant", "content": result.text})
    return 0


async def _sample_rss(samples: list[int], stop: asyncio.Event, every_s: float = 0.5) -> None:
    while not stop.is_set():
        rss = current_rss()
        if rss is not None:
            samples.append(rss)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)


async def load_over_http(url: str, names: list[str], conversations: int = 4, turns: int = 5, max_tokens: int = 16,
                         time_limit_s: float = 900.0, timeout_s: float = 1800.0, dialogues=None,
                         story_chars: int | None = None, session_header: bool = True) -> dict:
    """Run ``conversations`` conversations of ``turns`` turns at once against the server at ``url`` (loopback only);
    the report (module docstring). ``story_chars``: cut each story to this many characters (small contexts);
    ``session_header`` False: no request names its session."""
    url = require_loopback(url)
    if conversations < 1 or turns < 1 or max_tokens < 1 or time_limit_s <= 0:
        raise ConfigError("conversations, turns, max_tokens and time_limit_s must be positive")
    if len(names) < 2:
        raise ConfigError("the load test switches between two hosted models; the server hosts one")
    dialogues = dialogues if dialogues is not None else coqa_dialogues(conversations, min_turns=turns)
    plans = [(schedule(i, turns, names), user_turns(dialogues[i], turns, story_chars)) for i in range(conversations)]
    results: list[tuple[int, int, TurnResult]] = []
    samples: list[int] = []
    stop = asyncio.Event()
    rss_start = current_rss()
    started = time.monotonic()
    limits = httpx.Limits(max_connections=conversations + 4)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as http:
        sampler = asyncio.create_task(_sample_rss(samples, stop))
        left_out = await asyncio.gather(*(
            _conversation(http, i, models, texts, max_tokens, started + time_limit_s, results, session_header)
            for i, (models, texts) in enumerate(plans)))
        wall = time.monotonic() - started
        stop.set()
        await sampler
        health = (await http.get("/health")).json()
    return summarize_load(results, wall, sum(left_out), samples, rss_start, health,
                          {"conversations": conversations, "turns": turns, "max_tokens": max_tokens,
                           "time_limit_s": time_limit_s, "story_chars": story_chars,
                           "session_header": session_header,
                           "schedules": [models for models, _ in plans],
                           "conversation_ids": [d.id for d in dialogues[:conversations]]})


def summarize_load(results, wall: float, left_out: int, rss_samples: list[int], rss_start: int | None,
                   health: dict, settings: dict) -> dict:
    """The load test's report from its (conversation, turn, TurnResult) records."""
    ok = [r for _, _, r in results if not r.error]
    errors = [f"conversation {c} turn {t}: {r.error}" for c, t, r in results if r.error]
    by_status: dict[str, dict] = {}
    for status in sorted({r.status for r in ok}):
        chosen = [r for r in ok if r.status == status]
        ttft = [r.ttft_s if r.ttft_s is not None else r.first_chunk_s for r in chosen]
        server = [r.handoff["milliseconds"] for r in chosen]
        by_status[status] = {"requests": len(chosen), "ttft_p50_s": percentile(ttft, 0.5),
                             "ttft_p95_s": percentile(ttft, 0.95), "ttft_mean_s": statistics.fmean(ttft),
                             "server_ms_p50": percentile(server, 0.5), "server_ms_p95": percentile(server, 0.95),
                             "prompt_tokens_mean": statistics.fmean(r.prompt_tokens for r in chosen)}
    generated = sum(r.completion_tokens for r in ok)
    return {
        "format": LOAD_FORMAT,
        "kvhandoff_version": kvhandoff.__version__,
        "settings": settings,
        "wall_s": wall,
        "requests": len(ok),
        "errors": len(errors),
        "error_messages": errors[:10],
        "turns_left_out": left_out,
        "requests_per_s": len(ok) / wall if wall > 0 else None,
        "generated_tokens": generated,
        "generated_tokens_per_s": generated / wall if wall > 0 else None,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "ttft_by_status": by_status,
        "memory": {"peak_rss_bytes": peak_rss(rss_samples), "rss_start_bytes": rss_start,
                   "rss_max_during_run_bytes": max(rss_samples) if rss_samples else None,
                   "note": "RSS of the process running the server and the client (models included); peak_rss: "
                           "getrusage over the process's life, or the largest RSS sampled when the kernel's "
                           "high-water mark lags it"},
        "server_health_after": health,
        "requests_log": [{"conversation": c, "turn": t, **r.to_dict()} for c, t, r in results],
        "machine": machine_facts(),
    }


def run_load_test(models, mappers, config: ServeConfig = ServeConfig(),  # noqa: B008 - frozen
                  conversations: int = 4, turns: int = 5, max_tokens: int = 16, time_limit_s: float = 900.0,
                  dialogues=None, story_chars: int | None = None, out: str | Path | None = None,
                  session_header: bool = True) -> dict:
    """Serve ``models`` on a free loopback port in this process and run the load test against it; writes the report
    to ``out`` (JSON) when given and returns it."""
    engine = Engine(models, mappers, config)
    with serve_in_thread(engine, host="127.0.0.1") as server:
        report = asyncio.run(load_over_http(server.url, list(models), conversations, turns, max_tokens,
                                            time_limit_s, dialogues=dialogues, story_chars=story_chars,
                                            session_header=session_header))
    report["settings"].update({"guard": config.switch.guard, "guard_signal": config.switch.guard_signal,
                               "guard_threshold": config.switch.guard_threshold, "handover": config.handover,
                               "recompute": config.switch.served_recompute.spec, "models": list(models)})
    if out is not None:
        atomic_write_json(Path(out), report)
    return report


def load_table(report: dict):
    """A rich table of the load test's time to first token per status, with the totals in the title."""
    from rich.table import Table  # rich is only needed to print, not to measure

    memory = report["memory"]
    table = Table(title=(
        f"load test: {report['settings']['conversations']} conversations × {report['settings']['turns']} turns, "
        f"{report['requests']} requests in {report['wall_s']:.1f} s ({report['requests_per_s']:.3f} req/s, "
        f"{report['generated_tokens_per_s']:.2f} generated tok/s), errors {report['errors']}, peak RSS "
        f"{memory['peak_rss_bytes'] / 2**30:.2f} GiB"))
    for column in ("status", "requests", "ttft p50", "ttft p95", "server ms p50", "server ms p95", "prompt tokens"):
        table.add_column(column, justify="right")
    for status, row in report["ttft_by_status"].items():
        table.add_row(status, str(row["requests"]), f"{row['ttft_p50_s']:.3f} s", f"{row['ttft_p95_s']:.3f} s",
                      f"{row['server_ms_p50']:.0f}", f"{row['server_ms_p95']:.0f}", f"{row['prompt_tokens_mean']:.0f}")
    return table


CONCURRENCY_FORMAT = "kvhandoff-serve-concurrency/1"


def run_concurrency_bench(models, mappers, config: ServeConfig = ServeConfig(),  # noqa: B008 - frozen
                          levels: Iterable[int] = (1, 4, 16), batches: Iterable[int] = (1, 16), turns: int = 2,
                          max_tokens: int = 16, story_chars: int | None = None, time_limit_s: float = 900.0,
                          out: str | Path | None = None) -> dict:
    """The load test at each number of concurrent conversations in ``levels``, once per worker batch size in
    ``batches`` (``max_batch`` 1: one request at a time per model), back to back on the same conversations, each on
    a fresh server: requests and generated tokens per second, time to first token (client) p50 / p95 over all
    requests. Writes the report to ``out`` (JSON) when given and returns it."""
    levels, batches = list(levels), list(batches)
    dialogues = coqa_dialogues(max(levels), min_turns=turns)
    rows = []
    for level in levels:
        for max_batch in batches:
            engine = Engine(models, mappers, dataclasses.replace(config, max_batch=max_batch))
            with serve_in_thread(engine, host="127.0.0.1") as server:
                report = asyncio.run(load_over_http(server.url, list(models), level, turns, max_tokens,
                                                    time_limit_s, dialogues=dialogues, story_chars=story_chars))
            ttft = [entry["ttft_s"] if entry["ttft_s"] is not None else entry["first_chunk_s"]
                    for entry in report["requests_log"] if not entry["error"]]
            rows.append({"conversations": level, "max_batch": max_batch, "requests": report["requests"],
                         "errors": report["errors"], "turns_left_out": report["turns_left_out"],
                         "wall_s": report["wall_s"], "requests_per_s": report["requests_per_s"],
                         "generated_tokens_per_s": report["generated_tokens_per_s"],
                         "ttft_p50_s": percentile(ttft, 0.5), "ttft_p95_s": percentile(ttft, 0.95),
                         "prompt_tokens": report["prompt_tokens"]})
    result = {"format": CONCURRENCY_FORMAT, "kvhandoff_version": kvhandoff.__version__,
              "settings": {"levels": levels, "batches": batches, "turns": turns, "max_tokens": max_tokens,
                           "story_chars": story_chars, "time_limit_s": time_limit_s, "models": list(models),
                           "recompute": config.switch.served_recompute.spec, "prefill_chunk": config.prefill_chunk},
              "rows": rows,
              "machine": machine_facts()}
    if out is not None:
        atomic_write_json(Path(out), result)
    return result


def concurrency_table(report: dict):
    """A rich table of the concurrency bench: one row per (conversations, max_batch)."""
    from rich.table import Table  # rich is only needed to print, not to measure

    settings = report["settings"]
    table = Table(title=(f"concurrent conversations: {settings['turns']} turns each, {settings['max_tokens']} "
                         "answer tokens; max_batch 1 = one request at a time per model"))
    for column in ("conversations", "max_batch", "requests", "errors", "wall s", "req/s", "gen tok/s", "ttft p50",
                   "ttft p95"):
        table.add_column(column, justify="right")
    for row in report["rows"]:
        table.add_row(str(row["conversations"]), str(row["max_batch"]), str(row["requests"]), str(row["errors"]),
                      f"{row['wall_s']:.1f}", f"{row['requests_per_s']:.3f}", f"{row['generated_tokens_per_s']:.2f}",
                      f"{row['ttft_p50_s']:.3f} s", f"{row['ttft_p95_s']:.3f} s")
    return table
