"""`bench-serve`, `load-test`, `load-hostile`, `bench-concurrency`, `guard-eval`, `bench-agent`: the server measured
over loopback HTTP on real text — time to first token at a switch with the handoff vs a re-prefill, concurrent
switching conversations (batched and one at a time), the server under a hostile mixed load, the quality guard's AUROC
and threshold, and a tool-using agent switching models on GSM8K."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated

import typer

from kvhandoff.cli.options import (
    Recompute,
    list_of,
    non_negative_int,
    one_of,
    option_errors,
    positive_float,
    positive_int,
    positive_ints,
    recompute_policy,
)
from kvhandoff.cli.serve import (
    GuardActionOption,
    GuardSignal,
    GuardSwitch,
    GuardThreshold,
    Mappers,
    Models,
    family_specs,
)
from kvhandoff.runtime.policy import DEFAULT_RECOMPUTE, RecomputePolicy
from kvhandoff.runtime.switch.guard import GUARD_SIGNALS
from kvhandoff.runtime.switch.pair import SwitchSettings
from kvhandoff.serving.family import load_family
from kvhandoff.serving.settings import ServeConfig
from kvhandoff_lab.serving.agent_bench import (
    CONDITIONS,
    DEFAULT_MAX_STEPS,
    DEFAULT_MAX_TOKENS,
    DEFAULT_MIN_CALLS,
    AgentSettings,
    agent_over_http,
    agent_table,
    gsm8k_problems,
    run_agent_bench,
)
from kvhandoff_lab.serving.bench import DEFAULT_SERVE_LENGTHS, DIRECTIONS, run_serve_bench, serve_bench_table
from kvhandoff_lab.serving.client import require_loopback
from kvhandoff_lab.serving.guard_eval import guard_table, run_guard_eval
from kvhandoff_lab.serving.hostile import CLASSES as HOSTILE_CLASSES
from kvhandoff_lab.serving.hostile import hostile_summary, hostile_table, run_hostile_load
from kvhandoff_lab.serving.loadtest import concurrency_table, load_table, run_concurrency_bench, run_load_test

TimeLimit = Annotated[float | None, typer.Option("--time-limit", parser=positive_float, help=(
    "seconds; no new measurement starts after it"))]


def _server_config(guard: str, guard_signal: str, guard_threshold: float,
                   recompute: RecomputePolicy | None, guard_action=None) -> ServeConfig:
    """The measured server's settings: the measurements name their recompute policy (default `DEFAULT_RECOMPUTE`
    for every pair), so that a result says what it was served under; guard_action: every pair's (None: each pair's
    recorded one)."""
    with option_errors("--guard-threshold"):
        switch = SwitchSettings(recompute=recompute or DEFAULT_RECOMPUTE, guard=guard == "on",
                                guard_signal=guard_signal, guard_threshold=guard_threshold, guard_action=guard_action)
        return ServeConfig(switch=switch, log_level="warning")


def _print(table) -> None:
    from rich.console import Console  # rich is only needed to print

    Console(width=160).print(table)


def bench_serve(
    models: Models = "",
    mapper: Mappers = None,
    lengths: Annotated[tuple, typer.Option(parser=positive_ints, metavar="LIST", help=(
        "history lengths in tokens of real text, comma-separated"))] = ",".join(map(str, DEFAULT_SERVE_LENGTHS)),
    direction: Annotated[str, typer.Option(parser=one_of(DIRECTIONS), help=(
        "switch first → second hosted model (forward), back (reverse) or both"))] = "both",
    repeats: Annotated[int, typer.Option(parser=positive_int, help="measurements per path, length and direction "
                                                                   "(medians reported)")] = 1,
    max_tokens: Annotated[int, typer.Option(parser=positive_int, help="answer length of each request")] = 8,
    warmup: Annotated[bool, typer.Option(help="one untimed short switch per path and direction first")] = True,
    guard: GuardSwitch = "off",
    guard_signal: GuardSignal = SwitchSettings.guard_signal,
    guard_threshold: GuardThreshold = SwitchSettings.guard_threshold,
    guard_action: GuardActionOption = None,
    recompute: Recompute = None,
    time_limit: TimeLimit = None,
    out: Annotated[Path, typer.Option(help="the result (JSON)")] = Path("runs/serve_bench.json"),
    plot: Annotated[Path | None, typer.Option(help="also draw the times here (PNG)")] = None,
) -> None:
    """Time to first token over HTTP at a model switch: the handoff vs the target re-prefilling, side by side on one
    server on a free loopback port."""
    config = _server_config(guard, guard_signal, guard_threshold, recompute, guard_action)
    family = load_family(*family_specs(models, mapper), progress=True)
    result = run_serve_bench(*family, config, lengths=lengths, direction=direction, repeats=repeats,
                             max_tokens=max_tokens, warmup=warmup, time_limit_s=time_limit, out=out, plot=plot,
                             echo=typer.echo)
    _print(serve_bench_table(result))
    typer.echo(f"wrote {out}" + (f" and {plot}" if plot else ""))
    if result["skipped"]:
        typer.echo(f"not measured (time limit): {result['skipped']}")


def load_test(
    models: Models = "",
    mapper: Mappers = None,
    conversations: Annotated[int, typer.Option(parser=positive_int, help="conversations at once")] = 4,
    turns: Annotated[int, typer.Option(parser=positive_int, help="turns per conversation")] = 5,
    max_tokens: Annotated[int, typer.Option(parser=positive_int, help="answer length of each request")] = 16,
    time_limit: Annotated[float, typer.Option("--time-limit", parser=positive_float, help=(
        "seconds; no turn starts after it"))] = 900.0,
    story_chars: Annotated[int | None, typer.Option(parser=positive_int, help=(
        "cut each story to this many characters (default: whole stories)"))] = None,
    session_header: Annotated[bool, typer.Option(help=(
        "name each conversation by X-Session-ID (--no-session-header: send none, as most clients do; the server "
        "finds conversations by their tokens)"))] = True,
    guard: GuardSwitch = "off",
    guard_signal: GuardSignal = SwitchSettings.guard_signal,
    guard_threshold: GuardThreshold = SwitchSettings.guard_threshold,
    recompute: Recompute = None,
    out: Annotated[Path, typer.Option(help="the report (JSON)")] = Path("runs/serve_load.json"),
) -> None:
    """Concurrent conversations switching models every 2–3 turns against a server on a free loopback port:
    throughput, time to first token per handoff status, errors, memory."""
    config = _server_config(guard, guard_signal, guard_threshold, recompute)
    family = load_family(*family_specs(models, mapper), progress=True)
    report = run_load_test(*family, config, conversations=conversations, turns=turns, max_tokens=max_tokens,
                           time_limit_s=time_limit, story_chars=story_chars, out=out,
                           session_header=session_header)
    _print(load_table(report))
    typer.echo(f"wrote {out}")
    if report["errors"]:
        typer.echo(f"{report['errors']} request(s) failed: {report['error_messages'][0]}", err=True)
        raise typer.Exit(1)


def load_hostile(
    models: Models = "",
    mapper: Mappers = None,
    duration: Annotated[float, typer.Option(parser=positive_float, help=(
        "seconds of load; no request starts after it"))] = 60.0,
    max_requests: Annotated[int, typer.Option(parser=positive_int, help="requests at most, all classes together")]
    = 5000,
    max_tokens: Annotated[int, typer.Option(parser=positive_int, help="answer length of the normal chat requests")]
    = 8,
    read_timeout: Annotated[float, typer.Option(parser=positive_float, help=(
        "the server's --read-timeout: seconds a body may take to arrive (slow and half-sent bodies get 408 past "
        "it)"))] = 2.0,
    settle: Annotated[float, typer.Option(parser=positive_float, help=(
        "seconds the server idles after the load before the last RSS"))] = 5.0,
    classes: Annotated[tuple, typer.Option(parser=list_of(one_of(HOSTILE_CLASSES), "classes"), metavar="LIST",
                                           help="classes of request sent, comma-separated")]
    = ",".join(HOSTILE_CLASSES),
    out: Annotated[Path, typer.Option(help="the report (JSON)")] = Path("runs/serve_hostile.json"),
) -> None:
    """A hostile mixed load against a server on a free loopback port for --duration seconds: normal chat requests
    with tool floods, huge n × top_logprobs, slow and half-sent bodies, clients that go away, bad UTF-8, deep JSON
    and long keys, /health polled throughout: statuses per class, /health latency, RSS. Exits 1 on any 5xx."""
    config = dataclasses.replace(_server_config("off", None, None, None), read_timeout_s=read_timeout)
    family = load_family(*family_specs(models, mapper), progress=True)
    report = run_hostile_load(*family, config, duration_s=duration, max_requests=max_requests, max_tokens=max_tokens,
                              settle_s=settle, classes=classes, out=out)
    _print(hostile_table(report))
    typer.echo(hostile_summary(report))
    typer.echo(f"wrote {out}")
    if report["five_xx"] or report["server_five_xx"]:
        typer.echo(f"{report['five_xx']} answer(s) with a 5xx status (the server counted {report['server_five_xx']})",
                   err=True)
        raise typer.Exit(1)


def bench_concurrency(
    models: Models = "",
    mapper: Mappers = None,
    levels: Annotated[tuple, typer.Option(parser=positive_ints, metavar="LIST", help=(
        "numbers of concurrent conversations, comma-separated"))] = "1,4,16",
    batches: Annotated[tuple, typer.Option(parser=positive_ints, metavar="LIST", help=(
        "worker batch sizes to compare, comma-separated (1: one request at a time per model)"))] = "1,16",
    turns: Annotated[int, typer.Option(parser=positive_int, help="turns per conversation")] = 2,
    max_tokens: Annotated[int, typer.Option(parser=positive_int, help="answer length of each request")] = 16,
    story_chars: Annotated[int | None, typer.Option(parser=positive_int, help=(
        "cut each story to this many characters (default: whole stories)"))] = None,
    time_limit: Annotated[float, typer.Option("--time-limit", parser=positive_float, help=(
        "seconds per run; no turn starts after it"))] = 900.0,
    recompute: Recompute = None,
    out: Annotated[Path, typer.Option(help="the report (JSON)")] = Path("runs/serve_concurrency.json"),
) -> None:
    """Throughput and time to first token at several numbers of concurrent switching conversations, with the
    workers batching decode steps and one request at a time, back to back on the same load."""
    config = _server_config("off", None, None, recompute)
    family = load_family(*family_specs(models, mapper), progress=True)
    report = run_concurrency_bench(*family, config, levels=levels, batches=batches, turns=turns,
                                   max_tokens=max_tokens, story_chars=story_chars, time_limit_s=time_limit, out=out)
    _print(concurrency_table(report))
    typer.echo(f"wrote {out}")
    errors = sum(row["errors"] for row in report["rows"])
    if errors:
        typer.echo(f"{errors} request(s) failed", err=True)
        raise typer.Exit(1)


def guard_eval(
    models: Models = "",
    mapper: Mappers = None,
    conversations: Annotated[int, typer.Option(parser=positive_int, help="CoQA conversations at most")] = 20,
    turns: Annotated[int, typer.Option(parser=positive_int, help="turns per conversation")] = 4,
    switch_every: Annotated[int, typer.Option(parser=positive_int, help="switch model every n turns")] = 1,
    signals: Annotated[tuple, typer.Option(parser=list_of(one_of(GUARD_SIGNALS), "signals"), metavar="LIST", help=(
        "guard signals, comma-separated"))] = ",".join(GUARD_SIGNALS),
    max_new_tokens: Annotated[int, typer.Option(parser=positive_int, help="greedy answer length compared")] = 16,
    window: Annotated[int, typer.Option(parser=positive_int, help="positions of the new turn the guard scores")]
    = 64,
    heldout_every: Annotated[int, typer.Option(parser=positive_int, help=(
        "every n-th conversation is held out (n >= 2); the threshold is chosen on the others"))] = 2,
    max_false_fallback: Annotated[float | None, typer.Option(parser=positive_float, help=(
        "bound on the dev false-fallback rate when choosing the threshold"))] = None,
    time_limit: TimeLimit = None,
    story_chars: Annotated[int | None, typer.Option(parser=positive_int, help=(
        "cut each story to this many characters (default: whole stories)"))] = None,
    escalate: Annotated[RecomputePolicy | None, typer.Option(parser=recompute_policy, metavar="RULE:BUDGET", help=(
        "also hand every switch over with this recompute policy (e.g. recent:50%) and compare escalating with "
        "falling back"))] = None,
    recompute: Recompute = None,
    out: Annotated[Path, typer.Option(help="the result (JSON)")] = Path("runs/serve_guard.json"),
) -> None:
    """The quality guard on CoQA conversations switching models: AUROC per signal, a threshold chosen on dev
    conversations and its catch / false-fallback rates on held-out ones."""
    if heldout_every < 2:
        raise typer.BadParameter("give an integer >= 2", param_hint="--heldout-every")
    family = load_family(*family_specs(models, mapper), progress=True)
    result = run_guard_eval(*family, conversations=conversations, turns=turns, switch_every=switch_every,
                            signals=signals, max_new_tokens=max_new_tokens, window=window,
                            heldout_every=heldout_every, max_false_fallback=max_false_fallback,
                            time_limit_s=time_limit, story_chars=story_chars, escalate=escalate,
                            config=ServeConfig(switch=SwitchSettings(recompute=recompute or DEFAULT_RECOMPUTE)),
                            out=out)
    _print(guard_table(result))
    typer.echo(f"wrote {out}")


def bench_agent(
    models: Models = "",
    mapper: Mappers = None,
    url: Annotated[str | None, typer.Option(help=(
        "an already running server on this machine (e.g. http://127.0.0.1:8000) instead of starting one; its first "
        "two models are the small and the large one"))] = None,
    problems: Annotated[int, typer.Option(parser=positive_int, help="GSM8K test problems (report pool)")] = 20,
    seed: Annotated[int, typer.Option(parser=non_negative_int, help="which problems, in which order")] = 0,
    max_steps: Annotated[int, typer.Option(parser=positive_int, help="tool calls per problem at most")]
    = DEFAULT_MAX_STEPS,
    max_tokens: Annotated[int, typer.Option(parser=positive_int, help="answer tokens per step")] = DEFAULT_MAX_TOKENS,
    min_calls: Annotated[int, typer.Option(parser=non_negative_int, help=(
        "the first steps that must call the calculator (2: every switching problem switches at least twice)"))]
    = DEFAULT_MIN_CALLS,
    conditions: Annotated[tuple, typer.Option(parser=list_of(one_of(CONDITIONS), "conditions"), metavar="LIST",
                                              help="rows, comma-separated")] = ",".join(CONDITIONS),
    time_budget: Annotated[float | None, typer.Option("--time-budget", parser=positive_float, help=(
        "seconds; no problem starts after it (rerun with the same --out to continue)"))] = None,
    warmup: Annotated[bool, typer.Option(help="untimed short requests on each model and path first")] = True,
    guard: GuardSwitch = "off",
    guard_signal: GuardSignal = SwitchSettings.guard_signal,
    guard_threshold: GuardThreshold = SwitchSettings.guard_threshold,
    recompute: Recompute = None,
    max_context: Annotated[int | None, typer.Option(parser=positive_int, help=(
        "the started server's context (default: the hosted models' smallest max_position_embeddings)"))] = None,
    out: Annotated[Path, typer.Option(help="the results (JSON; problems already in it are skipped)")]
    = Path("runs/agent_bench.json"),
    render: Annotated[Path | None, typer.Option(help="print the table of an existing result and stop")] = None,
) -> None:
    """A tool-using agent on GSM8K through the server: always large, always small, and switching small/large with
    the handoff or a re-prefill; solve rate, valid calls, time to first token at the switches."""
    if render is not None:
        typer.echo(agent_table(json.loads(render.read_text())))
        return
    with option_errors("--max-steps", "--min-calls", "--conditions"):
        settings = AgentSettings(max_steps=max_steps, max_tokens=max_tokens, min_calls=min_calls,
                                 conditions=conditions)
    with option_errors("--problems"):
        chosen = gsm8k_problems(problems, seed)
    options = {"out": out, "time_budget_s": time_budget, "warmup": warmup, "progress": True}
    if url is not None:
        with option_errors("--url"):
            url = require_loopback(url)
        result = agent_over_http(url, chosen, settings, seed, **options)
    else:
        config = _server_config(guard, guard_signal, guard_threshold, recompute)
        with option_errors("--max-context"):
            config = dataclasses.replace(config, max_context=max_context)
        family = load_family(*family_specs(models, mapper), progress=True)
        result = run_agent_bench(*family, config, problems=chosen, seed=seed, settings=settings, **options)
    typer.echo(agent_table(result))
    typer.echo(f"wrote {out}")
    errors = sum(row["errors"] for row in result["summary"]["rows"].values())
    if errors:
        typer.echo(f"{errors} episode(s) stopped on a failed request (see the steps' error in {out})", err=True)
        raise typer.Exit(1)


def bench_handoff(
    models: Models = "",
    mapper: Mappers = None,
    problems: Annotated[int, typer.Option(parser=positive_int, help="CoQA conversations (held-out split)")] = 30,
    offset_recompute: Annotated[RecomputePolicy | None, typer.Option(parser=recompute_policy, metavar="RULE:BUDGET",
                                                                      help="what the analyst recomputes of a run "
                                                                           "reused at another offset (default: the "
                                                                           "server's)")] = None,
    time_budget: Annotated[float | None, typer.Option("--time-budget", parser=positive_float, help=(
        "seconds; no problem starts after it (rerun with the same --out to continue)"))] = None,
    out: Annotated[Path, typer.Option(help="the results (JSON; problems already in it are skipped)")]
    = Path("runs/agent_handoff.json"),
) -> None:
    """An OpenAI Agents SDK handoff through the server: a clerk on the small model looks a document up and hands off
    to an analyst on the large model with other instructions; the analyst's prompt share served from a cache, time
    to first bytes and answer F1, with the history found at another offset and with prefixes only."""
    from kvhandoff_lab.serving.agent_handoff import handoff_problems, run_handoff_bench

    with option_errors("--offset-recompute"):
        config = ServeConfig(switch=SwitchSettings(offset_recompute=offset_recompute), log_level="warning")
    chosen = handoff_problems(problems)
    family = load_family(*family_specs(models, mapper), progress=True)
    result = run_handoff_bench(*family, config, chosen, out=out, time_budget_s=time_budget,
                               settings={"offset_recompute": config.switch.offset_recompute.spec})
    typer.echo(json.dumps(result["summary"], indent=2))
    typer.echo(f"wrote {out}")
