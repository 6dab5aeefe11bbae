"""`eval` and `eval-render`: benchmark retention of a transfer, in one or both directions."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvhandoff.cli.options import (
    DEFAULT_DTYPE,
    DEFAULT_SOURCE,
    DEFAULT_TARGET,
    DeviceMap,
    Dtype,
    Progress,
    Recompute,
    Source,
    Target,
    fixed_top_k,
    k_list,
    non_negative_int,
    one_of,
    option_errors,
    positive_int,
)
from kvhandoff.config import TOP_K_CHOICES
from kvhandoff.workflow import load_named_pair
from kvhandoff_lab.evaluation.options import EXTRA_TASKS, EvalOptions, ScoringOptions
from kvhandoff_lab.evaluation.pipeline import MapperSource, evaluate_directions, pair_mappers
from kvhandoff_lab.evaluation.report import render_results
from kvhandoff_lab.evaluation.scoring import MAPPED_PARTS
from kvhandoff_lab.evaluation.tasks import parse_tasks


def tasks_list(value) -> str:
    """Task names or groups, comma-separated (`evaluation.tasks.parse_tasks`)."""
    with option_errors("--tasks"):
        parse_tasks(value, extra=EXTRA_TASKS)
    return value


def eval_command(
    source: Source = DEFAULT_SOURCE,
    target: Target = DEFAULT_TARGET,
    mapper: Annotated[Path | None, typer.Option(help=(
        "Fitted mapper folder (source → target). Or give --statistics. Without either, the pair's default mapper "
        "is fitted or reused from the cache (as `kvhandoff demo` does)."))] = None,
    both_directions: Annotated[bool, typer.Option(help=(
        "Without --mapper/--reverse-mapper, also evaluate target → source with the pair's default reverse "
        "mapper."))] = True,
    tasks: Annotated[str, typer.Option(parser=tasks_list, help=(
        "Comma list of tasks or groups: core, heldout, all, arc_challenge, hellaswag, winogrande, mmlu, gsm8k, "
        "piqa, boolq, arc_easy, perplexity, coqa."))] = "core",
    limit: Annotated[int, typer.Option(parser=positive_int, help="Items per task (seeded draw from the report "
                                                                 "pool).")] = 100,
    seed: Annotated[int, typer.Option(help="Item-selection and bootstrap seed.")] = 0,
    out: Annotated[Path, typer.Option(help="Output folder (per-item caches, results, report).")]
    = Path("kvhandoff-eval"),
    reverse: Annotated[Path | None, typer.Option("--reverse-mapper", help=(
        "Mapper folder for target → source: evaluates the reverse direction with it (the coqa multi-turn task "
        "needs a reverse mapper: this one, or the default one that --both-directions brings)."))] = None,
    statistics: Annotated[Path | None, typer.Option(help=(
        "Calibration statistics (source → target) to build the mapper from, for any k."))] = None,
    sweep_k: Annotated[bool, typer.Option(help=(
        "Choose k on the dev pool (needs --statistics); evaluate with the best k."))] = False,
    sweep_limit: Annotated[int, typer.Option(parser=positive_int, help="Dev items per task for the k sweep.")] = 50,
    sweep_ks: Annotated[tuple, typer.Option(parser=k_list, metavar="LIST", help=(
        "Comma list of candidate k for --sweep-k (integers or 'all')."))] = ",".join(map(str, TOP_K_CHOICES)),
    k: Annotated[object, typer.Option("--top-k", parser=fixed_top_k, metavar="K", help=(
        "k when building from --statistics without --sweep-k."))] = "all",
    exact_prefix: Annotated[int | None, typer.Option(parser=non_negative_int, help=(
        "Leading positions the target recomputes itself after each handoff (0 = none; default: the mapper's "
        "own setting)."))] = None,
    mapped: Annotated[str, typer.Option(parser=one_of(MAPPED_PARTS), help=(
        "What the transfer maps on benchmark tasks: 'all' (the whole context) or 'history' (the few-shot "
        "history; the target prefills the question, the new turn, itself; tasks without a few-shot history are "
        "skipped)."))] = "all",
    max_new_tokens: Annotated[int, typer.Option(parser=positive_int, help="GSM8K generation budget.")] = 256,
    n_resamples: Annotated[int, typer.Option(parser=positive_int, help="Bootstrap resamples.")] = 1000,
    perplexity_docs: Annotated[int, typer.Option(parser=positive_int, help="Held-out documents for "
                                                                           "'perplexity'.")] = 16,
    prefix_len: Annotated[int, typer.Option(parser=positive_int, help="Prefix tokens in cache for "
                                                                      "'perplexity'.")] = 1024,
    continuation_len: Annotated[int, typer.Option(parser=positive_int, help="Scored tokens for "
                                                                            "'perplexity'.")] = 1024,
    coqa_conversations: Annotated[int, typer.Option(parser=positive_int, help="Conversations for 'coqa'.")] = 20,
    dtype: Dtype = DEFAULT_DTYPE,
    device_map: DeviceMap = None,
    progress: Progress = True,
    recompute: Recompute = None,
) -> None:
    """Evaluate KV-cache transfer: target vs. source vs. transfer accuracy, retention with bootstrap intervals.

    Per-item results are cached under OUT/items, so an interrupted run resumes and a finished one re-renders
    at once. Writes OUT/forward.{json,md,png}, OUT/reverse.* when there is a reverse mapper
    (--reverse-mapper, or the pair's default one with --both-directions), and OUT/summary.{md,png}.
    """
    with option_errors("--mapper", "--statistics", "--sweep-k"):
        mappers = MapperSource(mapper, statistics, k, sweep_k, sweep_limit, sweep_ks, reverse, both_directions)
    options = EvalOptions(tasks, limit, seed, mapped, exact_prefix, recompute)
    scoring = ScoringOptions(max_new_tokens, n_resamples, perplexity_docs=perplexity_docs, prefix_len=prefix_len,
                             continuation_len=continuation_len, coqa_conversations=coqa_conversations)
    pair = load_named_pair(source, target, dtype, progress, device_map=device_map)
    forward, backward, sweep = pair_mappers(pair, mappers, options, out, progress)
    if sweep is not None:
        typer.echo(f"k sweep: best k = {sweep['best_k']} (mean dev score per k: {sweep['scores']})")
    md, png = evaluate_directions(pair, forward, backward, options, scoring, out, progress)
    typer.echo(md.read_text(encoding="utf-8"))
    typer.echo(f"wrote {md} and {png}")


def render_command(
    results: Annotated[list[Path], typer.Argument(help="One or two result files (forward, reverse).")],
    out: Annotated[Path, typer.Option(help="Folder for summary.md and summary.png.")] = Path("."),
    stem: Annotated[str, typer.Option(help="File name stem.")] = "summary",
) -> None:
    """Re-render the Markdown table and retention chart from result files (no models needed)."""
    md, png = render_results(results, out, stem=stem)
    typer.echo(md.read_text(encoding="utf-8"))
    typer.echo(f"wrote {md} and {png}")
