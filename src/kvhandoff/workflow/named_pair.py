"""A named model pair (`NamedPair`: the two models with the names they were asked for and each one's fingerprint) and
the folders of its cache entries under `$KVHANDOFF_HOME/pairs/`: calibration statistics, their partial checkpoints and
feature rows, and mappers, each keyed by both models' identities (`identity_of`: the pairing keys, tokenizer hash
included, and the weights checksum) and the settings, so a changed model under the same folder name never reuses
an old entry.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvhandoff.config import CalibrationSpec, FitConfig, MLPConfig, kvhandoff_home
from kvhandoff.files import sha256_json
from kvhandoff.fit.distributed import Ranks, local_gpus
from kvhandoff.model.geometry import PAIRING_KEYS, model_fingerprint
from kvhandoff.model.loading import ModelPair, load_pair
from kvhandoff.progress import Progress

#: version of the cache keys (part of every key: raising it makes every entry written before a miss)
CACHE_SCHEMA = 2
#: the fingerprint entries a cache entry depends on: what pairs a mapper, plus the weights themselves
IDENTITY_KEYS = (*PAIRING_KEYS, "weights_checksum")


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

