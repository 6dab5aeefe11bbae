"""The fit-or-reuse steps shared by the CLI commands: statistics and mappers for a named pair, cached on disk.

Calibration statistics are the expensive part (a forward pass of both models over the corpus); they are
kept, so a mapper for any k or λ is a solve away. A cached mapper is reused only when its manifest matches
the pair's fingerprints and the fit config; otherwise it is refitted and saved (atomically).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from kvhandoff.config import CalibrationSpec, FitConfig, MLPConfig, kvhandoff_home
from kvhandoff.corpus import calibration_batches
from kvhandoff.errors import KVHandoffError
from kvhandoff.features import FeatureShardWriter, features_complete
from kvhandoff.files import atomic_write_json, sha256_json
from kvhandoff.fit import collect_statistics, feature_layout, mapper_from_statistics
from kvhandoff.geometry import check_pair, model_fingerprint
from kvhandoff.heldout import fit_heldout_mapper
from kvhandoff.mapper import Mapper
from kvhandoff.mlp import fit_mlp_mapper
from kvhandoff.selection import layer_r2_matrix
from kvhandoff.statistics import CalibrationStats


def _slug(spec: str) -> str:
    return "".join(c if c.isalnum() or c in ".-" else "_" for c in spec.strip("/").split("/")[-1])


def _key(*parts) -> str:
    return sha256_json(parts, 12)


def pair_dir(source_spec: str, target_spec: str) -> Path:
    return kvhandoff_home() / "pairs" / f"{_slug(source_spec)}__{_slug(target_spec)}"


def statistics_path(source_spec: str, target_spec: str, config: FitConfig, calibration: CalibrationSpec) -> Path:
    key = _key(calibration.to_dict(), config.token_stride, config.skip_first_tokens)
    return pair_dir(source_spec, target_spec) / f"stats-{key}.safetensors"


def features_dir(source_spec: str, target_spec: str, config: FitConfig, calibration: CalibrationSpec) -> Path:
    """Calibration feature rows of the same pass as `statistics_path` (only written when asked for)."""
    stats_file = statistics_path(source_spec, target_spec, config, calibration)
    return stats_file.with_name(stats_file.stem.replace("stats-", "features-", 1))


def mapper_dir(source_spec: str, target_spec: str, config: FitConfig, calibration: CalibrationSpec) -> Path:
    return pair_dir(source_spec, target_spec) / f"mapper-{_key(config.to_dict(), calibration.to_dict())}"


def mlp_mapper_dir(source_spec: str, target_spec: str, config: FitConfig, calibration: CalibrationSpec,
                   mlp: MLPConfig) -> Path:
    return pair_dir(source_spec, target_spec) / f"mlp-{_key(config.to_dict(), calibration.to_dict(), mlp.to_dict())}"


def _cached_statistics(source_spec, target_spec, config, calibration, features: bool, progress: bool):
    """(stats, info) of a cached pass over `calibration`'s windows in either direction, or None. Statistics
    collected for the opposite direction serve too: they hold both models' full Grams."""
    for first, second, flip in ((source_spec, target_spec, False), (target_spec, source_spec, True)):
        candidate = statistics_path(first, second, config, calibration)
        candidate_info = candidate.with_suffix(".json")
        feature_folder = features_dir(first, second, config, calibration)
        if not (candidate.is_file() and candidate_info.is_file()):
            continue
        if features and not features_complete(feature_folder):
            continue
        try:
            stats, info = CalibrationStats.load(candidate), json.loads(candidate_info.read_text())
        except (KVHandoffError, json.JSONDecodeError) as exc:
            if progress:
                print(f"cached statistics {candidate} not usable ({exc}); collecting again")
            continue
        if features:
            info = {**info, "features": {"folder": str(feature_folder), "reverse": flip}}
        if flip:
            stats = stats.reversed()
            info = {**info, "source_model": source_spec, "target_model": target_spec, "reused_reverse_pass": True}
        return stats, info
    return None


def _split_mix(calibration: CalibrationSpec, leading: int) -> tuple[CalibrationSpec, CalibrationSpec] | None:
    """The mix's first `leading` groups and the rest as specs of their own, when each reads exactly the windows
    it reads inside the mix (each group is packed on its own, so only the windows per group must agree)."""
    shares = calibration.windows_per_group()
    parts = []
    for groups in (calibration.mix[:leading], calibration.mix[leading:]):
        part = replace(calibration, mix=groups, num_sequences=sum(shares[g] for g in groups))
        if part.windows_per_group() != {g: shares[g] for g in groups}:
            return None
        parts.append(part)
    return parts[0], parts[1]


def obtain_statistics(
    source_spec: str, target_spec: str, source, target, tokenizer, config: FitConfig,
    calibration: CalibrationSpec, progress: bool = True, features: bool = False,
) -> tuple[CalibrationStats, dict]:
    """Load the pair's calibration statistics, or collect and save them. Returns (stats, calibration info).

    Statistics collected for the opposite direction serve too. A mix whose leading groups were collected
    before (e.g. the default mix, extended by one more group at the same windows per group) collects only the
    remaining groups and adds the two passes' statistics, which is exact: sums over disjoint windows add.
    features: also make sure the pass's feature rows are on disk; info["features"] then says where
    ({"folder", "reverse"}). When they are missing the pass is run again (statistics and rows must come
    from the same tokens), and a mix is never assembled from parts.
    """
    cached = _cached_statistics(source_spec, target_spec, config, calibration, features, progress)
    if cached is not None:
        return cached
    if not features:
        for leading in range(len(calibration.mix) - 1, 0, -1):
            parts = _split_mix(calibration, leading)
            lead = parts and _cached_statistics(source_spec, target_spec, config, parts[0], False, progress)
            if lead:
                return _extend(source_spec, target_spec, source, target, tokenizer, config, calibration, parts,
                               lead, progress)
    feature_folder = features_dir(source_spec, target_spec, config, calibration) if features else None
    return _collect(source_spec, target_spec, source, target, tokenizer, config, calibration, progress,
                    feature_folder)


def _corpus(tokenizer, calibration: CalibrationSpec):
    """The built-in corpus windows of `calibration` (the tokens a pass over it reads)."""
    return calibration_batches(tokenizer, calibration.num_sequences, calibration.seq_len, seed=calibration.seed,
                               batch_size=calibration.batch_size, mix=calibration.mix)


def _extend(source_spec, target_spec, source, target, tokenizer, config, calibration, parts, lead, progress):
    """Statistics of `calibration` = the cached pass `lead` over its leading groups + a pass over the rest
    (`parts`: the two specs)."""
    (lead_spec, rest_spec), (lead_stats, lead_info) = parts, lead
    if progress:
        print(f"extending the cached pass over {list(lead_spec.mix)} with {rest_spec.num_sequences} windows of "
              f"{list(rest_spec.mix)}")
    rest_stats, rest_info = obtain_statistics(source_spec, target_spec, source, target, tokenizer, config,
                                              rest_spec, progress)
    info = {**_corpus(tokenizer, calibration).describe(), "source_model": source_spec, "target_model": target_spec,
            "collect_seconds": round(lead_info["collect_seconds"] + rest_info["collect_seconds"], 1),
            "assembled_from": {"cached_pass": lead_spec.to_dict(), "new_pass": rest_spec.to_dict()}}
    stats = lead_stats.merge(rest_stats)
    _save_statistics(statistics_path(source_spec, target_spec, config, calibration), stats, info)
    return stats, info


def _collect(source_spec, target_spec, source, target, tokenizer, config, calibration, progress, feature_folder=None):
    path = statistics_path(source_spec, target_spec, config, calibration)
    corpus = _corpus(tokenizer, calibration)
    started = time.perf_counter()
    writer = None
    if feature_folder is not None:
        writer = FeatureShardWriter(feature_folder, feature_layout(source), feature_layout(target))
    stats = collect_statistics(source, target, corpus, config, progress, feature_writer=writer)
    info = {**corpus.describe(), "source_model": source_spec, "target_model": target_spec,
            "collect_seconds": round(time.perf_counter() - started, 1)}
    if writer is not None:
        writer.close({"calibration": info, "token_stride": config.token_stride})
    _save_statistics(path, stats, info)
    if writer is not None:
        info = {**info, "features": {"folder": str(feature_folder), "reverse": False}}
    return stats, info


def _save_statistics(path: Path, stats: CalibrationStats, info: dict) -> None:
    stats.save(path)
    atomic_write_json(path.with_suffix(".json"), info)


def _cached(folder: Path, source, target, tokenizer, expected: dict, progress: bool) -> Mapper | None:
    """The mapper saved in `folder` if it loads, fits this pair and its manifest matches `expected`."""
    if not folder.exists():
        return None
    try:
        mapper = Mapper.load(folder, source, target, tokenizer, tokenizer)
    except KVHandoffError as exc:  # stale or damaged cache entry: refit, never reuse silently
        if progress:
            print(f"cached mapper in {folder} not usable ({exc}); refitting")
        return None
    return mapper if all(mapper.manifest.get(key) == value for key, value in expected.items()) else None


def obtain_mapper(
    source_spec: str,
    target_spec: str,
    source,
    target,
    tokenizer,
    config: FitConfig = FitConfig(),  # noqa: B008 - frozen
    calibration: CalibrationSpec = CalibrationSpec(),  # noqa: B008 - frozen
    progress: bool = True,
    refit: bool = False,
    mlp: MLPConfig | None = None,
) -> tuple[Mapper, Path, bool]:
    """Return (mapper, its folder, whether it was reused from the cache): the ridge mapper of `config`, or with
    `mlp` an `MLPMapper` around it. Settings that need the calibration rows (top_k="heldout", the MLP) make the
    pass keep them, running it again when a cached pass kept none (`obtain_statistics`)."""
    folder = (mapper_dir(source_spec, target_spec, config, calibration) if mlp is None
              else mlp_mapper_dir(source_spec, target_spec, config, calibration, mlp))
    expected = {"config": config.to_dict(), **({} if mlp is None else {"mlp_config": mlp.to_dict()})}
    cached = None if refit else _cached(folder, source, target, tokenizer, expected, progress)
    if cached is not None:
        return cached, folder, True
    check_pair(source, target, tokenizer, tokenizer)
    stats, info = obtain_statistics(
        source_spec, target_spec, source, target, tokenizer, config, calibration, progress,
        features=mlp is not None or config.top_k == "heldout",
    )
    r2 = layer_r2_matrix(stats, config.probe_lambda)
    mapper = _ridge_mapper(stats, info, config, source, target, tokenizer, r2_matrix=r2)
    if mlp is not None:
        features = info["features"]
        mapper = fit_mlp_mapper(mapper, features["folder"], r2, mlp, reverse=features["reverse"], progress=progress)
    mapper.save(folder)
    return mapper, folder, False


def _ridge_mapper(stats, info: dict, config: FitConfig, source, target, tokenizer, r2_matrix=None) -> Mapper:
    """The ridge mapper of `config` from a pass's statistics (and its rows, in info["features"], when the
    config chooses settings on held-out windows)."""
    info = dict(info)
    features = info.pop("features", None)
    fingerprints = (model_fingerprint(source, tokenizer), model_fingerprint(target, tokenizer))
    positions = (source.config.max_position_embeddings, target.config.max_position_embeddings)
    if config.top_k == "heldout":
        return fit_heldout_mapper(stats, features["folder"], config, *fingerprints, info, positions,
                                  reverse=features["reverse"], r2_matrix=r2_matrix)
    return mapper_from_statistics(stats, config, *fingerprints, info, max_position_embeddings=positions,
                                  r2_matrix=r2_matrix)
