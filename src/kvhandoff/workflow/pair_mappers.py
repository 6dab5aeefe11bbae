"""The pair's mappers (`obtain_mapper`): a cached mapper reused when its manifest matches the fit config, else fitted
from the pair's calibration statistics (`calibration_passes`) and saved (atomically), with what was measured for it
(`measured`); a mapper of the target layers in blocks, of a text file, or refined end to end; and a line on each.
Why a cached mapper is not used is logged (`logging`, this module's logger).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from kvhandoff.config import CalibrationSpec, FitConfig, MLPConfig, RefineConfig
from kvhandoff.errors import ConfigError, KVHandoffError
from kvhandoff.fit.corpus import calibration_batches, pack_texts
from kvhandoff.fit.distributed import Ranks, dismiss, lead_collection
from kvhandoff.fit.heldout import fit_heldout_mapper
from kvhandoff.fit.mlp import fit_mlp_mapper
from kvhandoff.fit.pipeline import (
    blocked_metrics,
    collect_statistics,
    feature_layout,
    fit_in_blocks,
    fit_mapper,
    mapper_from_statistics,
)
from kvhandoff.fit.refine import check_refinable, refine_mapper
from kvhandoff.fit.selection import layer_r2_matrix
from kvhandoff.fit.statistics import CalibrationStats
from kvhandoff.mapper.mapper import Mapper
from kvhandoff.model.cache import model_device
from kvhandoff.model.geometry import check_pair
from kvhandoff.progress import Progress
from kvhandoff.workflow.calibration_passes import (
    calibration_windows,
    obtain_statistics,
    one_process_record,
    pass_info,
    statistics_on_disk,
)
from kvhandoff.workflow.measured import measured_record
from kvhandoff.workflow.named_pair import NamedPair, mapper_dir, mlp_mapper_dir

logger = logging.getLogger(__name__)


def on_source_device(mapper: Mapper | None, source_model) -> Mapper | None:
    """`mapper` moved (in place) to where `source_model` takes its inputs (`cache.model_device`) when that is not
    the CPU: a handoff maps the source's cache where it is (a model spread over several devices is not handed
    over yet: its cache layers sit on several devices)."""
    device = model_device(source_model)
    if mapper is not None and device.type != "cpu" and mapper.device != device:
        mapper.to(device)
    return mapper


def load_pair_mapper(folder: str | Path, pair: NamedPair) -> Mapper:
    """A saved mapper, checked against both models and each one's own tokenizer."""
    return Mapper.load(folder, pair.source, pair.target, pair.models.source_tokenizer, pair.models.target_tokenizer)


def _cached(folder: Path, pair: NamedPair, expected: dict) -> Mapper | None:
    """The mapper saved in `folder` if it loads, fits this pair and its manifest matches `expected`."""
    if not folder.exists():
        return None
    try:
        mapper = load_pair_mapper(folder, pair)
    except KVHandoffError as exc:  # stale or damaged cache entry: refit, never reuse silently
        problem = f"not usable ({exc})"
    else:
        if all(mapper.manifest.get(key) == value for key, value in expected.items()):
            return mapper
        problem = "stale (fitted with other settings)"
    logger.warning("cached mapper in %s %s; refitting", folder, problem)
    return None


def obtain_mapper(
    pair: NamedPair,
    config: FitConfig = FitConfig(),  # noqa: B008 - frozen
    calibration: CalibrationSpec = CalibrationSpec(),  # noqa: B008 - frozen
    progress: Progress | bool = False,
    refit: bool = False,
    mlp: MLPConfig | None = None,
    ranks: Ranks | None = None,
    layer_block: int | None = None,
    both_directions: bool = False,
) -> tuple[Mapper, Path, bool]:
    """Return (mapper, its folder, whether it was reused from the cache): the ridge mapper of `config`, or with
    `mlp` an `MLPMapper` around it. Settings that need the calibration rows (top_k="heldout", the MLP) make the
    pass keep them, running it again when a cached pass kept none (`obtain_statistics`).
    ranks (rank 0 of a distributed run): a pass needed is shared with the other ranks (`serve_calibration`), which
    are dismissed once the statistics are there; only rank 0 solves and saves.
    layer_block: without cached statistics of the pair, fit the target layers in blocks of this many
    (`fit_in_layer_blocks`; the mapper is cached, the statistics are not).
    both_directions: a pass run for it keeps what the reverse direction's fit needs too (`obtain_statistics`).
    progress: bars over the passes and the MLP's training (`kvhandoff.progress`)."""
    if config.weighted and (mlp is not None or both_directions):
        raise ConfigError("attention-weighted statistics weight the rows by this direction's target: they serve "
                          "neither the MLP mapper (which trains on unweighted rows) nor the reverse direction; fit "
                          "with row_weights='uniform' (`--row-weights uniform`), or without --both-directions")
    if mlp is not None and config.compact:
        raise ConfigError("the MLP corrects the full ridge map; fit it without heads, k_tolerance or rank")
    if layer_block is not None and config.compact:
        raise ConfigError("a compact mapper is solved from the whole statistics; fit it without --layer-block "
                          "(or --stats-memory)")
    folder = (mapper_dir(pair, config, calibration) if mlp is None
              else mlp_mapper_dir(pair, config, calibration, mlp))
    expected = {"config": config.to_dict(), **({} if mlp is None else {"mlp_config": mlp.to_dict()})}
    cached = None if refit else _cached(folder, pair, expected)
    if cached is not None:
        _dismiss(ranks)
        return cached, folder, True
    check_pair(pair.source, pair.target, pair.models.source_tokenizer, pair.models.target_tokenizer)
    if layer_block is not None and mlp is None and not statistics_on_disk(pair, config, calibration):
        mapper = fit_in_layer_blocks(pair, config, calibration, layer_block, progress, ranks)
        mapper.save(folder)
        return mapper, folder, False
    stats, info = obtain_statistics(pair, config, calibration, progress,
                                    features=mlp is not None or config.top_k == "heldout", ranks=ranks,
                                    both_directions=both_directions)
    _dismiss(ranks)
    r2 = layer_r2_matrix(stats, config.probe_lambda)
    mapper = _ridge_mapper(stats, info, config, pair, r2_matrix=r2)
    del stats  # the sums are on disk: free them before the MLP trains and the save copies the maps
    if mlp is not None:
        features = info["features"]
        mapper = fit_mlp_mapper(mapper, features["folder"], r2, mlp, reverse=features["reverse"],
                                progress=progress)
    mapper.save(folder)
    measured = measured_record(pair, config, calibration) if mlp is None else None
    if measured is not None:
        mapper.record_measured(measured.guard, measured.recompute)
        logger.info("recorded what was measured for this mapper's pair with it (%s)",
                    "; ".join(f"{name}: {origin['docs']}" for name, origin in measured.measured_by.items()))
    return mapper, folder, False


def fit_in_layer_blocks(pair: NamedPair, config: FitConfig, calibration: CalibrationSpec, layer_block: int,
                        progress: Progress | bool = False, ranks: Ranks | None = None) -> Mapper:
    """The ridge mapper of `config` from one pass over `calibration`'s windows per block of `layer_block` target
    layers (`fit.fit_in_blocks`): the statistics held at once are one block's, and none are kept on disk.
    ranks (rank 0 of a distributed run): every pass is shared with the ranks in `serve_calibration` (no checkpoint).
    """
    return _blocked_mapper(pair, calibration_windows(pair.tokenizer, calibration), config, layer_block, progress, ranks)


def _blocked_mapper(pair: NamedPair, corpus, config: FitConfig, layer_block: int, progress: Progress | bool = False,
                    ranks: Ranks | None = None) -> Mapper:
    """`fit_in_layer_blocks` over the windows of `corpus` (`corpus.CalibrationBatches`)."""
    if config.top_k == "heldout":
        raise ConfigError("top_k='heldout' needs the calibration rows of the whole target: fit it without layer "
                          "blocks")
    records: list[dict] = []

    def collect(layers: range, source_sums: bool) -> CalibrationStats:
        if ranks is None or not ranks.distributed:
            return collect_statistics(pair.source, pair.target, corpus, config, progress, target_layers=layers,
                                      source_sums=source_sums)
        stats, record = lead_collection(ranks, pair.source, pair.target, corpus.input_ids, config,
                                        corpus.batch_size, None, progress, layers, source_sums)
        records.append(record)
        return stats

    started = time.perf_counter()
    try:
        fitted = fit_in_blocks(collect, feature_layout(pair.source), feature_layout(pair.target), config,
                               layer_block)
    finally:
        _dismiss(ranks)
    seconds = time.perf_counter() - started - fitted.solve_seconds
    info = {**pass_info(pair, corpus, seconds),
            **(records[0] if records else one_process_record(corpus.num_sequences))}
    return fitted.mapper(config, *pair.fingerprints(), info, pair.max_positions(),
                         blocked_metrics(fitted.target, layer_block))


def _dismiss(ranks: Ranks | None) -> None:
    if ranks is not None:
        dismiss(ranks)


def _ridge_mapper(stats, info: dict, config: FitConfig, pair: NamedPair, r2_matrix=None) -> Mapper:
    """The ridge mapper of `config` from a pass's statistics (and its rows, in info["features"], when the
    config chooses settings on held-out windows)."""
    info = dict(info)
    features = info.pop("features", None)
    fingerprints = pair.fingerprints()
    if config.top_k == "heldout":
        return fit_heldout_mapper(stats, features["folder"], config, *fingerprints, info, pair.max_positions(),
                                  reverse=features["reverse"], r2_matrix=r2_matrix)
    return mapper_from_statistics(stats, config, *fingerprints, info, max_position_embeddings=pair.max_positions(),
                                  r2_matrix=r2_matrix)


def fit_on_texts(pair: NamedPair, texts: Path, config: FitConfig, sequences: int, seq_len: int,
                 seed: int = 0, ranks: Ranks | None = None, layer_block: int | None = None,
                 progress: Progress | bool = False) -> Mapper:
    """A ridge mapper calibrated on a UTF-8 text file (paragraphs split on blank lines), not cached.
    layer_block: the target layers in blocks (`fit_in_layer_blocks`). progress: bars over the passes.
    ranks (rank 0 of a distributed run): the pass is shared with the ranks in `serve_calibration` (no checkpoint:
    nothing of a text-file fit is cached)."""
    if config.top_k == "heldout":
        raise ConfigError("top_k='heldout' calibrates on the built-in corpus (its rows are cached per pair)")
    paragraphs = [p.strip() for p in texts.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    corpus = pack_texts(pair.tokenizer, paragraphs, sequences, seq_len, seed=seed, name=str(texts))
    if layer_block is not None:
        check_pair(pair.source, pair.target, pair.models.source_tokenizer, pair.models.target_tokenizer)
        return _blocked_mapper(pair, corpus, config, layer_block, progress, ranks)
    if ranks is not None and ranks.distributed:
        check_pair(pair.source, pair.target, pair.models.source_tokenizer, pair.models.target_tokenizer)
        started = time.perf_counter()
        try:
            stats, record = lead_collection(ranks, pair.source, pair.target, corpus.input_ids, config,
                                            corpus.batch_size, progress=progress)
        finally:
            _dismiss(ranks)
        mapper = mapper_from_statistics(stats, config, *pair.fingerprints(),
                                        {**corpus.describe(), "source_model": pair.source_spec,
                                         "target_model": pair.target_spec, **record},
                                        max_position_embeddings=pair.max_positions())
        mapper.manifest = mapper.manifest.with_metrics(collect_seconds=round(time.perf_counter() - started, 3))
        return mapper
    return fit_mapper(pair.source, pair.target, corpus, config, pair.models.source_tokenizer,
                      pair.models.target_tokenizer,
                      calibration={**corpus.describe(), "source_model": pair.source_spec,
                                   "target_model": pair.target_spec, **one_process_record(corpus.num_sequences)},
                      progress=progress)


def describe_fit(mapper: Mapper) -> str:
    """One line on a fitted mapper: R² (ridge), held-out loss (MLP), and k per layer when chosen held-out."""
    metrics = mapper.manifest["fit_metrics"]
    if "mlp" in metrics:
        return (f"held-out loss (1 − R²) ridge {metrics['mlp']['heldout_loss_ridge']:.4f} → mlp "
                f"{metrics['mlp']['heldout_loss_mlp']:.4f}")
    note = f"R² K {metrics['r2_k_mean']:.3f}, V {metrics['r2_v_mean']:.3f}"
    if "heldout_choice" in metrics:
        note += f"; k per target layer {metrics['heldout_choice']['k_per_target_layer']}"
    if "k_per_target_layer" in metrics.get("compact", {}):
        note += f"; k per target layer {metrics['compact']['k_per_target_layer']}"
    return note


def describe_size(mapper: Mapper) -> str:
    """Parameters, bytes on disk (once saved) and FLOPs per mapped token of a mapper."""
    storage = mapper.manifest.storage
    disk = "" if storage is None else (f", {storage['file_bytes'] / 1e6:.1f} MB on disk "
                                       f"({storage['weight_dtype']} weights)")
    return f"{mapper.num_parameters():,} parameters{disk}, {mapper.flops_per_token() / 1e6:.1f} MFLOP per token"


def refine_saved_mapper(pair: NamedPair, mapper_path: Path, config: RefineConfig, windows: int, seq_len: int,
                        mix: tuple[str, ...], progress: Progress | bool = False) -> Mapper:
    """Refine the linear mapper saved at `mapper_path` end to end on `windows` built-in corpus windows of
    `seq_len` tokens (`refine.refine_mapper`); the corpus is shuffled with `config.seed`."""
    if seq_len < config.window_length():
        raise ConfigError(f"windows of {seq_len} tokens are shorter than max context + continuation "
                          f"({config.window_length()})")
    base = load_pair_mapper(mapper_path, pair)
    check_refinable(base)
    corpus = calibration_batches(pair.tokenizer, windows, seq_len, seed=config.seed, mix=mix)
    return refine_mapper(base, pair.source, pair.target, corpus.input_ids, config, progress=progress,
                         description={**corpus.describe(), "base_mapper": str(mapper_path)})
