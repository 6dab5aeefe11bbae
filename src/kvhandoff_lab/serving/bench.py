"""Time to first token over HTTP at a model switch, with the handoff and with a re-prefill, side by side on one
server (`kvhandoff-lab bench-serve`).

The server runs in this process on a free loopback port (`server.serve_in_thread`). For each history length L and
direction (source → target) a conversation is built from real text: the first user turn is a document of L tokens
(CoQA stories, `workload.document`) with a question about it. Each measurement is one fresh session:

1. the source model answers the first turn (it prefills the history; streamed, untimed for the comparison but its
   time to first token is kept as ``source_ttft_s``);
2. the next turn (the source's answer and a follow-up question) goes to the target, streamed, with
   ``kv_handoff.mode`` "auto" (path "handoff": the history is mapped, the guard as configured) or "reprefill" (path
   "reprefill": the target prefills the whole conversation itself).

Per length and direction the two paths alternate (handoff first at even repeats, re-prefill first at odd ones),
``repeats`` times each; the time to first token is the client's time from sending the request to the first chunk
with content (``first_chunk_s``: to the first chunk, the handoff report). Reported: medians and samples per path,
the server's own report (status, milliseconds from the session's state to the first token's distribution) and the
ratio median re-prefill ÷ median handoff.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import httpx
import torch

import kvhandoff
from kvhandoff.errors import ConfigError, KVHandoffError
from kvhandoff.files import atomic_write_json
from kvhandoff.serving.engine import Engine
from kvhandoff.serving.server import serve_in_thread
from kvhandoff.serving.settings import ServeConfig
from kvhandoff_lab.bench import summarize
from kvhandoff_lab.figures import save_figure
from kvhandoff_lab.serving.client import TurnResult, machine_facts, stream_chat
from kvhandoff_lab.serving.workload import coqa_dialogues, document

SERVE_BENCH_FORMAT = "kvhandoff-serve-bench/1"
DEFAULT_SERVE_LENGTHS = (512, 1024, 2048)
DIRECTIONS = ("forward", "reverse", "both")
PATHS = ("handoff", "reprefill")
#: the mode each path sends as kv_handoff.mode
PATH_MODES = {"handoff": "auto", "reprefill": "reprefill"}


class BenchRequestError(KVHandoffError):
    """A request of the bench failed (the server answered an error)."""


def pairs_of(names: list[str], direction: str) -> list[tuple[str, str]]:
    """(source, target) pairs: "forward" the first hosted model → the second, "reverse" back, "both" both."""
    if direction not in DIRECTIONS:
        raise ConfigError(f"direction must be one of {', '.join(DIRECTIONS)}, got {direction!r}")
    if len(names) < 2:
        raise ConfigError("the serve bench needs two hosted models")
    forward, reverse = (names[0], names[1]), (names[1], names[0])
    return {"forward": [forward], "reverse": [reverse], "both": [forward, reverse]}[direction]


def bench_messages(tokenizer, tokens: int, conversations) -> tuple[list[dict], str]:
    """(the first turn's messages: a document of ``tokens`` tokens and a question about its first story, the
    follow-up question)."""
    first = conversations[0]
    text = document(tokenizer, tokens, conversations)
    return ([{"role": "user", "content": f"{text}\n\nQ: {first.turns[0].question}"}],
            f"Q: {first.turns[1].question}")


async def measure_switch(http: httpx.AsyncClient, source: str, target: str, messages: list[dict], follow_up: str,
                         path: str, max_tokens: int) -> tuple[TurnResult, TurnResult]:
    """One fresh session: ``source`` answers ``messages``, then ``target`` answers the follow-up with ``path``'s
    mode. (source's result, target's result); raises BenchRequestError when either failed."""
    session = f"serve-bench-{uuid.uuid4().hex}"
    first = await stream_chat(http, source, messages, session, max_tokens)
    if first.error:
        raise BenchRequestError(f"{source}: {first.error}")
    conversation = [*messages, {"role": "assistant", "content": first.text}, {"role": "user", "content": follow_up}]
    second = await stream_chat(http, target, conversation, session, max_tokens, PATH_MODES[path])
    if second.error:
        raise BenchRequestError(f"{target}: {second.error}")
    return first, second


def _ttft(result: TurnResult) -> float:
    """The time to the first content chunk; for an empty answer the time to the first chunk."""
    return result.ttft_s if result.ttft_s is not None else result.first_chunk_s


def path_summary(results: list[TurnResult]) -> dict:
    """Medians and samples of one path's target requests, with the server's reports."""
    return {
        "ttft_s": summarize([_ttft(r) for r in results]),
        "first_chunk_s": summarize([r.first_chunk_s for r in results]),
        "server_ms": summarize([r.handoff["milliseconds"] for r in results]),
        "status": [r.status for r in results],
        "mapped_tokens": [r.handoff["mapped_tokens"] for r in results],
        "read_tokens": [r.handoff["read_tokens"] for r in results],
        "guard": [r.handoff.get("guard") for r in results],
        "empty_answers": sum(r.ttft_s is None for r in results),
        "answers": [r.text for r in results],
    }


async def bench_over_http(url: str, tokenizer, pairs: list[tuple[str, str]], lengths, repeats: int = 1,
                          max_tokens: int = 8, warmup: bool = True, time_limit_s: float | None = None,
                          timeout_s: float = 1800.0, conversations=None, echo=print) -> dict:
    """Measure every length and pair against the server at ``url`` (see the module docstring); the rows of the
    result, with the lengths skipped for the time limit (no new length starts after ``time_limit_s``)."""
    conversations = conversations if conversations is not None else coqa_dialogues(40)
    rows, skipped = [], []
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as http:
        if warmup:  # untimed: first-request costs (allocations, lazy imports) of every model and both paths
            messages, follow_up = bench_messages(tokenizer, 16, conversations)
            for source, target in pairs:
                for path in PATHS:
                    await measure_switch(http, source, target, messages, follow_up, path, 2)
        for tokens in lengths:
            if time_limit_s is not None and time.monotonic() - started > time_limit_s:
                skipped.append(tokens)
                continue
            messages, follow_up = bench_messages(tokenizer, tokens, conversations)
            for source, target in pairs:
                sources = {path: [] for path in PATHS}
                targets = {path: [] for path in PATHS}
                for repeat in range(repeats):
                    for path in PATHS if repeat % 2 == 0 else PATHS[::-1]:
                        first, second = await measure_switch(http, source, target, messages, follow_up, path,
                                                             max_tokens)
                        sources[path].append(first)
                        targets[path].append(second)
                        echo(f"{tokens} tokens {source} → {target} {path}: ttft {_ttft(second):.3f} s "
                             f"({second.status}, server {second.handoff['milliseconds']:.0f} ms)")
                row = {"tokens": tokens, "source": source, "target": target,
                       "history_tokens": sources["handoff"][0].prompt_tokens,
                       "prompt_tokens": targets["handoff"][0].prompt_tokens,
                       "source_ttft_s": summarize([_ttft(r) for path in PATHS for r in sources[path]])}
                for path in PATHS:
                    row[path] = path_summary(targets[path])
                row["ratio"] = row["reprefill"]["ttft_s"]["median"] / row["handoff"]["ttft_s"]["median"]
                row["server_ratio"] = (row["reprefill"]["server_ms"]["median"]
                                       / max(row["handoff"]["server_ms"]["median"], 1e-9))
                rows.append(row)
    return {"results": rows, "skipped": skipped}


def run_serve_bench(models, mappers, config: ServeConfig = ServeConfig(),  # noqa: B008 - frozen
                    lengths=DEFAULT_SERVE_LENGTHS, direction: str = "both", repeats: int = 1, max_tokens: int = 8,
                    warmup: bool = True, time_limit_s: float | None = None, conversations=None,
                    out: str | Path | None = None, plot: str | Path | None = None, echo=print) -> dict:
    """Serve ``models`` with ``mappers`` on a free loopback port in this process and measure the time to first token
    at a switch with the handoff and with a re-prefill (module docstring); writes the result to ``out`` (JSON) and a
    figure to ``plot`` when given; returns it."""
    names = list(models)
    pairs = pairs_of(names, direction)
    lengths = [int(n) for n in lengths]
    if repeats < 1 or max_tokens < 1 or any(n < 1 for n in lengths):
        raise ConfigError("repeats, max_tokens and lengths must be positive")
    tokenizer = models[names[0]][1]
    engine = Engine(models, mappers, config)
    too_long = [n for n in lengths if n + 64 + 2 * max_tokens > engine.max_context]
    if too_long:
        engine.close()
        raise ConfigError(f"lengths: {too_long} do not fit the server's context of {engine.max_context} tokens")
    with serve_in_thread(engine, host="127.0.0.1") as server:
        measured = asyncio.run(bench_over_http(server.url, tokenizer, pairs, lengths, repeats, max_tokens, warmup,
                                               time_limit_s, conversations=conversations, echo=echo))
    result = {
        "format": SERVE_BENCH_FORMAT,
        "kvhandoff_version": kvhandoff.__version__,
        "models": names,
        "settings": {"lengths": lengths, "direction": direction, "repeats": repeats, "max_tokens": max_tokens,
                     "warmup": warmup, "time_limit_s": time_limit_s, "guard": config.switch.guard,
                     "guard_signal": config.switch.guard_signal, "guard_threshold": config.switch.guard_threshold,
                     "handover": config.handover, "recompute": config.switch.served_recompute.spec,
                     "temperature": 0.0,
                     "text": "CoQA validation stories (workload.document), question and follow-up of the first",
                     "ttft": "client: request sent → first SSE chunk with content (streaming, loopback HTTP)",
                     "torch_threads": torch.get_num_threads()},
        "machine": machine_facts(),
        **measured,
    }
    if out is not None:
        atomic_write_json(Path(out), result)
    if plot is not None:
        plot_serve_bench(result, plot)
    return result


def serve_bench_table(result: dict):
    """A rich table: per length and direction the median time to first token of each path, the server's time and the
    ratio."""
    from rich.table import Table  # rich is only needed to print, not to measure

    table = Table(title=f"time to first token at a switch over HTTP: handoff vs re-prefill "
                        f"({result['settings']['repeats']} repeat(s), median)")
    for column in ("history", "switch", "prompt", "handoff", "status", "re-prefill", "ratio", "server ms h / r",
                   "source ttft"):
        table.add_column(column, justify="right")
    for row in result["results"]:
        statuses = ",".join(sorted(set(row["handoff"]["status"])))
        table.add_row(str(row["tokens"]), f"{row['source']} → {row['target']}", str(row["prompt_tokens"]),
                      f"{row['handoff']['ttft_s']['median']:.3f} s", statuses,
                      f"{row['reprefill']['ttft_s']['median']:.3f} s", f"×{row['ratio']:.2f}",
                      f"{row['handoff']['server_ms']['median']:.0f} / {row['reprefill']['server_ms']['median']:.0f}",
                      f"{row['source_ttft_s']['median']:.3f} s")
    return table


def plot_serve_bench(result: dict, path: str | Path) -> Path:
    """Time to first token of both paths per history length, one panel per direction (log-log)."""
    import matplotlib  # heavy, and only needed for the figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullLocator

    directions = list(dict.fromkeys((r["source"], r["target"]) for r in result["results"]))
    fig, axes = plt.subplots(1, max(len(directions), 1), figsize=(6 * max(len(directions), 1), 4.5), squeeze=False)
    for axis, (source, target) in zip(axes[0], directions, strict=False):
        rows = [r for r in result["results"] if (r["source"], r["target"]) == (source, target)]
        tokens = [r["tokens"] for r in rows]
        for name, style in (("reprefill", "o-"), ("handoff", "s-")):
            axis.plot(tokens, [r[name]["ttft_s"]["median"] for r in rows], style, label=name)
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xticks(tokens, [str(t) for t in tokens])
        axis.xaxis.set_minor_locator(NullLocator())
        axis.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        axis.yaxis.set_minor_locator(NullLocator())
        axis.set_title(f"{source} → {target}", fontsize=10)
        axis.set_xlabel("history (tokens)")
        axis.set_ylabel("time to first token over HTTP (s, median)")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)
