"""Paired difference between two switch conditions of one `kvhandoff-lab eval-switch` run on the generative group
(the per-item scores its `switch.json` keeps: exact match, token F1 or accuracy), per task and pooled over the
tasks, per direction, with a paired bootstrap interval over the items; and how many items differ.

    python experiments/paired_switch_scores.py RUN_DIR CONDITION_A CONDITION_B [OTHER_RUN_DIR]

A condition is "target", "source" or a switch condition as `switch.json` names it ("switch:recent:5%",
"switch:turn_attention:5%"; "switch" for no recompute). The difference printed is score(A) − score(B). With
OTHER_RUN_DIR, B is read from that run (e.g. the same items under another mapper), matched item by item; the items
only one of the runs scored are left out.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from kvhandoff_lab.evaluation.metrics import paired_bootstrap


def difference(a: list[float], b: list[float]) -> dict:
    diffs = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    low, high = paired_bootstrap({"d": diffs}, lambda s: float(s["d"].mean()), 2000, 0)
    return {"n": len(diffs), "value": float(diffs.mean()), "ci": [low, high],
            "differ": int(np.count_nonzero(np.abs(diffs) > 1e-9))}


def compare(result: dict, first: str, second: str, other: dict | None = None) -> dict:
    out = {}
    for name, direction in result["directions"].items():
        rows, pooled_a, pooled_b = {}, [], []
        for task, entry in direction["tasks"].items():
            theirs = entry if other is None else other["directions"].get(name, {}).get("tasks", {}).get(task)
            if theirs is None or first not in entry.get("scores", {}) or second not in theirs.get("scores", {}):
                continue
            a, b = matched(entry, first, theirs, second)
            rows[task] = difference(a, b)
            pooled_a += a
            pooled_b += b
        if pooled_a:
            rows["pooled"] = difference(pooled_a, pooled_b)
        out[name] = rows
    return out


def matched(entry: dict, first: str, theirs: dict, second: str) -> tuple[list[float], list[float]]:
    """The scores of condition `first` in `entry` and `second` in `theirs` on the items both scored, in order."""
    if theirs is entry:
        return entry["scores"][first], entry["scores"][second]
    by_id = dict(zip(theirs["item_ids"], theirs["scores"][second], strict=False))
    pairs = [(score, by_id[item]) for item, score in zip(entry["item_ids"], entry["scores"][first], strict=False)
             if item in by_id]
    return [a for a, _ in pairs], [b for _, b in pairs]


def load(run_dir: str) -> dict:
    return json.loads((Path(run_dir) / "switch.json").read_text(encoding="utf-8"))


def main(run_dir: str, first: str, second: str, other_run_dir: str | None = None) -> None:
    compared = compare(load(run_dir), first, second, None if other_run_dir is None else load(other_run_dir))
    for direction, rows in compared.items():
        for task, row in rows.items():
            print(f"{direction:8s} {task:12s} n={row['n']:4d}  {first} − {second}: {row['value']:+.3f} "
                  f"[{row['ci'][0]:+.3f}, {row['ci'][1]:+.3f}]  ({row['differ']} items differ)")
    print(json.dumps(compared))


if __name__ == "__main__":
    if len(sys.argv) not in (4, 5):
        sys.exit(__doc__)
    main(*sys.argv[1:])
