"""Where the switch benchmark stands against the switch-quality goal, per direction: every task's switch under one
recompute policy beside the two models alone, read from `kvhandoff-lab eval-switch` runs (each RUN_DIR's
`switch.json` and its item store; a task is read from the first run that scored it under the policy).

    python experiments/switch_goal.py POLICY OUT_JSON RUN_DIR [RUN_DIR ...] [--small MODEL]

POLICY: a recompute spec as the runs name it ("turn_attention:5%"). The small model: MODEL, else the source of the
first run's forward direction; a run of one direction (`--no-both-directions`) counts for the direction of its
models. Per task and direction: n, the source and the target alone, the switch, its retention (switch / target
alone) and switch − the small model alone, each with a paired bootstrap interval over the items; per direction the
mean retention over the tasks, with an interval from resampling every task's items, and the tasks whose switch is
below the small model alone in point estimate.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from paired_switch_accuracy import store_of  # the sibling script's lookup of a condition's item store

from kvhandoff.runtime.policy import parse
from kvhandoff_lab.evaluation.switch import switch_name
from kvhandoff_lab.evaluation.tasks import get_task, mc_item_metrics

RESAMPLES = 2000


def multiple_choice_scores(run_dir: Path, task: str, entry: dict, policy: str) -> list[float]:
    """Per-item primary-metric scores of a multiple-choice task from the run's item store (``policy``: "target",
    "source" or a recompute spec)."""
    store, metric = store_of(run_dir, task, policy, entry), get_task(task).primary_metric
    return [mc_item_metrics(store[i])[metric] for i in entry["tasks"][task]["item_ids"]]


def task_scores(run_dir: Path, entry: dict, task: str, spec: str) -> dict[str, np.ndarray] | None:
    """{"source", "target", "switch"}: per-item scores of ``task`` in one direction of a run under the recompute
    ``spec``, or None when the run did not score it under that policy."""
    summary, condition = entry["tasks"][task], switch_name(parse(spec))
    if "scores" in summary:  # the generative group keeps its per-item scores in the summary
        if condition not in summary["scores"]:
            return None
        return {name: np.asarray(summary["scores"][key], dtype=float)
                for name, key in (("source", "source"), ("target", "target"), ("switch", condition))}
    if condition not in summary.get("transfers", {}):
        return None
    return {name: np.asarray(multiple_choice_scores(run_dir, task, entry, key), dtype=float)
            for name, key in (("source", "source"), ("target", "target"), ("switch", spec))}


def interval(values: list[float]) -> list[float]:
    finite = np.asarray([v for v in values if np.isfinite(v)])
    return [float(np.percentile(finite, 2.5)), float(np.percentile(finite, 97.5))] if finite.size else [None, None]


def ratio(a: np.ndarray, b: np.ndarray) -> float:
    return float(a.mean() / b.mean()) if b.mean() > 0 else float("nan")


def task_row(scores: dict[str, np.ndarray], small: str, rng) -> dict:
    n = len(scores["switch"])
    draws = [rng.integers(0, n, n) for _ in range(RESAMPLES)]
    switch, target, alone = scores["switch"], scores["target"], scores[small]
    return {"n": n, **{name: float(values.mean()) for name, values in scores.items()},
            "retention": ratio(switch, target),
            "retention_ci": interval([ratio(switch[d], target[d]) for d in draws]),
            "minus_small": float((switch - alone).mean()),
            "minus_small_ci": interval([float((switch - alone)[d].mean()) for d in draws]),
            "_draws": draws}


def direction_rows(runs: list[tuple[Path, dict]], names: tuple[str, str], small: str, spec: str,
                   rng) -> dict | None:
    """Every task scored under ``spec`` in the direction ``names`` (source, target) of any run (a run's "forward"
    or "reverse" entry, whichever has those models), each task from the first run that has it; None: no task."""
    rows: dict[str, dict] = {}
    for run_dir, result in runs:
        entry = next((e for e in result["directions"].values() if (e["source"], e["target"]) == names), None)
        for task in (entry or {}).get("tasks", {}):
            if task in rows:
                continue
            scores = task_scores(run_dir, entry, task, spec)
            if scores is not None:
                rows[task] = {"run": str(run_dir), "display": entry["tasks"][task].get("display", task),
                              **task_row(scores, small, rng), "_scores": scores}
    if not rows:
        return None
    return {"small_model": small, "summary": summarise(rows),
            "tasks": {task: {k: v for k, v in row.items() if not k.startswith("_")} for task, row in rows.items()}}


def summarise(rows: dict[str, dict]) -> dict:
    """The mean retention over the tasks' rows (`task_row`, with their ``_scores``), its interval from resampling
    every task's items together, and the tasks below the small model alone in point estimate."""
    means = []
    for k in range(RESAMPLES):
        values = [ratio(row["_scores"]["switch"][row["_draws"][k]], row["_scores"]["target"][row["_draws"][k]])
                  for row in rows.values()]
        means.append(float(np.mean(values)))
    return {"tasks": len(rows), "mean_retention": float(np.mean([row["retention"] for row in rows.values()])),
            "mean_retention_ci": interval(means),
            "below_small_alone": [task for task, row in rows.items() if row["minus_small"] < 0]}


def main(policy: str, out: str, *run_dirs: str, small_model: str | None = None) -> None:
    spec = parse(policy).spec
    condition = switch_name(parse(spec))
    runs = [(Path(d), json.loads((Path(d) / "switch.json").read_text(encoding="utf-8"))) for d in run_dirs]
    rng = np.random.default_rng(0)
    result = {"policy": spec, "runs": list(run_dirs), "directions": {}}
    first = runs[0][1]["directions"]["forward"]
    small_model = small_model or first["source"]
    large_model = first["target"] if first["source"] == small_model else first["source"]
    for direction, names in (("forward", (small_model, large_model)), ("reverse", (large_model, small_model))):
        small = "source" if direction == "forward" else "target"
        rows = direction_rows(runs, names, small, spec, rng)
        if rows is None:
            continue
        result["directions"][direction] = {"source": names[0], "target": names[1], **rows}
        print(f"{names[0]} → {names[1]} ({condition}; small model alone = the {rows['small_model']})")
        for row in rows["tasks"].values():
            low, high = row["retention_ci"]
            dlow, dhigh = row["minus_small_ci"]
            print(f"  {row['display']:40s} n={row['n']:4d} source {row['source']:.3f} target {row['target']:.3f} "
                  f"switch {row['switch']:.3f} retention {row['retention']:.3f} [{low:.3f}, {high:.3f}] "
                  f"switch − small {row['minus_small']:+.3f} [{dlow:+.3f}, {dhigh:+.3f}]")
        summary = rows["summary"]
        low, high = summary["mean_retention_ci"]
        print(f"  mean retention over {summary['tasks']} tasks: {summary['mean_retention']:.3f} [{low:.3f}, "
              f"{high:.3f}]; below the small model alone: {', '.join(summary['below_small_alone']) or 'none'}")
    Path(out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("policy")
    parser.add_argument("out_json")
    parser.add_argument("run_dirs", nargs="+")
    parser.add_argument("--small", default=None,
                        help="the small model as the runs name it (default: the first run's forward source)")
    args = parser.parse_args()
    main(args.policy, args.out_json, *args.run_dirs, small_model=args.small)
