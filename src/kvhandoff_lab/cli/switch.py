"""`eval-switch`: the switch benchmark (a real switch on a long history), and the recompute sweep."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import torch
import typer

from kvhandoff.cli.options import (
    DEFAULT_DTYPE,
    DEFAULT_SOURCE,
    DEFAULT_TARGET,
    DeviceMap,
    Dtype,
    Progress,
    Source,
    Target,
    non_negative_float,
    non_negative_int,
    one_of,
    option_errors,
    positive_int,
    recompute_policy,
)
from kvhandoff.errors import ConfigError
from kvhandoff.mapper.mapper import Mapper
from kvhandoff.model.geometry import tokenizer_hash
from kvhandoff.runtime.policy import DEFAULT_RECOMPUTE, RULES
from kvhandoff.workflow import load_named_pair
from kvhandoff_lab.evaluation.options import EvalOptions
from kvhandoff_lab.evaluation.pipeline import MapperSource, pair_mappers
from kvhandoff_lab.evaluation.switch import DEFAULT_HISTORIES, DEFAULT_HISTORY_TOKENS, SwitchSettings, switch_tasks
from kvhandoff_lab.evaluation.switchbench import (
    DEFAULT_SWEEP_BUDGETS,
    DEFAULT_TTFT_LENGTHS,
    Direction,
    choose_recompute,
    recompute_points,
    run_recompute_sweep,
    run_switch_benchmark,
    sweep_group,
    sweep_markdown,
    switch_markdown,
)
from kvhandoff_lab.evaluation.switchtasks import DEFAULT_MAX_NEW_TOKENS, DEFAULT_TASK_HISTORIES, GROUP, SWITCH_TASKS


def _comma_list(value: str, parse, what: str) -> tuple:
    try:
        items = tuple(parse(part.strip()) for part in str(value).split(",") if part.strip())
    except ValueError:
        items = ()
    if not items:
        raise typer.BadParameter(f"give a comma list of {what}, got {value!r}")
    return items


def rule_list(value) -> tuple[str, ...]:
    rules = _comma_list(value, str, "rules")
    swept = [name for name in RULES if name != "none"]
    bad = [r for r in rules if r not in swept]
    if bad:
        raise typer.BadParameter(f"unknown recompute rule(s) {', '.join(bad)}; use {', '.join(swept)}")
    return rules


def budget_list(value) -> tuple[float, ...]:
    """Percentages of the mapped positions: "0,5,20" → 0, 0.05, 0.2."""
    budgets = _comma_list(value, lambda p: float(p.rstrip("%")) / 100, "budgets")
    if any(not 0 <= b <= 1 for b in budgets):
        raise typer.BadParameter(f"budgets are percentages in 0..100, got {value!r}")
    return budgets


def length_list(value) -> tuple[int, ...]:
    lengths = _comma_list(value, int, "token counts")
    if any(n < 2 for n in lengths):
        raise typer.BadParameter(f"history lengths must be >= 2 tokens, got {value!r}")
    return lengths


def split_top_level(value: str) -> list[str]:
    """``value`` split at the commas outside parentheses ("none,mix(sinks=0.2,recent=0.8):5%" → two parts)."""
    parts, depth, current = [], 0, ""
    for char in str(value):
        depth += (char == "(") - (char == ")")
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [part.strip() for part in [*parts, current] if part.strip()]


def policy_list(value) -> tuple:
    """Recompute policies, comma-separated ("none,recent:5%"): one switch condition each."""
    policies = tuple(recompute_policy(part) for part in split_top_level(value))
    if not policies:
        raise typer.BadParameter(f"give a comma list of recompute policies, got {value!r}")
    return policies


def max_new_tokens_option(value) -> dict:
    """Generation lengths per task family ("answer=32,cot=256"; a bare count sets every family)."""
    text = str(value).strip()
    if text.isdigit():
        lengths = dict.fromkeys(DEFAULT_MAX_NEW_TOKENS, int(text))
    else:
        lengths = {}
        for part in _comma_list(text, str, "FAMILY=TOKENS pairs"):
            family, _, count = part.partition("=")
            if family.strip() not in DEFAULT_MAX_NEW_TOKENS or not count.strip().isdigit():
                raise typer.BadParameter(f"give FAMILY=TOKENS pairs with FAMILY one of "
                                         f"{', '.join(DEFAULT_MAX_NEW_TOKENS)}, got {part!r}")
            lengths[family.strip()] = int(count)
    if any(n < 1 for n in lengths.values()):
        raise typer.BadParameter(f"generation lengths must be >= 1, got {value!r}")
    return lengths


def pool_option(value) -> str | None:
    """'report', 'dev', or nothing (the command's default: report, dev for --sweep-recompute)."""
    return one_of(("report", "dev"), "pool")(value) if value else None


def switch_tasks_option(value) -> str:
    with option_errors("--tasks"):
        switch_tasks(value)
    return value


def _record_choices(result: dict, directions: list[Direction], min_retention: float, min_speedup: float = 0.0
                    ) -> None:
    """Record each direction's chosen policy (`choose_recompute`) with its mapper (`Mapper.record_recompute`)."""
    for direction in directions:
        if not isinstance(direction.mapper, Mapper):
            raise ConfigError(f"the mapper of {direction.source_name} → {direction.target_name} is not a saved "
                              "kvhandoff mapper, so no policy can be recorded with it: sweep with saved mappers "
                              "(--mapper, --reverse-mapper, or the pair's default ones)")
    for direction in directions:
        chosen = choose_recompute(result, direction.name, min_retention, min_speedup)
        if chosen is None:
            typer.echo(f"{direction.source_name} → {direction.target_name}: no point scored yet; nothing recorded")
            continue
        direction.mapper.record_recompute(chosen)
        typer.echo(f"{direction.source_name} → {direction.target_name}: recompute {chosen.spec}, "
                   f"{chosen.describe()} — recorded in {direction.mapper.folder}")


def pair_directions(pair, mappers: MapperSource, out: Path, progress: bool) -> list[Direction]:
    """The forward direction with its mapper (fitted or reused), and the reverse one where ``mappers`` asks."""
    forward, backward, _ = pair_mappers(pair, mappers, EvalOptions(), out, progress)
    directions = [Direction("forward", pair.source, pair.target, forward, pair.source_spec, pair.target_spec)]
    if backward is not None:
        directions.append(Direction("reverse", pair.target, pair.source, backward, pair.target_spec,
                                    pair.source_spec))
    return directions


def eval_switch(
    source: Source = DEFAULT_SOURCE,
    target: Target = DEFAULT_TARGET,
    mapper: Annotated[Path | None, typer.Option(help="Fitted mapper folder (source → target); default: the pair's "
                                                     "default mapper (fitted or reused from the cache).")] = None,
    reverse: Annotated[Path | None, typer.Option("--reverse-mapper", help=(
        "Mapper folder for target → source; default with --both-directions: the pair's default reverse "
        "mapper."))] = None,
    both_directions: Annotated[bool, typer.Option(help="Also evaluate target → source.")] = True,
    tasks: Annotated[str, typer.Option(parser=switch_tasks_option, help=(
        "Comma list of multiple-choice tasks or groups (core, heldout, all; GSM8K, which generates, is left "
        f"out of groups) and of the generative group ({', '.join(SWITCH_TASKS)}; alias {GROUP}).")
    )] = "core",
    limit: Annotated[int, typer.Option(parser=positive_int, help="Items per task (seeded draw from the pool).")]
    = 100,
    pool: Annotated[str | None, typer.Option(parser=pool_option, help=(
        "Item pool: 'report' for the benchmark, 'dev' to choose a policy (default of --sweep-recompute); the "
        "histories' exemplars come from the other pool."))] = "",
    seed: Annotated[int, typer.Option(help="Item, history and bootstrap seed.")] = 0,
    histories: Annotated[int, typer.Option(parser=positive_int, help="Histories per task, each shared by an "
                                                                     "equal share of the items.")]
    = DEFAULT_HISTORIES,
    history_tokens: Annotated[int, typer.Option(parser=positive_int, help="Least tokens of a history.")]
    = DEFAULT_HISTORY_TOKENS,
    recompute: Annotated[tuple | None, typer.Option(parser=policy_list, metavar="RULE:BUDGET[,...]", help=(
        "Recompute policies of the switch, comma-separated (one switch condition each), e.g. none,recent:5%; "
        f"default: {DEFAULT_RECOMPUTE.spec}."))] = None,
    generative_histories: Annotated[int, typer.Option(parser=positive_int, help=(
        "Histories per task of the generative group."))] = DEFAULT_TASK_HISTORIES,
    max_new_tokens: Annotated[dict | None, typer.Option(parser=max_new_tokens_option, metavar="FAMILY=TOKENS,...",
                                                        help=(
        "Greedy generation lengths per task family of the generative group (answer: nq_open, coqa_gen; cot: "
        "gsm8k_cot); a bare number sets both. Default: "
        + ",".join(f"{k}={v}" for k, v in DEFAULT_MAX_NEW_TOKENS.items()) + "."))] = None,
    exact_prefix: Annotated[int | None, typer.Option(parser=non_negative_int, help=(
        "Leading positions the target recomputes at the switch (default: the mapper's setting)."))] = None,
    all_mapped: Annotated[bool, typer.Option(help="Also score the paper's condition (the question mapped "
                                                  "too).")] = True,
    ttft_repeats: Annotated[int, typer.Option(parser=non_negative_int, help=(
        "Timed rounds of the TTFT measurement per history (0: none)."))] = 1,
    sweep_recompute: Annotated[tuple | None, typer.Option(parser=rule_list, metavar="RULES", help=(
        "Sweep these recompute rules over --budgets on the dev pool instead: TTFT speed-up at --ttft-lengths "
        "and mean core retention per (rule, budget), a table and a plot."))] = None,
    budgets: Annotated[tuple, typer.Option(parser=budget_list, metavar="PERCENTS", help=(
        "Budgets of --sweep-recompute, percent of the mapped positions."))]
    = ",".join(f"{b * 100:g}" for b in DEFAULT_SWEEP_BUDGETS),
    ttft_lengths: Annotated[tuple, typer.Option(parser=length_list, metavar="TOKENS", help=(
        "History lengths of the sweep's TTFT measurement."))] = ",".join(map(str, DEFAULT_TTFT_LENGTHS)),
    record_recompute: Annotated[bool, typer.Option(help=(
        "After --sweep-recompute, record each direction's policy with its mapper, where `kvhandoff serve` reads "
        "it: among the points at least --min-speedup times faster than re-prefill at the longest --ttft-lengths, "
        "the fastest whose mean retention is at least --min-retention (else the most retentive), recorded with "
        "every point measured (`kvhandoff serve --min-speedup` chooses from them again)."))] = False,
    min_retention: Annotated[float, typer.Option(parser=non_negative_float, help=(
        "The mean retention a recorded policy must keep (--record-recompute)."))] = 0.97,
    min_speedup: Annotated[float, typer.Option(parser=non_negative_float, help=(
        "The speed-up over re-prefill a recorded policy must keep (--record-recompute; 0: none)."))] = 0.0,
    time_limit: Annotated[float | None, typer.Option(help=(
        "Minutes after which no new item is started; the last finished history round is the result (the next "
        "run with the same --out resumes)."))] = None,
    out: Annotated[Path, typer.Option(help="Output folder (item store, results).")] = Path("kvhandoff-switch"),
    threads: Annotated[int | None, typer.Option(parser=positive_int, help="torch CPU threads.")] = None,
    dtype: Dtype = DEFAULT_DTYPE,
    device_map: DeviceMap = None,
    progress: Progress = True,
) -> None:
    """The switch benchmark: each item's history (k solved exemplars, at least --history-tokens tokens) is
    prefilled by the source and handed over (mapped, then the recompute policy), the new turn (the question) is
    read by the target. Reports target alone, source alone, the switch, the all-mapped condition, retention with
    paired bootstrap intervals and TTFT against re-prefill (OUT/switch.{json,md}); the generative group's tasks
    answer greedily (or score yes/no after a passage in the history), with switch − target and switch − source,
    agreement with the target and the first-answer-token KL. With --sweep-recompute: the rule × budget trade-off
    on the dev pool (OUT/sweep_recompute.{json,md,png}).
    """
    if record_recompute and sweep_recompute is None:
        raise typer.BadParameter("records the policy a sweep chooses: give --sweep-recompute too",
                                 param_hint="--record-recompute")
    if threads is not None:
        torch.set_num_threads(threads)
    deadline = None if time_limit is None else time.monotonic() + 60 * time_limit
    sweep = sweep_recompute is not None
    policies = recompute_points(sweep_recompute, budgets) if sweep else (recompute or (DEFAULT_RECOMPUTE,))
    with option_errors("--tasks", "--recompute"):
        settings = SwitchSettings(tuple(switch_tasks(tasks)), limit, pool or ("dev" if sweep else "report"), seed,
                                  histories, history_tokens, policies, exact_prefix, all_mapped, ttft_repeats,
                                  generative_histories=generative_histories,
                                  max_new_tokens=tuple((max_new_tokens or {}).items()))
        if sweep:
            sweep_group(settings.tasks)
    pair = load_named_pair(source, target, dtype, progress, device_map=device_map)
    directions = pair_directions(pair, MapperSource(mapper, reverse_mapper=reverse, both_directions=both_directions),
                                 out, progress)
    tok_id = tokenizer_hash(pair.tokenizer)
    if sweep:
        result = run_recompute_sweep(directions, pair.tokenizer, tok_id, settings, out, ttft_lengths, ttft_repeats,
                                     progress, deadline)
        typer.echo(sweep_markdown(result))
        typer.echo(f"wrote {out / 'sweep_recompute.json'}, .md and .png")
        if record_recompute:
            _record_choices(result, directions, min_retention, min_speedup)
        return
    result = run_switch_benchmark(directions, pair.tokenizer, tok_id, settings, out, progress, deadline)
    typer.echo(switch_markdown(result))
    typer.echo(f"wrote {out / 'switch.json'} and {out / 'switch.md'}")
