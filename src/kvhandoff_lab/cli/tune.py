"""`tune`: fit settings swept from one set of statistics, scored on a dev set."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kvhandoff.cli.options import (
    DEFAULT_MIX,
    DEFAULT_SEQ_LEN,
    DEFAULT_SEQUENCES,
    DEFAULT_SOURCE,
    DEFAULT_STRIDE,
    DEFAULT_TARGET,
    Mix,
    SeqLen,
    Sequences,
    Source,
    Stride,
    Target,
    k_list,
    lambdas,
    non_negative_ints,
    one_of,
    option_errors,
    positive_int,
    source_inputs,
)
from kvhandoff.config import CalibrationSpec
from kvhandoff.files import atomic_write_json
from kvhandoff.workflow import load_named_pair
from kvhandoff_lab.evaluation.devsets import DEV_SETS, DevSet, tune_pair, tune_table
from kvhandoff_lab.tuning import config_grid


def tune(
    source: Source = DEFAULT_SOURCE,
    target: Target = DEFAULT_TARGET,
    ks: Annotated[tuple, typer.Option(parser=k_list, metavar="LIST", help="comma-separated k values ('all' allowed)")]
    = "1,2,4,8,all",
    lams: Annotated[tuple, typer.Option("--lambdas", parser=lambdas, metavar="LIST", help=(
        "comma-separated relative ridge λ values"))] = "0.001,0.01,0.1,1",
    exact_prefixes: Annotated[tuple, typer.Option(parser=non_negative_ints, metavar="LIST", help=(
        "comma-separated leading tokens the target recomputes"))] = "0",
    inputs: Annotated[tuple, typer.Option(parser=source_inputs, metavar="LIST", help=(
        "comma-separated source inputs per map: own, kv"))] = "own",
    target_tails: Annotated[tuple, typer.Option(parser=non_negative_ints, metavar="LIST", help=(
        "comma-separated last context tokens the target prefills itself instead of reading them mapped"))] = "0",
    dev: Annotated[str, typer.Option(parser=one_of(DEV_SETS), help=(
        "dev set: 'prose' (held-out LAMBADA documents, --prefix-len + --continuation-len tokens each), 'mmlu' "
        "(5-shot prompts of MMLU validation items, one per subject; the answer letter is scored) or 'gsm8k' "
        "(8-shot prompts of GSM8K dev-pool items; the reference solution is scored) or 'zeroshot' (dev-pool "
        "items of ARC-Challenge, HellaSwag, WinoGrande; the gold choice is scored)"))] = "prose",
    docs: Annotated[int, typer.Option(parser=positive_int, help=(
        "dev documents (prose), MMLU subjects (mmlu), GSM8K items (gsm8k) or items per task (zeroshot)"))] = 4,
    prefix_len: Annotated[int, typer.Option(parser=positive_int)] = 512,
    continuation_len: Annotated[int, typer.Option(parser=positive_int)] = 128,
    sequences: Sequences = DEFAULT_SEQUENCES,
    seq_len: SeqLen = DEFAULT_SEQ_LEN,
    stride: Stride = DEFAULT_STRIDE,
    groups: Mix = DEFAULT_MIX,
    features: Annotated[bool, typer.Option(help="also keep the feature rows (for --method mlp)")] = False,
    mappers: Annotated[list[Path] | None, typer.Option("--mapper", help="also score this saved mapper (repeatable)")]
    = None,
    out: Annotated[Path, typer.Option(help="JSON file for the sweep table")] = Path("runs/tune.json"),
) -> None:
    """Sweep k, λ, source inputs, exact prefixes and target tails from one set of statistics, scored by the
    next-token KL against the target's own cache on a dev set (--dev: prose, mmlu, gsm8k or zeroshot)."""
    with option_errors("--ks", "--lambdas", "--inputs", "--sequences", "--mix"):
        configs = config_grid(ks, lams, inputs, stride)
        calibration = CalibrationSpec(num_sequences=sequences, seq_len=seq_len, mix=groups)
    dev_set = DevSet(dev, docs, prefix_len, continuation_len)
    result = tune_pair(load_named_pair(source, target, progress=True), dev_set, configs, calibration, exact_prefixes,
                       target_tails, mappers or (), features, progress=True)
    Console().print(tune_table(result))
    atomic_write_json(out, result)
