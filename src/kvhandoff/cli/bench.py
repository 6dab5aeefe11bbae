"""`bench`: latency of handoff vs the target's re-prefill, per context length."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import torch
import typer

from kvhandoff.bench import DEFAULT_LENGTHS, bench_mapper, run_bench
from kvhandoff.cli.options import (
    DEFAULT_SOURCE,
    DEFAULT_TARGET,
    Recompute,
    SavedMapper,
    Source,
    Target,
    TopK,
    non_negative_int,
    positive_float,
    positive_int,
    positive_ints,
)
from kvhandoff.workflow import load_named_pair


def bench(
    source: Source = DEFAULT_SOURCE,
    target: Target = DEFAULT_TARGET,
    mapper: SavedMapper = None,
    lengths: Annotated[tuple, typer.Option(parser=positive_ints, metavar="LIST", help="comma-separated context "
                                                                                      "lengths")]
    = ",".join(map(str, DEFAULT_LENGTHS)),
    repeats: Annotated[int, typer.Option(parser=positive_int, help="timed repeats per path and length")] = 5,
    warmup: Annotated[int, typer.Option(parser=non_negative_int, help="untimed warm-up runs per path and length")]
    = 1,
    out: Annotated[Path, typer.Option(help="folder for bench.json and bench.png")] = Path("runs/bench"),
    synthetic: Annotated[bool, typer.Option(help="time a random mapper of the pair's shape (no fit needed; "
                                                 "latency does not depend on the weights)")] = False,
    k: TopK = "all",
    threads: Annotated[int | None, typer.Option(parser=positive_int, help="torch CPU threads (default: torch's "
                                                                          "choice)")] = None,
    budget: Annotated[float | None, typer.Option(parser=positive_float, help="stop starting new lengths after "
                                                                             "this many seconds")] = None,
    memory: Annotated[bool, typer.Option(help="measure peak tensor memory of each path")] = True,
    new_turn: Annotated[int, typer.Option(parser=positive_int, help=(
        "tokens at the end of each context the target reads itself (1: all mapped; more: a switch at a turn "
        "boundary)"))] = 1,
    recompute: Recompute = None,
    two_step: Annotated[bool, typer.Option(help="also time the handoff whose target recomputes the exact prefix in "
                                                "a forward of its own before it reads the new turn")] = True,
    resident: Annotated[bool, typer.Option(help="copy the models' weights out of their file-backed memory maps "
                                                "first, so that memory pressure cannot send a timed forward to the "
                                                "disk")] = True,
) -> None:
    """Latency of handoff (transfer + one target forward: the exact prefix and the new turn) vs the target's
    re-prefill, per context length, with peak tensor memory and the FLOP bound."""
    if threads is not None:
        torch.set_num_threads(threads)
    pair = load_named_pair(source, target)
    the_mapper, note = bench_mapper(pair, mapper, synthetic, k)
    typer.echo(note)
    result = run_bench(pair.source, pair.target, the_mapper, lengths, repeats=repeats, warmup=warmup, out_dir=out,
                       time_budget_s=budget, measure_memory=memory, source_name=source, target_name=target,
                       new_turn=new_turn, recompute=recompute, two_step=two_step, resident=resident)
    typer.echo(f"wrote {out / 'bench.json'} and {out / 'bench.png'}")
    if result["failed"] or result["skipped"]:
        typer.echo(f"not measured: skipped {result['skipped']}, failed {[f['tokens'] for f in result['failed']]}")
