"""A pair's recompute trade-off from separate runs: every policy's mean retention over the tasks of `kvhandoff-lab
eval-switch` runs on dev items, and its speed-up at one history length from a time-to-first-token run, each point
a `TradeoffPoint`, and the point the records' rule takes from them (`choose_point`) — what
`workflow.MEASURED_RECORDS` records with a default mapper when the sweep's items and its timing were measured apart.

    python experiments/recompute_tradeoff.py TTFT_JSON OUT_JSON RUN_JSON [RUN_JSON ...] [--direction forward]
        [--tasks coqa_gen,boolq_long] [--min-retention 0.97] [--min-speedup 5]

RUN_JSON: a run's `switch.json`; a task is read from the first run that scored it, and a policy is a point when
every task was scored under it. TTFT_JSON: an `eval-switch --ttft-repeats` run timing those policies.

A policy with a ``coverage`` or an ``escalate`` budget recomputes a different share at each switch, so one timing
does not price it: its time is the mean over its switches (the runs count each one's recompute) of the time of the
same rule without them at that share, interpolated linearly between the budgets the TTFT run timed (clamped to
the timed range).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from kvhandoff.mapper.manifest import TradeoffPoint, choose_point
from kvhandoff.runtime.policy import parse
from kvhandoff_lab.evaluation.switch import mean_retention


def read(path: str) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def timing_curve(seconds: dict[str, float], spec: str) -> tuple[list[float], list[float]]:
    """The budgets the TTFT run timed for ``spec``'s rule without its coverage and escalation (the same rule and
    settings), and their seconds, by budget."""
    policy = parse(spec)
    if not hasattr(policy, "coverage"):
        return [], []
    uncovered = dataclasses.replace(policy, coverage=1.0, reliance=0.0, escalate=0.0)
    curve = {}
    for condition, value in seconds.items():
        if not condition.startswith("switch:"):
            continue
        timed = parse(condition.removeprefix("switch:"))
        if type(timed) is type(uncovered) and dataclasses.replace(timed, budget=uncovered.budget) == uncovered:
            curve[timed.budget] = value
    budgets = sorted(curve)
    return budgets, [curve[b] for b in budgets]


def covered_speedup(tasks: dict, condition: str, seconds: dict[str, float]) -> float | None:
    """A coverage policy's speed-up: the re-prefill's seconds over the mean, over its switches, of the timed curve
    at each switch's recompute share; None when its rule was not timed or a run did not count its recompute."""
    budgets, times = timing_curve(seconds, condition.removeprefix("switch:"))
    shares = [share for t in tasks.values() for share in t["transfers"][condition].get("recompute_share", [None])]
    if len(budgets) < 2 or not shares or None in shares:
        return None
    return seconds["reprefill"] / float(np.mean(np.interp(shares, budgets, times)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ttft")
    parser.add_argument("out")
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--direction", default="forward")
    parser.add_argument("--tasks", default="coqa_gen,boolq_long")
    parser.add_argument("--min-retention", type=float, default=0.97)
    parser.add_argument("--min-speedup", type=float, default=0.0)
    args = parser.parse_args()
    for name in ("min_retention", "min_speedup"):
        if not math.isfinite(getattr(args, name)) or getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be a finite number >= 0, got {getattr(args, name)}")

    tasks: dict[str, dict] = {}
    for path in args.runs:
        for name, entry in read(path)["directions"][args.direction]["tasks"].items():
            if name in args.tasks.split(",") and name not in tasks:
                tasks[name] = entry
    missing = set(args.tasks.split(",")) - set(tasks)
    if missing:
        raise SystemExit(f"no run scored {', '.join(sorted(missing))}")
    timing = read(args.ttft)
    timed_tasks = timing["directions"][args.direction]["tasks"]
    if len(timed_tasks) != 1:
        raise SystemExit(f"{args.ttft} timed {len(timed_tasks)} tasks ({', '.join(timed_tasks)}); give a run that "
                         "timed one (eval-switch --ttft-repeats with one task)")
    (timed,) = timed_tasks.values()
    speedups, length = dict(timed["ttft"]["mean"]["speedup"]), timing["settings"]["history_tokens"]
    seconds = timed["ttft"]["mean"]["seconds"]

    points = []
    for condition in sorted(set.intersection(*(set(t["transfers"]) for t in tasks.values()))):
        retention = mean_retention(tasks, condition, "all")
        if condition not in speedups and (covered := covered_speedup(tasks, condition, seconds)) is not None:
            speedups[condition] = covered
        if not condition.startswith("switch:") or condition not in speedups or not math.isfinite(
                retention["mean_retention"]) or retention["retention_tasks"] != len(tasks):
            continue
        points.append(TradeoffPoint(condition.removeprefix("switch:"), retention["mean_retention"],
                                    speedups[condition]))
    points.sort(key=lambda p: -p.speedup)
    chosen = choose_point(tuple(points), args.min_retention, args.min_speedup)
    items = {name: len(entry["item_ids"]) for name, entry in tasks.items()}
    out = {"direction": args.direction, "tasks": items, "history_tokens": length,
           "min_retention": args.min_retention, "min_speedup": args.min_speedup,
           "points": [vars(p) for p in points], "chosen": None if chosen is None else chosen.spec}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    print(f"{args.direction}, {', '.join(f'{n} ({k} items)' for n, k in items.items())}, {length} tokens:")
    for p in points:
        mark = "  <- chosen" if chosen is not None and p.spec == chosen.spec else ""
        print(f"  {p.spec:24s} mean retention {p.mean_retention:.4f}  speed-up {p.speedup:.2f}x{mark}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
