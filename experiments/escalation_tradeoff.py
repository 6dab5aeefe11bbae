"""What an escalating recompute rule ("BASE:reliance=SHARE:escalate=BUDGET") keeps and costs at each threshold,
composed from runs of its two budgets on the same items.

    python experiments/escalation_tradeoff.py OUT_JSON --reliance SHARES_JSON [...] --runs RUN_DIR [...] \\
        --base turn_attention:10% --escalate turn_attention:20% --thresholds 0.6,0.7,0.8 --ttft TTFT_JSON \\
        [--min-speedup 5] [--direction forward]

An escalating rule ranks the positions as its base rule does and takes the base budget's share of the ranking, or
the larger budget's when the source's read of the new turn leans on the mapped rows (`policy.history_reliance` ≥
SHARE), so each switch picks exactly what one of the two budgets picks: its records are the base run's where the
read does not escalate and the escalated run's where it does. SHARES_JSON: `coverage_shares.py` results (each
item's ``reliance``); RUN_DIR: `kvhandoff-lab eval-switch` runs, or their ``switch.json`` alone for the generative
group (each task's scores from the first run that scored it under each budget, matched by item id). Per threshold
and task: the items escalated, the composed switch beside both models alone (`switch_goal.task_row`: retention and
switch − small model alone, with paired intervals); the mean retention over the tasks with its interval
(`switch_goal.summarise`); the speed-up at the TTFT run's length, the re-prefill's seconds over the mean over the
tasks of each task's mean switch time (the base budget's or the larger budget's timed seconds per switch); a task
the reads cover but no run scored counts in the time only. A threshold at which some escalated item has no score
under the larger budget is reported as incomplete and never chosen. The chosen threshold: the most retentive at
``--min-speedup`` or faster.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from switch_goal import summarise, task_row, task_scores

from kvhandoff.runtime.policy import parse
from kvhandoff_lab.evaluation.switch import switch_name


def reliance_of(paths: list[str]) -> dict[str, dict[str, float]]:
    """{task: {item id: reliance}} over `coverage_shares.py` results (the first that holds a task)."""
    found: dict[str, dict[str, float]] = {}
    for path in paths:
        for task, entry in json.loads(Path(path).read_text(encoding="utf-8"))["tasks"].items():
            found.setdefault(task, {row["id"]: row["reliance"] for row in entry["items"]})
    return found


def scored(runs: list[tuple[Path, dict]], direction: str, task: str, spec: str) -> dict[str, dict] | None:
    """{item id: {"source", "target", "switch"}} of ``task`` under ``spec`` from the first run that scored it."""
    for run_dir, result in runs:
        entry = result["directions"].get(direction)
        if entry and task in entry["tasks"] and (scores := task_scores(run_dir, entry, task, spec)) is not None:
            ids = entry["tasks"][task]["item_ids"]
            return {item: {name: float(values[i]) for name, values in scores.items()} for i, item in enumerate(ids)}
    return None


def compose(base: dict[str, dict], escalated: dict[str, dict] | None, reliance: dict[str, float],
            threshold: float) -> tuple[dict[str, np.ndarray] | None, int, int]:
    """The composed per-item scores over the base run's items that have a read, the items escalated, and the
    escalated items no run scored under the larger budget (the scores are None then)."""
    items = [item for item in base if item in reliance]
    up = [item for item in items if reliance[item] >= threshold]
    missing = [item for item in up if escalated is None or item not in escalated]
    if missing:
        return None, len(up), len(missing)
    rows = [escalated[item] if reliance[item] >= threshold else base[item] for item in items]
    return {name: np.asarray([row[name] for row in rows]) for name in ("source", "target", "switch")}, len(up), 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--reliance", nargs="+", required=True)
    parser.add_argument("--runs", nargs="+", required=True)
    parser.add_argument("--base", required=True)
    parser.add_argument("--escalate", required=True)
    parser.add_argument("--thresholds", required=True)
    parser.add_argument("--ttft", required=True)
    parser.add_argument("--direction", default="forward")
    parser.add_argument("--min-speedup", type=float, default=0.0)
    args = parser.parse_args()
    base_spec, up_spec = parse(args.base).spec, parse(args.escalate).spec
    thresholds = [float(t) for t in args.thresholds.split(",")]
    reads = reliance_of(args.reliance)
    runs = [(Path(d), json.loads((Path(d) / "switch.json").read_text(encoding="utf-8"))) if Path(d).is_dir()
            else (Path(d).parent, json.loads(Path(d).read_text(encoding="utf-8"))) for d in args.runs]
    timing = json.loads(Path(args.ttft).read_text(encoding="utf-8"))
    (timed,) = timing["directions"][args.direction]["tasks"].values()
    seconds = timed["ttft"]["mean"]["seconds"]
    cost = {False: seconds[switch_name(parse(base_spec))], True: seconds[switch_name(parse(up_spec))]}
    small = "source" if args.direction == "forward" else "target"
    scores = {task: (scored(runs, args.direction, task, base_spec), scored(runs, args.direction, task, up_spec))
              for task in reads}
    points = []
    for threshold in thresholds:
        rng = np.random.default_rng(0)
        rows, shares, times, incomplete = {}, {}, [], []
        for task, read in reads.items():
            escalations = [value >= threshold for value in read.values()]
            shares[task] = float(np.mean(escalations))
            times.append(float(np.mean([cost[up] for up in escalations])))
            base, escalated = scores[task]
            if base is None:
                continue
            composed, up, missing = compose(base, escalated, read, threshold)
            if composed is None:
                incomplete.append(f"{task} ({missing} of {up} escalated items unscored)")
                continue
            rows[task] = {**task_row(composed, small, rng), "escalated": up, "_scores": composed}
        point = {"threshold": threshold, "speedup": seconds["reprefill"] / float(np.mean(times)),
                 "escalated_share": shares, "incomplete": incomplete}
        if rows and not incomplete:
            point["summary"] = summarise(rows)
            point["tasks"] = {task: {k: v for k, v in row.items() if not k.startswith("_")}
                              for task, row in rows.items()}
        points.append(point)
        print(f"reliance ≥ {threshold:g}: {point['speedup']:.1f}× at {timing['settings']['history_tokens']} tokens; "
              "escalated " + ", ".join(f"{t} {s:.2f}" for t, s in shares.items()))
        if incomplete:
            print("  incomplete: " + "; ".join(incomplete))
            continue
        for task, row in point.get("tasks", {}).items():
            print(f"  {task:14s} n={row['n']:4d} escalated {row['escalated']:3d} target {row['target']:.3f} switch "
                  f"{row['switch']:.3f} retention {row['retention']:.3f} [{row['retention_ci'][0]:.3f}, "
                  f"{row['retention_ci'][1]:.3f}] switch − small {row['minus_small']:+.3f} "
                  f"[{row['minus_small_ci'][0]:+.3f}, {row['minus_small_ci'][1]:+.3f}]")
        if "summary" in point:
            summary = point["summary"]
            print(f"  mean retention {summary['mean_retention']:.3f} [{summary['mean_retention_ci'][0]:.3f}, "
                  f"{summary['mean_retention_ci'][1]:.3f}]; below the small model: "
                  f"{', '.join(summary['below_small_alone']) or 'none'}")
    eligible = [p for p in points if "summary" in p and p["speedup"] >= args.min_speedup]
    chosen = max(eligible, key=lambda p: p["summary"]["mean_retention"], default=None)
    spec = None if chosen is None else f"{base_spec}:reliance={chosen['threshold'] * 100:g}%:escalate=" \
        f"{parse(up_spec).budget * 100:g}%"
    print(f"chosen: {spec}")
    out = {"direction": args.direction, "base": base_spec, "escalate": up_spec, "ttft": args.ttft,
           "history_tokens": timing["settings"]["history_tokens"], "min_speedup": args.min_speedup,
           "points": points, "chosen": spec}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
