"""The server's quality guard at the switch benchmark's switches: fall back to a re-prefill, or escalate to a larger
recompute budget, at the switches whose guard score (--signal: one of the server's guard signals, such as
"logloss", the target's mean log-loss on the new turn minus the source's on its own cache) is above a threshold
chosen on dev items, then scored on report items (`kvhandoff_lab.evaluation.switchguard`).

    python experiments/switch_guard.py DEV_RUN REPORT_RUN TTFT_JSON OUT_JSON [--served COND] [--flagged COND,...]
        [--direction forward] [--min-speedup 5] [--signal entropy_gain] [--tasks coqa_gen,...] [--threshold T]
        [--reference-seconds S]

DEV_RUN / REPORT_RUN: `kvhandoff-lab eval-switch` runs of the generative group whose served switch's records carry
the guard's scores (`guard_scores`; `guard_entropy` for "entropy" and "entropy_gain"), with the target and source
alone and each flagged condition; TTFT_JSON: an `eval-switch --ttft-repeats` run with the seconds of the served and
flagged conditions, the re-prefill and the source's reference pass over the question (counted at every switch for
a signal that needs it; --reference-seconds: what the reference adds instead, e.g. when the served policy's own read
of the turn gives it, measured by `experiments/shared_turn_read_ttft.py`).
For each flagged condition ("target": fall back; "switch:recent:35%": escalate) the threshold is the one with the
best mean retention on DEV_RUN at MIN_SPEEDUP or faster (or the --threshold given, such as the one a pair's guard
records); its dev Pareto front and report scores are printed and written to OUT_JSON.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from kvhandoff.runtime.switch.guard import needs_reference
from kvhandoff_lab.evaluation.switchguard import (
    GUARD_SIGNALS,
    GuardRow,
    choose_threshold,
    guard_costs,
    guard_row,
    guard_separation,
    guard_table,
    guarded_report,
    guarded_task,
)


def tasks_of(run_dir: str, args, flagged: str) -> dict:
    result = json.loads((Path(run_dir) / "switch.json").read_text(encoding="utf-8"))
    entries = result["directions"][args.direction]["tasks"]
    only = None if args.tasks is None else set(args.tasks.split(","))
    return {name: guarded_task(entry, args.served, flagged, args.signal) for name, entry in entries.items()
            if entry.get("group") == "generative" and args.served in entry.get("scores", {})
            and (only is None or name in only)}


def ttft_seconds(path: str, direction: str) -> tuple[dict, float | None]:
    """(mean seconds per path, the guard's reference pass seconds or None) of a time-to-first-token run."""
    result = json.loads(Path(path).read_text(encoding="utf-8"))
    (task,) = result["directions"][direction]["tasks"].values()
    return task["ttft"]["mean"]["seconds"], task["ttft"]["mean"].get("guard_reference_seconds")


def pareto(rows: list) -> list:
    """The rows no other row beats on both mean retention and speed-up."""
    front = [row for row in rows if not math.isnan(row.mean_retention) and not any(
        (other.mean_retention > row.mean_retention and other.speedup >= row.speedup)
        or (other.mean_retention >= row.mean_retention and other.speedup > row.speedup) for other in rows)]
    return sorted(front, key=lambda row: -row.speedup)


def describe(row) -> str:
    tasks = ", ".join(f"{name} {score:.3f}" for name, score in row.scores.items())
    return (f"threshold {row.threshold:7.3f}  flagged {row.flagged_share:5.2f}  speed-up {row.speedup:5.2f}×  "
            f"mean retention {row.mean_retention:.3f}  lowest − source {row.lowest_minus_source:+.3f}  ({tasks})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dev_run")
    parser.add_argument("report_run")
    parser.add_argument("ttft_json")
    parser.add_argument("out_json")
    parser.add_argument("--served", default="switch:turn_attention:5%")
    parser.add_argument("--flagged", default="target,switch:recent:35%")
    parser.add_argument("--direction", default="forward")
    parser.add_argument("--min-speedup", type=float, default=5.0)
    parser.add_argument("--signal", choices=GUARD_SIGNALS, default="entropy_gain")
    parser.add_argument("--tasks", default=None, help="comma-separated tasks (default: every generative task)")
    parser.add_argument("--threshold", type=float, default=None,
                        help="score this threshold (e.g. a pair's recorded guard) instead of choosing one on dev")
    parser.add_argument("--reference-seconds", type=float, default=None,
                        help="seconds the reference pass adds at a switch, instead of the TTFT run's")
    args = parser.parse_args()
    seconds, reference = ttft_seconds(args.ttft_json, args.direction)
    reference = reference if args.reference_seconds is None else args.reference_seconds
    reference = reference if needs_reference(args.signal) else 0.0
    out = {"served": args.served, "signal": args.signal, "direction": args.direction, "reference_seconds": reference,
           "min_speedup": args.min_speedup, "threshold": args.threshold, "flagged": {}}
    for flagged in args.flagged.split(","):
        costs = guard_costs(seconds, args.served, flagged, reference)
        dev_tasks = tasks_of(args.dev_run, args, flagged)
        rows = guard_table(dev_tasks, costs)
        chosen = (choose_threshold(rows, args.min_speedup) if args.threshold is None else
                  guard_row(dev_tasks, costs, args.threshold))
        print(f"\n== flagged switches served by {flagged} (costs {costs}) ==\ndev Pareto front:")
        for row in pareto(rows):
            print("  " + describe(row))
        entry = {"costs": costs.__dict__, "dev_pareto": [row.to_dict() for row in pareto(rows)],
                 "chosen": None if chosen is None else chosen.to_dict(), "report": None}
        if chosen is None:
            print(f"no threshold keeps {args.min_speedup}× on dev")
        else:
            print(("chosen on dev: " if args.threshold is None else "given, on dev: ") + describe(chosen))
            report_tasks = tasks_of(args.report_run, args, flagged)
            separation = {"dev": guard_separation(dev_tasks, chosen.threshold),
                          "report": guard_separation(report_tasks, chosen.threshold)}
            for pool, got in separation.items():
                print(f"  {pool}: {got['bad']} of {got['switches']} switches below the target alone; AUROC "
                      f"{got['auroc']}, catch {got['catch_rate']}, false fallback {got['false_fallback_rate']}")
            entry["separation"] = separation
            report = guarded_report(report_tasks, costs, chosen.threshold)
            print("report: " + describe(GuardRow(**report["row"])))
            for name, task in report["tasks"].items():
                print(f"  {name:12s} n={task['n']:4d} score {task['score']:.3f}  "
                      + "  ".join(f"{key} {task[key]['value']:+.3f} [{task[key]['ci'][0]:+.3f}, "
                                  f"{task[key]['ci'][1]:+.3f}]"
                                  for key in ("minus_target", "minus_source", "minus_unguarded")))
            entry["report"] = report
        out["flagged"][flagged] = entry
    Path(args.out_json).write_text(json.dumps(out, indent=1, allow_nan=True), encoding="utf-8")


if __name__ == "__main__":
    main()
