"""What the server's quality guard would do at the switch benchmark's switches.

A guarded switch serves the handed-over cache unless the guard's score of it is above a threshold; the score is one
of `GUARD_SIGNALS`, the server's signals of the same names (`serving.guard.guard_score`), from the served switch's
records: ``guard_scores`` (every signal, scored against the source's reference pass over the new turn), or, for a
run whose records carry only ``guard_entropy`` (a reader's mean next-token entropy over the new turn), "entropy",
the target's on the handed-over cache, and "entropy_gain", that minus the source alone's on its own cache. A
flagged switch is served by another condition of the same run instead — ``target`` (the guard falls back to a
re-prefill) or a switch with a larger recompute budget (it escalates). Its cost at a switch is the served switch's
time to first token (the guard scores the cache the target has just read the new turn on), the source's reference
pass for a signal that needs one, and, when flagged, the other condition's.

`guard_table` sweeps the thresholds of a dev run: per threshold the share flagged, each task's score and retention
(guarded score / the target alone's), the mean retention, the lowest guarded − source alone over the tasks and the
mean speed-up over re-prefill. `choose_threshold` picks the best mean retention among the thresholds that keep a
speed-up, and `guarded_report` scores one threshold on other items with paired bootstrap intervals.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from kvhandoff.errors import ConfigError
from kvhandoff.serving.calibrate import auroc, flag_rates
from kvhandoff_lab.evaluation.metrics import mean
from kvhandoff_lab.evaluation.switch import SWITCH_GUARD_SIGNALS, paired_difference

#: the condition a switch's time to first token is compared with (its seconds are the re-prefill's)
TARGET = "target"
#: the guard scores a run's records give (the server's signals of the same names)
GUARD_SIGNALS = SWITCH_GUARD_SIGNALS
#: the signals a run whose records carry only ``guard_entropy`` gives
ENTROPY_SIGNALS = ("entropy", "entropy_gain")


@dataclass(frozen=True)
class GuardedTask:
    """One task's items as a guard sees them: the served switch's scores and guard scores, the flagged
    condition's scores, the target's and the source's alone, item by item."""

    served: tuple[float, ...]
    guard: tuple[float, ...]
    flagged: tuple[float, ...]
    target: tuple[float, ...]
    source: tuple[float, ...]

    def scores(self, threshold: float) -> list[float]:
        """Each item's score under the guard ``threshold`` (flagged: score above it)."""
        return [f if g > threshold else s for s, g, f in zip(self.served, self.guard, self.flagged, strict=True)]

    def flagged_count(self, threshold: float) -> int:
        return sum(g > threshold for g in self.guard)


def guarded_task(entry: Mapping, served: str, flagged: str, signal: str = "entropy") -> GuardedTask:
    """A task of a run's `switch.json` direction (its per-item ``scores`` and ``guard_scores`` or
    ``guard_entropy``) as a `GuardedTask` scored by ``signal`` (one of `GUARD_SIGNALS`); a ConfigError names what
    is missing."""
    if signal not in GUARD_SIGNALS:
        raise ConfigError(f"guard signal must be one of {', '.join(GUARD_SIGNALS)}, got {signal!r}")
    scores = entry.get("scores", {})
    missing = [name for name in (served, flagged, TARGET, "source") if name not in scores]
    if missing:
        raise ConfigError(f"the run has no per-item scores for {', '.join(missing)}; run eval-switch with those "
                          f"conditions (--recompute) into the same --out")
    return GuardedTask(*(tuple(float(v) for v in values) for values in (
        scores[served], guard_of(entry, served, signal), scores[flagged], scores[TARGET], scores["source"])))


def guard_of(entry: Mapping, served: str, signal: str) -> list[float]:
    """The ``served`` switch's guard score of each item of a task under ``signal``."""
    recorded = entry.get("guard_scores", {}).get(served, {})
    if signal in recorded:
        return [float(v) for v in recorded[signal]]
    entropies = entry.get("guard_entropy", {})
    needed = (served, "source") if signal == "entropy_gain" else (served,)
    unscored = [name for name in needed if name not in entropies] if signal in ENTROPY_SIGNALS else [served]
    if unscored:
        raise ConfigError(f"the run's {' and '.join(unscored)} records carry no {signal!r} guard score: run "
                          f"eval-switch into a fresh --out, copying in only the stored records of the other "
                          f"conditions")
    guard = [float(v) for v in entropies[served]]
    if signal == "entropy_gain":
        guard = [g - float(r) for g, r in zip(guard, entropies["source"], strict=True)]
    return guard


@dataclass(frozen=True)
class GuardCosts:
    """Seconds to the first token at one history length: the served switch's, the flagged condition's (the
    re-prefill's for ``target``) and the re-prefill's; reference: the source's pass over the new turn a relative
    signal adds at every switch (0 for a signal without one)."""

    served: float
    flagged: float
    reprefill: float
    reference: float = 0.0

    def speedup(self, flagged_share: float) -> float:
        """Mean speed-up over re-prefill when ``flagged_share`` of the switches are flagged."""
        return self.reprefill / (self.served + self.reference + flagged_share * self.flagged)


def guard_costs(ttft: Mapping, served: str, flagged: str, reference: float | None = 0.0) -> GuardCosts:
    """`GuardCosts` from a time-to-first-token measurement's mean seconds (``{"reprefill": s, condition: s}``, as
    `eval-switch --ttft-repeats` writes them); ``reference``: its ``guard_reference_seconds`` for a relative signal
    (None: it has none, refused)."""
    seconds = dict(ttft)
    seconds.setdefault(TARGET, seconds.get("reprefill"))
    missing = [name for name in (served, flagged, "reprefill") if seconds.get(name) is None]
    if missing:
        raise ConfigError(f"the time-to-first-token measurement has no seconds for {', '.join(missing)}; measure "
                          f"them with eval-switch --ttft-repeats and the same --recompute")
    if reference is None:
        raise ConfigError("the time-to-first-token measurement has no guard_reference_seconds (the source's pass "
                          "over the new turn a relative signal needs): measure it again with eval-switch "
                          "--ttft-repeats")
    return GuardCosts(float(seconds[served]), float(seconds[flagged]), float(seconds["reprefill"]), float(reference))


@dataclass(frozen=True)
class GuardRow:
    """The guard at one threshold over a run's tasks."""

    threshold: float
    flagged_share: float
    speedup: float
    scores: dict[str, float]
    retention: dict[str, float]
    mean_retention: float
    lowest_minus_source: float

    def to_dict(self) -> dict:
        return asdict(self)


def guard_row(tasks: Mapping[str, GuardedTask], costs: GuardCosts, threshold: float) -> GuardRow:
    """The guard ``threshold`` over ``tasks``: the share of all their switches flagged, the speed-up at that share,
    each task's mean guarded score and retention (guarded / the target alone; NaN for a target scoring 0), their
    mean over the tasks with one, and the lowest guarded − source alone."""
    count = sum(len(task.served) for task in tasks.values())
    if not count:
        raise ConfigError("the run has no scored items to put a guard on")
    flagged = sum(task.flagged_count(threshold) for task in tasks.values()) / count
    scores = {name: mean(task.scores(threshold)) for name, task in tasks.items()}
    retention = {name: scores[name] / mean(task.target) if mean(task.target) > 0 else math.nan
                 for name, task in tasks.items()}
    kept = [value for value in retention.values() if not math.isnan(value)]
    return GuardRow(threshold, flagged, costs.speedup(flagged), scores, retention,
                    mean(kept) if kept else math.nan,
                    min(scores[name] - mean(task.source) for name, task in tasks.items()))


def thresholds_of(tasks: Mapping[str, GuardedTask]) -> list[float]:
    """Every threshold that changes what a guard flags on ``tasks``: below all scores (flag all), each score, and
    +inf (flag none)."""
    values = sorted({g for task in tasks.values() for g in task.guard})
    return [values[0] - 1.0, *values, math.inf] if values else [math.inf]


def guard_table(tasks: Mapping[str, GuardedTask], costs: GuardCosts) -> list[GuardRow]:
    """`guard_row` at every threshold of `thresholds_of`, flagging fewer and fewer."""
    return [guard_row(tasks, costs, threshold) for threshold in thresholds_of(tasks)]


def choose_threshold(rows: Sequence[GuardRow], min_speedup: float) -> GuardRow | None:
    """The row with the highest mean retention among those at ``min_speedup`` or faster (ties: the one flagging
    fewer); None when none keeps that speed-up."""
    kept = [row for row in rows if row.speedup >= min_speedup and not math.isnan(row.mean_retention)]
    if not kept:
        return None
    return max(kept, key=lambda row: (row.mean_retention, -row.flagged_share))


def guard_separation(tasks: Mapping[str, GuardedTask], threshold: float) -> dict:
    """How the guard's score singles out the switches that score below the target alone (the bad ones) over all
    of ``tasks``' items: switches, bad ones, the score's AUROC for them (None with one class only) and, at
    ``threshold``, the share of the bad ones flagged (catch rate) and of the others (false-fallback rate)."""
    scores, bad = [], []
    for task in tasks.values():
        scores += list(task.guard)
        bad += [s < t for s, t in zip(task.served, task.target, strict=True)]
    catch, false_rate = flag_rates(scores, bad, threshold)
    return {"switches": len(bad), "bad": sum(bad), "auroc": auroc(scores, bad), "catch_rate": catch,
            "false_fallback_rate": false_rate}


def guarded_report(tasks: Mapping[str, GuardedTask], costs: GuardCosts, threshold: float,
                   n_resamples: int = 2000, seed: int = 0) -> dict:
    """The guard ``threshold`` (chosen elsewhere) on ``tasks``: its `GuardRow`, and per task and pooled the guarded
    score − the target alone, − the source alone and − the served switch unguarded, with paired bootstrap
    intervals."""
    row = guard_row(tasks, costs, threshold)
    per_task, pooled = {}, {"guarded": [], "target": [], "source": [], "served": []}
    for name, task in tasks.items():
        guarded = task.scores(threshold)
        per_task[name] = {"n": len(guarded), "flagged": task.flagged_count(threshold),
                          **_differences(guarded, task, n_resamples, seed)}
        for key, values in (("guarded", guarded), ("target", task.target), ("source", task.source),
                            ("served", task.served)):
            pooled[key] += list(values)
    pooled_task = GuardedTask(tuple(pooled["served"]), (), (), tuple(pooled["target"]), tuple(pooled["source"]))
    per_task["pooled"] = {"n": len(pooled["guarded"]),
                          **_differences(pooled["guarded"], pooled_task, n_resamples, seed)}
    return {"row": row.to_dict(), "tasks": per_task}


def _differences(guarded: Sequence[float], task: GuardedTask, n_resamples: int, seed: int) -> dict:
    return {"score": mean(guarded),
            "minus_target": paired_difference(guarded, task.target, n_resamples, seed),
            "minus_source": paired_difference(guarded, task.source, n_resamples, seed),
            "minus_unguarded": paired_difference(guarded, task.served, n_resamples, seed)}
