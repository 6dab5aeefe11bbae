"""How much of the source's attention over a new turn the top positions of a history hold, and how many positions
each coverage needs: the numbers that place a `turn_attention:BUDGET:coverage=SHARE` policy on a task.

    python experiments/coverage_shares.py OUT_JSON [TASKS] [LIMIT] [POOL] [THREADS]
    python experiments/coverage_shares.py correlate SHARES_JSON SWITCH_JSON [SWITCH_JSON ...]

The default pair's small → large direction (its mapper's exact prefix); for the first LIMIT (default 24) items of
each task of TASKS (default coqa_gen,boolq_long; generative-group or core tasks) from POOL (default dev) on the
switch benchmark's histories (as `eval-switch` draws them), the source prefills the history and reads the item's
question (`KVCache.read_turn`, as `turn_attention` does); over the positions after the exact prefix: the share of
the turn's attention they receive (``mapped_attention``: of every layer's, head's and question token's;
``reliance``: of its attention over the cached positions, `policy.history_reliance`, what an ``escalate`` budget
reads), the share
of that held by the top 5/10/15/20%, and the share of the positions each coverage (50–95%) recomputes
(`policy.covering_count`).

``correlate``: whether a switch's ``mapped_attention`` tells how much recompute it needs. For every task of
SHARES_JSON that an `eval-switch` result (its ``switch.json``, small → large, with `turn_attention` at several
budgets) scored on the same items, the Pearson correlation, with a bootstrap 95% interval over the items, of the
item's ``mapped_attention`` with what the largest budget gains over the middle one and with what the middle one
loses against the target alone.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

from kvhandoff.model.cache import prefill
from kvhandoff.model.loading import DEFAULT_SOURCE, DEFAULT_TARGET
from kvhandoff.runtime.plan import HandoffPlan
from kvhandoff.runtime.policy import budget_count, covering_count, history_reliance
from kvhandoff.runtime.seam import as_kv_cache
from kvhandoff.workflow import load_named_pair, obtain_mapper
from kvhandoff_lab.evaluation.switch import (
    DEFAULT_HISTORIES,
    DEFAULT_HISTORY_TOKENS,
    build_histories,
    switch_items,
    turn_items,
)
from kvhandoff_lab.evaluation.switchtasks import DEFAULT_TASK_HISTORIES, SWITCH_TASKS

BUDGETS = (0.05, 0.10, 0.15, 0.20)
COVERAGES = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


def item_shares(scores: torch.Tensor) -> dict:
    """The top budgets' share of the attention and each coverage's share of the positions, for one row of
    candidates' scores [1, n]."""
    ranked = scores.float().clamp_min(0).sort(dim=1, descending=True).values[0]
    total = float(ranked.sum()) or 1.0
    n = ranked.numel()
    return {"held": {f"{b:g}": float(ranked[:budget_count(b, n)].sum()) / total for b in BUDGETS},
            "positions": {f"{c:g}": covering_count(scores, c) / n for c in COVERAGES}}


def task_turns(task: str, tokenizer, limit: int, pool: str) -> list[tuple[str, list[int], list[int]]]:
    """(id, history ids, question ids) of the task's first ``limit`` items, as `eval-switch` draws them."""
    if task in SWITCH_TASKS:
        return [(item.id, list(item.history.ids) + list(item.extension), list(item.question))
                for item in turn_items(task, tokenizer, DEFAULT_TASK_HISTORIES, DEFAULT_HISTORY_TOKENS, limit,
                                       pool=pool)]
    histories = build_histories(task, tokenizer, DEFAULT_HISTORIES, DEFAULT_HISTORY_TOKENS, pool=pool)
    return [(item.id, list(item.history.ids), list(item.question))
            for item in switch_items(task, tokenizer, histories, limit, pool=pool)]


def spread(values: list[float]) -> dict:
    return {"mean": float(np.mean(values)), "quartiles": [float(q) for q in np.percentile(values, (25, 50, 75))]}


@torch.inference_mode()
def main() -> None:
    out = Path(sys.argv[1])
    tasks = (sys.argv[2] if len(sys.argv) > 2 else "coqa_gen,boolq_long").split(",")
    limit = int(sys.argv[3]) if len(sys.argv) > 3 else 24
    pool = sys.argv[4] if len(sys.argv) > 4 else "dev"
    if len(sys.argv) > 5:
        torch.set_num_threads(int(sys.argv[5]))
    pair = load_named_pair(DEFAULT_SOURCE, DEFAULT_TARGET)
    mapper, _, _ = obtain_mapper(pair)
    config = pair.source.config
    result = {"pool": pool, "limit": limit, "tasks": {}}
    for task in tasks:
        rows = []
        for item_id, history, question in task_turns(task, pair.tokenizer, limit, pool):
            ids = torch.tensor([history])
            cache = as_kv_cache(prefill(pair.source, ids)[0])
            scores = cache.read_turn(pair.source, torch.tensor([question]), 1, 0).scores
            own = HandoffPlan().prefix_length(mapper, ids.shape[1])
            queries = config.num_hidden_layers * config.num_attention_heads * len(question)
            rows.append({"id": item_id, "candidates": ids.shape[1] - own,
                         "mapped_attention": float(scores[:, own:].sum()) / queries,
                         "reliance": float(history_reliance(scores, own)[0]), **item_shares(scores[:, own:])})
            print(task, item_id, rows[-1]["candidates"], round(rows[-1]["mapped_attention"], 3), flush=True)
        result["tasks"][task] = {
            "n": len(rows), "mapped_attention": spread([r["mapped_attention"] for r in rows]),
            "reliance": spread([r["reliance"] for r in rows]),
            "held": {k: spread([r["held"][k] for r in rows]) for k in rows[0]["held"]},
            "positions": {k: spread([r["positions"][k] for r in rows]) for k in rows[0]["positions"]},
            "items": rows}
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    for task, entry in result["tasks"].items():
        quartiles = ", ".join(f"{q:.3f}" for q in entry["mapped_attention"]["quartiles"])
        print(f"{task} (n={entry['n']}): the turn's attention on mapped rows {entry['mapped_attention']['mean']:.3f}"
              f" (quartiles {quartiles})")
        print("  held by the top " + ", ".join(f"{k}: {v['mean']:.3f}" for k, v in entry["held"].items()))
        print("  positions each coverage recomputes: "
              + ", ".join(f"{k}: {v['mean']:.3f}" for k, v in entry["positions"].items()))
    print(f"wrote {out}")


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    if x.std() == 0 or y.std() == 0:
        return 0.0
    return float(np.corrcoef(x, y)[0, 1])


def bootstrap_correlation(x: np.ndarray, y: np.ndarray, rounds: int = 2000, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    draws = [pearson(x[i], y[i]) for i in rng.integers(0, len(x), (rounds, len(x)))]
    return {"r": pearson(x, y), "ci": [float(np.percentile(draws, 2.5)), float(np.percentile(draws, 97.5))]}


def budget_of(condition: str) -> float:
    return float(condition.rsplit(":", 1)[1].rstrip("%"))


def correlate(shares_path: Path, switch_paths: list[Path]) -> None:
    shares = json.loads(shares_path.read_text(encoding="utf-8"))["tasks"]
    for path in switch_paths:
        tasks = json.loads(path.read_text(encoding="utf-8"))["directions"]["forward"]["tasks"]
        for task, entry in tasks.items():
            if task not in shares:
                continue
            attention = {row["id"]: row["mapped_attention"] for row in shares[task]["items"]}
            kept = [i for i, item in enumerate(entry["item_ids"]) if item in attention]
            scores = {name: np.asarray(values)[kept] for name, values in entry["scores"].items()}
            budgets = sorted((name for name in scores if name.startswith("switch:turn_attention:")), key=budget_of)
            if len(budgets) < 2 or not kept:
                print(f"{task} in {path}: needs turn_attention at two budgets or more on the same items")
                continue
            middle, largest = budgets[len(budgets) // 2 - (len(budgets) % 2 == 0)], budgets[-1]
            x = np.asarray([attention[entry["item_ids"][i]] for i in kept])
            gain = bootstrap_correlation(x, scores[largest] - scores[middle])
            loss = bootstrap_correlation(x, scores["target"] - scores[middle])
            print(f"{task} (n={len(kept)}): mapped_attention against {largest} − {middle}: r {gain['r']:+.2f} "
                  f"[{gain['ci'][0]:+.2f}, {gain['ci'][1]:+.2f}]; against target − {middle}: r {loss['r']:+.2f} "
                  f"[{loss['ci'][0]:+.2f}, {loss['ci'][1]:+.2f}]")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "correlate":
        correlate(Path(sys.argv[2]), [Path(p) for p in sys.argv[3:]])
    else:
        main()
