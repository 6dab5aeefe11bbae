"""The fit-or-reuse steps shared by the CLI commands: statistics and mappers for a named pair, cached on disk.

Calibration statistics are the expensive part (a forward pass of both models over the corpus); they are
kept, so a mapper for any k or λ is a solve away. A pass asked for both directions (`both_directions`) sums the
target's Gram too, so the reverse direction's fit reuses it instead of running a pass of its own. Cache
entries are keyed by both models' identities (`geometry.model_fingerprint`: the pairing keys, tokenizer hash
included, and the weights checksum) and the settings, so a changed model under the same folder name never reuses
old statistics. A cached mapper is reused only when its manifest matches the fit config; otherwise it is refitted
and saved (atomically). Why a cache entry is not used is logged (`logging`, this module's logger).
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch

from kvhandoff.config import PROSE_ONLY_MIX, CalibrationSpec, FitConfig, MLPConfig, RefineConfig, kvhandoff_home
from kvhandoff.errors import ConfigError, KVHandoffError, MapperFormatError
from kvhandoff.files import atomic_write_json, sha256_json
from kvhandoff.fit.corpus import calibration_batches, pack_texts
from kvhandoff.fit.distributed import Ranks, dismiss, follow, lead_collection, local_gpus
from kvhandoff.fit.features import FeatureShardWriter, features_complete
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
from kvhandoff.fit.statistics import CalibrationStats, SumsContent
from kvhandoff.mapper.manifest import GuardCalibration, RecomputeChoice
from kvhandoff.mapper.mapper import Mapper
from kvhandoff.model.cache import model_device
from kvhandoff.model.geometry import PAIRING_KEYS, check_pair, model_fingerprint
from kvhandoff.model.loading import ModelPair, load_pair
from kvhandoff.progress import Progress

#: version of the cache keys (part of every key: raising it makes every entry written before a miss)
CACHE_SCHEMA = 2
#: the fingerprint entries a cache entry depends on: what pairs a mapper, plus the weights themselves
IDENTITY_KEYS = (*PAIRING_KEYS, "weights_checksum")

logger = logging.getLogger(__name__)

#: the records measured for the embedded pair's default mappers, shipped with kvhandoff (`measured_records`)
MEASURED_RECORDS_FILE = Path(__file__).with_name("data") / "measured_records.json"
#: what a record of the file holds: the pair, the fit it applies to, what was measured, where the numbers come from
_RECORD_FIELDS = ("source_model", "target_model", "config", "calibration", "guard", "recompute", "source")
#: the measurements a record may hold, each the manifest record of that name
_MEASUREMENTS = ("guard", "recompute")
#: what a record's "source" names for each of its measurements (required, then optional)
_SOURCE_FIELDS = ("docs", "command")
_SOURCE_OPTIONAL = ("how",)


@dataclass(frozen=True)
class MeasuredRecord:
    """What was measured for one direction's ridge mapper of `config` over `calibration`'s windows: its quality
    guard and the selective-recompute policy chosen for it (None: not measured). measured_by: for each of them,
    where its numbers come from ({"guard" | "recompute": {"docs", "command", "how"}}; not part of the record's
    identity)."""

    source: str
    target: str
    config: FitConfig
    calibration: CalibrationSpec
    guard: GuardCalibration | None = None
    recompute: RecomputeChoice | None = None
    measured_by: dict = field(default_factory=dict, compare=False)


def measured_records(path: Path | str | None = None) -> tuple[MeasuredRecord, ...]:
    """The records measured for the embedded pair's default mappers (`MEASURED_RECORDS_FILE`, or the records file
    at ``path``), written into their manifests when they are fitted, so that a fresh machine serves the default pair
    with them. Each file is read and checked once, when first asked for; ConfigError (naming the file, the record
    and the fix) when it is not a valid records file.

    The file: {"description": ..., "records": [...]}; a record: its pair ("source_model", "target_model"), the fit
    it applies to ("config": `FitConfig.to_dict`, "calibration": `CalibrationSpec.to_dict`), what was measured
    ("guard", "recompute": each in the form the mapper manifest writes it, checked by the manifest's own classes)
    and where the numbers come from ("source": for each measurement, the docs section and the experiment command,
    optionally how the record was chosen)."""
    return _read_measured_records(Path(MEASURED_RECORDS_FILE if path is None else path))


def measured_record(pair: NamedPair, config: FitConfig, calibration: CalibrationSpec) -> MeasuredRecord | None:
    """What was measured for `pair`'s ridge mapper of `config` over `calibration` (`measured_records`), or None."""
    return next((m for m in measured_records() if (m.source, m.target, m.config, m.calibration)
                 == (pair.source_spec, pair.target_spec, config, calibration)), None)


class _RecordsProblem(ConfigError):
    """A problem with one record of a records file (the file is named where it is caught)."""


@functools.cache
def _read_measured_records(path: Path) -> tuple[MeasuredRecord, ...]:
    def bad(problem: str) -> ConfigError:
        return ConfigError(f"the measured records file {path} {problem}: {_RECORDS_FIX}")

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise bad(f"cannot be read ({exc})") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad(f"is not valid JSON ({exc})") from exc
    if not isinstance(data, dict) or not isinstance(data.get("records"), list):
        raise bad('must be a JSON object with a list of "records"')
    unknown = sorted(set(data) - {"description", "records"})
    if unknown:
        raise bad(f"has fields kvhandoff does not know ({', '.join(unknown)}; a records file holds "
                  '"description" and "records")')
    records: dict[tuple, MeasuredRecord] = {}
    for index, entry in enumerate(data["records"]):
        name = _record_name(index, entry)
        try:
            record = _measured_record(entry)
        except _RecordsProblem as exc:
            raise bad(f"has an invalid {name}: {exc}") from exc
        key = (record.source, record.target, record.config, record.calibration)
        if key in records:
            raise bad(f"has {name} for a pair, fit config and calibration an earlier record names too (one record "
                      "each)")
        records[key] = record
    return tuple(records.values())


#: what an invalid records file's message says to do
_RECORDS_FIX = ("correct the record (each measurement in the form a mapper manifest writes it, `measured_records`), "
                "or restore kvhandoff's own copy of the file (reinstall kvhandoff)")


def _record_name(index: int, entry) -> str:
    """"record N", with its pair where the record names one."""
    if isinstance(entry, dict) and all(isinstance(entry.get(k), str) for k in ("source_model", "target_model")):
        return f"record {index} ({entry['source_model']} → {entry['target_model']})"
    return f"record {index}"


def _measured_record(entry) -> MeasuredRecord:
    """One record of a records file, checked (`_RecordsProblem` names what is wrong)."""
    if not isinstance(entry, dict):
        raise _RecordsProblem(f"a record must be a JSON object, got {entry!r}")
    unknown = sorted(set(entry) - set(_RECORD_FIELDS))
    if unknown:
        raise _RecordsProblem(f"fields kvhandoff does not know ({', '.join(unknown)}; a record holds "
                              f"{', '.join(_RECORD_FIELDS)})")
    missing = [name for name in _RECORD_FIELDS if name not in entry and name not in _MEASUREMENTS]
    if missing:
        raise _RecordsProblem(f"field {missing[0]!r} is missing")
    for name in ("source_model", "target_model"):
        if not isinstance(entry[name], str) or not entry[name]:
            raise _RecordsProblem(f"field {name!r} must name a model, got {entry[name]!r}")
    measured = tuple(name for name in _MEASUREMENTS if name in entry)
    if not measured:
        raise _RecordsProblem(f"it records no measurement ({' or '.join(_MEASUREMENTS)})")
    calibration = entry["calibration"]
    if isinstance(calibration, dict):  # `CalibrationSpec.to_dict`: the mix as a list, left out when prose-only
        mix = calibration.get("mix", PROSE_ONLY_MIX)
        calibration = {**calibration, "mix": tuple(mix) if isinstance(mix, list) else mix}
    return MeasuredRecord(
        entry["source_model"], entry["target_model"], _checked("config", FitConfig, entry["config"]),
        _checked("calibration", CalibrationSpec, calibration),
        guard=_checked("guard", GuardCalibration, entry["guard"]) if "guard" in entry else None,
        recompute=_checked("recompute", RecomputeChoice, entry["recompute"]) if "recompute" in entry else None,
        measured_by=_measured_by(entry["source"], measured))


def _checked(name: str, kind: type, value):
    """``value`` (a record's field ``name``, the JSON form of ``kind``) built, and so checked, by ``kind`` itself."""
    if not isinstance(value, dict):
        raise _RecordsProblem(f"field {name!r} must be a JSON object (a {kind.__name__}), got {value!r}")
    unknown = sorted(set(value) - {spec.name for spec in fields(kind)})
    if unknown:
        raise _RecordsProblem(f"field {name!r} has fields a {kind.__name__} does not know ({', '.join(unknown)})")
    try:
        return kind(**value)
    except (TypeError, ConfigError, MapperFormatError) as exc:
        raise _RecordsProblem(f"field {name!r} fails the {kind.__name__} check ({exc})") from exc


def _measured_by(value, measured: tuple[str, ...]) -> dict:
    """A record's "source": for each of its ``measured`` records, where its numbers come from."""
    if not isinstance(value, dict) or set(value) != set(measured):
        raise _RecordsProblem(f"field 'source' must name where each measurement comes from: an object with an entry "
                              f"for each of {', '.join(measured)}, got {value!r}")
    for name, origin in value.items():
        text = isinstance(origin, dict) and all(isinstance(v, str) and v.strip() for v in origin.values())
        if not text or set(_SOURCE_FIELDS) - set(origin) or set(origin) - {*_SOURCE_FIELDS, *_SOURCE_OPTIONAL}:
            raise _RecordsProblem(
                f"field 'source.{name}' must be an object of non-empty strings naming the docs section and the "
                f"experiment command the numbers come from ({', '.join(_SOURCE_FIELDS)}; optionally "
                f"{', '.join(_SOURCE_OPTIONAL)}), got {origin!r}")
    return copy.deepcopy(value)


def identity_of(fingerprint: dict) -> str:
    """Hash of what a model's cached statistics depend on (`IDENTITY_KEYS` of its fingerprint)."""
    return sha256_json({key: fingerprint[key] for key in IDENTITY_KEYS}, 16)


@dataclass(frozen=True)
class NamedPair:
    """A loaded model pair with the names it was asked for and each model's fingerprint (with its own tokenizer's
    hash), taken once: what mapper manifests record and, hashed, the identities cache entries are keyed by."""

    source_spec: str
    target_spec: str
    models: ModelPair
    source_fingerprint: dict
    target_fingerprint: dict

    @classmethod
    def of(cls, source_spec: str, target_spec: str, models: ModelPair) -> NamedPair:
        return cls(source_spec, target_spec, models, model_fingerprint(models.source, models.source_tokenizer),
                   model_fingerprint(models.target, models.target_tokenizer))

    @property
    def source_identity(self) -> str:
        return identity_of(self.source_fingerprint)

    @property
    def target_identity(self) -> str:
        return identity_of(self.target_fingerprint)

    @property
    def source(self):
        return self.models.source

    @property
    def target(self):
        return self.models.target

    @property
    def tokenizer(self):
        """The tokenizer both models share (the source's)."""
        return self.models.tokenizer

    def reversed(self) -> NamedPair:
        models = ModelPair(self.target, self.source, self.models.target_tokenizer, self.models.source_tokenizer)
        return NamedPair(self.target_spec, self.source_spec, models, self.target_fingerprint, self.source_fingerprint)

    def fingerprints(self) -> tuple[dict, dict]:
        """Copies of each model's fingerprint with its own tokenizer's hash (what mapper manifests record)."""
        return copy.deepcopy(self.source_fingerprint), copy.deepcopy(self.target_fingerprint)

    def max_positions(self) -> tuple[int, int]:
        return self.source.config.max_position_embeddings, self.target.config.max_position_embeddings


def load_named_pair(source: str, target: str, dtype: torch.dtype | str = torch.float32,
                    progress: Progress | bool = False, ranks: Ranks | None = None,
                    device_map: str | None = None) -> NamedPair:
    """`loading.load_pair` (which refuses pairs whose tokenizers differ), with the names and cache identities.

    dtype, device_map: see `loading.load_model` and `placement.ModelPlacement`. ranks (a distributed run): rank 0
    loads first (converting registry models once), then the other ranks; every rank must end up with the same two
    models (`DistributedError` otherwise); a planned device map spreads each rank's models over its own share of
    the node's GPUs (`distributed.local_gpus`)."""
    if ranks is None or not ranks.distributed:
        return NamedPair.of(source, target, load_pair(source, target, dtype, progress, device_map))
    gpus = local_gpus() or None
    pair = NamedPair.of(source, target, load_pair(source, target, dtype, progress, device_map, gpus)) \
        if ranks.is_root else None
    ranks.barrier("waiting for rank 0 to load the models")
    if pair is None:
        pair = NamedPair.of(source, target, load_pair(source, target, dtype, False, device_map, gpus))
    ranks.require_same((pair.source_identity, pair.target_identity), "models (source and target identities)")
    return pair


def serve_calibration(pair: NamedPair, ranks: Ranks) -> list[dict]:
    """Ranks other than 0 of a distributed fit: read their share of every pass rank 0 leads, until dismissed.
    Returns each pass's record (world_size, windows_per_rank)."""
    return follow(ranks, pair.source, pair.target)


def _slug(spec: str) -> str:
    return "".join(c if c.isalnum() or c in ".-" else "_" for c in spec.strip("/").split("/")[-1])


def _key(pair: NamedPair, *parts) -> str:
    return sha256_json([CACHE_SCHEMA, pair.source_identity, pair.target_identity, *parts], 12)


def pair_dir(pair: NamedPair) -> Path:
    """The pair's cache folder (named for reading; what is inside is keyed by the models' identities)."""
    return kvhandoff_home() / "pairs" / f"{_slug(pair.source_spec)}__{_slug(pair.target_spec)}"


def statistics_path(pair: NamedPair, config: FitConfig, calibration: CalibrationSpec) -> Path:
    key = _key(pair, asdict(calibration), *config.pass_key())
    return pair_dir(pair) / f"stats-{key}.safetensors"


def checkpoint_path(pair: NamedPair, config: FitConfig, calibration: CalibrationSpec) -> Path:
    """Partial statistics of a distributed pass over the same windows as `statistics_path` (rank 0 rewrites it
    after every round; a re-run resumes from it; removed once the statistics are saved)."""
    stats_file = statistics_path(pair, config, calibration)
    return stats_file.with_name(stats_file.name.replace("stats-", "partial-", 1))


def features_dir(pair: NamedPair, config: FitConfig, calibration: CalibrationSpec) -> Path:
    """Calibration feature rows of the same pass as `statistics_path` (only written when asked for)."""
    stats_file = statistics_path(pair, config, calibration)
    return stats_file.with_name(stats_file.stem.replace("stats-", "features-", 1))


def mapper_dir(pair: NamedPair, config: FitConfig, calibration: CalibrationSpec) -> Path:
    return pair_dir(pair) / f"mapper-{_key(pair, config.key_dict(), asdict(calibration))}"


def mlp_mapper_dir(pair: NamedPair, config: FitConfig, calibration: CalibrationSpec, mlp: MLPConfig) -> Path:
    return pair_dir(pair) / f"mlp-{_key(pair, config.key_dict(), asdict(calibration), asdict(mlp))}"


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


def _statistics_on_disk(pair: NamedPair, config: FitConfig, calibration) -> bool:
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


def _corpus(tokenizer, calibration: CalibrationSpec):
    """The built-in corpus windows of `calibration` (the tokens a pass over it reads)."""
    return calibration_batches(tokenizer, calibration.num_sequences, calibration.seq_len, seed=calibration.seed,
                               batch_size=calibration.batch_size, mix=calibration.mix)


def _pass_info(pair: NamedPair, corpus, seconds: float) -> dict:
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
    info = {**_pass_info(pair, _corpus(pair.tokenizer, calibration),
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
    corpus = _corpus(pair.tokenizer, calibration)
    started = time.perf_counter()
    if ranks is not None and ranks.distributed:
        checkpoint = checkpoint_path(pair, config, calibration)
        stats, record = lead_collection(ranks, pair.source, pair.target, corpus.input_ids, config,
                                        corpus.batch_size, checkpoint, progress, target_gram=target_gram,
                                        kv_cross=kv_cross)
        info = {**_pass_info(pair, corpus, time.perf_counter() - started), **record}
        _save_statistics(path, stats, info)
        checkpoint.unlink(missing_ok=True)
        return stats, info
    writer = None
    if feature_folder is not None:
        writer = FeatureShardWriter(feature_folder, feature_layout(pair.source), feature_layout(pair.target))
    stats = collect_statistics(pair.source, pair.target, corpus, config, progress, feature_writer=writer,
                               target_gram=target_gram, kv_cross=kv_cross)
    info = {**_pass_info(pair, corpus, time.perf_counter() - started), **_one_process_record(corpus.num_sequences)}
    if writer is not None:
        writer.close({"calibration": info, "token_stride": config.token_stride})
    _save_statistics(path, stats, info)
    if writer is not None:
        info = {**info, "features": {"folder": str(feature_folder), "reverse": False}}
    return stats, info


def _one_process_record(windows: int) -> dict:
    """How a one-process pass read its windows, in the form a distributed pass records it."""
    return {"world_size": 1, "windows_per_rank": [list(range(windows))]}


def _save_statistics(path: Path, stats: CalibrationStats, info: dict) -> None:
    stats.save(path)
    atomic_write_json(path.with_suffix(".json"), info)


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
    if layer_block is not None and mlp is None and not _statistics_on_disk(pair, config, calibration):
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
    return _blocked_mapper(pair, _corpus(pair.tokenizer, calibration), config, layer_block, progress, ranks)


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
    info = {**_pass_info(pair, corpus, seconds),
            **(records[0] if records else _one_process_record(corpus.num_sequences))}
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
                                   "target_model": pair.target_spec, **_one_process_record(corpus.num_sequences)},
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
