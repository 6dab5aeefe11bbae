"""The pair's calibration statistics (`obtain_statistics`): a pass of both models over the built-in corpus windows,
saved, or a cached pass reused. They are the expensive part, and kept, so a mapper for any k or λ is a solve away.
A pass asked for both directions sums the target's Gram too, so the reverse direction reuses it instead of running
a pass of its own; a mix whose leading groups were collected before runs only the rest. Why a cached pass is not
used is logged (`logging`, this module's logger).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from pathlib import Path

from kvhandoff.config import CalibrationSpec, FitConfig
from kvhandoff.errors import ConfigError, KVHandoffError
from kvhandoff.files import atomic_write_json
from kvhandoff.fit.corpus import calibration_batches
from kvhandoff.fit.distributed import Ranks, follow, lead_collection
from kvhandoff.fit.features import FeatureShardWriter, features_complete
from kvhandoff.fit.pipeline import collect_statistics, feature_layout
from kvhandoff.fit.statistics import CalibrationStats, SumsContent
from kvhandoff.progress import Progress
from kvhandoff.workflow.named_pair import NamedPair, checkpoint_path, features_dir, statistics_path

logger = logging.getLogger(__name__)


def serve_calibration(pair: NamedPair, ranks: Ranks) -> list[dict]:
    """Ranks other than 0 of a distributed fit: read their share of every pass rank 0 leads, until dismissed.
    Returns each pass's record (world_size, windows_per_rank)."""
    return follow(ranks, pair.source, pair.target)


def _identities(pair: NamedPair) -> dict:
    return {"source_identity": pair.source_identity, "target_identity": pair.target_identity}


def _load_cached_statistics(path: Path, pair: NamedPair, target_gram: bool = False,
                            kv_cross: bool = False) -> tuple[CalibrationStats, dict] | None:
    """(stats, info) saved at `path` for exactly `pair`, or None (with a warning) when stale or unreadable.
    target_gram, kv_cross: with those moments (the file must hold them)."""
    try:
        stats = CalibrationStats.load(path, target_gram=target_gram, kv_cross=kv_cross)
        info = json.loads(path.with_suffix(".json").read_text())
    except (KVHandoffError, OSError, json.JSONDecodeError) as exc:
        problem = f"not usable ({exc})"
    else:
        if all(info.get(key) == value for key, value in _identities(pair).items()):
            return stats, info
        problem = "stale (written for other models)"
    logger.warning("cached statistics %s %s; collecting again", path, problem)
    return None


def _shortfall(path: Path, flip: bool, kv_cross: bool) -> tuple[SumsContent | None, str | None]:
    """(what the statistics file holds of the optional moments, None when unreadable: loading it says why; why it
    cannot serve this direction (`flip`: it was collected for the other one) with or without the K–V cross
    moments, or None)."""
    try:
        held = CalibrationStats.saved_content(path)
    except KVHandoffError:
        return None, None
    if flip and not held.target_gram:
        return held, "hold no target Gram (a pass for their own direction only), so they cannot serve the reverse one"
    if kv_cross and not held.kv_cross:
        return held, "hold no K–V cross moments, which maps that read source K and V together need"
    return held, None


def _cached_statistics(pair: NamedPair, config, calibration, features: bool, keep_gram: bool = False,
                       kv_cross: bool = False):
    """(stats, info) of a cached pass over `calibration`'s windows in either direction, or None. Statistics
    collected for the opposite direction serve when they hold its target's Gram (a pass for both directions).
    keep_gram: keep the target's Gram where the cached pass of this direction has one; kv_cross: the pass must
    hold the K–V cross moments."""
    for candidate_pair, flip in _pass_directions(pair, config):
        candidate = statistics_path(candidate_pair, config, calibration)
        feature_folder = features_dir(candidate_pair, config, calibration)
        if not (candidate.is_file() and candidate.with_suffix(".json").is_file()):
            continue
        if features and not features_complete(feature_folder):
            continue
        held, problem = _shortfall(candidate, flip, kv_cross)
        if problem is not None:
            logger.info("cached statistics %s %s", candidate, problem)
            continue
        # reversed, the Gram is the input covariance
        gram = flip or (keep_gram and held is not None and held.target_gram)
        loaded = _load_cached_statistics(candidate, candidate_pair, gram, kv_cross)
        if loaded is None:
            continue
        stats, info = loaded
        if features:
            info = {**info, "features": {"folder": str(feature_folder), "reverse": flip}}
        if flip:
            stats = stats.reversed()
            info = {**info, "source_model": pair.source_spec, "target_model": pair.target_spec,
                    **_identities(pair), "reused_reverse_pass": True}
        return stats, info
    return None


def statistics_on_disk(pair: NamedPair, config: FitConfig, calibration) -> bool:
    """Whether statistics of `calibration`'s windows that serve `config`'s maps are cached for the pair, in either
    direction (not read)."""
    return any(statistics_path(candidate, config, calibration).is_file()
               and _shortfall(statistics_path(candidate, config, calibration), flip, config.joint_inputs)[1] is None
               for candidate, flip in _pass_directions(pair, config))


def _pass_directions(pair: NamedPair, config: FitConfig) -> tuple[tuple[NamedPair, bool], ...]:
    """The directions whose cached pass may serve `config`'s fit of `pair`, each with whether it is the reverse one;
    rows weighted by one target's attention serve that direction only."""
    return ((pair, False),) if config.weighted else ((pair, False), (pair.reversed(), True))


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
    pair: NamedPair, config: FitConfig, calibration: CalibrationSpec, progress: Progress | bool = False,
    features: bool = False,
    ranks: Ranks | None = None, both_directions: bool = False, kv_cross: bool | None = None,
) -> tuple[CalibrationStats, dict]:
    """Load the pair's calibration statistics, or collect and save them. Returns (stats, calibration info).

    Statistics collected for the opposite direction serve too. A mix whose leading groups were collected
    before (e.g. the default mix, extended by one more group at the same windows per group) collects only the
    remaining groups and adds the two passes' statistics, which is exact: sums over disjoint windows add.
    features: also make sure the pass's feature rows are on disk; info["features"] then says where
    ({"folder", "reverse"}). When they are missing the pass is run again (statistics and rows must come
    from the same tokens), and a mix is never assembled from parts.
    ranks (rank 0 of a distributed run): a pass is shared with the other ranks, waiting in `serve_calibration`
    (`distributed.lead_collection`), checkpointed after every round at `checkpoint_path`; feature rows cannot be
    collected that way.
    both_directions: a pass run here sums the target's Gram too and saves it, so that the reverse direction's
    statistics are these (`CalibrationStats.reversed`); statistics already cached are used as they are.
    kv_cross: the statistics must hold the K–V cross moments (None: when `config`'s maps read source K and V
    together); a cached pass without them is run again with them (under the same key: it then serves every map).
    progress: a bar over a pass run here (`kvhandoff.progress`); why a cached pass is not used is logged.
    """
    kv_cross = config.joint_inputs if kv_cross is None else kv_cross
    if features and ranks is not None and ranks.distributed:
        raise ConfigError("a distributed calibration collects statistics only: settings that need the calibration "
                          "rows (top_k='heldout', the MLP mapper) run in one process (without torchrun)")
    cached = _cached_statistics(pair, config, calibration, features, kv_cross=kv_cross)
    if cached is not None:
        return cached
    if not features:
        for leading in range(len(calibration.mix) - 1, 0, -1):
            parts = _split_mix(calibration, leading)
            lead = parts and _cached_statistics(pair, config, parts[0], False, both_directions, kv_cross)
            if lead:
                return _extend(pair, config, calibration, parts, lead, progress, ranks, both_directions, kv_cross)
    feature_folder = features_dir(pair, config, calibration) if features else None
    return _collect(pair, config, calibration, progress, feature_folder, ranks, both_directions, kv_cross)


def calibration_windows(tokenizer, calibration: CalibrationSpec):
    """The built-in corpus windows of `calibration` (the tokens a pass over it reads)."""
    return calibration_batches(tokenizer, calibration.num_sequences, calibration.seq_len, seed=calibration.seed,
                               batch_size=calibration.batch_size, mix=calibration.mix)


def pass_info(pair: NamedPair, corpus, seconds: float) -> dict:
    """What a pass of `pair` over the windows of `corpus` in `seconds` records (the calibration of its mappers)."""
    return {**corpus.describe(), "source_model": pair.source_spec, "target_model": pair.target_spec,
            **_identities(pair), "collect_seconds": round(seconds, 1)}


def _extend(pair: NamedPair, config, calibration, parts, lead, progress, ranks=None, both_directions=False,
            kv_cross=False):
    """Statistics of `calibration` = the cached pass `lead` over its leading groups + a pass over the rest
    (`parts`: the two specs); with the target's Gram when both passes have it (`both_directions`)."""
    (lead_spec, rest_spec), (lead_stats, lead_info) = parts, lead
    logger.info("extending the cached pass over %s with %d windows of %s", list(lead_spec.mix), rest_spec.num_sequences,
                list(rest_spec.mix))
    rest_stats, rest_info = obtain_statistics(pair, config, rest_spec, progress, ranks=ranks,
                                              both_directions=both_directions, kv_cross=kv_cross)
    # the leading groups' windows come first in the mix: the new pass's window i is window lead + i of the mix
    lead_windows = lead_spec.num_sequences
    info = {**pass_info(pair, calibration_windows(pair.tokenizer, calibration),
                        lead_info["collect_seconds"] + rest_info["collect_seconds"]),
            "world_size": rest_info.get("world_size", 1),
            "windows_per_rank": [[lead_windows + w for w in share]
                                 for share in rest_info.get("windows_per_rank", [range(rest_spec.num_sequences)])],
            "assembled_from": {"cached_pass": lead_spec.to_dict(), "new_pass": rest_spec.to_dict(),
                               "cached_pass_windows": f"0-{lead_windows - 1}",
                               "cached_pass_world_size": lead_info.get("world_size")}}
    stats = lead_stats.merge(rest_stats)
    _save_statistics(statistics_path(pair, config, calibration), stats, info)
    return stats, info


def _collect(pair: NamedPair, config, calibration, progress, feature_folder=None, ranks=None, target_gram=False,
             kv_cross=False):
    path = statistics_path(pair, config, calibration)
    corpus = calibration_windows(pair.tokenizer, calibration)
    started = time.perf_counter()
    if ranks is not None and ranks.distributed:
        checkpoint = checkpoint_path(pair, config, calibration)
        stats, record = lead_collection(ranks, pair.source, pair.target, corpus.input_ids, config,
                                        corpus.batch_size, checkpoint, progress, target_gram=target_gram,
                                        kv_cross=kv_cross)
        info = {**pass_info(pair, corpus, time.perf_counter() - started), **record}
        _save_statistics(path, stats, info)
        checkpoint.unlink(missing_ok=True)
        return stats, info
    writer = None
    if feature_folder is not None:
        writer = FeatureShardWriter(feature_folder, feature_layout(pair.source), feature_layout(pair.target))
    stats = collect_statistics(pair.source, pair.target, corpus, config, progress, feature_writer=writer,
                               target_gram=target_gram, kv_cross=kv_cross)
    info = {**pass_info(pair, corpus, time.perf_counter() - started), **one_process_record(corpus.num_sequences)}
    if writer is not None:
        writer.close({"calibration": info, "token_stride": config.token_stride})
    _save_statistics(path, stats, info)
    if writer is not None:
        info = {**info, "features": {"folder": str(feature_folder), "reverse": False}}
    return stats, info


def one_process_record(windows: int) -> dict:
    """How a one-process pass read its windows, in the form a distributed pass records it."""
    return {"world_size": 1, "windows_per_rank": [list(range(windows))]}


def _save_statistics(path: Path, stats: CalibrationStats, info: dict) -> None:
    stats.save(path)
    atomic_write_json(path.with_suffix(".json"), info)


