"""Paired comparison of two mappers on the same switch-benchmark items: `kvhandoff-lab eval-switch` runs of each mapper
into one item store (the models alone are scored once), under one recompute policy.

    python experiments/paired_switch_mappers.py RUN_DIR SHA_A SHA_B [POLICY] [OUT.json]

RUN_DIR/items/switch-<task>/ holds the switch records of both mappers (their headers name each mapper by
`manifest_sha`; SHA_A and SHA_B are prefixes of it) and the target alone's. For every direction both mappers were
run in, per task group (core, held-out): n items scored by both, accuracy(A) − accuracy(B) under each task's primary
metric, agreement with the target alone A − B, and choice KL (target alone → switch) A − B, each with a paired
bootstrap interval over the items.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

from kvhandoff.model.cache import kl_divergence
from kvhandoff_lab.evaluation.runner import ItemStore
from kvhandoff_lab.evaluation.tasks import CORE_TASKS, HELDOUT_TASKS, get_task, mc_choice_scores, mc_item_metrics


def header(path: Path) -> dict:
    with path.open(encoding="utf-8") as f:
        return json.loads(f.readline())["_header"]


def stores(task_dir: Path, policy: str) -> tuple[dict, dict]:
    """({(source fingerprint sha, target sha, manifest sha): switch store}, {model fingerprint sha: alone store})."""
    switches, alone = {}, {}
    for path in sorted(task_dir.glob("*.jsonl")):
        head = header(path)
        if head.get("condition") == "switch" and head.get("recompute") == policy:
            key = (json.dumps(head["source"], sort_keys=True), json.dumps(head["target"], sort_keys=True),
                   head["mapper"]["manifest_sha"])
            switches[key] = ItemStore(path)
        elif head.get("condition") == "standalone":
            alone[json.dumps(head["model"], sort_keys=True)] = ItemStore(path)
    return switches, alone


def item_measures(task: str, target: dict, record: dict) -> tuple[float, float, float]:
    """(accuracy, agreement with the target alone, choice KL from the target alone) of one switch record."""
    metric = get_task(task).primary_metric
    reference, scores = (torch.from_numpy(mc_choice_scores(r, metric)) for r in (target, record))
    agree = float(reference.argmax() == scores.argmax())
    kl = float(kl_divergence(reference.log_softmax(-1), scores.log_softmax(-1)))
    return mc_item_metrics(record)[metric], agree, kl


def interval(values: np.ndarray, rng, resamples: int = 2000) -> list[float]:
    boots = [values[rng.integers(0, len(values), len(values))].mean() for _ in range(resamples)]
    return [float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5))]


def main(run_dir: str, sha_a: str, sha_b: str, policy: str = "recent:5%", out: str | None = None) -> dict:
    rng = np.random.default_rng(0)
    pooled: dict[tuple, dict[str, list]] = {}
    for task_dir in sorted((Path(run_dir) / "items").glob("switch-*")):
        task = task_dir.name.removeprefix("switch-")
        group = "core" if task in CORE_TASKS else "heldout" if task in HELDOUT_TASKS else "other"
        switches, alone = stores(task_dir, policy)
        directions = {(s, t) for s, t, _ in switches}
        for source, target in sorted(directions):
            pick = {name: [store for (s, t, sha), store in switches.items()
                           if (s, t) == (source, target) and sha.startswith(prefix)]
                    for name, prefix in (("a", sha_a), ("b", sha_b))}
            reference = alone.get(target)
            if any(len(found) != 1 for found in pick.values()) or reference is None:
                continue
            a, b = pick["a"][0], pick["b"][0]
            ids = [i for i in a.records if i in b and i in reference]
            entry = pooled.setdefault((json.loads(source)["architecture"], json.loads(source)["geometry"]["num_layers"],
                                       json.loads(target)["geometry"]["num_layers"], group),
                                      {"accuracy": [], "agreement": [], "choice_kl": [], "tasks": []})
            entry["tasks"].append(f"{task} ({len(ids)})")
            for item_id in ids:
                ma = item_measures(task, reference[item_id], a[item_id])
                mb = item_measures(task, reference[item_id], b[item_id])
                for key, x, y in zip(("accuracy", "agreement", "choice_kl"), ma, mb, strict=True):
                    entry[key].append((x, y))
    result = {"run_dir": run_dir, "mapper_a": sha_a, "mapper_b": sha_b, "policy": policy, "groups": []}
    for (architecture, source_layers, target_layers, group), entry in sorted(pooled.items()):
        row = {"direction": f"{source_layers} → {target_layers} layers ({architecture})", "group": group,
               "n": len(entry["accuracy"]), "tasks": entry["tasks"]}
        for key in ("accuracy", "agreement", "choice_kl"):
            pairs = np.asarray(entry[key])
            diff = pairs[:, 0] - pairs[:, 1]
            row[key] = {"a": float(pairs[:, 0].mean()), "b": float(pairs[:, 1].mean()),
                        "a_minus_b": float(diff.mean()), "ci": interval(diff, rng)}
        result["groups"].append(row)
        print(f"{row['direction']}, {group}: n = {row['n']}; " + "; ".join(
            f"{key} {row[key]['a']:.3f} vs {row[key]['b']:.3f}, A − B {row[key]['a_minus_b']:+.3f} "
            f"[{row[key]['ci'][0]:+.3f}, {row[key]['ci'][1]:+.3f}]" for key in ("accuracy", "agreement", "choice_kl")))
    if out:
        Path(out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    main(*sys.argv[1:6])
