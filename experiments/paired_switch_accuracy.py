"""Paired accuracy difference between two switch conditions of `kvhandoff-lab eval-switch` runs that share an item
store (e.g. the default policy and no recompute on the same report-pool items), per direction and task group, with a
bootstrap interval over the items.

    python experiments/paired_switch_accuracy.py RUN_DIR POLICY_A POLICY_B

RUN_DIR holds `switch.json` (its item ids) and `items/` with the records of both policies ("none" or a spec such as
"recent:5%"; "target" or "source": that model alone on the same history); the difference printed is accuracy(A) −
accuracy(B) under each task's primary metric.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from kvhandoff.runtime import policy as recompute_policy
from kvhandoff_lab.evaluation.runner import ItemStore, slug
from kvhandoff_lab.evaluation.tasks import CORE_TASKS, get_task, mc_item_metrics


def store_of(run_dir: Path, task: str, policy: str, direction: dict) -> dict:
    if policy in ("target", "source"):
        prefix = f"model-{slug(direction[policy])}-"
    else:
        spec = recompute_policy.parse(policy).spec  # the command line's spec
        name = "switch" if spec == "none" else f"switch:{spec}"
        prefix = f"{slug(name)}-{slug(direction['source'])}-to-"
    (path,) = (run_dir / "items" / f"switch-{task}").glob(f"{prefix}*.jsonl")
    return ItemStore(path)


def main(run_dir: str, policy_a: str, policy_b: str, resamples: int = 2000) -> None:
    run_dir = Path(run_dir)
    result = json.loads((run_dir / "switch.json").read_text(encoding="utf-8"))
    rng = np.random.default_rng(0)
    for entry in result["directions"].values():
        for group in ("core", "heldout"):
            diffs = []
            for task, summary in entry["tasks"].items():
                if (task in CORE_TASKS) != (group == "core"):
                    continue
                a, b = (store_of(run_dir, task, p, entry) for p in (policy_a, policy_b))
                metric = get_task(task).primary_metric
                diffs += [mc_item_metrics(a[i])[metric] - mc_item_metrics(b[i])[metric] for i in summary["item_ids"]]
            if not diffs:
                continue
            diffs = np.asarray(diffs)
            boots = [diffs[rng.integers(0, len(diffs), len(diffs))].mean() for _ in range(resamples)]
            print(f"{entry['source']} → {entry['target']}, {group}: n = {len(diffs)}, accuracy({policy_a}) − "
                  f"accuracy({policy_b}) = {diffs.mean():+.3f} [{np.percentile(boots, 2.5):+.3f}, "
                  f"{np.percentile(boots, 97.5):+.3f}], items that differ: {int((diffs != 0).sum())}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
