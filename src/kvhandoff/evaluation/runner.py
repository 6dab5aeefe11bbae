"""The evaluation runner: item selection, resumable per-item result files, summaries.

On-disk layout under ``out_dir``::

    items/<task>/<key>.jsonl     append-only per-item records of one condition (first line: a header)
    <name>.json / .md / .png     the summary, its Markdown table and the retention chart

``<key>`` hashes everything a record depends on (model identities, the mapper's manifest, the tokenizer,
the task settings), so the forward and reverse directions share the standalone runs of the same model, a
changed mapper never reuses stale transfer records, and an interrupted run resumes where it stopped: each
record is appended and flushed as soon as it is computed, and a torn last line from a crash is skipped.
Summaries are written to a temporary file and renamed over the old one.

Item selection: each task's items are split once into a *dev* pool (≈1 in 5, by a hash of the item id,
independent of the seed) used only by the k sweep and a *report* pool; ``limit`` items are drawn from a
pool by a seeded shuffle, so the same seed gives the same items and a larger limit extends a smaller one.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvhandoff.errors import ConfigError
from kvhandoff.evaluation.metrics import mean, summarise_conditions
from kvhandoff.evaluation.tasks import (
    CORE_TASKS,
    GENERATE,
    HELDOUT_TASKS,
    POOLS,
    Item,
    TaskSpec,
    get_task,
    item_metrics,
    load_items,
    parse_tasks,
    pool_of,
)
from kvhandoff.files import atomic_write_json

RECORD_VERSION = 1
RESULT_FORMAT = "kvhandoff-eval/1"
EXTRA_TASKS = ("perplexity", "coqa")


# -- identities and keys --------------------------------------------------------------------------------------


def _hash(obj: Any, n: int = 16) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:n]


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-").lower()[:60] or "model"


def model_identity(model) -> dict:
    """What a model's outputs depend on: name, class, dtype, parameter count and a sample of weight values."""
    import torch

    name = str(getattr(model, "name_or_path", "") or getattr(getattr(model, "config", None), "_name_or_path", ""))
    total, checksum = 0, 0.0
    with torch.no_grad():
        for p in model.parameters():
            total += p.numel()
            flat = p.detach().reshape(-1)
            checksum += float(flat[:: max(1, flat.numel() // 997)].double().sum())
    return {
        "name": name,
        "class": type(model).__name__,
        "dtype": str(getattr(model, "dtype", "")),
        "parameters": total,
        "checksum": f"{checksum:.9e}",
    }


_VOLATILE_KEYS = ("seconds", "created", "timestamp", "time")


def _stable(obj: Any) -> Any:
    """``obj`` without timing entries (a mapper rebuilt from the same statistics must hash the same)."""
    if isinstance(obj, Mapping):
        return {k: _stable(v) for k, v in obj.items() if not any(w in str(k).lower() for w in _VOLATILE_KEYS)}
    if isinstance(obj, list | tuple):
        return [_stable(v) for v in obj]
    return obj


def mapper_identity(mapper) -> dict:
    """A mapper's identity: its manifest (hashed, timings left out) when it has one; otherwise (stand-in
    mappers in tests) its class and public scalar attributes."""
    manifest = getattr(mapper, "manifest", None)
    if isinstance(manifest, Mapping):
        return {"manifest_sha": _hash(_stable(manifest), 32), "top_k": (manifest.get("config") or {}).get("top_k")}
    attributes = {
        k: v for k, v in sorted(vars(mapper).items()) if not k.startswith("_") and isinstance(v, int | float | str)
    } if hasattr(mapper, "__dict__") else {}
    return {"class": f"{type(mapper).__module__}.{type(mapper).__qualname__}", "attributes": attributes}


_TOKENIZER_PROBE = "The quick brown fox, 12,345 times: \"naïve\" café!\n\nQ: why?\nA: because"


def tokenizer_identity(tokenizer) -> str:
    """Hash of how the tokenizer encodes a probe text (special tokens included)."""
    return _hash({"probe": list(tokenizer.encode(_TOKENIZER_PROBE, add_special_tokens=True))})


def display_name(model, fallback: str) -> str:
    name = model_identity(model)["name"]
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
    progress: bool = False,
    on_item: ItemHook | None = None,
    item_id: Callable[[Any], str] = lambda item: item.id,
) -> dict[str, dict[str, dict]]:
    """Records of every (item, run), computing only those not stored yet; item by item, all runs per item.
    Items sharing a few-shot prefix (``shared_prefix``) are computed one after another, so that the conditions'
    bounded prefix caches keep hitting (MMLU's 57 subjects come shuffled); the records do not depend on it.

    on_item(task, run name, record) is called after each newly computed record has been stored.
    """
    from tqdm.auto import tqdm

    stores = {
        run.name: ItemStore(None if store_dir is None else store_dir / task / f"{run.key}.jsonl", run.header)
        for run in runs
    }
    ids = [item_id(item) for item in items]
    done = sum(i in stores[run.name] for i in ids for run in runs)
    bar = tqdm(total=len(ids) * len(runs), initial=done, desc=task, disable=not progress, leave=False,
               dynamic_ncols=True)
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


def _standalone_run(name: str, model, tok_id: str, settings: dict, compute) -> RecordRun:
    ident = model_identity(model)
    header = {"condition": "standalone", "model": ident, "tokenizer": tok_id, **settings}
    return RecordRun(name, f"model-{slug(display_name(model, 'model'))}-{_hash(header)}", header, compute)


def _transfer_run(name: str, source, target, mapper, tok_id: str, settings: dict, compute) -> RecordRun:
    header = {
        "condition": "transfer",
        "source": model_identity(source),
        "target": model_identity(target),
        "mapper": mapper_identity(mapper),
        "tokenizer": tok_id,
        **settings,
    }
    key = f"transfer-{slug(display_name(source, 'source'))}-to-{slug(display_name(target, 'target'))}"
    return RecordRun(name, f"{key}-{_hash(header)}", header, compute)


def benchmark_runs(
    source_model, target_model, mapper, tokenizer, spec: TaskSpec, max_new_tokens: int = 256,
    conditions: Sequence[str] = ("target", "source", "transfer"), tok_id: str | None = None,
    exact_prefix: int = 0, mapped: str = "all",
) -> list[RecordRun]:
    """The record runs (target, source, transfer) of one benchmark task (mapped: see `standard_conditions`)."""
    from kvhandoff.evaluation.scoring import evaluate_item, standard_conditions

    tok_id = tok_id or tokenizer_identity(tokenizer)
    conds = standard_conditions(source_model, target_model, mapper, exact_prefix, mapped)
    # "all" stays out of the record header, so records made before `mapped` existed stay valid
    transfer_settings = {"exact_prefix": exact_prefix, **({} if mapped == "all" else {"mapped": mapped})}
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
                                      {**settings, **transfer_settings}, compute_for(cond)))
        else:
            model = target_model if name == "target" else source_model
            runs.append(_standalone_run(name, model, tok_id, settings, compute_for(cond)))
    return runs


def run_eval(
    source_model,
    target_model,
    mapper,
    tasks: str | Sequence[str] = "core",
    limit: int | None = 100,
    seed: int = 0,
    out_dir: str | Path | None = None,
    *,
    tokenizer,
    reverse_mapper=None,
    exact_prefix: int | None = None,
    mapped: str = "all",
    max_new_tokens: int = 256,
    n_resamples: int = 1000,
    confidence: float = 0.95,
    documents: Sequence[Any] | None = None,
    perplexity_docs: int = 16,
    prefix_len: int = 1024,
    continuation_len: int = 1024,
    coqa_conversations: int = 20,
    coqa_turns: int = 10,
    coqa_max_new_tokens: int = 50,
    source_name: str | None = None,
    target_name: str | None = None,
    result_name: str = "results",
    progress: bool = True,
    on_item: ItemHook | None = None,
    render: bool = True,
) -> dict:
    """Evaluate target / source / transfer on ``tasks`` and write ``<out_dir>/<result_name>.{json,md,png}``.

    tasks: names or groups ("core", "heldout", "all"), plus "perplexity" (conditional perplexity on
    ``documents`` or, when None, ``kvhandoff.corpus.heldout_documents``) and "coqa" (multi-turn switching;
    needs ``reverse_mapper``, target → source). limit: items per task from the report pool (None = all).
    exact_prefix: leading positions the target recomputes after every handoff (0 = purely mapped cache;
    None = the mapper's own setting).
    mapped: what the transfer condition maps on benchmark tasks: "all" (the whole context) or "history" (the
    few-shot history; the target prefills the question itself). Tasks without a few-shot history are skipped
    under "history" and listed in the result's "skipped". Perplexity and CoQA are unaffected: they already map
    what came before and let the target read the new tokens.
    on_item(task, condition, record) runs after each newly computed record is stored (progress hooks, tests).
    Returns the result dictionary (also written as JSON when ``out_dir`` is given).
    """
    from kvhandoff.evaluation.scoring import check_mapped

    names = parse_tasks(tasks, extra=EXTRA_TASKS)
    check_mapped(mapped)
    if exact_prefix is None:  # the mapper's own setting, recorded explicitly in the results
        exact_prefix = getattr(mapper, "exact_prefix", 0)
    if "coqa" in names and reverse_mapper is None:
        raise ConfigError("the 'coqa' multi-turn task needs the reverse mapper (target → source) as well")
    out_path = None if out_dir is None else Path(out_dir)
    store_dir = None if out_path is None else out_path / "items"
    tok_id = tokenizer_identity(tokenizer)
    src_display = source_name or display_name(source_model, "source")
    tgt_display = target_name or display_name(target_model, "target")
    result: dict[str, Any] = {
        "format": RESULT_FORMAT,
        "direction": {"source": src_display, "target": tgt_display},
        "source": model_identity(source_model),
        "target": model_identity(target_model),
        "mapper": mapper_identity(mapper),
        "tokenizer": tok_id,
        "exact_prefix": exact_prefix,
        "mapped": mapped,
        "seed": seed,
        "limit": limit,
        "bootstrap": {"n_resamples": n_resamples, "confidence": confidence, "paired": True},
        "tasks": {},
    }
    for name in names:
        if name in EXTRA_TASKS:
            continue
        spec = get_task(name)
        items = select_items(name, limit, seed, "report")
        if mapped == "history" and not all(getattr(item, "shared_prefix", None) for item in items):
            result.setdefault("skipped", {})[name] = "no few-shot history: the whole context is the new turn"
            continue
        runs = benchmark_runs(source_model, target_model, mapper, tokenizer, spec, max_new_tokens, tok_id=tok_id,
                              exact_prefix=exact_prefix, mapped=mapped)
        records = run_records(name, items, runs, store_dir, progress, on_item)
        result["tasks"][name] = {**task_summary(spec, items, records, n_resamples, seed, confidence),
                                 "item_ids": [item.id for item in items]}
    result["summary"] = _group_means(list(result["tasks"].values()))
    if "perplexity" in names:
        result["perplexity"] = _run_perplexity(
            source_model, target_model, mapper, tokenizer, documents, perplexity_docs, prefix_len,
            continuation_len, store_dir, progress, on_item, tok_id, exact_prefix,
        )
    if "coqa" in names:
        result["coqa"] = _run_coqa(
            source_model, target_model, mapper, reverse_mapper, tokenizer, coqa_conversations, coqa_turns,
            coqa_max_new_tokens, seed, store_dir, progress, on_item, tok_id, exact_prefix,
        )
    if out_path is not None:
        atomic_write_json(out_path / f"{result_name}.json", result)
        if render:
            from kvhandoff.evaluation.report import render_results

            render_results([out_path / f"{result_name}.json"], out_path, stem=result_name)
    return result


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


def _run_perplexity(source_model, target_model, mapper, tokenizer, documents, num_docs, prefix_len,
                    continuation_len, store_dir, progress, on_item, tok_id, exact_prefix) -> dict:
    from kvhandoff.evaluation.perplexity import (
        document_id,
        perplexity_record,
        summarise_perplexity,
        usable_documents,
    )
    from kvhandoff.evaluation.scoring import standard_conditions

    if documents is None:
        from kvhandoff.corpus import heldout_documents

        documents = heldout_documents(tokenizer, num_docs, min_tokens=prefix_len + continuation_len)
    docs = usable_documents(documents, prefix_len, continuation_len)[:num_docs]
    if not docs:
        raise ConfigError(f"no held-out document has the {prefix_len + continuation_len} tokens needed")
    conds = standard_conditions(source_model, target_model, mapper, exact_prefix)
    settings = {"record_version": RECORD_VERSION, "task": "perplexity", "prefix_len": prefix_len,
                "continuation_len": continuation_len}

    def compute_for(cond):
        return lambda ids: perplexity_record(cond, ids, prefix_len, continuation_len)

    runs = [
        _standalone_run("target", target_model, tok_id, settings, compute_for(conds["target"])),
        _standalone_run("source", source_model, tok_id, settings, compute_for(conds["source"])),
        _transfer_run("transfer", source_model, target_model, mapper, tok_id,
                      {**settings, "exact_prefix": exact_prefix}, compute_for(conds["transfer"])),
    ]
    records = run_records("perplexity", docs, runs, store_dir, progress, on_item, item_id=document_id)
    ids = [document_id(d) for d in docs]
    summary = summarise_perplexity({name: [recs[i] for i in ids] for name, recs in records.items()})
    return {**summary, "prefix_len": prefix_len, "continuation_len": continuation_len, "document_ids": ids}


def _coqa_compute(schedule, handover, models, mappers, tokenizer, max_new_tokens, exact_prefix):
    from kvhandoff.evaluation.multiturn import run_conversation

    return lambda conv: run_conversation(conv, schedule, models, mappers, tokenizer, max_new_tokens, exact_prefix,
                                         handover)


def _run_coqa(source_model, target_model, mapper, reverse_mapper, tokenizer, num_conversations, num_turns,
              max_new_tokens, seed, store_dir, progress, on_item, tok_id, exact_prefix) -> dict:
    from kvhandoff.evaluation.multiturn import load_coqa_conversations, run_variants, summarise_multiturn

    conversations = load_coqa_conversations(min_turns=num_turns, num_turns=num_turns)
    conversations = [c for c in conversations if pool_of("coqa", c.id) == "report"]
    random.Random(f"{seed}/coqa/report").shuffle(conversations)
    conversations = conversations[:num_conversations]
    names = ("source", "target")
    models = {"source": source_model, "target": target_model}
    mappers = {("source", "target"): mapper, ("target", "source"): reverse_mapper}
    settings = {"record_version": RECORD_VERSION, "task": "coqa", "max_new_tokens": max_new_tokens,
                "num_turns": num_turns}
    common = (models, mappers, tokenizer, max_new_tokens, exact_prefix)
    runs = []
    for name, (schedule, handover) in run_variants(num_turns, names).items():
        compute = _coqa_compute(schedule, handover, *common)
        if name.startswith("standalone_"):
            runs.append(_standalone_run(name, models[name.removeprefix("standalone_")], tok_id, settings, compute))
            continue
        header = {
            "condition": "switch", "schedule": schedule, "source": model_identity(source_model),
            "target": model_identity(target_model), "mapper": mapper_identity(mapper),
            "reverse_mapper": mapper_identity(reverse_mapper), "tokenizer": tok_id,
            "exact_prefix": exact_prefix, **settings,
            # "all" stays out of the header, so records made before handovers existed stay valid
            **({} if handover == "all" else {"handover": handover}),
        }
        runs.append(RecordRun(name, f"{name}-{_hash(header)}", header, compute))
    records = run_records("coqa", conversations, runs, store_dir, progress, on_item)
    return {**summarise_multiturn(conversations, records, names),
            "conversation_ids": [c.id for c in conversations]}
