"""`analyze`: why a mapper works or fails, measured on held-out text."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kvhandoff.cli.options import (
    DEFAULT_SOURCE,
    DEFAULT_TARGET,
    SavedMapper,
    Source,
    Target,
    k_list,
    positive_float,
    positive_int,
)
from kvhandoff.workflow import load_named_pair
from kvhandoff_lab.analyze import analyze_pair, summary_table

DEFAULT_KS = "1,2,4,8,all"


def analyze(
    source: Source = DEFAULT_SOURCE,
    target: Target = DEFAULT_TARGET,
    mapper: SavedMapper = None,
    ks: Annotated[object, typer.Option(parser=k_list, metavar="LIST", help=(
        f"comma-separated k to fit from the statistics and analyse (default {DEFAULT_KS} when no --mapper is "
        "given)"))] = None,
    stats: Annotated[Path | None, typer.Option(help="saved calibration statistics (default: the pair's cached "
                                                    "statistics, collected if absent)")] = None,
    lam: Annotated[float, typer.Option("--lambda", parser=positive_float, metavar="λ", help=(
        "ridge λ for probes and fitted mappers"))] = 0.01,
    windows: Annotated[int, typer.Option(parser=positive_int, help="held-out windows (documents)")] = 4,
    seq_len: Annotated[int, typer.Option(parser=positive_int, help="tokens per held-out window")] = 512,
    retention: Annotated[Path | None, typer.Option(help="evaluation result JSON(s) (file or folder), or a JSON "
                                                        "{mapper name: retention}")] = None,
    out: Annotated[Path, typer.Option(help="folder for analysis.json and the figures")] = Path("runs/analyze"),
) -> None:
    """R² heatmaps, R² vs k, layer selection, attention-output cosine and error concentration on held-out text."""
    if ks is None:
        ks = () if mapper is not None else k_list(DEFAULT_KS)
    result = analyze_pair(load_named_pair(source, target, progress=True), out, mapper, ks, stats, lam, windows,
                          seq_len, retention, progress=True)
    Console().print(summary_table(result["summary"], result["correlations"]))
    typer.echo(f"wrote {out / 'analysis.json'} and figures (heatmaps, r2_vs_k, selection, attention) in {out}")
