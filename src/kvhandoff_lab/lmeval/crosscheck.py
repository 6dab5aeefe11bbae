"""The lm-eval adapter checked against lm-eval's own `hf` model and against `kvhandoff-lab eval`, item by item.

On the items `kvhandoff-lab eval` draws (its seeded report-pool sample; lm-eval scores the same documents through
its `samples` selection), three comparisons, each against the per-item records `kvhandoff-lab eval` stored:

- **target alone** (an ARC task): lm-eval's `hf` model (`pretrained=<the target's folder>,dtype=float32`) and
  the adapter's `mode=target` against `kvhandoff-lab eval`'s target condition;
- **whole context mapped** (the same items): the adapter's `mode=all` against the transfer condition;
- **history mapped** (MMLU 5-shot; ARC is zero-shot and has no history): the adapter's `mode=history` against
  `kvhandoff-lab eval --mapped history`'s transfer condition.

Each comparison gives both sides' acc (and acc_norm where the task has it), the items whose predicted choice
differs (with the reference's margin between its two best choices, which says whether a flip is a near-tie), and
the per-choice loglikelihood differences against a tolerance. Run it with::

    python -m kvhandoff_lab.lmeval.crosscheck --task arc_easy --limit 200 --history-limit 120 \\
        --eval-dir runs/lmeval_crosscheck --out docs/results/lmeval_crosscheck.json

The `kvhandoff-lab eval` half is `run_eval` writing to `--eval-dir/{all,history}` as the command line would
(`kvhandoff-lab eval --tasks arc_easy --limit 200 --no-both-directions --out DIR/all` prints the same summary from the
stored records).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvhandoff.errors import ConfigError
from kvhandoff.files import atomic_write_json
from kvhandoff.model.loading import DEFAULT_SOURCE, DEFAULT_TARGET
from kvhandoff.runtime import policy
from kvhandoff.workflow import NamedPair, load_named_pair, load_pair_mapper, obtain_mapper
from kvhandoff_lab.evaluation.options import EvalOptions, OutputOptions, ScoringOptions
from kvhandoff_lab.evaluation.runner import benchmark_runs, mapper_identity, run_eval, run_records, select_items
from kvhandoff_lab.evaluation.tasks import get_task, load_items, mc_item_metrics
from kvhandoff_lab.lmeval import TASKS_DIR, KVHandoffLM, history_of

#: kvhandoff task → the lm-eval task config in `TASKS_DIR` with the same items and prompts
LM_EVAL_TASKS = {"arc_easy": "kvhandoff_arc_easy", "arc_challenge": "kvhandoff_arc_challenge",
                 "mmlu": "kvhandoff_mmlu"}
#: largest per-choice loglikelihood difference (nats) counted as agreement: float32 round-off of one forward pass
#: over the whole sequence (lm-eval `hf`) against a cached prefill read on token by token
DEFAULT_TOLERANCE = 1e-3
RESULT_FORMAT = "kvhandoff-lmeval-crosscheck/1"

logger = logging.getLogger(__name__)


# -- per-item records and their comparison --------------------------------------------------------------------------
def lm_eval_records(samples: Sequence[Mapping[str, Any]], target_delimiter: str = " ") -> dict[str, dict]:
    """lm-eval's logged samples of a multiple-choice task as kvhandoff-style records, keyed by the document's
    `id`: the choices' loglikelihoods, their lengths in characters (the continuation without the target
    delimiter, lm-eval's acc_norm length), the gold index and lm-eval's own per-sample metrics."""
    records = {}
    for sample in samples:
        continuations = [str(arguments[1]) for arguments in sample["arguments"]]
        records[str(sample["doc"]["id"])] = {
            "id": str(sample["doc"]["id"]),
            "loglikelihoods": [float(resp[0][0]) for resp in sample["resps"]],
            "norm_lengths": [len(c.removeprefix(target_delimiter)) for c in continuations],
            "gold": int(sample["target"]),
            "metrics": {m: float(sample[m]) for m in ("acc", "acc_norm") if m in sample},
        }
    return records


def item_scores(record: Mapping[str, Any]) -> dict[str, float]:
    """acc and acc_norm of one record: the harness's own where it logged them (lm-eval), else kvhandoff's."""
    return {**mc_item_metrics(record), **record.get("metrics", {})}


def chosen(record: Mapping[str, Any], metric: str) -> tuple[int, float]:
    """(the predicted choice under `metric`, its margin over the next best), from the record's loglikelihoods."""
    scores = np.asarray(record["loglikelihoods"], dtype=np.float64)
    if metric == "acc_norm":
        scores = scores / np.maximum(np.asarray(record["norm_lengths"], dtype=np.float64), 1.0)
    order = np.argsort(-scores, kind="stable")
    margin = float(scores[order[0]] - scores[order[1]]) if len(scores) > 1 else float("inf")
    return int(order[0]), margin


def compare_records(reference: Mapping[str, dict], other: Mapping[str, dict], metrics: Sequence[str],
                    tolerance: float = DEFAULT_TOLERANCE) -> dict:
    """Both sides' accuracy per metric, the items whose prediction differs, and the per-choice loglikelihood
    differences, over the reference's items (the other side must have every one of them, with as many
    choices and the same gold)."""
    missing = [i for i in reference if i not in other]
    if missing:
        raise ConfigError(f"{len(missing)} items have no record on the other side, e.g. {missing[:3]}")
    differences = []
    for item_id, ref in reference.items():
        got = other[item_id]
        if len(got["loglikelihoods"]) != len(ref["loglikelihoods"]) or int(got["gold"]) != int(ref["gold"]):
            raise ConfigError(f"item {item_id!r}: the two sides score different choices or gold answers")
        differences += [abs(a - b) for a, b in zip(ref["loglikelihoods"], got["loglikelihoods"], strict=True)]
    out: dict[str, Any] = {"n": len(reference), "accuracy": {}, "predictions_differ": {}, "differing_items": {}}
    for metric in metrics:
        out["accuracy"][metric] = {side: float(np.mean([item_scores(r)[metric] for r in records.values()]))
                                   for side, records in (("reference", reference),
                                                         ("other", {i: other[i] for i in reference}))}
        flips = []
        for item_id, ref in reference.items():
            (ref_choice, margin), (other_choice, _) = chosen(ref, metric), chosen(other[item_id], metric)
            if ref_choice != other_choice:
                flips.append({"id": item_id, "reference": ref_choice, "other": other_choice,
                              "reference_margin": margin, "gold": int(ref["gold"])})
        out["predictions_differ"][metric] = len(flips)
        out["differing_items"][metric] = flips
    out["loglikelihood_difference"] = {
        "max": max(differences, default=0.0), "mean": float(np.mean(differences)) if differences else 0.0,
        "choices": len(differences), "beyond_tolerance": sum(d > tolerance for d in differences),
        "tolerance": tolerance,
    }
    return out


def history_boundaries(task: str, ids: Sequence[str], delimiter: str = "\n\n") -> dict:
    """How many items' adapter history (`history_of`: the context up to its last `delimiter`) is the item's
    few-shot prefix, the history `kvhandoff-lab eval --mapped history` maps; the others' questions hold a blank
    line, so the adapter maps part of the question too."""
    items = {item.id: item for item in load_items(task)}
    other = [i for i in ids if history_of(items[i].choices[0].context, delimiter) != items[i].shared_prefix]
    return {"n": len(ids), "same_history": len(ids) - len(other), "question_holds_the_delimiter": other}


def doc_indices(task: str, ids: Sequence[str]) -> list[int]:
    """The positions of `ids` among the task's items: the document indices of its lm-eval task (whose dataset
    lists the items in kvhandoff's order)."""
    positions = {item.id: index for index, item in enumerate(load_items(task))}
    return sorted(positions[i] for i in ids)


# -- the two harnesses ----------------------------------------------------------------------------------------------
def kvhandoff_eval_records(pair: NamedPair, mapper, task: str, limit: int, seed: int, mapped: str, out_dir: Path,
                           progress: bool = False) -> tuple[dict, dict[str, dict[str, dict]]]:
    """`kvhandoff-lab eval`'s summary of `task` (run_eval, as the command line runs it, into `out_dir`) and its stored
    per-item records of the target and transfer conditions (read back, never recomputed)."""
    options = EvalOptions(tasks=task, limit=limit, seed=seed, mapped=mapped)
    result = run_eval(pair.source, pair.target, mapper, pair.tokenizer, options, ScoringOptions(),
                      OutputOptions(out_dir=out_dir, result_name="forward", progress=progress, render=False))
    if task not in result["tasks"]:
        raise ConfigError(f"kvhandoff-lab eval skipped {task!r}: {result.get('skipped', {}).get(task)}")
    runs = benchmark_runs(pair.source, pair.target, mapper, pair.tokenizer, get_task(task),
                          conditions=("target", "transfer"), exact_prefix=result["exact_prefix"], mapped=mapped,
                          recompute=policy.parse(result["recompute"]))

    def not_stored(*_args) -> None:
        raise RuntimeError("a record kvhandoff-lab eval should have stored was computed again")

    records = run_records(task, select_items(task, limit, seed), runs, out_dir / "items", on_item=not_stored)
    return result["tasks"][task], records


def lm_eval_run(model, task: str, ids: Sequence[str], model_args: str | None = None) -> tuple[dict, dict]:
    """lm-eval's metrics and per-item records of `model` (a registered name with `model_args`, or an `LM`) on
    the documents `ids` of the lm-eval task matching `task`."""
    import lm_eval
    import torch
    from lm_eval.tasks import TaskManager

    lm_task = LM_EVAL_TASKS[task]
    output = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[lm_task],
                                     samples={lm_task: doc_indices(task, ids)}, log_samples=True,
                                     task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False),
                                     bootstrap_iters=0,
                                     device="cuda" if torch.cuda.is_available() else "cpu", batch_size=1)
    metrics = {key.split(",")[0]: float(value) for key, value in output["results"][lm_task].items()
               if key.endswith(",none") and "stderr" not in key}
    return metrics, lm_eval_records(output["samples"][lm_task])


# -- the cross-check ------------------------------------------------------------------------------------------------
def check(name: str, task: str, reference: str, other: str, reference_records, other_records, metrics,
          tolerance: float, **extra: Any) -> dict:
    """One comparison's entry in the result."""
    return {"name": name, "task": task, "reference": reference, "other": other,
            **compare_records(reference_records, other_records, metrics, tolerance), **extra}


def target_and_all_checks(pair: NamedPair, mapper, task: str, limit: int, seed: int, eval_dir: Path,
                          tolerance: float, progress: bool) -> list[dict]:
    """Target alone (lm-eval `hf`, the adapter) and the whole context mapped (the adapter) against `kvhandoff
    eval` on `limit` items of `task`."""
    summary, records = kvhandoff_eval_records(pair, mapper, task, limit, seed, "all", eval_dir / "all", progress)
    ids, metrics = summary["item_ids"], get_task(task).metrics
    reported = {m: summary["metrics"][m]["accuracy"] for m in metrics}
    folder = str(pair.target.name_or_path)
    hf_metrics, hf_records = lm_eval_run("hf", task, ids, f"pretrained={folder},dtype=float32")
    gc.collect()  # lm-eval's own copy of the target
    _, target_records = lm_eval_run(KVHandoffLM(pair=pair, mode="target", progress=progress), task, ids)
    _, all_records = lm_eval_run(KVHandoffLM(pair=pair, mapper=mapper, mode="all", progress=progress), task, ids)
    return [
        check("target alone: lm-eval hf vs kvhandoff-lab eval", task, "kvhandoff-lab eval target", "lm-eval hf",
              records["target"], hf_records, metrics, tolerance, lm_eval_reported=hf_metrics,
              kvhandoff_eval_reported=reported, hf_model_args=f"pretrained={folder},dtype=float32"),
        check("target alone: adapter vs kvhandoff-lab eval", task, "kvhandoff-lab eval target", "adapter mode=target",
              records["target"], target_records, metrics, tolerance),
        check("whole context mapped: adapter vs kvhandoff-lab eval", task, "kvhandoff-lab eval transfer (mapped all)",
              "adapter mode=all", records["transfer"], all_records, metrics, tolerance),
    ]


def history_check(pair: NamedPair, mapper, task: str, limit: int, seed: int, eval_dir: Path, tolerance: float,
                  progress: bool) -> dict:
    """The few-shot history mapped: the adapter's mode=history against `kvhandoff-lab eval --mapped history`."""
    summary, records = kvhandoff_eval_records(pair, mapper, task, limit, seed, "history", eval_dir / "history",
                                              progress)
    ids, metrics = summary["item_ids"], get_task(task).metrics
    adapter = KVHandoffLM(pair=pair, mapper=mapper, mode="history", progress=progress)
    _, history_records = lm_eval_run(adapter, task, ids)
    return check("history mapped: adapter vs kvhandoff-lab eval", task, "kvhandoff-lab eval transfer (mapped history)",
                 "adapter mode=history", records["transfer"], history_records, metrics, tolerance,
                 kvhandoff_eval_reported={m: summary["metrics"][m]["accuracy"] for m in metrics},
                 history_boundaries=history_boundaries(task, ids))


def run_crosscheck(pair: NamedPair, mapper, eval_dir: Path, task: str = "arc_easy", limit: int = 200,
                   history_task: str = "mmlu", history_limit: int = 120, seed: int = 0,
                   tolerance: float = DEFAULT_TOLERANCE, progress: bool = False) -> dict:
    """Every comparison of the module docstring (history ones skipped when `history_limit` is 0)."""
    for name in (task, history_task):
        if name not in LM_EVAL_TASKS:
            raise ConfigError(f"no lm-eval task config matches {name!r}; choose from {', '.join(LM_EVAL_TASKS)}")
    import lm_eval

    checks = target_and_all_checks(pair, mapper, task, limit, seed, Path(eval_dir), tolerance, progress)
    if history_limit:
        checks.append(history_check(pair, mapper, history_task, history_limit, seed, Path(eval_dir), tolerance,
                                    progress))
    return {"format": RESULT_FORMAT, "lm_eval_version": lm_eval.__version__, "seed": seed,
            "source": str(pair.source.name_or_path), "target": str(pair.target.name_or_path),
            "mapper": mapper_identity(mapper), "checks": checks}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kvhandoff_lab.lmeval.crosscheck",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--source", default=DEFAULT_SOURCE)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--mapper", type=Path, default=None, help="a saved mapper (default: the pair's default)")
    parser.add_argument("--task", default="arc_easy", choices=("arc_easy", "arc_challenge"))
    parser.add_argument("--limit", type=int, default=200, help="items of --task")
    parser.add_argument("--history-task", default="mmlu", choices=("mmlu",))
    parser.add_argument("--history-limit", type=int, default=120, help="items of --history-task (0: skip)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE)
    parser.add_argument("--eval-dir", type=Path, default=Path("runs/lmeval_crosscheck"))
    parser.add_argument("--out", type=Path, default=Path("lmeval_crosscheck.json"))
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    return parser.parse_args(argv)


def summary_lines(result: dict, out: Path) -> list[str]:
    """The crosscheck's result in a few lines: each check's accuracies and log-likelihood difference."""
    lines = []
    for entry in result["checks"]:
        lines.append(json.dumps({k: entry[k] for k in ("name", "task", "n", "accuracy", "predictions_differ")}))
        lines.append(f"  loglikelihood difference: {entry['loglikelihood_difference']}")
    return [*lines, f"wrote {out}"]


def main(argv: Sequence[str] | None = None) -> dict:
    """The command line: the crosscheck of the pair's mapper, written to --out; the summary is logged."""
    args = parse_args(argv)
    pair = load_named_pair(args.source, args.target, progress=args.progress)
    mapper = (load_pair_mapper(args.mapper, pair) if args.mapper is not None
              else obtain_mapper(pair, progress=args.progress)[0])
    result = run_crosscheck(pair, mapper, args.eval_dir, args.task, args.limit, args.history_task,
                            args.history_limit, args.seed, args.tolerance, args.progress)
    atomic_write_json(args.out, result)
    for line in summary_lines(result, args.out):
        logger.info("%s", line)
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()
