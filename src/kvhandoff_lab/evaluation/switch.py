"""The switch benchmark: every item is a real model switch on a long history.

An item's context is a *history* (≥ ``min_tokens`` tokens of solved exemplars of the task, drawn from the other
item pool than the one evaluated, so no evaluated item is its own exemplar) followed by the *new turn* (the item's
question and a choice). Each task has a few histories (`build_histories`), each shared by an equal share of the
items (item i uses history i mod H), so a result does not hinge on one history.

Conditions (`switch_conditions`), each reading the same history cache for all the items that share it:

- ``target`` / ``source``: the model prefills the history (once per history) and reads the new turn.
- ``switch``: the source prefills the history (the same cache as ``source``), the mapper maps it and the recompute
  policy patches it (once per history and policy); the target reads the new turn. Several policies can be
  evaluated side by side (``switch:<policy>``).
- ``all_mapped``: the paper's condition: the source reads the new turn up to its last shared token too, the whole
  cache is mapped (no recompute), the target reads on from there.

Scoring (`score_turns`): the choices' turns share their leading tokens (the question); those are read once on the
history cache, and the rest of every choice is read in one right-padded batched forward over the question's cache
(causal attention: padding after a row's tokens never reaches them). The history cache is restored afterwards.

Time to first token (`time_to_first_token`): on a history and a question, the target's re-prefill of both against
the switch (mapping + exact prefix + recompute + the target's prefill of the question), interleaved, median of
the repeats; the source's prefill of the history is not counted (at a switch the source already holds it).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvhandoff.errors import ConfigError
from kvhandoff.files import sha256_json
from kvhandoff.model.cache import cache_of, kl_divergence, model_device, prefill, rollback
from kvhandoff.model.geometry import model_fingerprint
from kvhandoff.runtime import policy as recompute_policies
from kvhandoff.runtime.handoff import handoff_cache
from kvhandoff.runtime.plan import HandoffPlan
from kvhandoff.runtime.policy import NoRecompute, RecomputePolicy
from kvhandoff.runtime.seam import as_kv_cache
from kvhandoff_lab.evaluation.metrics import mean, paired_bootstrap, summarise_conditions
from kvhandoff_lab.evaluation.runner import (
    RECORD_VERSION,
    ItemStore,
    RecordRun,
    display_name,
    mapper_identity,
    run_records,
    select_items,
    slug,
)
from kvhandoff_lab.evaluation.tasks import (
    CORE_TASKS,
    HELDOUT_TASKS,
    LOGLIKELIHOOD,
    MCItem,
    encode,
    get_task,
    mc_choice_scores,
    mc_item_metrics,
    parse_tasks,
)

#: history length of the benchmark (tokens) and histories per task
DEFAULT_HISTORY_TOKENS = 1024
DEFAULT_HISTORIES = 4
#: what opens a history, per task (the rest is exemplars)
HISTORY_HEADERS = {"mmlu": "The following are multiple choice questions (with answers).\n\n"}
EXEMPLAR_SEPARATOR = "\n\n"
OTHER_POOL = {"dev": "report", "report": "dev"}


# -- histories and items -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class History:
    """A shared history: its key (``<task>-h<index>``), token ids and the items whose solutions it holds."""

    key: str
    ids: tuple[int, ...]
    exemplars: tuple[str, ...]


@dataclass(frozen=True)
class SwitchItem:
    """A multiple-choice item as a new turn after a history: per choice, the turn's token ids (context +
    continuation) and how many of its last tokens are the scored continuation."""

    id: str
    history: History
    turns: tuple[tuple[int, ...], ...]
    continuation_lengths: tuple[int, ...]
    norm_lengths: tuple[int, ...]
    gold: int

    @property
    def shared_prefix(self) -> str:
        """Items of one history are run one after another (`runner.prefix_grouped_order`)."""
        return self.history.key

    @property
    def chance(self) -> float:
        return 1.0 / len(self.turns)

    @property
    def question(self) -> tuple[int, ...]:
        """The turn tokens every choice shares and reads before its own (`shared_length`)."""
        return self.turns[0][: shared_length(self.turns, self.continuation_lengths)]


def turn_text(item: MCItem, choice: int) -> str:
    """The context of ``choice`` after the item's own few-shot prefix (the new turn's context)."""
    return item.choices[choice].context[len(item.shared_prefix or "") :]


def exemplar_text(item: MCItem) -> str:
    """The item solved: its new-turn context and the gold continuation, then a blank line."""
    return turn_text(item, item.gold) + item.choices[item.gold].continuation + EXEMPLAR_SEPARATOR


def _check_task(task: str) -> None:
    if get_task(task).kind != LOGLIKELIHOOD:
        raise ConfigError(f"the switch benchmark scores multiple-choice tasks; {task!r} generates")


def build_histories(task: str, tokenizer, count: int = DEFAULT_HISTORIES, min_tokens: int = DEFAULT_HISTORY_TOKENS,
                    pool: str = "dev", seed: int = 0) -> list[History]:
    """``count`` histories of at least ``min_tokens`` tokens each: the task's header and solved exemplars of the
    pool other than ``pool`` (the one evaluated), each history in its own seeded order (a small pool's histories
    may share exemplars; no two are the same)."""
    _check_task(task)
    if count < 1 or min_tokens < 1:
        raise ConfigError(f"need count >= 1 and min_tokens >= 1, got {count} and {min_tokens}")
    candidates = select_items(task, None, seed, OTHER_POOL[pool])
    header = HISTORY_HEADERS.get(task, "")
    histories = []
    for index in range(count):
        order = list(candidates)
        random.Random(f"{seed}/{task}/history-{index}").shuffle(order)
        text, used = header, []
        ids = encode(tokenizer, text)
        for item in order:
            if len(ids) >= min_tokens:
                break
            text += exemplar_text(item)
            used.append(item.id)
            ids = encode(tokenizer, text)
        if len(ids) < min_tokens:
            raise ConfigError(f"{task}: the {OTHER_POOL[pool]} pool's exemplars make {len(ids)} tokens, fewer than "
                              f"the {min_tokens} of a history")
        histories.append(History(f"{task}-h{index}", tuple(ids), tuple(used)))
    return histories


def turn_tokens(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a new turn (trailing context spaces move to the continuation), without special tokens."""
    spaces = len(context) - len(context.rstrip(" "))
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    context_ids = encode(tokenizer, context, add_special_tokens=False)
    whole = encode(tokenizer, context + continuation, add_special_tokens=False)
    return context_ids, whole[len(context_ids) :]


def switch_item(item: MCItem, history: History, tokenizer) -> SwitchItem:
    turns, lengths = [], []
    for index, choice in enumerate(item.choices):
        context, continuation = turn_tokens(tokenizer, turn_text(item, index), choice.continuation)
        if not context or not continuation:
            raise ConfigError(f"item {item.id!r}: choice {index} has an empty context or continuation")
        turns.append(tuple(context + continuation))
        lengths.append(len(continuation))
    return SwitchItem(item.id, history, tuple(turns), tuple(lengths),
                      tuple(c.norm_length for c in item.choices), item.gold)


def switch_items(task: str, tokenizer, histories: Sequence[History], limit: int | None, seed: int = 0,
                 pool: str = "dev") -> list[SwitchItem]:
    """``limit`` items of the pool (`runner.select_items`), item i on history i mod len(histories)."""
    _check_task(task)
    chosen = select_items(task, limit, seed, pool)
    return [switch_item(item, histories[i % len(histories)], tokenizer) for i, item in enumerate(chosen)]


# -- scoring -----------------------------------------------------------------------------------------------------


def shared_length(turns: Sequence[Sequence[int]], continuation_lengths: Sequence[int]) -> int:
    """How many leading tokens every turn shares, up to the shortest context (so every scored token comes after
    them); at least 1."""
    shortest = min(len(t) - n for t, n in zip(turns, continuation_lengths, strict=True))
    length = 0
    while length < shortest and all(t[length] == turns[0][length] for t in turns):
        length += 1
    if length == 0:
        raise ConfigError("the choices' turns share no leading token; the switch benchmark needs a shared question")
    return length


def batch_view(cache, batch: int):
    """``cache`` (batch 1) seen as ``batch`` rows (expanded views, no copy; forwards on it leave it unchanged)."""
    return cache_of((layer.keys.expand(batch, -1, -1, -1), layer.values.expand(batch, -1, -1, -1))
                    for layer in cache.layers)


@torch.inference_mode()
def score_turns(reader, cache, turns: Sequence[Sequence[int]], continuation_lengths: Sequence[int]) -> list[float]:
    """Summed log-probs of each turn's last ``continuation_lengths`` tokens, reading on from ``cache``: the shared
    question once, the rest of all turns in one batched forward (right-padded); ``cache`` is restored."""
    # every condition's cache alike, as the reader's own transformers cache (a handoff's is its `KVCache.native`):
    # the batched read over expanded views of it (`batch_view`) is a transformers-level measurement the seam has no
    # method for
    length = cache.get_seq_length()
    shared = shared_length(turns, continuation_lengths)
    device = model_device(reader)
    try:
        _, last = prefill(reader, torch.tensor([list(turns[0][:shared])], device=device), cache)
        first = last[0].float().log_softmax(-1)  # predicts token `shared` of every turn
        rests = [list(t[shared:-1]) for t in turns]
        width = max(len(r) for r in rests)
        later = None
        if width:
            ids = torch.tensor([r + [0] * (width - len(r)) for r in rests], device=device)
            later = reader(input_ids=ids, cache=batch_view(cache, len(turns)), use_cache=True).logits
            later = later.float().log_softmax(-1)
    finally:
        rollback(cache, length)
    scores = []
    for row, (turn, count) in enumerate(zip(turns, continuation_lengths, strict=True)):
        total = 0.0
        for j in range(len(turn) - count, len(turn)):  # token j is predicted at turn position j − 1
            logprobs = first if j == shared else later[row, j - 1 - shared]
            total += float(logprobs[turn[j]])
        scores.append(total)
    return scores


def item_record(item: SwitchItem, scores: Sequence[float]) -> dict:
    return {"id": item.id, "history": item.history.key, "loglikelihoods": list(scores),
            "norm_lengths": list(item.norm_lengths), "gold": item.gold}


# -- conditions --------------------------------------------------------------------------------------------------


class HistoryPrefills:
    """Each model's cache of the current history (the last ``entries`` histories per model are kept): the target
    and source conditions read on from it, the switch conditions map the source's."""

    def __init__(self, entries: int = 1) -> None:
        self.entries = entries
        self._caches: dict[tuple[int, str], Any] = {}
        self.prefills = 0

    def of(self, model, history: History):
        key = (id(model), history.key)
        if key not in self._caches:
            self.prefills += 1
            own = [k for k in self._caches if k[0] == id(model)]
            for old in own[: max(0, len(own) - self.entries + 1)]:
                del self._caches[old]
            ids = torch.tensor([list(history.ids)], device=model_device(model))
            self._caches[key] = prefill(model, ids)[0]
        return self._caches[key]


class SwitchCondition:
    """Scores an item: a history cache (``history_cache``) and the reader that reads the new turn on it."""

    name: str
    reader: Any

    def history_cache(self, history: History):
        raise NotImplementedError

    def score(self, item: SwitchItem) -> list[float]:
        return score_turns(self.reader, self.history_cache(item.history), item.turns, item.continuation_lengths)


class AloneOnHistory(SwitchCondition):
    """A model prefills the history itself and reads the new turn."""

    def __init__(self, name: str, model, prefills: HistoryPrefills) -> None:
        self.name, self.reader, self.prefills = name, model, prefills

    def history_cache(self, history: History):
        return self.prefills.of(self.reader, history)


class SwitchOnHistory(SwitchCondition):
    """The source's history cache, mapped and patched (exact prefix, recompute policy) once per history; the
    target reads the new turn."""

    def __init__(self, name: str, source, target, mapper, prefills: HistoryPrefills, exact_prefix: int | None = None,
                 recompute: RecomputePolicy = NoRecompute()) -> None:  # noqa: B008 - frozen
        self.name, self.source, self.reader, self.mapper, self.prefills = name, source, target, mapper, prefills
        self.plan = HandoffPlan(exact_prefix, recompute)
        self.exact_prefix, self.recompute = exact_prefix, recompute
        self._mapped: tuple[str, Any] | None = None

    def history_cache(self, history: History):
        if self._mapped is None or self._mapped[0] != history.key:
            self._mapped = (history.key, self.switch(history))
        return self._mapped[1]

    def switch(self, history: History, source_cache=None):
        """The target's cache of the history from the source's (the switch itself)."""
        source_cache = self.prefills.of(self.source, history) if source_cache is None else source_cache
        ids = torch.tensor([list(history.ids)])
        return handoff_cache(self.source, self.reader, self.mapper, ids, self.plan, source_cache)


class AllMapped(SwitchCondition):
    """The paper's condition: the source also reads the question up to its last token; the whole cache is mapped
    (no recompute) and the target reads on from the question's last token."""

    def __init__(self, name: str, source, target, mapper, prefills: HistoryPrefills,
                 exact_prefix: int | None = None) -> None:
        self.name, self.source, self.reader, self.mapper, self.prefills = name, source, target, mapper, prefills
        self.exact_prefix = exact_prefix
        self.plan = HandoffPlan(exact_prefix, NoRecompute())

    @torch.inference_mode()
    def score(self, item: SwitchItem) -> list[float]:
        history = as_kv_cache(self.prefills.of(self.source, item.history))
        # the history's rows as views: the source's question tokens extend them into new tensors, the shared history
        # cache stays as it is
        source = as_kv_cache(history.export())
        read = len(item.question) - 1  # the source reads these; the target reads on from the last shared token
        if read:
            source.read(self.source, torch.tensor([list(item.question[:read])]))
        ids = torch.tensor([list(item.history.ids) + list(item.question[:read])])
        mapped = handoff_cache(self.source, self.reader, self.mapper, ids, self.plan, source)
        turns = [t[read:] for t in item.turns]
        return score_turns(self.reader, mapped, turns, item.continuation_lengths)


def switch_name(policy: RecomputePolicy) -> str:
    """The switch condition's name under a recompute policy: "switch" (none) or "switch:<spec>"."""
    spec = policy.spec
    return "switch" if spec == "none" else f"switch:{spec}"


def switch_conditions(source, target, mapper, policies: Sequence[RecomputePolicy] = (NoRecompute(),),
                      exact_prefix: int | None = None,
                      all_mapped: bool = True, prefills: HistoryPrefills | None = None) -> dict[str, SwitchCondition]:
    """target, source, one switch per recompute policy and (all_mapped) the paper's condition, sharing one
    `HistoryPrefills` (``prefills``: one shared with other directions, whose prefills of a model it reuses)."""
    prefills = HistoryPrefills() if prefills is None else prefills
    conditions: dict[str, SwitchCondition] = {
        "target": AloneOnHistory("target", target, prefills),
        "source": AloneOnHistory("source", source, prefills),
    }
    for policy in policies:
        name = switch_name(policy)
        conditions[name] = SwitchOnHistory(name, source, target, mapper, prefills, exact_prefix, policy)
    if all_mapped:
        conditions["all_mapped"] = AllMapped("all_mapped", source, target, mapper, prefills, exact_prefix)
    return conditions


# -- record runs -------------------------------------------------------------------------------------------------


def histories_identity(histories: Sequence[History]) -> str:
    return sha256_json([[h.key, list(h.ids)] for h in histories], 16)


def switch_runs(conditions: Mapping[str, SwitchCondition], source, target, mapper, tok_id: str, task: str,
                histories: Sequence[History], exact_prefix: int | None) -> list[RecordRun]:
    """One `runner.RecordRun` per condition; its key hashes the models, the histories and the condition's settings
    (standalone runs are shared by both directions and every policy)."""
    base = {"record_version": RECORD_VERSION, "benchmark": "switch", "task": task, "tokenizer": tok_id,
            "histories": histories_identity(histories)}
    runs = []
    for name, condition in conditions.items():
        if name in ("target", "source"):
            model = condition.reader
            header = {**base, "condition": "standalone", "model": model_fingerprint(model)}
            key = f"model-{slug(display_name(model, 'model'))}"
        else:
            header = {**base, "condition": name.split(":")[0], "source": model_fingerprint(source),
                      "target": model_fingerprint(target), "mapper": mapper_identity(mapper),
                      "exact_prefix": exact_prefix,
                      "recompute": getattr(getattr(condition, "recompute", None), "spec", "none")}
            key = f"{slug(name)}-{slug(display_name(source, 'source'))}-to-{slug(display_name(target, 'target'))}"
        runs.append(RecordRun(name, f"{key}-{sha256_json(header, 16)}", header, _compute(condition)))
    return runs


def _compute(condition: SwitchCondition) -> Callable[[SwitchItem], dict]:
    return lambda item: item_record(item, condition.score(item))


# -- summaries ---------------------------------------------------------------------------------------------------


def accuracy_per_item(spec_name: str, records: Mapping[str, dict], ids: Sequence[str]) -> list[float]:
    metric = get_task(spec_name).primary_metric
    return [mc_item_metrics(records[i])[metric] for i in ids]


def agreement_with_target(task: str, target: Mapping[str, dict], transfer: Mapping[str, dict], ids: Sequence[str],
                          n_resamples: int = 1000, seed: int = 0) -> dict:
    """How closely a transfer condition follows the target alone, item by item: the share of items where it
    chooses the target's answer, and the mean KL (nats) from the target's to the transfer's distribution over the
    choices (softmax of the task metric's choice scores, `tasks.mc_choice_scores`), with bootstrap intervals.
    Paired and graded, they separate policies at item counts where accuracy cannot."""
    metric = get_task(task).primary_metric
    agree, kl = [], []
    for item_id in ids:
        reference, scores = (torch.from_numpy(mc_choice_scores(records[item_id], metric))
                             for records in (target, transfer))
        agree.append(float(reference.argmax() == scores.argmax()))
        kl.append(float(kl_divergence(reference.log_softmax(-1), scores.log_softmax(-1))))
    out = {}
    for i, (name, values) in enumerate((("agreement", agree), ("choice_kl", kl))):
        ci = paired_bootstrap({"x": values}, lambda s: float(s["x"].mean()), n_resamples, seed + i)
        out[name] = {"value": mean(values), "ci": list(ci), "per_item": [round(v, 6) for v in values]}
    return out


def switch_task_summary(task: str, items: Sequence[SwitchItem], records: Mapping[str, Mapping[str, dict]],
                        n_resamples: int = 1000, seed: int = 0) -> dict:
    """Accuracy per condition; retention and floor-normalised retention (paired bootstrap) of every switch and of
    all_mapped against the target alone, and their agreement with it (`agreement_with_target`)."""
    ids = [item.id for item in items]
    chance = [item.chance for item in items]
    per_item = {name: accuracy_per_item(task, recs, ids) for name, recs in records.items()}
    base = summarise_conditions({k: v for k, v in per_item.items() if k in ("target", "source")}, chance,
                                n_resamples, seed)
    transfers = {}
    for name, scores in per_item.items():
        if name in ("target", "source"):
            continue
        paired = summarise_conditions({"target": per_item["target"], "transfer": scores}, chance, n_resamples, seed)
        transfers[name] = {"accuracy": paired["accuracy"]["transfer"], "retention": paired["retention"],
                           "floor_normalised_retention": paired["floor_normalised_retention"],
                           **agreement_with_target(task, records["target"], records[name], ids, n_resamples, seed)}
    spec = get_task(task)
    return {"display": spec.display, "group": _group(task), "primary_metric": spec.primary_metric, "n": len(items),
            "chance": base["chance"], "accuracy": base["accuracy"], "transfers": transfers,
            "history_tokens": sorted({len(item.history.ids) for item in items}),
            "question_tokens": float(np.mean([len(item.question) for item in items])) if items else 0.0,
            "item_ids": ids}


def _group(task: str) -> str:
    return "core" if task in CORE_TASKS else "heldout" if task in HELDOUT_TASKS else "other"


def mean_retention(tasks: Mapping[str, dict], condition: str, group: str = "core") -> dict:
    """Mean retention, floor-normalised retention, agreement with the target and choice KL of ``condition`` over
    the tasks of ``group`` ("all": every task), each mean over the tasks where it is defined (retention is not where
    the target alone scores 0; the counts say over how many)."""
    members = [t["transfers"][condition] for t in tasks.values()
               if condition in t["transfers"] and (group == "all" or t["group"] == group)]
    out = {"tasks": len(members)}
    for key in ("retention", "floor_normalised_retention", "agreement", "choice_kl"):
        values = [m[key]["value"] for m in members if key in m and math.isfinite(m[key]["value"])]
        out[f"mean_{key}"] = mean(values) if values else float("nan")
        out[f"{key}_tasks"] = len(values)
    return out


# -- time to first token -----------------------------------------------------------------------------------------


def _seconds(work: Callable[[], Any]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


@torch.inference_mode()
def time_to_first_token(source, target, mapper, history: History, question: Sequence[int],
                        policies: Sequence[RecomputePolicy] = (NoRecompute(),),
                        exact_prefix: int | None = None, repeats: int = 1,
                        warmup: int = 0) -> dict:
    """Seconds to the target's first-token logits after ``history`` + ``question``: re-prefill (the target
    prefills both) and the switch under each policy (map the source's history cache, patch, the target prefills
    the question), interleaved; medians of ``repeats`` after ``warmup`` untimed rounds."""
    source_cache = prefill(source, torch.tensor([list(history.ids)], device=model_device(source)))[0]
    both = torch.tensor([list(history.ids) + list(question)], device=model_device(target))
    turn = torch.tensor([list(question)], device=model_device(target))
    prefills = HistoryPrefills()
    switches = {switch_name(p): SwitchOnHistory(switch_name(p), source, target, mapper, prefills, exact_prefix, p)
                for p in policies}
    times: dict[str, list[float]] = {"reprefill": [], **{name: [] for name in switches}}
    for round_ in range(warmup + repeats):
        timed = {"reprefill": _seconds(lambda: prefill(target, both))}
        for name, switch in switches.items():
            timed[name] = _seconds(lambda s=switch: prefill(target, turn, s.switch(history, source_cache)))
        if round_ >= warmup:
            for name, seconds in timed.items():
                times[name].append(seconds)
    medians = {name: float(np.median(values)) for name, values in times.items()}
    return {"history": history.key, "history_tokens": len(history.ids), "question_tokens": len(question),
            "seconds": medians,
            "speedup": {name: medians["reprefill"] / s for name, s in medians.items() if name != "reprefill"}}


def mean_ttft(timings: Sequence[dict]) -> dict:
    """Mean seconds per path over several histories and the speed-up of the means."""
    if not timings:
        return {}
    names = timings[0]["seconds"]
    seconds = {name: mean([t["seconds"][name] for t in timings]) for name in names}
    return {"histories": len(timings), "history_tokens": mean([t["history_tokens"] for t in timings]),
            "seconds": seconds,
            "speedup": {name: seconds["reprefill"] / s for name, s in seconds.items() if name != "reprefill"}}


# -- one direction -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SwitchSettings:
    """What the switch benchmark runs: tasks, items per task from a pool, histories, policies, timing."""

    tasks: tuple[str, ...] = ("arc_challenge", "hellaswag", "winogrande", "mmlu")
    limit: int | None = 100
    pool: str = "report"
    seed: int = 0
    histories: int = DEFAULT_HISTORIES
    history_tokens: int = DEFAULT_HISTORY_TOKENS
    policies: tuple[RecomputePolicy, ...] = (NoRecompute(),)  # specs are read here, once
    exact_prefix: int | None = None
    all_mapped: bool = True
    ttft_repeats: int = 1
    n_resamples: int = 1000

    def __post_init__(self) -> None:
        for task in self.tasks:
            _check_task(task)
        if self.pool not in OTHER_POOL:
            raise ConfigError(f"pool must be 'dev' or 'report', got {self.pool!r}")
        if self.histories < 1 or self.history_tokens < 1 or self.ttft_repeats < 0:
            raise ConfigError("histories and history_tokens must be >= 1, ttft_repeats >= 0")
        object.__setattr__(self, "policies", tuple(recompute_policies.parse(p) for p in self.policies))


class TimeLimitReached(Exception):
    """Raised between items when a run's time limit has passed (what was computed is stored)."""


def _bounded(run: RecordRun, deadline: float | None) -> RecordRun:
    if deadline is None:
        return run

    def compute(item):
        if time.monotonic() > deadline:
            raise TimeLimitReached
        return run.compute(item)

    return RecordRun(run.name, run.key, run.header, compute)


def stored_records(store_name: str, items: Sequence[SwitchItem], runs: Sequence[RecordRun], store_dir
                   ) -> tuple[list[SwitchItem], dict[str, dict[str, dict]]]:
    """The items every run has a stored record of, and those records (what an interrupted run left)."""
    if store_dir is None:
        return [], {run.name: {} for run in runs}
    stores = {run.name: ItemStore(Path(store_dir) / store_name / f"{run.key}.jsonl") for run in runs}
    done = [item for item in items if all(item.id in store for store in stores.values())]
    return done, {name: {item.id: store[item.id] for item in done} for name, store in stores.items()}


def run_switch_task(source, target, mapper, tokenizer, tok_id: str, task: str, settings: SwitchSettings,
                    conditions: Mapping[str, SwitchCondition], store_dir=None, progress: bool = False,
                    deadline: float | None = None, histories_used: int | None = None
                    ) -> tuple[dict, list[History], list[SwitchItem]]:
    """One task's summary (``complete`` False when the time limit stopped it: the items done so far), its
    histories and items; ``histories_used``: only the items of the first that many histories."""
    histories = build_histories(task, tokenizer, settings.histories, settings.history_tokens, settings.pool,
                                settings.seed)
    items = switch_items(task, tokenizer, histories, settings.limit, settings.seed, settings.pool)
    runs = switch_runs(conditions, source, target, mapper, tok_id, task, histories, settings.exact_prefix)
    if histories_used is not None:
        histories = histories[:histories_used]
        items = [item for item in items if item.history in histories]
    store_name = f"switch-{task}"
    try:
        records = run_records(store_name, items, [_bounded(r, deadline) for r in runs], store_dir, progress)
        done, complete = items, True
    except TimeLimitReached:
        done, records = stored_records(store_name, items, runs, store_dir)
        complete = False
    summary = switch_task_summary(task, done, records, settings.n_resamples, settings.seed) if done else {
        "display": get_task(task).display, "group": _group(task), "n": 0, "transfers": {}}
    return {**summary, "complete": complete}, histories, done


def task_ttft(source, target, mapper, histories: Sequence[History], items: Sequence[SwitchItem],
              settings: SwitchSettings) -> dict:
    """TTFT on each history with the question of its first item (one untimed warm-up round on the first)."""
    timings = []
    for history in histories:
        question = next((item.question for item in items if item.history.key == history.key), None)
        if question is not None:
            timings.append(time_to_first_token(source, target, mapper, history, question, settings.policies,
                                               settings.exact_prefix, settings.ttft_repeats, warmup=int(not timings)))
    return {"per_history": timings, "mean": mean_ttft(timings)}


def run_switch_direction(source, target, mapper, tokenizer, tok_id: str, settings: SwitchSettings,
                         store_dir=None, progress: bool = False, deadline: float | None = None,
                         histories_used: int | None = None, prefills: HistoryPrefills | None = None) -> dict:
    """Per task: the summary of every condition (records resumable under ``store_dir``) and, with
    ``settings.ttft_repeats``, the TTFT on each history. Past ``deadline`` (time.monotonic()) the task under way
    is summarised over its finished items and the tasks after it are left out. ``histories_used``: only the
    items of each task's first that many histories; ``prefills``: history prefills shared with other directions."""
    if settings.exact_prefix is None:
        settings = replace(settings, exact_prefix=getattr(mapper, "exact_prefix", 0))
    conditions = switch_conditions(source, target, mapper, settings.policies, settings.exact_prefix,
                                   settings.all_mapped, prefills)
    tasks = {}
    for task in settings.tasks:
        summary, histories, items = run_switch_task(source, target, mapper, tokenizer, tok_id, task, settings,
                                                    conditions, store_dir, progress, deadline, histories_used)
        tasks[task] = summary
        if not summary["complete"]:
            break
        if settings.ttft_repeats and histories_used in (None, settings.histories):
            summary["ttft"] = task_ttft(source, target, mapper, histories, items, settings)
    return tasks


def switch_tasks(spec) -> list[str]:
    """The multiple-choice tasks of a task spec (`tasks.parse_tasks`): groups leave GSM8K (generation) out, naming
    it is refused."""
    names = parse_tasks(spec)
    named = {p.strip().lower().replace("-", "_") for p in (spec.split(",") if isinstance(spec, str) else spec)}
    for name in names:
        if get_task(name).kind != LOGLIKELIHOOD and name in named:
            _check_task(name)
    return [name for name in names if get_task(name).kind == LOGLIKELIHOOD]
