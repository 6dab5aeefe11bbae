"""Typer command functions of the evaluation (registered by ``kvhandoff.cli`` as ``kvhandoff eval`` and
``kvhandoff eval-render``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from kvhandoff.assets import DEFAULT_SOURCE, DEFAULT_TARGET
from kvhandoff.config import TOP_K_CHOICES
from kvhandoff.errors import ConfigError, IncompatiblePairError
from kvhandoff.selection import parse_ks

_DTYPES = ("float32", "bfloat16", "float16")


def _load_pair(source: str, target: str, dtype: str, progress: bool):
    import torch

    from kvhandoff.assets import load_model

    if dtype not in _DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    torch_dtype = getattr(torch, dtype)
    source_model, source_tok = load_model(source, dtype=torch_dtype, progress=progress)
    target_model, target_tok = load_model(target, dtype=torch_dtype, progress=progress)
    check_tokenizers(source_tok, target_tok)
    return source_model, target_model, target_tok


def check_tokenizers(source_tokenizer, target_tokenizer) -> None:
    """Refuse a pair whose tokenizers disagree (the transfer shares token positions)."""
    from kvhandoff.evaluation.runner import tokenizer_identity

    same = tokenizer_identity(source_tokenizer) == tokenizer_identity(target_tokenizer)
    if same and hasattr(source_tokenizer, "get_vocab") and hasattr(target_tokenizer, "get_vocab"):
        from kvhandoff.geometry import tokenizer_hash

        same = tokenizer_hash(source_tokenizer) == tokenizer_hash(target_tokenizer)
    if not same:
        raise IncompatiblePairError(
            "source and target tokenizers encode text differently; a KV cache can only be handed over "
            "between models of one family that share a tokenizer"
        )


def eval_command(
    source: Annotated[
        str, typer.Option(help="Source model (prefills): registry name, folder or hub id.")
    ] = DEFAULT_SOURCE,
    target: Annotated[
        str, typer.Option(help="Target model (decodes on): registry name, folder or hub id.")
    ] = DEFAULT_TARGET,
    mapper: Annotated[
        Path | None,
        typer.Option(help="Fitted mapper folder (source → target). Or give --statistics. Without either, the "
                          "pair's default mapper is fitted or reused from the cache (as `kvhandoff demo` does)."),
    ] = None,
    both_directions: Annotated[
        bool, typer.Option(help="Without --mapper/--reverse-mapper, also evaluate target → source with the "
                                "pair's default reverse mapper.")
    ] = True,
    tasks: Annotated[
        str,
        typer.Option(help="Comma list of tasks or groups: core, heldout, all, arc_challenge, hellaswag, "
                          "winogrande, mmlu, gsm8k, piqa, boolq, arc_easy, perplexity, coqa."),
    ] = "core",
    limit: Annotated[int, typer.Option(help="Items per task (seeded draw from the report pool).")] = 100,
    seed: Annotated[int, typer.Option(help="Item-selection and bootstrap seed.")] = 0,
    out: Annotated[Path, typer.Option(help="Output folder (per-item caches, results, report).")] = Path(
        "kvhandoff-eval"
    ),
    reverse_mapper: Annotated[
        Path | None,
        typer.Option(help="Mapper folder for target → source: also evaluates the reverse direction "
                          "(and is required for the coqa multi-turn task)."),
    ] = None,
    statistics: Annotated[
        Path | None,
        typer.Option(help="Calibration statistics (source → target) to build the mapper from, for any k."),
    ] = None,
    sweep_k: Annotated[
        bool, typer.Option(help="Choose k on the dev pool (needs --statistics); evaluate with the best k.")
    ] = False,
    sweep_limit: Annotated[int, typer.Option(help="Dev items per task for the k sweep.")] = 50,
    sweep_ks: Annotated[
        str, typer.Option(help="Comma list of candidate k for --sweep-k (integers or 'all').")
    ] = ",".join(str(k) for k in TOP_K_CHOICES),
    top_k: Annotated[str, typer.Option(help="k when building from --statistics without --sweep-k.")] = "all",
    exact_prefix: Annotated[
        int | None,
        typer.Option(help="Leading positions the target recomputes itself after each handoff (0 = none; "
                          "default: the mapper's own setting)."),
    ] = None,
    mapped: Annotated[
        str,
        typer.Option(help="What the transfer maps on benchmark tasks: 'all' (the whole context) or 'history' (the "
                          "few-shot history; the target prefills the question, the new turn, itself; tasks "
                          "without a few-shot history are skipped)."),
    ] = "all",
    max_new_tokens: Annotated[int, typer.Option(help="GSM8K generation budget.")] = 256,
    n_resamples: Annotated[int, typer.Option(help="Bootstrap resamples.")] = 1000,
    perplexity_docs: Annotated[int, typer.Option(help="Held-out documents for 'perplexity'.")] = 16,
    prefix_len: Annotated[int, typer.Option(help="Prefix tokens in cache for 'perplexity'.")] = 1024,
    continuation_len: Annotated[int, typer.Option(help="Scored tokens for 'perplexity'.")] = 1024,
    coqa_conversations: Annotated[int, typer.Option(help="Conversations for 'coqa'.")] = 20,
    dtype: Annotated[str, typer.Option(help="Model dtype: float32, bfloat16 or float16.")] = "float32",
    progress: Annotated[bool, typer.Option(help="Show progress bars.")] = True,
) -> None:
    """Evaluate KV-cache transfer: target vs. source vs. transfer accuracy, retention with bootstrap intervals.

    Per-item results are cached under OUT/items, so an interrupted run resumes and a finished one re-renders
    at once. Writes OUT/forward.{json,md,png}, OUT/reverse.* with --reverse-mapper, and OUT/summary.{md,png}.
    """
    from kvhandoff.evaluation.report import render_results
    from kvhandoff.evaluation.runner import run_eval
    from kvhandoff.evaluation.scoring import check_mapped

    check_mapped(mapped)  # before the models load
    if mapper is not None and (statistics is not None or sweep_k):
        raise ConfigError("give either --mapper or --statistics (with or without --sweep-k), not both")
    if sweep_k and statistics is None:
        raise ConfigError("--sweep-k needs --statistics (a mapper per candidate k is built from them)")
    source_model, target_model, tokenizer = _load_pair(source, target, dtype, progress)
    forward_mapper = _forward_mapper(
        source_model, target_model, tokenizer, mapper, statistics, sweep_k, sweep_limit, top_k, seed, out, progress,
        exact_prefix, source, target, candidates=parse_ks(sweep_ks, "--sweep-ks"),
    )
    backward = None
    if reverse_mapper is not None:
        from kvhandoff.mapper import Mapper

        backward = Mapper.load(reverse_mapper, source_model=target_model, target_model=source_model)
    elif mapper is None and statistics is None and both_directions:
        from kvhandoff.workflow import obtain_mapper

        backward = obtain_mapper(target, source, target_model, source_model, tokenizer, progress=progress)[0]
    common = dict(
        tokenizer=tokenizer, exact_prefix=exact_prefix, mapped=mapped, max_new_tokens=max_new_tokens,
        n_resamples=n_resamples,
        perplexity_docs=perplexity_docs, prefix_len=prefix_len, continuation_len=continuation_len,
        coqa_conversations=coqa_conversations, progress=progress,
    )
    files = []
    run_eval(source_model, target_model, forward_mapper, tasks, limit, seed, out, reverse_mapper=backward,
             source_name=source, target_name=target, result_name="forward", **common)
    files.append(out / "forward.json")
    if backward is not None:
        reverse_tasks = ",".join(t for t in tasks.split(",") if t.strip().lower() != "coqa") or None
        if reverse_tasks:
            run_eval(target_model, source_model, backward, reverse_tasks, limit, seed, out,
                     source_name=target, target_name=source, result_name="reverse", **common)
            files.append(out / "reverse.json")
    md, png = render_results(files, out, stem="summary")
    typer.echo(md.read_text(encoding="utf-8"))
    typer.echo(f"wrote {md} and {png}")


def _forward_mapper(source_model, target_model, tokenizer, mapper_path, statistics, sweep_k, sweep_limit,
                    top_k, seed, out: Path, progress: bool, exact_prefix: int | None = None,
                    source_name: str = DEFAULT_SOURCE, target_name: str = DEFAULT_TARGET,
                    candidates=TOP_K_CHOICES):
    from kvhandoff.config import FitConfig
    from kvhandoff.mapper import Mapper

    if mapper_path is not None:
        return Mapper.load(mapper_path, source_model=source_model, target_model=target_model)
    if statistics is None:
        from kvhandoff.workflow import obtain_mapper

        return obtain_mapper(source_name, target_name, source_model, target_model, tokenizer, progress=progress)[0]
    from kvhandoff.evaluation.sweep import choose_k, default_mapper_factory
    from kvhandoff.files import atomic_write_json
    from kvhandoff.statistics import CalibrationStats

    stats = CalibrationStats.load(statistics)
    factory = default_mapper_factory(stats, source_model, target_model, tokenizer)
    if sweep_k:
        sweep = choose_k(source_model, target_model, tokenizer, mapper_factory=factory, limit=sweep_limit,
                         candidates=candidates,
                         seed=seed, out_dir=out, progress=progress, exact_prefix=exact_prefix)
        atomic_write_json(out / "sweep.json", sweep)
        typer.echo(f"k sweep: best k = {sweep['best_k']} "
                   f"(mean dev score per k: {json.dumps(sweep['scores'])})")
        return factory(sweep["best_k"])
    try:
        k: int | str = top_k if top_k == "all" else int(top_k)
    except ValueError:
        raise ConfigError(f"--top-k must be a positive integer or 'all', got {top_k!r}") from None
    return factory(FitConfig(top_k=k).top_k)


def render_command(
    results: Annotated[list[Path], typer.Argument(help="One or two result files (forward, reverse).")],
    out: Annotated[Path, typer.Option(help="Folder for summary.md and summary.png.")] = Path("."),
    stem: Annotated[str, typer.Option(help="File name stem.")] = "summary",
) -> None:
    """Re-render the Markdown table and retention chart from result files (no models needed)."""
    from kvhandoff.evaluation.report import render_results

    md, png = render_results(results, out, stem=stem)
    typer.echo(md.read_text(encoding="utf-8"))
    typer.echo(f"wrote {md} and {png}")
