"""The switch benchmark in both directions, the recompute sweep (rule × budget), and their tables and plot.

Both run in *history rounds* (`run_in_history_rounds`): round r adds the items of every task's r-th history in
every direction, so each history is prefilled and handed over once, and a run stopped by its time limit leaves a
result balanced over tasks and directions (the last finished round; records are resumed from the item store).

`run_switch_benchmark` (report pool by default) writes ``<out>/switch.{json,md}``; the generative group's tasks
have a table of their own, with each switch's pooled differences over the group (`switch.pooled_difference`).
`run_recompute_sweep` is the Pareto trade-off of selective recompute on the dev pool: the time to first token of
every (rule, budget) point against re-prefill on one history per length (1K and 2K tokens by default, both
directions, interleaved), then the retention of every point on the core tasks, or on the generative group's
(`sweep_group`: one group per sweep);
``<out>/sweep_recompute.{json,md,png}``. Choose a policy on the dev pool, report it with `run_switch_benchmark` on
the report pool.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kvhandoff.errors import ConfigError
from kvhandoff.files import atomic_write_json, atomic_write_text
from kvhandoff.mapper.manifest import TRADEOFF_RULES, RecomputeChoice, TradeoffPoint, choose_point
from kvhandoff.runtime import policy as recompute_policies
from kvhandoff.runtime.policy import NoRecompute, RecomputePolicy, policy_for
from kvhandoff_lab.evaluation.metrics import mean, paired_bootstrap
from kvhandoff_lab.evaluation.runner import mapper_identity
from kvhandoff_lab.evaluation.switch import (
    History,
    HistoryPrefills,
    SwitchSettings,
    build_histories,
    mean_retention,
    pooled_difference,
    run_switch_direction,
    switch_items,
    switch_name,
    time_to_first_token,
)
from kvhandoff_lab.evaluation.switchtasks import GROUP, SWITCH_TASKS
from kvhandoff_lab.figures import save_figure

SWITCH_FORMAT = "kvhandoff-switch/1"
SWEEP_FORMAT = "kvhandoff-switch-sweep/1"
DEFAULT_SWEEP_RULES = ("recent", "sinks", "deviation")
DEFAULT_SWEEP_BUDGETS = (0.0, 0.02, 0.05, 0.10, 0.20, 0.50)
DEFAULT_TTFT_LENGTHS = (1024, 2048)
#: the multiple-choice task whose histories time a sweep of the generative group (the time depends on the lengths)
TTFT_TASK = "arc_challenge"


@dataclass(frozen=True)
class Direction:
    """One direction of a pair: its name ("forward"/"reverse"), models, mapper and display names."""

    name: str
    source: Any
    target: Any
    mapper: Any
    source_name: str
    target_name: str


def recompute_points(rules: Sequence[str], budgets: Sequence[float]) -> tuple[RecomputePolicy, ...]:
    """The policies of a rule × budget grid, "none" (budget 0) once and first."""
    points: dict[str, RecomputePolicy] = {"none": NoRecompute()}
    for rule in rules:
        for budget in budgets:
            point = policy_for(rule, float(budget))
            points.setdefault(point.spec, point)
    return tuple(points.values())


def _direction_header(direction: Direction) -> dict:
    return {"source": direction.source_name, "target": direction.target_name,
            "mapper": mapper_identity(direction.mapper)}


def _settings_record(settings: SwitchSettings) -> dict:
    record = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(settings).items()}
    return {**record, "policies": [policy.spec for policy in settings.policies],
            "max_new_tokens": dict(settings.max_new_tokens)}


# -- the benchmark -----------------------------------------------------------------------------------------------


def run_in_history_rounds(directions: Sequence[Direction], tokenizer, tok_id: str, settings: SwitchSettings,
                          store_dir: Path | None, progress: bool, deadline: float | None, on_round) -> None:
    """Round r adds the items of every task's r-th history, in every direction; ``on_round(r, directions' tasks,
    finished)`` after each round (`SwitchSettings.rounds` of them). Each history is prefilled and handed over once
    (its items are in one round), each model's prefill of it serves both directions; past ``deadline`` the round
    under way is the last."""
    prefills = HistoryPrefills(entries=settings.history_entries())
    for used in range(1, settings.rounds + 1):
        done = {d.name: {**_direction_header(d), "tasks": run_switch_direction(
            d.source, d.target, d.mapper, tokenizer, tok_id, settings, store_dir, progress, deadline, used, prefills)}
            for d in directions}
        finished = all(len(d["tasks"]) == len(settings.tasks) and all(t["complete"] for t in d["tasks"].values())
                       for d in done.values())
        on_round(used, done, finished)
        if not finished:
            return


def run_switch_benchmark(directions: Sequence[Direction], tokenizer, tok_id: str, settings: SwitchSettings,
                         out_dir: Path | None = None, progress: bool = False, deadline: float | None = None) -> dict:
    """Every direction's per-task summaries and TTFT, with the mean retention of each switch condition over the
    core and held-out tasks (and, with generative-group tasks, over them and their pooled differences,
    ``pooled``); written to ``<out_dir>/switch.{json,md}`` after each history round (`run_in_history_rounds`)."""
    store = None if out_dir is None else Path(out_dir) / "items"
    result: dict = {"format": SWITCH_FORMAT, "settings": _settings_record(settings), "directions": {},
                    "histories_done": 0, "complete": False}

    def keep(used: int, done: dict, finished: bool) -> None:
        if not (finished or not result["directions"]):
            return
        generative = any(task in SWITCH_TASKS for task in settings.tasks)
        groups = ("core", "heldout", GROUP, "all") if generative else ("core", "heldout", "all")
        for entry in done.values():
            conditions = sorted({name for task in entry["tasks"].values() for name in task["transfers"]})
            entry["summary"] = {name: {group: mean_retention(entry["tasks"], name, group)
                                       for group in groups} for name in conditions}
            if generative:
                entry["pooled"] = {name: pooled_difference(entry["tasks"], name, GROUP, settings.n_resamples,
                                                           settings.seed)
                                   for name in conditions if name != "all_mapped"}
        result.update(directions=done, histories_done=used, complete=finished and used == settings.rounds)
        if out_dir is not None:
            atomic_write_json(Path(out_dir) / "switch.json", result)
            atomic_write_text(Path(out_dir) / "switch.md", switch_markdown(result))

    run_in_history_rounds(directions, tokenizer, tok_id, settings, store, progress, deadline, keep)
    return result


def _fmt(value, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return f"{value:.{digits}f}"


def _ci(entry: dict | None) -> str:
    if not entry:
        return "–"
    lo, hi = entry["ci"]
    return f"{_fmt(entry['value'])} [{_fmt(lo)}, {_fmt(hi)}]"


def switch_markdown(result: dict) -> str:
    """One table per direction: accuracy per condition, retention of the switch and of the all-mapped condition,
    the switch's agreement with the target alone, and the time to first token of the switch against re-prefill."""
    lines = []
    for direction in result["directions"].values():
        lines += [f"### {direction['source']} → {direction['target']}", ""]
        multiple_choice = [t for t in direction["tasks"].values() if t.get("group") != GROUP]
        generative = [t for t in direction["tasks"].values() if t.get("group") == GROUP]
        if multiple_choice or not generative:
            lines += ["| Task | n | History tokens | Question tokens | Source | Target | Switch | All mapped "
                      "| Retention, switch [95% CI] | Floor-normalised, switch | Agreement with target, switch "
                      "| Retention, all mapped | TTFT re-prefill | TTFT switch | Speed-up |",
                      "|---|---:|---|---:|---:|---:|---:|---:|---|---|---|---|---:|---:|---:|"]
            for task in multiple_choice:
                lines += [_task_row(task, name) for name in task["transfers"] if name != "all_mapped"]
            lines.append("")
        if generative:
            lines += _generative_table(generative, direction.get("pooled", {}))
    return "\n".join(lines)


def _signed(entry: dict | None) -> str:
    if not entry or entry.get("value") is None or not math.isfinite(entry["value"]):
        return "–"
    lo, hi = entry["ci"]
    return f"{entry['value']:+.3f} [{lo:+.3f}, {hi:+.3f}]"


def _generative_table(tasks: Sequence[dict], pooled: dict) -> list[str]:
    """The generative group's rows (per task and switch) and the pooled differences of every switch."""
    lines = ["| Task | Metric | n | Histories | History tokens | Source | Target | Switch | Switch − target [95% CI] "
             "| Switch − source [95% CI] | Agreement with target [95% CI] | KL to target (first answer token / "
             "choices) |",
             "|---|---|---:|---:|---|---:|---:|---:|---|---|---|---:|"]
    for task in tasks:
        if not task.get("n"):
            lines.append(f"| {task['display']} | | 0 | | | | | | | | | |")
            continue
        acc, low_high = task["accuracy"], task["history_tokens"]
        for name, switch in task["transfers"].items():
            label = task["display"] + ("" if name == "switch" else f" ({name.removeprefix('switch:')})")
            kl = switch.get("answer_kl", switch.get("choice_kl"))
            lines.append(f"| {label} | {task['primary_metric']} | {task['n']} | {task['histories']} "
                         f"| {low_high[0]}–{low_high[1]} "
                         f"| {_fmt(acc['source']['value'])} | {_fmt(acc['target']['value'])} "
                         f"| {_fmt(switch['accuracy']['value'])} | {_signed(switch['minus_target'])} "
                         f"| {_signed(switch['minus_source'])} | {_ci(switch.get('agreement'))} "
                         f"| {_fmt(kl['value'] if kl else None)} |")
    for name, entry in pooled.items():
        label = "switch" if name == "switch" else name.removeprefix("switch:")
        lines.append(f"| **pooled, {GROUP} ({entry['tasks']} tasks), {label}** | | {entry['n']} | | | | | "
                     f"| {_signed(entry['minus_target'])} | {_signed(entry['minus_source'])} | | |")
    return [*lines, ""]


def _task_row(task: dict, switch: str) -> str:
    if not task.get("n"):
        return f"| {task['display']} | 0 | | | | | | | | | | | | | |"
    acc, transfers = task["accuracy"], task["transfers"]
    ttft = task.get("ttft", {}).get("mean", {})
    seconds = ttft.get("seconds", {})
    label = task["display"] + ("" if switch == "switch" else f" ({switch.removeprefix('switch:')})")
    lengths = task["history_tokens"]
    return (f"| {label} | {task['n']} | {min(lengths)}–{max(lengths)} "
            f"| {task['question_tokens']:.0f} | {_fmt(acc['source']['value'])} | {_fmt(acc['target']['value'])} "
            f"| {_fmt(transfers[switch]['accuracy']['value'])} "
            f"| {_fmt(transfers.get('all_mapped', {}).get('accuracy', {}).get('value'))} "
            f"| {_ci(transfers[switch]['retention'])} | {_ci(transfers[switch]['floor_normalised_retention'])} "
            f"| {_ci(transfers[switch].get('agreement'))} "
            f"| {_ci(transfers.get('all_mapped', {}).get('retention'))} "
            f"| {_fmt(seconds.get('reprefill'), 2)} s | {_fmt(seconds.get(switch), 2)} s "
            f"| {_fmt(ttft.get('speedup', {}).get(switch), 1)}× |")


# -- the sweep ---------------------------------------------------------------------------------------------------


def ttft_history(task: str, tokenizer, length: int, settings: SwitchSettings) -> tuple[History, tuple[int, ...]]:
    """A history of at least ``length`` tokens of ``task`` and the question of the first item put on it."""
    history = build_histories(task, tokenizer, 1, length, settings.pool, settings.seed)[0]
    item = switch_items(task, tokenizer, [history], 1, settings.seed, settings.pool)[0]
    return history, item.question


def sweep_ttft(directions: Sequence[Direction], tokenizer, settings: SwitchSettings, lengths: Sequence[int],
               repeats: int = 1) -> dict:
    """Per direction and history length: seconds and speed-ups of every policy against re-prefill (on a history
    of the first task; one short untimed round first warms each direction up)."""
    task = settings.tasks[0] if settings.tasks[0] not in SWITCH_TASKS else TTFT_TASK
    out: dict = {}
    for direction in directions:
        args = (direction.source, direction.target, direction.mapper)
        warm, question = ttft_history(task, tokenizer, 32, settings)
        time_to_first_token(*args, warm, question, settings.policies, settings.exact_prefix, 1)
        out[direction.name] = {}
        for length in lengths:
            history, question = ttft_history(task, tokenizer, length, settings)
            out[direction.name][str(length)] = time_to_first_token(*args, history, question, settings.policies,
                                                                  settings.exact_prefix, repeats)
    return out


def sweep_points(result: dict) -> list[dict]:
    """Per policy: mean retention over the sweep's group (the core tasks, or the generative group's) per direction
    and both, the change of the choice (or first-answer-token) KL against no recompute, the pooled difference to the
    target alone (``minus_target``), and the TTFT speed-ups."""
    group = result.get("group", "core")
    points = []
    for policy in result["policies"]:
        parsed = recompute_policies.parse(policy)  # a stored result's spec
        name = switch_name(parsed)
        per_direction = {d: mean_retention(entry["tasks"], name, group) for d, entry in result["directions"].items()}
        speedups = {length: {d: result["ttft"][d][length]["speedup"][name] for d in result["ttft"]}
                    for length in next(iter(result["ttft"].values()), {})}
        points.append({
            "policy": policy, "rule": parsed.rule if parsed.active else "none", "budget": parsed.budget,
            "retention": per_direction,
            "mean_retention": mean([r["mean_retention"] for r in per_direction.values()]),
            "mean_floor_normalised_retention": mean([r["mean_floor_normalised_retention"]
                                                     for r in per_direction.values()]),
            "mean_agreement": mean([r.get("mean_agreement", math.nan) for r in per_direction.values()]),
            "mean_choice_kl": mean([r.get("mean_choice_kl", math.nan) for r in per_direction.values()]),
            "choice_kl_change": {d: choice_kl_change(entry["tasks"], name, switch_name(NoRecompute()), group)
                                 for d, entry in result["directions"].items()},
            "minus_target": {d: _pooled_minus_target(entry["tasks"], name, group)
                             for d, entry in result["directions"].items()},
            "speedup": {length: {**by_dir, "mean": mean(list(by_dir.values()))} for length, by_dir in speedups.items()},
        })
    return points


def _pooled_minus_target(tasks: dict, condition: str, group: str) -> dict:
    """``condition`` − target alone over the items of ``group`` pooled (where its tasks keep per-item scores)."""
    pooled = pooled_difference(tasks, condition, group) if any(
        t.get("group") == group and condition in t.get("scores", {}) for t in tasks.values()) else None
    return {"n": 0} if pooled is None else {**pooled["minus_target"], "n": pooled["n"]}


def choice_kl_change(tasks: dict, policy: str, baseline: str, group: str = "core",
                     n_resamples: int = 1000, seed: int = 0) -> dict:
    """How much ``policy`` lowers the choice KL to the target alone against ``baseline`` (no recompute), over the
    items of every task of ``group`` pooled (a generating task's KL of the first answer token): the mean paired
    difference (policy − baseline, negative = closer to the target) with a bootstrap interval, and the item count.
    The sweep's selection statistic: graded and paired, it resolves differences that accuracy at a few dozen items
    cannot."""
    diffs = []
    for task in tasks.values():
        transfers = task.get("transfers", {})
        if task.get("group") != group or policy not in transfers or baseline not in transfers:
            continue
        ours, theirs = (transfers[name].get("choice_kl", transfers[name].get("answer_kl", {})).get("per_item")
                        for name in (policy, baseline))
        if ours is None or theirs is None:
            continue
        diffs += [a - b for a, b in zip(ours, theirs, strict=True)]
    if not diffs:
        return {"n": 0, "value": math.nan, "ci": [math.nan, math.nan]}
    ci = paired_bootstrap({"d": diffs}, lambda s: float(s["d"].mean()), n_resamples, seed)
    return {"n": len(diffs), "value": mean(diffs), "ci": list(ci)}


def choose_recompute(result: dict, direction: str, min_retention: float = 0.97, min_speedup: float = 0.0,
                     length: str | None = None) -> RecomputeChoice | None:
    """The policy a sweep's result recommends for ``direction`` by `TRADEOFF_RULES` (`choose_point`) over its
    points' mean retention over the sweep's group in that direction and speed-up at ``length`` (default: the
    longest history timed), recorded with every such point (the trade-off the server can choose from again). None
    when no point has a retention yet."""
    lengths = result["ttft_lengths"]
    length = length or max(lengths, key=int)
    if length not in lengths:
        raise ConfigError(f"the sweep timed {', '.join(lengths)} tokens, not {length}")
    if direction not in result.get("directions", {}):
        raise ConfigError(f"the sweep has no direction {direction!r} ({', '.join(result.get('directions', {}))})")
    points = tuple(TradeoffPoint(p["policy"], p["retention"][direction]["mean_retention"],
                                 p["speedup"][length][direction])
                   for p in result.get("points", []) if math.isfinite(p["retention"][direction]["mean_retention"]))
    chosen = choose_point(points, min_retention, min_speedup)
    if chosen is None:
        return None
    return RecomputeChoice(chosen.spec, TRADEOFF_RULES[0], float(min_retention), result.get("group", "core"),
                           tuple(result["settings"]["tasks"]), result["settings"]["pool"],
                           int(result["items_per_task"]), chosen.mean_retention, int(length), chosen.speedup,
                           float(min_speedup), points)


def pareto_front(points: Sequence[dict], length: str) -> list[str]:
    """The policies no other point beats on both mean retention and mean speed-up at ``length`` (points without a
    mean retention, e.g. of a run stopped early, are left out)."""
    def key(p):
        return p["mean_retention"], p["speedup"][length]["mean"]

    points = [p for p in points if math.isfinite(p["mean_retention"])]
    front = []
    for p in points:
        r, s = key(p)
        if not any(key(q)[0] >= r and key(q)[1] >= s and key(q) != (r, s) for q in points):
            front.append(p["policy"])
    return front


def run_recompute_sweep(directions: Sequence[Direction], tokenizer, tok_id: str, settings: SwitchSettings,
                        out_dir: Path, lengths: Sequence[int] = DEFAULT_TTFT_LENGTHS, ttft_repeats: int = 1,
                        progress: bool = False, deadline: float | None = None) -> dict:
    """TTFT of every policy (``settings.policies``) at each history length, then retention per history round
    (`run_in_history_rounds`); ``<out_dir>/sweep_recompute.{json,md,png}`` after each finished round (see the
    module docstring)."""
    group = sweep_group(settings.tasks)
    out_dir = Path(out_dir)
    settings = replace(settings, ttft_repeats=0, all_mapped=False)
    result: dict = {"format": SWEEP_FORMAT, "settings": _settings_record(settings), "group": group,
                    "policies": [policy.spec for policy in settings.policies],
                    "ttft_lengths": [str(n) for n in lengths],
                    "ttft_repeats": ttft_repeats,
                    "mappers": {d.name: mapper_identity(d.mapper) for d in directions}}
    ttft = stored_ttft(out_dir, result)
    result.update(ttft=ttft if ttft is not None else sweep_ttft(directions, tokenizer, settings, lengths, ttft_repeats),
                  directions={}, histories_done=0, items_per_task=0, complete=False)

    def keep(used: int, done: dict, finished: bool) -> None:
        if not (finished or not result["directions"]):
            return
        counts = [t["n"] for d in done.values() for t in d["tasks"].values()]
        result.update(directions=done, histories_done=used, items_per_task=min(counts, default=0),
                      complete=finished and used == settings.rounds)
        result["points"] = sweep_points(result)
        result["pareto"] = {length: pareto_front(result["points"], length) for length in result["ttft_lengths"]}
        write_sweep(result, out_dir)

    run_in_history_rounds(directions, tokenizer, tok_id, settings, out_dir / "items", progress, deadline, keep)
    return result


def sweep_group(tasks: Sequence[str]) -> str:
    """The group a sweep ranks its policies by: "core" for multiple-choice tasks, the generative group for its
    tasks; ConfigError for a mix of the two (their retentions do not average)."""
    named = [task for task in tasks if task in SWITCH_TASKS]
    if named and len(named) != len(tasks):
        raise ConfigError(f"a recompute sweep ranks policies by multiple-choice tasks or by the {GROUP} group's, not "
                          f"both: sweep {', '.join(named)} apart from {', '.join(t for t in tasks if t not in named)}")
    return GROUP if named else "core"


def stored_ttft(out_dir: Path, header: dict) -> dict | None:
    """The TTFT of an earlier run of the same sweep in ``out_dir`` (same settings, policies, lengths, repeats and
    mappers), so a resumed sweep does not time it again; None when there is none or it differs."""
    path = Path(out_dir) / "sweep_recompute.json"
    if not path.is_file():
        return None
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if stored.get("format") != SWEEP_FORMAT or any(stored.get(key) != value for key, value in header.items()):
        return None
    return stored.get("ttft")


# -- sweep rendering ---------------------------------------------------------------------------------------------


def rewrite_sweep(out_dir: Path) -> dict:
    """Recompute the points and the Pareto front of ``<out_dir>/sweep_recompute.json`` from its per-task summaries
    and write the json, table and plot again (no models)."""
    result = json.loads((Path(out_dir) / "sweep_recompute.json").read_text(encoding="utf-8"))
    result["points"] = sweep_points(result)
    result["pareto"] = {length: pareto_front(result["points"], length) for length in result["ttft_lengths"]}
    write_sweep(result, Path(out_dir))
    return result


def write_sweep(result: dict, out_dir: Path) -> None:
    atomic_write_json(out_dir / "sweep_recompute.json", result)
    atomic_write_text(out_dir / "sweep_recompute.md", sweep_markdown(result))
    if result.get("points"):
        sweep_plot(result, out_dir / "sweep_recompute.png")


def _signed_ci(entry: dict | None) -> str:
    if not entry or not entry.get("n") or entry["value"] is None or not math.isfinite(entry["value"]):
        return "–"
    lo, hi = entry["ci"]
    return f"{entry['value']:+.3f} [{lo:+.3f}, {hi:+.3f}]"


def sweep_markdown(result: dict) -> str:
    lengths = result["ttft_lengths"]
    directions = list(result["directions"])
    head = ["Policy"] + [f"Retention {d}" for d in directions] + ["Mean retention", "Mean floor-normalised"]
    head += [f"Agreement {d}" for d in directions] + [f"Choice KL {d}" for d in directions]
    head += [f"Choice KL vs none {d} [95% CI]" for d in directions]
    head += [f"Speed-up {n} {d}" for n in lengths for d in directions]
    group = result.get("group", "core")
    head += [f"Pooled − target {d} [95% CI]" for d in directions]
    lines = [f"Items per {group} task and direction: {result['items_per_task']} (dev pool); complete: "
             f"{result['complete']}. Pareto front (mean retention vs mean speed-up): "
             + "; ".join(f"{n} tokens: {', '.join(front)}" for n, front in result.get("pareto", {}).items()), "",
             "| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for point in result.get("points", []):
        cells = [point["policy"]] + [_fmt(point["retention"][d]["mean_retention"]) for d in directions]
        cells += [_fmt(point["mean_retention"]), _fmt(point["mean_floor_normalised_retention"])]
        cells += [_fmt(point["retention"][d].get(f"mean_{key}")) for key in ("agreement", "choice_kl")
                  for d in directions]
        cells += [_signed_ci(point.get("choice_kl_change", {}).get(d)) for d in directions]
        cells += [_fmt(point["speedup"][n][d], 1) + "×" for n in lengths for d in directions]
        cells += [_signed_ci(point.get("minus_target", {}).get(d)) for d in directions]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def sweep_plot(result: dict, path: Path) -> Path:
    """Mean core retention against TTFT speed-up, one panel per direction and history length, one line per rule
    through its budgets (each starting at the no-recompute point)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directions, lengths = list(result["directions"]), result["ttft_lengths"]
    fig, axes = plt.subplots(len(directions), len(lengths), figsize=(5 * len(lengths), 3.8 * len(directions)),
                             squeeze=False)
    points = result["points"]
    none = next(p for p in points if p["rule"] == "none")
    rules = sorted({p["rule"] for p in points} - {"none"})
    for row, direction in enumerate(directions):
        for col, length in enumerate(lengths):
            ax = axes[row][col]
            for rule in rules:
                line = [none, *sorted((p for p in points if p["rule"] == rule), key=lambda p: p["budget"])]
                xs = [p["speedup"][length][direction] for p in line]
                ys = [p["retention"][direction]["mean_retention"] for p in line]
                ax.plot(xs, ys, marker="o", label=rule)
                for p, x, y in zip(line[1:], xs[1:], ys[1:], strict=True):
                    ax.annotate(f"{p['budget'] * 100:g}%", (x, y), fontsize=7, xytext=(3, 3),
                                textcoords="offset points")
            ax.axhline(1.0, ls="--", lw=0.8, color="grey")
            ax.set_xlabel(f"TTFT speed-up vs re-prefill, {length}-token history")
            ax.set_ylabel(f"mean retention ({result.get('group', 'core')} tasks)")
            entry = result["directions"][direction]
            ax.set_title(f"{entry['source']} → {entry['target']}", fontsize=9)
            ax.legend(fontsize=7)
    fig.suptitle(f"Selective recompute at a switch: {result['items_per_task']} dev items per "
                 f"{result.get('group', 'core')} task", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)
