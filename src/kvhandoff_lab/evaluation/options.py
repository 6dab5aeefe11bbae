"""What `run_eval` runs, how it scores, and where it writes: three frozen option sets, validated on creation."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvhandoff.config import require_positive
from kvhandoff.errors import ConfigError
from kvhandoff.runtime import policy
from kvhandoff.runtime.policy import RecomputePolicy
from kvhandoff_lab.evaluation.scoring import check_mapped
from kvhandoff_lab.evaluation.tasks import parse_tasks

#: entries of `EvalOptions.tasks` that are not benchmark tasks: conditional perplexity, multi-turn switching
EXTRA_TASKS = ("perplexity", "coqa")


@dataclass(frozen=True)
class EvalOptions:
    """What to run.

    tasks: names or groups ("core", "heldout", "all", comma-separated or a sequence), plus "perplexity" and
        "coqa" (`EXTRA_TASKS`); kept as the tuple of names they expand to.
    limit: items per task from the report pool (None = all); seed: item selection and bootstrap seed.
    mapped: what the transfer condition maps on benchmark tasks: "all" (the whole context) or "history" (the
        few-shot history; the target prefills the question itself).
    exact_prefix: leading positions the target recomputes after every handoff (None = the mapper's own setting).
    recompute: the selective-recompute policy of every handoff, a `RecomputePolicy` or a spec such as
        "deviation:10%" (stored parsed; None = `DEFAULT_RECOMPUTE`).
    """

    tasks: str | tuple[str, ...] = "core"
    limit: int | None = 100
    seed: int = 0
    mapped: str = "all"
    exact_prefix: int | None = None
    recompute: RecomputePolicy | str | None = None

    def __post_init__(self) -> None:
        try:
            names = tuple(parse_tasks(self.tasks, extra=EXTRA_TASKS))
        except ConfigError as exc:
            raise ConfigError(f"tasks: {exc}") from None
        object.__setattr__(self, "tasks", names)
        if self.limit is not None:
            require_positive("limit", self.limit)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")
        check_mapped(self.mapped)
        if self.exact_prefix is not None and (
            isinstance(self.exact_prefix, bool) or not isinstance(self.exact_prefix, int) or self.exact_prefix < 0
        ):
            raise ConfigError(f"exact_prefix must be an integer >= 0 or None, got {self.exact_prefix!r}")
        if self.recompute is not None:
            object.__setattr__(self, "recompute", policy.parse(self.recompute))

    def benchmark_tasks(self) -> tuple[str, ...]:
        return tuple(name for name in self.tasks if name not in EXTRA_TASKS)


@dataclass(frozen=True)
class ScoringOptions:
    """How items are scored: generation budgets, the bootstrap, the perplexity documents and CoQA conversations."""

    max_new_tokens: int = 256
    n_resamples: int = 1000
    confidence: float = 0.95
    perplexity_docs: int = 16
    prefix_len: int = 1024
    continuation_len: int = 1024
    coqa_conversations: int = 20
    coqa_turns: int = 10
    coqa_max_new_tokens: int = 50

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "n_resamples", "perplexity_docs", "prefix_len", "continuation_len",
                     "coqa_conversations", "coqa_turns", "coqa_max_new_tokens"):
            require_positive(name, getattr(self, name))
        if isinstance(self.confidence, bool) or not 0 < self.confidence < 1:
            raise ConfigError(f"confidence must be in (0, 1), got {self.confidence!r}")


@dataclass(frozen=True)
class OutputOptions:
    """Where results go: ``<out_dir>/<result_name>.{json,md,png}`` (nothing written when out_dir is None), the
    direction's display names (default: the models' names), progress bars, and whether to render md/png."""

    out_dir: Path | None = None
    result_name: str = "results"
    source_name: str | None = None
    target_name: str | None = None
    progress: bool = False
    render: bool = True

    def __post_init__(self) -> None:
        if self.out_dir is not None:
            object.__setattr__(self, "out_dir", Path(self.out_dir))
        if not self.result_name or "/" in self.result_name:
            raise ConfigError(f"result_name must be a plain file stem, got {self.result_name!r}")

    @property
    def store_dir(self) -> Path | None:
        """Where per-item records are kept (None: in memory only)."""
        return None if self.out_dir is None else self.out_dir / "items"
