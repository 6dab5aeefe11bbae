"""Choosing k (source layers per target layer) on held-aside dev items.

Every candidate k gets a mapper from the same calibration statistics (``mapper_from_statistics``, no new pass
over data) and is scored by the transfer condition's primary metric on the *dev pool* of the core
loglikelihood tasks (ARC-Challenge, HellaSwag, WinoGrande, MMLU): items the reported evaluation never uses
(see :func:`kvhandoff_lab.evaluation.tasks.pool_of`). The score of k is the mean over tasks; the best k wins,
ties going to the larger k ("all" counts as the number of source layers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvhandoff.config import TOP_K_CHOICES, FitConfig
from kvhandoff.errors import ConfigError
from kvhandoff.fit.pipeline import mapper_from_statistics
from kvhandoff.fit.selection import layer_r2_matrix
from kvhandoff.model.geometry import model_fingerprint, tokenizer_hash
from kvhandoff_lab.evaluation.metrics import mean
from kvhandoff_lab.evaluation.runner import ItemHook, benchmark_runs, run_records, select_items
from kvhandoff_lab.evaluation.tasks import LOGLIKELIHOOD, SWEEP_TASKS, get_task, item_metrics


def _num_layers(model) -> int:
    config = model.config
    config = getattr(config, "text_config", None) or config
    return int(config.num_hidden_layers)


def _k_value(k: int | str, num_source_layers: int) -> int:
    return num_source_layers if k == "all" else int(k)


def sweep_candidates(candidates: Sequence[int | str], num_source_layers: int) -> list[int | str]:
    """Valid, distinct candidates: ints above the layer count dropped, an int equal to it dropped when "all"
    is present (the same mapper)."""
    out: list[int | str] = []
    for k in candidates:
        FitConfig(top_k=k)  # validates
        if k != "all" and (k > num_source_layers or (k == num_source_layers and "all" in candidates)):
            continue
        if k not in out:
            out.append(k)
    if not out:
        raise ConfigError(f"no candidate k fits a source model with {num_source_layers} layers")
    return out


def default_mapper_factory(
    stats, source_model, target_model, tokenizer, base_config: FitConfig = FitConfig(),  # noqa: B008
    target_tokenizer=None, **fit_kwargs: Any,
) -> Callable[[int | str], Any]:
    """k → ``mapper_from_statistics(stats, FitConfig(top_k=k, ...), fingerprints, ...)`` (R² matrix shared).
    The fingerprints record each model's own tokenizer (`target_tokenizer`, default: the source's)."""
    fingerprints = (model_fingerprint(source_model, tokenizer),
                    model_fingerprint(target_model, tokenizer if target_tokenizer is None else target_tokenizer))
    fit_kwargs.setdefault(
        "max_position_embeddings",
        (source_model.config.max_position_embeddings, target_model.config.max_position_embeddings),
    )
    fit_kwargs.setdefault("r2_matrix", layer_r2_matrix(stats, base_config.ridge_lambda))

    def factory(k: int | str):
        config = dataclasses.replace(base_config, top_k=k)
        return mapper_from_statistics(stats, config, *fingerprints, **fit_kwargs)

    return factory


@dataclasses.dataclass
class _DevRun:
    """The dev-pool items of a sweep and how their records are computed and stored."""

    source_model: Any
    target_model: Any
    tokenizer: Any
    items: dict[str, list]
    store_dir: Path | None
    progress: bool
    on_item: ItemHook | None
    tok_id: str

    def score(self, condition: str, mapper=None, exact_prefix: int | None = None) -> dict[str, float]:
        """Mean primary metric per task of one condition ("target", or "transfer" with `mapper`)."""
        scores = {}
        for task, items in self.items.items():
            spec = get_task(task)
            (run,) = benchmark_runs(self.source_model, self.target_model, mapper, self.tokenizer, spec,
                                    conditions=(condition,), tok_id=self.tok_id, exact_prefix=exact_prefix)
            records = run_records(task, items, [run], self.store_dir, self.progress, self.on_item)[condition]
            scores[task] = mean([item_metrics(spec, records[i.id])[spec.primary_metric] for i in items])
        return scores


def choose_k(
    source_model,
    target_model,
    tokenizer,
    stats=None,
    *,
    candidates: Sequence[int | str] = TOP_K_CHOICES,
    tasks: Sequence[str] = SWEEP_TASKS,
    limit: int | None = 50,
    seed: int = 0,
    out_dir: str | Path | None = None,
    mapper_factory: Callable[[int | str], Any] | None = None,
    base_config: FitConfig = FitConfig(),  # noqa: B008 - frozen
    fit_kwargs: dict | None = None,
    progress: bool = False,
    on_item: ItemHook | None = None,
    exact_prefix: int | None = None,
) -> dict:
    """Score every candidate k on the dev pool and pick the best (mean transfer score; ties → larger k).

    Either ``stats`` (calibration statistics; mappers via :func:`default_mapper_factory`) or
    ``mapper_factory`` (k → mapper) is needed. ``out_dir`` makes the sweep resumable (records are stored
    under ``<out_dir>/items`` like the main evaluation's, keyed by each mapper's manifest).

    Returns {"best_k", "candidates", "scores": {k: mean score}, "per_task": {k: {task: score}},
    "target": {task: target score}, "tasks", "limit", "seed", "items": {task: n}} (k as strings).
    exact_prefix: as in :func:`kvhandoff_lab.evaluation.run_eval` (the transfer condition's sink patch).
    """
    for task in tasks:
        if get_task(task).kind != LOGLIKELIHOOD:
            raise ConfigError(f"the k sweep uses loglikelihood tasks only; {task!r} is not one")
    num_layers = _num_layers(source_model)
    ks = sweep_candidates(candidates, num_layers)
    if mapper_factory is None:
        if stats is None:
            raise ConfigError("choose_k needs calibration statistics or a mapper_factory")
        mapper_factory = default_mapper_factory(stats, source_model, target_model, tokenizer, base_config,
                                                **(fit_kwargs or {}))
    dev = _DevRun(source_model, target_model, tokenizer,
                  {task: select_items(task, limit, seed, "dev") for task in tasks},
                  None if out_dir is None else Path(out_dir) / "items", progress, on_item, tokenizer_hash(tokenizer))
    target_scores = dev.score("target")
    per_task = {str(k): dev.score("transfer", mapper_factory(k), exact_prefix) for k in ks}
    scores = {k: mean(list(by_task.values())) for k, by_task in per_task.items()}
    best = max(ks, key=lambda k: (scores[str(k)], _k_value(k, num_layers)))
    return {
        "best_k": best,
        "candidates": [str(k) for k in ks],
        "scores": scores,
        "per_task": per_task,
        "target": target_scores,
        "tasks": list(tasks),
        "limit": limit,
        "seed": seed,
        "exact_prefix": exact_prefix,
        "items": {task: len(v) for task, v in dev.items.items()},
    }
