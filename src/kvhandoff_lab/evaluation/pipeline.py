"""The `kvhandoff-lab eval` pipeline: which mappers to evaluate, both directions' runs, the summary.

The forward mapper is a saved one, one built from calibration statistics (for a given k or the k chosen on the
dev pool, `choose_k`), or the pair's default mapper (fitted or reused from the cache, `workflow.obtain_mapper`);
the reverse one a saved one or the pair's default reverse mapper.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from kvhandoff.config import TOP_K_CHOICES, FitConfig
from kvhandoff.errors import ConfigError
from kvhandoff.files import atomic_write_json
from kvhandoff.fit.statistics import CalibrationStats
from kvhandoff.workflow import NamedPair, load_pair_mapper, obtain_mapper
from kvhandoff.workflow.pair_mappers import on_source_device
from kvhandoff_lab.evaluation.options import EvalOptions, OutputOptions, ScoringOptions
from kvhandoff_lab.evaluation.report import render_results
from kvhandoff_lab.evaluation.runner import run_eval
from kvhandoff_lab.evaluation.sweep import choose_k, default_mapper_factory


@dataclass(frozen=True)
class MapperSource:
    """Where the evaluated mappers come from.

    mapper: a saved forward mapper; or statistics: calibration statistics to build it from, with k = top_k or,
    with sweep_k, the k of `sweep_ks` that scores best on `sweep_limit` dev items per task; neither: the pair's
    default mapper. reverse_mapper: a saved target → source mapper; without one (and without mapper/statistics)
    both_directions evaluates the pair's default reverse mapper too.
    """

    mapper: Path | None = None
    statistics: Path | None = None
    top_k: int | str = "all"
    sweep_k: bool = False
    sweep_limit: int = 50
    sweep_ks: tuple[int | str, ...] = TOP_K_CHOICES
    reverse_mapper: Path | None = None
    both_directions: bool = True

    def __post_init__(self) -> None:
        if self.mapper is not None and (self.statistics is not None or self.sweep_k):
            raise ConfigError("give either mapper or statistics (with or without sweep_k), not both")
        if self.sweep_k and self.statistics is None:
            raise ConfigError("sweep_k needs statistics (a mapper per candidate k is built from them)")
        FitConfig(top_k=self.top_k)  # validates top_k


def forward_mapper(pair: NamedPair, source: MapperSource, options: EvalOptions, out: Path, progress: bool):
    """(the forward mapper, the k sweep's result or None); the sweep is also written to OUT/sweep.json."""
    if source.mapper is not None:
        return load_pair_mapper(source.mapper, pair), None
    if source.statistics is None:  # a pass run here serves the default reverse mapper too, when one is wanted
        both = source.both_directions and source.reverse_mapper is None
        return obtain_mapper(pair, progress=progress, both_directions=both)[0], None
    stats = CalibrationStats.load(source.statistics)
    factory = default_mapper_factory(stats, pair.source, pair.target, pair.models.source_tokenizer,
                                     target_tokenizer=pair.models.target_tokenizer)
    if not source.sweep_k:
        return factory(source.top_k), None
    sweep = choose_k(pair.source, pair.target, pair.tokenizer, mapper_factory=factory, limit=source.sweep_limit,
                     candidates=source.sweep_ks, seed=options.seed, out_dir=out, progress=progress,
                     exact_prefix=options.exact_prefix)
    atomic_write_json(out / "sweep.json", sweep)
    return factory(sweep["best_k"]), sweep


def reverse_mapper(pair: NamedPair, source: MapperSource, progress: bool):
    """The target → source mapper to evaluate, or None."""
    if source.reverse_mapper is not None:
        return load_pair_mapper(source.reverse_mapper, pair.reversed())
    if source.mapper is None and source.statistics is None and source.both_directions:
        return obtain_mapper(pair.reversed(), progress=progress)[0]
    return None


def pair_mappers(pair: NamedPair, source: MapperSource, options: EvalOptions, out: Path, progress: bool):
    """(forward mapper, reverse mapper or None, the k sweep's result or None): `forward_mapper` and
    `reverse_mapper`, each placed on its source model's device."""
    forward, sweep = forward_mapper(pair, source, options, out, progress)
    on_source_device(forward, pair.source)
    backward = on_source_device(reverse_mapper(pair, source, progress), pair.target)
    return forward, backward, sweep


def evaluate_directions(pair: NamedPair, forward, backward, options: EvalOptions, scoring: ScoringOptions,
                        out: Path, progress: bool = False) -> tuple[Path, Path]:
    """Run the forward evaluation (OUT/forward.*) and, with a reverse mapper, the reverse one (OUT/reverse.*,
    CoQA left out: it already switches both ways); render both into OUT/summary.{md,png}, returned."""
    files = [out / "forward.json"]
    run_eval(pair.source, pair.target, forward, pair.tokenizer, options, scoring,
             OutputOptions(out, "forward", pair.source_spec, pair.target_spec, progress), reverse_mapper=backward)
    reverse_tasks = _without_coqa(options.tasks)
    if backward is not None and reverse_tasks:
        run_eval(pair.target, pair.source, backward, pair.tokenizer, replace(options, tasks=reverse_tasks), scoring,
                 OutputOptions(out, "reverse", pair.target_spec, pair.source_spec, progress))
        files.append(out / "reverse.json")
    return render_results(files, out, stem="summary")


def _without_coqa(tasks: Sequence[str]) -> tuple[str, ...]:
    return tuple(task for task in tasks if task != "coqa")
