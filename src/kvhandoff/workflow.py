"""The fit-or-reuse steps shared by the CLI commands: statistics and mappers for a named pair, cached on disk.

Calibration statistics are the expensive part (a forward pass of both models over the corpus); they are
kept, so a mapper for any k or λ is a solve away. A cached mapper is reused only when its manifest matches
the pair's fingerprints and the fit config; otherwise it is refitted and saved (atomically).
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from kvhandoff.config import CalibrationSpec, FitConfig, kvhandoff_home
from kvhandoff.corpus import calibration_batches
from kvhandoff.errors import KVHandoffError
from kvhandoff.fit import check_pair, collect_statistics, mapper_from_statistics
from kvhandoff.geometry import model_fingerprint
from kvhandoff.mapper import Mapper
from kvhandoff.statistics import CalibrationStats


def _slug(spec: str) -> str:
    return "".join(c if c.isalnum() or c in ".-" else "_" for c in spec.strip("/").split("/")[-1])


def _key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


def pair_dir(source_spec: str, target_spec: str) -> Path:
    return kvhandoff_home() / "pairs" / f"{_slug(source_spec)}__{_slug(target_spec)}"


def statistics_path(source_spec: str, target_spec: str, config: FitConfig, calibration: CalibrationSpec) -> Path:
    key = _key(calibration.to_dict(), config.token_stride, config.skip_first_tokens)
    return pair_dir(source_spec, target_spec) / f"stats-{key}.safetensors"


def mapper_dir(source_spec: str, target_spec: str, config: FitConfig, calibration: CalibrationSpec) -> Path:
    return pair_dir(source_spec, target_spec) / f"mapper-{_key(config.to_dict(), calibration.to_dict())}"


def obtain_statistics(
    source_spec: str, target_spec: str, source, target, tokenizer, config: FitConfig,
    calibration: CalibrationSpec, progress: bool = True,
) -> tuple[CalibrationStats, dict]:
    """Load the pair's calibration statistics, or collect and save them. Returns (stats, calibration info).

    Statistics collected for the opposite direction serve too: they hold both models' full Grams.
    """
    path = statistics_path(source_spec, target_spec, config, calibration)
    info_path = path.with_suffix(".json")
    reverse_path = statistics_path(target_spec, source_spec, config, calibration)
    for candidate, flip in ((path, False), (reverse_path, True)):
        candidate_info = candidate.with_suffix(".json")
        if not (candidate.is_file() and candidate_info.is_file()):
            continue
        try:
            stats, info = CalibrationStats.load(candidate), json.loads(candidate_info.read_text())
        except (KVHandoffError, json.JSONDecodeError) as exc:
            if progress:
                print(f"cached statistics {candidate} not usable ({exc}); collecting again")
            continue
        if flip:
            stats = stats.reversed()
            info = {**info, "source_model": source_spec, "target_model": target_spec, "reused_reverse_pass": True}
        return stats, info
    corpus = calibration_batches(
        tokenizer, calibration.num_sequences, calibration.seq_len, seed=calibration.seed,
        batch_size=calibration.batch_size,
    )
    started = time.perf_counter()
    stats = collect_statistics(source, target, corpus, config, progress)
    info = {**corpus.describe(), "source_model": source_spec, "target_model": target_spec,
            "collect_seconds": round(time.perf_counter() - started, 1)}
    path.parent.mkdir(parents=True, exist_ok=True)
    stats.save(path)
    tmp = info_path.with_name(info_path.name + ".tmp")
    tmp.write_text(json.dumps(info, indent=2))
    tmp.replace(info_path)
    return stats, info


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
) -> tuple[Mapper, Path, bool]:
    """Return (mapper, its folder, whether it was reused from the cache)."""
    folder = mapper_dir(source_spec, target_spec, config, calibration)
    if folder.exists() and not refit:
        try:
            mapper = Mapper.load(folder, source, target, tokenizer, tokenizer)
            if mapper.manifest.get("config") == config.to_dict():
                return mapper, folder, True
        except KVHandoffError as exc:  # stale or damaged cache entry: refit, never reuse silently
            if progress:
                print(f"cached mapper in {folder} not usable ({exc}); refitting")
    check_pair(source, target, tokenizer, tokenizer)
    stats, info = obtain_statistics(
        source_spec, target_spec, source, target, tokenizer, config, calibration, progress
    )
    mapper = mapper_from_statistics(
        stats, config, model_fingerprint(source, tokenizer), model_fingerprint(target, tokenizer), info,
        max_position_embeddings=(source.config.max_position_embeddings, target.config.max_position_embeddings),
    )
    mapper.save(folder)
    return mapper, folder, False
