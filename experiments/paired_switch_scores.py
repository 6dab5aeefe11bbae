"""Paired difference between two switch conditions of one `kvhandoff-lab eval-switch` run on the generative group
(the per-item scores its `switch.json` keeps: exact match, token F1 or accuracy), per task and pooled over the
tasks, per direction, with a paired bootstrap interval over the items; and how many items differ.

    python experiments/paired_switch_scores.py RUN_DIR CONDITION_A CONDITION_B

A condition is "target", "source" or a switch condition as `switch.json` names it ("switch:recent:5%",
"switch:turn_attention:5%"; "switch" for no recompute). The difference printed is score(A) − score(B).
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


def compare(result: dict, first: str, second: str) -> dict:
    out = {}
    for name, direction in result["directions"].items():
        rows, pooled_a, pooled_b = {}, [], []
        for task, entry in direction["tasks"].items():
            scores = entry.get("scores", {})
            if first not in scores or second not in scores:
                continue
            rows[task] = difference(scores[first], scores[second])
            pooled_a += scores[first]
            pooled_b += scores[second]
        if pooled_a:
            rows["pooled"] = difference(pooled_a, pooled_b)
        out[name] = rows
    return out


def main(run_dir: str, first: str, second: str) -> None:
    result = json.loads((Path(run_dir) / "switch.json").read_text(encoding="utf-8"))
    compared = compare(result, first, second)
    for direction, rows in compared.items():
        for task, row in rows.items():
            print(f"{direction:8s} {task:12s} n={row['n']:4d}  {first} − {second}: {row['value']:+.3f} "
                  f"[{row['ci'][0]:+.3f}, {row['ci'][1]:+.3f}]  ({row['differ']} items differ)")
    print(json.dumps(compared))


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
