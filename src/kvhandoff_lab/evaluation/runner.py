"""The evaluation runner: item selection, resumable per-item result files, summaries.

On-disk layout under ``out_dir``::

    items/<task>/<key>.jsonl     append-only per-item records of one condition (first line: a header)
    <name>.json / .md / .png     the summary, its Markdown table and the retention chart

``<key>`` hashes everything a record depends on (`geometry.model_fingerprint` of the models, the mapper's
manifest, the tokenizer's hash, the task settings), so the forward and reverse directions share the
standalone runs of the same model, a changed mapper never reuses stale transfer records, and an interrupted
run resumes where it stopped: each record is appended and flushed as soon as it is computed, and a torn last
line from a crash is skipped.
Summaries are written to a temporary file and renamed over the old one.

Item selection: each task's items are split once into a *dev* pool (≈1 in 5, by a hash of the item id,
independent of the seed) used only by the k sweep and a *report* pool; ``limit`` items are drawn from a
pool by a seeded shuffle, so the same seed gives the same items and a larger limit extends a smaller one.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvhandoff.errors import ConfigError
from kvhandoff.files import atomic_write_json, sha256_json
from kvhandoff.fit.corpus import heldout_documents
from kvhandoff.model.geometry import model_fingerprint, tokenizer_hash
from kvhandoff.progress import Progress, as_progress
from kvhandoff.runtime.policy import DEFAULT_RECOMPUTE, NoRecompute, RecomputePolicy
from kvhandoff_lab.evaluation.metrics import mean, summarise_conditions
from kvhandoff_lab.evaluation.multiturn import (
    load_coqa_conversations,
    run_conversation,
    run_variants,
    summarise_multiturn,
)
from kvhandoff_lab.evaluation.options import EvalOptions, OutputOptions, ScoringOptions
from kvhandoff_lab.evaluation.perplexity import document_id, perplexity_record, summarise_perplexity, usable_documents
from kvhandoff_lab.evaluation.report import render_results
from kvhandoff_lab.evaluation.scoring import evaluate_item, standard_conditions
from kvhandoff_lab.evaluation.tasks import (
    CORE_TASKS,
    GENERATE,
    HELDOUT_TASKS,
    POOLS,
    Item,
    TaskSpec,
    get_task,
    item_metrics,
    load_items,
    pool_of,
)

#: version of the per-item records, part of their keys (records are keyed by `geometry.model_fingerprint` and
#: `geometry.tokenizer_hash`; a store's header holds every setting)
RECORD_VERSION = 2
RESULT_FORMAT = "kvhandoff-eval/2"


# -- identities and keys --------------------------------------------------------------------------------------


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-").lower()[:60] or "model"


_VOLATILE_KEYS = ("seconds", "created", "timestamp", "time")


def _stable(obj: Any) -> Any:
    """``obj`` without timing entries (a mapper rebuilt from the same statistics must hash the same)."""
    if isinstance(obj, Mapping):
        return {k: _stable(v) for k, v in obj.items() if not any(w in str(k).lower() for w in _VOLATILE_KEYS)}
    if isinstance(obj, list | tuple):
        return [_stable(v) for v in obj]
    return obj


#: manifest records of how a pair is served, not of what its map computes: left out of a mapper's identity
_SERVING_RECORDS = ("recompute", "guard")


def mapper_identity(mapper) -> dict:
    """A mapper's identity: its manifest (hashed; timings and the records of how it is served, its recompute
    policy and its guard, left out) when it has one; otherwise (stand-in mappers in tests) its class and public
    scalar attributes."""
    manifest = getattr(mapper, "manifest", None)
    if isinstance(manifest, Mapping):
        top_k = (manifest.get("config") or {}).get("top_k")
        kept = {key: value for key, value in manifest.items() if key not in _SERVING_RECORDS}
        return {"manifest_sha": sha256_json(_stable(kept), 32), "top_k": top_k}
    attributes = {
        k: v for k, v in sorted(vars(mapper).items()) if not k.startswith("_") and isinstance(v, int | float | str)
    } if hasattr(mapper, "__dict__") else {}
    return {"class": f"{type(mapper).__module__}.{type(mapper).__qualname__}", "attributes": attributes}


def display_name(model, fallback: str) -> str:
    name = model_fingerprint(model)["name"]
    return Path(name).name if name else fallback


# -- item selection -------------------------------------------------------------------------------------------


def select_items(
    task: str, limit: int | None, seed: int, pool: str = "report", items: Sequence[Item] | None = None
) -> list[Item]:
    """``limit`` items (all when None) of the pool, in a seeded random order."""
    if pool not in POOLS:
        raise ConfigError(f"pool must be one of {POOLS}, got {pool!r}")
    if limit is not None and limit < 1:
        raise ConfigError(f"limit must be >= 1, got {limit}")
    items = load_items(task) if items is None else list(items)
    chosen = [item for item in items if pool_of(task, item.id) == pool]
    random.Random(f"{seed}/{task}/{pool}").shuffle(chosen)
    return chosen if limit is None else chosen[:limit]


# -- the per-item store ---------------------------------------------------------------------------------------


class ItemStore:
    """Append-only JSONL of per-item records (keyed by ``id``); in memory only when ``path`` is None."""

    def __init__(self, path: Path | None, header: Mapping[str, Any] | None = None) -> None:
        self.path = path
        self.header = dict(header or {})
        self.records: dict[str, dict] = {}
        self.skipped_lines = 0
        if path is not None and path.exists():
            self._load()

    def _load(self) -> None:
        assert self.path is not None
        with self.path.open("r", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    self.skipped_lines += 1  # a torn line from an interrupted write
                    continue
                if not isinstance(record, dict) or "_header" in record or "id" not in record:
                    continue
                self.records.setdefault(str(record["id"]), record)

    def __contains__(self, item_id: str) -> bool:
        return item_id in self.records

    def __getitem__(self, item_id: str) -> dict:
        return self.records[item_id]

    def append(self, record: dict) -> None:
        item_id = str(record["id"])
        if item_id in self.records:
            raise ValueError(f"record {item_id!r} is already stored")
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            new = not self.path.exists() or self.path.stat().st_size == 0
            line = json.dumps(record, ensure_ascii=False) + "\n"
            with self.path.open("a", encoding="utf-8") as f:
                if new:
                    f.write(json.dumps({"_header": self.header}, ensure_ascii=False, default=str) + "\n")
                elif not self._ends_with_newline():
                    f.write("\n")  # never glue a record onto a torn line
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
        self.records[item_id] = record

    def _ends_with_newline(self) -> bool:
        assert self.path is not None
        with self.path.open("rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"


@dataclass
class RecordRun:
    """One condition of one task: how to compute an item's record, and where it is stored."""

    name: str
    key: str
    header: dict
    compute: Callable[[Any], dict]


ItemHook = Callable[[str, str, dict], None]


def run_records(
    task: str,
    items: Sequence[Any],
    runs: Sequence[RecordRun],
    store_dir: Path | None,
    progress: Progress | bool = False,
    on_item: ItemHook | None = None,
    item_id: Callable[[Any], str] = lambda item: item.id,
) -> dict[str, dict[str, dict]]:
    """Records of every (item, run), computing only those not stored yet; item by item, all runs per item.
    Items sharing a few-shot prefix (``shared_prefix``) are computed one after another, so that the conditions'
    bounded prefix caches keep hitting (MMLU's 57 subjects come shuffled); the records do not depend on it.

    on_item(task, run name, record) is called after each newly computed record has been stored.
    """
    stores = {
        run.name: ItemStore(None if store_dir is None else store_dir / task / f"{run.key}.jsonl", run.header)
        for run in runs
    }
    ids = [item_id(item) for item in items]
    done = sum(i in stores[run.name] for i in ids for run in runs)
    bar = as_progress(progress)(total=len(ids) * len(runs), initial=done, desc=task, leave=False, dynamic_ncols=True)
    try:
        for index in prefix_grouped_order(items):
            item, i = items[index], ids[index]
            for run in runs:
                store = stores[run.name]
                if i in store:
                    continue
                record = run.compute(item)
                if str(record.get("id")) != i:
                    raise RuntimeError(f"record id {record.get('id')!r} does not match item {i!r}")
                store.append(record)
                bar.update(1)
                if on_item is not None:
                    on_item(task, run.name, record)
    finally:
        bar.close()
    return {run.name: {i: stores[run.name][i] for i in ids} for run in runs}


def prefix_grouped_order(items: Sequence[Any]) -> list[int]:
    """Indices of ``items`` in the given order, except that items sharing a ``shared_prefix`` follow the first
    of them (stable)."""
    first: dict[str, int] = {}
    keys = []
    for index, item in enumerate(items):
        prefix = getattr(item, "shared_prefix", None)
        keys.append(index if prefix is None else first.setdefault(prefix, index))
    return sorted(range(len(items)), key=lambda index: (keys[index], index))


# -- summaries ------------------------------------------------------------------------------------------------


def task_summary(
    spec: TaskSpec,
    items: Sequence[Item],
    records: Mapping[str, Mapping[str, dict]],
    n_resamples: int = 1000,
    seed: int = 0,
    confidence: float = 0.95,
) -> dict:
    """Per-condition accuracy, retention and floor-normalised retention (primary metric up front)."""
    chance = [item.chance for item in items]
    by_metric = {}
    for metric in spec.metrics:
        per_item = {
            cond: [item_metrics(spec, recs[item.id])[metric] for item in items] for cond, recs in records.items()
        }
        by_metric[metric] = summarise_conditions(per_item, chance, n_resamples, seed, confidence)
    primary = by_metric[spec.primary_metric]
    return {
        "display": spec.display,
        "kind": spec.kind,
        "group": "core" if spec.name in CORE_TASKS else "heldout" if spec.name in HELDOUT_TASKS else "other",
        "num_fewshot": spec.num_fewshot,
        "split": spec.split,
        "primary_metric": spec.primary_metric,
        "n": len(items),
        "chance": primary["chance"],
        "accuracy": primary["accuracy"],
        **{k: primary[k] for k in ("retention", "floor_normalised_retention") if k in primary},
        "metrics": by_metric,
    }


# -- the runner -----------------------------------------------------------------------------------------------


def recompute_setting(recompute: RecomputePolicy) -> dict:
    """The recompute policy as a record-run setting (its spec); "none" adds nothing, so the records of runs without a
    policy keep keys that do not mention it."""
    return {} if not recompute.active else {"recompute": recompute.spec}


def _standalone_run(name: str, model, tok_id: str, settings: dict, compute) -> RecordRun:
    header = {"condition": "standalone", "model": model_fingerprint(model), "tokenizer": tok_id, **settings}
    return RecordRun(name, f"model-{slug(display_name(model, 'model'))}-{sha256_json(header, 16)}", header, compute)


def _transfer_run(name: str, source, target, mapper, tok_id: str, settings: dict, compute) -> RecordRun:
    header = {
        "condition": "transfer",
        "source": model_fingerprint(source),
        "target": model_fingerprint(target),
        "mapper": mapper_identity(mapper),
        "tokenizer": tok_id,
        **settings,
    }
    key = f"transfer-{slug(display_name(source, 'source'))}-to-{slug(display_name(target, 'target'))}"
    return RecordRun(name, f"{key}-{sha256_json(header, 16)}", header, compute)


def benchmark_runs(
    source_model, target_model, mapper, tokenizer, spec: TaskSpec, max_new_tokens: int = 256,
    conditions: Sequence[str] = ("target", "source", "transfer"), tok_id: str | None = None,
    exact_prefix: int = 0, mapped: str = "all", recompute: RecomputePolicy = NoRecompute(),  # noqa: B008 - frozen
) -> list[RecordRun]:
    """The record runs (target, source, transfer) of one benchmark task (mapped, recompute: see
    `standard_conditions`)."""
    tok_id = tok_id or tokenizer_hash(tokenizer)
    conds = standard_conditions(source_model, target_model, mapper, exact_prefix, mapped, recompute)
    settings: dict[str, Any] = {"record_version": RECORD_VERSION, "task": spec.name}
    if spec.kind == GENERATE:
        settings["max_new_tokens"] = max_new_tokens

    def compute_for(cond):
        return lambda item: evaluate_item(cond, tokenizer, item, max_new_tokens)

    runs = []
    for name in conditions:
        cond = conds[name]
        if name == "transfer":
            runs.append(_transfer_run(name, source_model, target_model, mapper, tok_id,
                                      {**settings, "exact_prefix": exact_prefix, "mapped": mapped,
                                       **recompute_setting(recompute)},
                                      compute_for(cond)))
        else:
            model = target_model if name == "target" else source_model
            runs.append(_standalone_run(name, model, tok_id, settings, compute_for(cond)))
    return runs


@dataclass
class _Evaluation:
    """One `run_eval` call's models, settings and identities, shared by its steps."""

    source_model: Any
    target_model: Any
    mapper: Any
    tokenizer: Any
    options: EvalOptions
    scoring: ScoringOptions
    output: OutputOptions
    on_item: ItemHook | None
    exact_prefix: int
    tok_id: str
    recompute: RecomputePolicy = NoRecompute()  # noqa: RUF009 - frozen


def run_eval(
    source_model,
    target_model,
    mapper,
    tokenizer,
    options: EvalOptions = EvalOptions(),  # noqa: B008 - frozen
    scoring: ScoringOptions = ScoringOptions(),  # noqa: B008 - frozen
    output: OutputOptions = OutputOptions(),  # noqa: B008 - frozen
    *,
    reverse_mapper=None,
    documents: Sequence[Any] | None = None,
    on_item: ItemHook | None = None,
) -> dict:
    """Evaluate target / source / transfer on ``options.tasks`` and write
    ``<output.out_dir>/<output.result_name>.{json,md,png}``.

    "perplexity" scores conditional perplexity on ``documents`` (when None, ``corpus.heldout_documents``);
    "coqa" runs multi-turn switching and needs ``reverse_mapper`` (target → source). Under
    ``options.mapped == "history"`` tasks without a few-shot history are skipped and listed in the result's
    "skipped"; perplexity and CoQA are unaffected (they already map what came before and let the target read
    the new tokens). on_item(task, condition, record) runs after each newly computed record is stored.
    Returns the result dictionary (also written as JSON when ``output.out_dir`` is given).
    """
    if "coqa" in options.tasks and reverse_mapper is None:
        raise ConfigError("the 'coqa' multi-turn task needs the reverse mapper (target → source) as well")
    # the mapper's own setting when none is given, recorded explicitly in the results
    exact_prefix = getattr(mapper, "exact_prefix", 0) if options.exact_prefix is None else options.exact_prefix
    recompute = DEFAULT_RECOMPUTE if options.recompute is None else options.recompute
    run = _Evaluation(source_model, target_model, mapper, tokenizer, options, scoring, output, on_item,
                      exact_prefix, tokenizer_hash(tokenizer), recompute)
    result = _result_header(run)
    _run_benchmarks(run, result)
    if "perplexity" in options.tasks:
        result["perplexity"] = _run_perplexity(run, documents)
    if "coqa" in options.tasks:
        result["coqa"] = _run_coqa(run, reverse_mapper)
    _write_result(result, output)
    return result


def _result_header(run: _Evaluation) -> dict:
    options, scoring, output = run.options, run.scoring, run.output
    return {
        "format": RESULT_FORMAT,
        "direction": {"source": output.source_name or display_name(run.source_model, "source"),
                      "target": output.target_name or display_name(run.target_model, "target")},
        "source": model_fingerprint(run.source_model),
        "target": model_fingerprint(run.target_model),
        "mapper": mapper_identity(run.mapper),
        "tokenizer": run.tok_id,
        "exact_prefix": run.exact_prefix,
        "recompute": run.recompute.spec,
        "mapped": options.mapped,
        "seed": options.seed,
        "limit": options.limit,
        "bootstrap": {"n_resamples": scoring.n_resamples, "confidence": scoring.confidence, "paired": True},
        "tasks": {},
    }


def _run_benchmarks(run: _Evaluation, result: dict) -> None:
    """Each benchmark task's records and summary into result["tasks"] (and the group means into "summary")."""
    options, scoring = run.options, run.scoring
    for name in options.benchmark_tasks():
        spec = get_task(name)
        items = select_items(name, options.limit, options.seed, "report")
        if options.mapped == "history" and not all(getattr(item, "shared_prefix", None) for item in items):
            result.setdefault("skipped", {})[name] = "no few-shot history: the whole context is the new turn"
            continue
        runs = benchmark_runs(run.source_model, run.target_model, run.mapper, run.tokenizer, spec,
                              scoring.max_new_tokens, tok_id=run.tok_id, exact_prefix=run.exact_prefix,
                              mapped=options.mapped, recompute=run.recompute)
        records = run_records(name, items, runs, run.output.store_dir, run.output.progress, run.on_item)
        summary = task_summary(spec, items, records, scoring.n_resamples, options.seed, scoring.confidence)
        result["tasks"][name] = {**summary, "item_ids": [item.id for item in items]}
    result["summary"] = _group_means(list(result["tasks"].values()))


def _write_result(result: dict, output: OutputOptions) -> None:
    if output.out_dir is None:
        return
    path = output.out_dir / f"{output.result_name}.json"
    atomic_write_json(path, result)
    if output.render:
        render_results([path], output.out_dir, stem=output.result_name)


def _group_means(tasks: Sequence[dict]) -> dict:
    """Mean retention and floor-normalised retention over the core, held-out and all tasks (groups present)."""
    out = {}
    for group in ("core", "heldout", "all"):
        members = [t for t in tasks if t.get("retention") and (group == "all" or t["group"] == group)]
        if members:
            out[group] = {
                "tasks": [t["display"] for t in members],
                "mean_retention": mean([t["retention"]["value"] for t in members]),
                "mean_floor_normalised_retention": mean([t["floor_normalised_retention"]["value"] for t in members]),
            }
    return out


def _run_perplexity(run: _Evaluation, documents) -> dict:
    scoring = run.scoring
    prefix_len, continuation_len = scoring.prefix_len, scoring.continuation_len
    if documents is None:
        documents = heldout_documents(run.tokenizer, scoring.perplexity_docs, min_tokens=prefix_len + continuation_len)
    docs = usable_documents(documents, prefix_len, continuation_len)[: scoring.perplexity_docs]
    if not docs:
        raise ConfigError(f"no held-out document has the {prefix_len + continuation_len} tokens needed")
    conds = standard_conditions(run.source_model, run.target_model, run.mapper, run.exact_prefix,
                                recompute=run.recompute)
    settings = {"record_version": RECORD_VERSION, "task": "perplexity", "prefix_len": prefix_len,
                "continuation_len": continuation_len}

    def compute_for(cond):
        return lambda ids: perplexity_record(cond, ids, prefix_len, continuation_len)

    runs = [
        _standalone_run("target", run.target_model, run.tok_id, settings, compute_for(conds["target"])),
        _standalone_run("source", run.source_model, run.tok_id, settings, compute_for(conds["source"])),
        _transfer_run("transfer", run.source_model, run.target_model, run.mapper, run.tok_id,
                      {**settings, "exact_prefix": run.exact_prefix, **recompute_setting(run.recompute)},
                      compute_for(conds["transfer"])),
    ]
    records = run_records("perplexity", docs, runs, run.output.store_dir, run.output.progress, run.on_item,
                          item_id=document_id)
    ids = [document_id(d) for d in docs]
    summary = summarise_perplexity({name: [recs[i] for i in ids] for name, recs in records.items()})
    return {**summary, "prefix_len": prefix_len, "continuation_len": continuation_len, "document_ids": ids}


def _coqa_compute(schedule, handover, models, mappers, tokenizer, max_new_tokens, exact_prefix,
                  recompute: RecomputePolicy = NoRecompute()):  # noqa: B008 - frozen
    return lambda conv: run_conversation(conv, schedule, models, mappers, tokenizer, max_new_tokens, exact_prefix,
                                         handover, recompute)


def _run_coqa(run: _Evaluation, reverse_mapper) -> dict:
    scoring, seed = run.scoring, run.options.seed
    conversations = load_coqa_conversations(min_turns=scoring.coqa_turns, num_turns=scoring.coqa_turns)
    conversations = [c for c in conversations if pool_of("coqa", c.id) == "report"]
    random.Random(f"{seed}/coqa/report").shuffle(conversations)
    conversations = conversations[: scoring.coqa_conversations]
    names = ("source", "target")
    models = {"source": run.source_model, "target": run.target_model}
    mappers = {("source", "target"): run.mapper, ("target", "source"): reverse_mapper}
    settings = {"record_version": RECORD_VERSION, "task": "coqa", "max_new_tokens": scoring.coqa_max_new_tokens,
                "num_turns": scoring.coqa_turns}
    common = (models, mappers, run.tokenizer, scoring.coqa_max_new_tokens, run.exact_prefix, run.recompute)
    runs = []
    for name, (schedule, handover) in run_variants(scoring.coqa_turns, names).items():
        compute = _coqa_compute(schedule, handover, *common)
        if name.startswith("standalone_"):
            model = models[name.removeprefix("standalone_")]
            runs.append(_standalone_run(name, model, run.tok_id, settings, compute))
            continue
        header = {
            "condition": "switch", "schedule": schedule, "source": model_fingerprint(run.source_model),
            "target": model_fingerprint(run.target_model), "mapper": mapper_identity(run.mapper),
            "reverse_mapper": mapper_identity(reverse_mapper), "tokenizer": run.tok_id,
            "exact_prefix": run.exact_prefix, "handover": handover, **settings, **recompute_setting(run.recompute),
        }
        runs.append(RecordRun(name, f"{name}-{sha256_json(header, 16)}", header, compute))
    records = run_records("coqa", conversations, runs, run.output.store_dir, run.output.progress, run.on_item)
    return {**summarise_multiturn(conversations, records, names),
            "conversation_ids": [c.id for c in conversations]}
