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

The generative group (`switchtasks`: nq_open, gsm8k_cot, coqa_gen, boolq_long) runs the same way on `TurnItem`s,
whose history may end in the item's own tokens (``extension``: a CoQA story's earlier turns, a BoolQ passage), read
on the shared history cache by whoever holds it and mapped with it at the switch (once per item, or once per
history when there is none). Generative items are answered greedily (`answer_on`); the switch's records carry the
KL from the target's distribution of the first answer token to its own (``answer_kl``). Every record carries the
server's guard score "entropy" of its reader over the new turn (``guard_entropy``, `question_entropy`): on a
switch, the handed-over cache's; on the source alone, the reference a relative guard compares it with (what the
previous model makes of the same turn on its own cache). A switch record also carries every guard signal the
server scores a switch with, against the source's reference pass over the turn (``guard_scores``), for what a guard
would do at each switch (`switchguard`).

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
from kvhandoff.runtime.handoff import handoff_cache, map_for_target, verify_mapper
from kvhandoff.runtime.plan import HandoffPlan
from kvhandoff.runtime.policy import NoRecompute, RecomputePolicy, SelectionInfo
from kvhandoff.runtime.seam import as_kv_cache
from kvhandoff.runtime.switch.guard import DEFAULT_GUARD_WINDOW, GUARD_SIGNALS, guard_score
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
from kvhandoff_lab.evaluation.scoring import OpenContext, greedy_from
from kvhandoff_lab.evaluation.switchtasks import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_TASK_HISTORIES,
    GROUP,
    SWITCH_TASKS,
    SwitchTask,
    TaskItem,
    exemplar_order,
    get_switch_task,
    item_score,
    max_new_tokens_of,
    pool_items,
    same_answer,
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

#: the server's guard signals a switch record scores over the new turn (``guard_scores``): all but the share of
#: positions mapped, which the history's layout fixes
SWITCH_GUARD_SIGNALS = tuple(signal for signal in GUARD_SIGNALS if signal != "mapped_share")
#: history length of the benchmark (tokens) and histories per task
DEFAULT_HISTORY_TOKENS = 1024
DEFAULT_HISTORIES = 4
#: a story task's histories of one round kept prefilled per model, at most
MAX_STORY_ENTRIES = 8
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
        raise ConfigError(f"the switch benchmark scores multiple-choice tasks; {task!r} generates (its generative "
                          f"tasks: {', '.join(SWITCH_TASKS)})")


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
    and source conditions read on from it, the switch conditions map the source's. Each model's latest pass over a
    question on its own cache is kept too (`question_logprobs`): its alone record and every switch's guard
    reference read the same one."""

    def __init__(self, entries: int = 1) -> None:
        self.entries = entries
        self._caches: dict[tuple[int, str], Any] = {}
        self._extensions: dict[tuple[int, str], tuple[int, ...]] = {}
        self._questions: dict[int, tuple[tuple, torch.Tensor]] = {}
        self.prefills = 0
        self.question_passes = 0

    def of(self, model, history: History):
        return self.extended(model, history, ())

    def extended(self, model, history: History, extension: Sequence[int] = ()):
        """``model``'s cache of the history followed by ``extension`` (token ids read on it; they replace the ones
        read before)."""
        key = (id(model), history.key)
        if key not in self._caches:
            self.prefills += 1
            own = [k for k in self._caches if k[0] == id(model)]
            for old in own[: max(0, len(own) - self.entries + 1)]:
                del self._caches[old]
                self._extensions.pop(old, None)
            ids = torch.tensor([list(history.ids)], device=model_device(model))
            self._caches[key] = prefill(model, ids)[0]
        cache, extension = self._caches[key], tuple(extension)
        if self._extensions.get(key, ()) != extension:
            rollback(cache, len(history.ids))
            self._extensions[key] = ()
            if extension:
                prefill(model, torch.tensor([list(extension)], device=model_device(model)), cache)
                self._extensions[key] = extension
        return cache

    def question_logprobs(self, model, history: History, extension: Sequence[int], question: Sequence[int]
                          ) -> torch.Tensor:
        """``model``'s `question_logprobs` over ``question`` on its own cache of the history and ``extension``;
        read once while it stays the model's latest question."""
        key = (history.key, tuple(extension), tuple(question))
        kept = self._questions.get(id(model))
        if kept is None or kept[0] != key:
            self.question_passes += 1
            kept = (key, question_logprobs(model, self.extended(model, history, extension), question))
            self._questions[id(model)] = kept
        return kept[1]


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


def counted_handoff(source, target, mapper, ids: torch.Tensor, plan: HandoffPlan, source_cache,
                    new_turn: Sequence[int] = ()) -> tuple[Any, dict[str, int]]:
    """`handoff_cache` that also says how many of the mapped positions after the exact prefix (``candidates``) the
    target recomputed (``recomputed``): a policy with a ``coverage`` recomputes a different number at each switch."""
    verify_mapper(mapper, source, target)
    mapped = map_for_target(source, target, mapper, ids, plan, source_cache, SelectionInfo(new_turn=tuple(new_turn)))
    own = plan.prefix_length(mapper, ids.shape[1])
    counts = {"recomputed": int(mapped.pending.shape[1]) - own, "candidates": ids.shape[1] - own}
    return mapped.settle(target).native, counts


class SwitchOnHistory(SwitchCondition):
    """The source's history cache, mapped and patched (exact prefix, recompute policy) once per history; the
    target reads the new turn."""

    def __init__(self, name: str, source, target, mapper, prefills: HistoryPrefills, exact_prefix: int | None = None,
                 recompute: RecomputePolicy = NoRecompute()) -> None:  # noqa: B008 - frozen
        self.name, self.source, self.reader, self.mapper, self.prefills = name, source, target, mapper, prefills
        self.plan = HandoffPlan(exact_prefix, recompute)
        self.exact_prefix, self.recompute = exact_prefix, recompute
        self._mapped: tuple[str, Any, dict[str, int]] | None = None

    def history_cache(self, history: History, question: Sequence[int] = ()):
        """The switch's cache of ``history``, made once per history (and per question, for a policy that picks
        positions by the turn read next)."""
        return self._map(history, question)[1]

    def recompute_counts(self, item: SwitchItem) -> dict[str, int]:
        """What the item's switch recomputed (`counted_handoff`)."""
        return dict(self._map(item.history, item.question)[2])

    def _map(self, history: History, question: Sequence[int]) -> tuple:
        key = (history.key, tuple(question) if self.recompute.reads_new_turn else ())
        if self._mapped is None or self._mapped[0] != key:
            self._mapped = None  # the old mapped cache is dropped before the next is made
            source_cache = self.prefills.of(self.source, history)
            ids = torch.tensor([list(history.ids)])
            self._mapped = (key, *counted_handoff(self.source, self.reader, self.mapper, ids, self.plan,
                                                  source_cache, key[1]))
        return self._mapped

    def score(self, item: SwitchItem) -> list[float]:
        return score_turns(self.reader, self.history_cache(item.history, item.question), item.turns,
                           item.continuation_lengths)

    def switch(self, history: History, source_cache=None, question: Sequence[int] = ()):
        """The target's cache of the history from the source's (the switch itself); ``question``: the turn the
        target reads next, for a policy that picks positions by it."""
        source_cache = self.prefills.of(self.source, history) if source_cache is None else source_cache
        ids = torch.tensor([list(history.ids)])
        return handoff_cache(self.source, self.reader, self.mapper, ids, self.plan, source_cache,
                             selection_info=SelectionInfo(new_turn=tuple(question)))


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
        recompute = getattr(getattr(condition, "recompute", None), "spec", "none")
        key, header = _run_identity(base, name, condition, source, target, mapper, name.split(":")[0],
                                    {"exact_prefix": exact_prefix, "recompute": recompute})
        runs.append(RecordRun(name, key, header, _compute(condition)))
    return runs


def _run_identity(base: dict, name: str, condition, source, target, mapper, kind: str,
                  settings: dict) -> tuple[str, dict]:
    """(record key, header) of condition ``name``: the target or the source alone is keyed by its model only
    (shared by both directions and every policy), a switch (``kind``) by the pair, the mapper and ``settings``."""
    if name in ("target", "source"):
        model = condition.reader
        header = {**base, "condition": "standalone", "model": model_fingerprint(model)}
        key = f"model-{slug(display_name(model, 'model'))}"
    else:
        header = {**base, "condition": kind, "source": model_fingerprint(source), "target": model_fingerprint(target),
                  "mapper": mapper_identity(mapper), **settings}
        key = f"{slug(name)}-{slug(display_name(source, 'source'))}-to-{slug(display_name(target, 'target'))}"
    return f"{key}-{sha256_json(header, 16)}", header


def _compute(condition: SwitchCondition) -> Callable[[SwitchItem], dict]:
    if isinstance(condition, SwitchOnHistory):
        return lambda item: {**item_record(item, condition.score(item)), **condition.recompute_counts(item)}
    return lambda item: item_record(item, condition.score(item))


# -- summaries ---------------------------------------------------------------------------------------------------


def accuracy_per_item(spec_name: str, records: Mapping[str, dict], ids: Sequence[str]) -> list[float]:
    metric = get_task(spec_name).primary_metric
    return [mc_item_metrics(records[i])[metric] for i in ids]


def agreement_with_target(task: str, target: Mapping[str, dict], transfer: Mapping[str, dict], ids: Sequence[str],
                          n_resamples: int = 1000, seed: int = 0, metric: str | None = None) -> dict:
    """How closely a transfer condition follows the target alone, item by item: the share of items where it
    chooses the target's answer, and the mean KL (nats) from the target's to the transfer's distribution over the
    choices (softmax of the task metric's choice scores, `tasks.mc_choice_scores`), with bootstrap intervals.
    Paired and graded, they separate policies at item counts where accuracy cannot. ``metric``: the task's primary
    one when None."""
    metric = metric or get_task(task).primary_metric
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
                           **agreement_with_target(task, records["target"], records[name], ids, n_resamples, seed),
                           **recompute_shares(records[name], ids)}
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


# -- the generative group: items ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TurnItem:
    """An item of the generative group as a new turn: its history (shared by the items of one slot and story), its
    own tokens read after it (``extension``), the question; per choice a turn of question + continuation
    (loglikelihood tasks) or the reference answers (generative ones)."""

    id: str
    task: str
    slot: int
    history: History
    extension: tuple[int, ...]
    question: tuple[int, ...]
    answers: tuple[str, ...] = ()
    turns: tuple[tuple[int, ...], ...] = ()
    continuation_lengths: tuple[int, ...] = ()
    norm_lengths: tuple[int, ...] = ()
    gold: int = 0

    @property
    def shared_prefix(self) -> str:
        """Items of one history are run one after another (`runner.prefix_grouped_order`)."""
        return self.history.key

    @property
    def chance(self) -> float:
        return 1.0 / len(self.turns) if self.turns else 0.0

    @property
    def history_tokens(self) -> int:
        return len(self.history.ids) + len(self.extension)


def task_history(task: SwitchTask, tokenizer, slot: int, item: TaskItem, min_tokens: int = DEFAULT_HISTORY_TOKENS,
                 pool: str = "report", seed: int = 0) -> History:
    """Slot ``slot``'s history for ``item``: the task's header, its seeded exemplars of the pool other than
    ``pool`` (at least the task's minimum) and the item's ``base``, at least ``min_tokens`` tokens in all."""
    order = exemplar_order(task, pool, slot, seed)
    used: list[str] = []
    body = ""
    ids = encode(tokenizer, task.header + item.base)
    estimate = len(ids)
    for exemplar in order:
        if len(used) >= task.min_exemplars and estimate >= min_tokens:
            ids = encode(tokenizer, task.header + body + item.base)
            if len(ids) >= min_tokens:
                break
            estimate = len(ids)
        body += exemplar.text
        used.append(exemplar.id)
        estimate += len(encode(tokenizer, exemplar.text, add_special_tokens=False))
    else:
        ids = encode(tokenizer, task.header + body + item.base)
    if len(ids) < min_tokens or len(used) < task.min_exemplars:
        raise ConfigError(f"{task.name}: the {OTHER_POOL[pool]} pool's exemplars make {len(ids)} tokens, fewer than "
                          f"the {min_tokens} of a history")
    key = f"{task.name}-h{slot}" + (f"-{item.history_base}" if item.history_base else "")
    return History(key, tuple(ids), tuple(used))


def turn_item(task: SwitchTask, item: TaskItem, slot: int, history: History, tokenizer) -> TurnItem:
    extension = tuple(encode(tokenizer, item.extension, add_special_tokens=False)) if item.extension else ()
    if task.kind == LOGLIKELIHOOD:
        turns, lengths = [], []
        for choice in item.choices:
            context, continuation = turn_tokens(tokenizer, item.question, choice)
            if not context or not continuation:
                raise ConfigError(f"item {item.id!r}: choice {choice!r} has an empty context or continuation")
            turns.append(tuple(context + continuation))
            lengths.append(len(continuation))
        question = turns[0][: shared_length(turns, lengths)]
        return TurnItem(item.id, task.name, slot, history, extension, question, turns=tuple(turns),
                        continuation_lengths=tuple(lengths),
                        norm_lengths=tuple(len(c.lstrip(" ")) for c in item.choices), gold=item.gold)
    question = tuple(encode(tokenizer, item.question, add_special_tokens=False))
    if not question:
        raise ConfigError(f"item {item.id!r}: an empty question")
    return TurnItem(item.id, task.name, slot, history, extension, question, answers=item.answers)


def turn_items(task_name: str, tokenizer, histories: int = DEFAULT_TASK_HISTORIES,
               min_tokens: int = DEFAULT_HISTORY_TOKENS, limit: int | None = None, seed: int = 0,
               pool: str = "report") -> list[TurnItem]:
    """``limit`` items of a generative-group task from ``pool`` (`switchtasks.pool_items`: item i on slot i mod
    ``histories``), each on its slot's history (`task_history`)."""
    task = get_switch_task(task_name)
    built: dict[tuple[int, str], History] = {}
    items = []
    for slot, item in pool_items(task, pool, histories, limit, seed):
        key = (slot, item.history_base)
        if key not in built:
            built[key] = task_history(task, tokenizer, slot, item, min_tokens, pool, seed)
        items.append(turn_item(task, item, slot, built[key], tokenizer))
    return items


# -- the generative group: conditions and records ----------------------------------------------------------------


@torch.inference_mode()
def answer_on(reader, cache, question: Sequence[int], tokenizer, max_new_tokens: int, stop: Sequence[str] = ()
              ) -> tuple[str, int, torch.Tensor]:
    """``reader`` reads ``question`` on ``cache`` and answers greedily (`scoring.greedy_from`); ``cache`` is
    restored. Returns the answer cut at the first stop string, the tokens generated and the float32 log-probs of
    the first answer token."""
    length = cache.get_seq_length()
    try:
        _, last = prefill(reader, torch.tensor([list(question)], device=model_device(reader)), cache)
        first = last[0].float().log_softmax(-1)
        state = OpenContext(reader, cache, length + len(question), first)
        text, generated = greedy_from(state, tokenizer, max_new_tokens, stop) if max_new_tokens else ("", [])
    finally:
        rollback(cache, length)
    return text, len(generated), first.cpu()


@torch.inference_mode()
def question_logprobs(reader, cache, question: Sequence[int], window: int = DEFAULT_GUARD_WINDOW) -> torch.Tensor:
    """``reader``'s float32 next-token log-probs over the question's last ``window`` positions [k, vocab], read on
    ``cache`` (restored afterwards): what the server's quality guard scores (`serving.guard.guard_score`)."""
    length = cache.get_seq_length()
    try:
        ids = torch.tensor([list(question)], device=model_device(reader))
        logits = reader(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=min(window, len(question))).logits
    finally:
        rollback(cache, length)
    return logits[0].float().log_softmax(-1)


def question_entropy(reader, cache, question: Sequence[int], window: int = DEFAULT_GUARD_WINDOW) -> float:
    """The server's quality-guard score "entropy" of ``cache``: ``reader``'s mean next-token entropy over the
    question's last ``window`` positions."""
    return guard_score("entropy", question_logprobs(reader, cache, question, window), None, question)


def question_guard_scores(served: torch.Tensor, reference: torch.Tensor, question: Sequence[int]) -> dict[str, float]:
    """Every guard signal that scores the new turn (`SWITCH_GUARD_SIGNALS`) of a switch: ``served``, the
    receiving model's log-probs over the question on the handed-over cache, against ``reference``, the previous
    model's on its own cache (`question_logprobs`); a signal with nothing to score is left out."""
    scores = {signal: guard_score(signal, served, reference, question) for signal in SWITCH_GUARD_SIGNALS}
    return {signal: score for signal, score in scores.items() if score is not None}


def first_token_kl(own: torch.Tensor, other: torch.Tensor) -> float:
    """KL (nats) from ``own``'s distribution of the first answer token to ``other``'s (log-probs; over the shared
    vocabulary when the sizes differ)."""
    n = min(own.shape[-1], other.shape[-1])
    if n != own.shape[-1] or n != other.shape[-1]:
        own, other = own[..., :n].log_softmax(-1), other[..., :n].log_softmax(-1)
    return float(kl_divergence(own.double(), other.double()))


class TurnCondition:
    """Reads a `TurnItem`'s new turn on a cache of its history and extension (``turn_cache``)."""

    name: str
    reader: Any

    def turn_cache(self, item: TurnItem):
        raise NotImplementedError

    def served_logprobs(self, item: TurnItem) -> torch.Tensor:
        """The reader's `question_logprobs` over the item's question on its ``turn_cache``."""
        return question_logprobs(self.reader, self.turn_cache(item), item.question)


class AloneOnTurn(TurnCondition):
    """A model reads the history and the extension itself (the history prefilled once), then the new turn; it
    keeps the first-answer-token log-probs of its latest answers (`first_logprobs`)."""

    def __init__(self, name: str, model, prefills: HistoryPrefills, keep: int = 4) -> None:
        self.name, self.reader, self.prefills, self.keep = name, model, prefills, keep
        self._first: dict[str, torch.Tensor] = {}

    def turn_cache(self, item: TurnItem):
        return self.prefills.extended(self.reader, item.history, item.extension)

    def served_logprobs(self, item: TurnItem) -> torch.Tensor:
        return self.prefills.question_logprobs(self.reader, item.history, item.extension, item.question)

    def remember(self, item: TurnItem, first: torch.Tensor) -> None:
        self._first[item.id] = first
        while len(self._first) > self.keep:
            del self._first[next(iter(self._first))]

    def first_logprobs(self, item: TurnItem) -> torch.Tensor:
        """Log-probs of the first answer token after the item's question (read again when not kept)."""
        if item.id not in self._first:
            cache = self.turn_cache(item)
            length = cache.get_seq_length()
            try:
                _, last = prefill(self.reader, torch.tensor([list(item.question)], device=model_device(self.reader)),
                                  cache)
            finally:
                rollback(cache, length)
            self.remember(item, last[0].float().log_softmax(-1).cpu())
        return self._first[item.id]


class SwitchOnTurn(TurnCondition):
    """The source's cache of the history and extension, handed over (`handoff_cache`: mapped, exact prefix,
    recompute) once per history and extension; the target reads the new turn."""

    def __init__(self, name: str, source, target, mapper, prefills: HistoryPrefills, exact_prefix: int | None = None,
                 recompute: RecomputePolicy = NoRecompute()) -> None:  # noqa: B008 - frozen
        self.name, self.source, self.reader, self.mapper, self.prefills = name, source, target, mapper, prefills
        self.plan = HandoffPlan(exact_prefix, recompute)
        self.exact_prefix, self.recompute = exact_prefix, recompute
        self._mapped: tuple[tuple[str, tuple[int, ...]], Any, dict[str, int]] | None = None

    def turn_cache(self, item: TurnItem):
        self._map(item)
        return self._mapped[1]

    def recompute_counts(self, item: TurnItem) -> dict[str, int]:
        """What the item's switch recomputed (`counted_handoff`)."""
        self._map(item)
        return dict(self._mapped[2])

    def _map(self, item: TurnItem) -> None:
        key = (item.history.key, item.extension, item.question if self.recompute.reads_new_turn else ())
        if self._mapped is not None and self._mapped[0] == key:
            return
        self._mapped = None  # the old mapped cache is dropped before the next is made
        source_cache = self.prefills.extended(self.source, item.history, item.extension)
        ids = torch.tensor([list(item.history.ids) + list(item.extension)])
        self._mapped = (key, *counted_handoff(self.source, self.reader, self.mapper, ids, self.plan, source_cache,
                                              key[2]))

    def reference_logprobs(self, item: TurnItem) -> torch.Tensor:
        """The source's log-probs over the item's question on its own cache of the history and extension (the
        reference pass of the server's relative guard signals)."""
        return self.prefills.question_logprobs(self.source, item.history, item.extension, item.question)


def turn_conditions(source, target, mapper, policies: Sequence[RecomputePolicy] = (NoRecompute(),),
                    exact_prefix: int | None = None, prefills: HistoryPrefills | None = None
                    ) -> dict[str, TurnCondition]:
    """target, source and one switch per recompute policy for the generative group, sharing ``prefills``."""
    prefills = HistoryPrefills() if prefills is None else prefills
    conditions: dict[str, TurnCondition] = {"target": AloneOnTurn("target", target, prefills),
                                            "source": AloneOnTurn("source", source, prefills)}
    for policy in policies:
        name = switch_name(policy)
        conditions[name] = SwitchOnTurn(name, source, target, mapper, prefills, exact_prefix, policy)
    return conditions


def turn_record(task: SwitchTask, condition: TurnCondition, item: TurnItem, tokenizer, max_new_tokens: int,
                reference: AloneOnTurn | None = None) -> dict:
    """One item's record under ``condition``: choice loglikelihoods, or the greedy answer (with ``reference``, the
    KL from its first-answer-token distribution to the condition's, ``answer_kl``)."""
    served = condition.served_logprobs(item)
    cache = condition.turn_cache(item)
    record: dict = {"id": item.id, "history": item.history.key, "history_tokens": item.history_tokens}
    record["guard_entropy"] = guard_score("entropy", served, None, item.question)
    if isinstance(condition, SwitchOnTurn):
        record["guard_scores"] = question_guard_scores(served, condition.reference_logprobs(item), item.question)
        record.update(condition.recompute_counts(item))
    if task.kind == LOGLIKELIHOOD:
        scores = score_turns(condition.reader, cache, item.turns, item.continuation_lengths)
        return {**record, "loglikelihoods": scores, "norm_lengths": list(item.norm_lengths), "gold": item.gold}
    text, generated, first = answer_on(condition.reader, cache, item.question, tokenizer, max_new_tokens, task.stop)
    record.update(output=text, generated_tokens=generated, answers=list(item.answers))
    if isinstance(condition, AloneOnTurn):
        condition.remember(item, first)
    if reference is not None:
        record["answer_kl"] = first_token_kl(reference.first_logprobs(item), first)
    return record


def turn_runs(conditions: Mapping[str, TurnCondition], source, target, mapper, tokenizer, tok_id: str,
              task: SwitchTask, settings: SwitchSettings) -> list[RecordRun]:
    """One `runner.RecordRun` per condition of a generative-group task; its key hashes the models, how the
    histories are drawn, the generation settings and the condition's (standalone runs are shared by both
    directions and every policy)."""
    max_new_tokens = max_new_tokens_of(task, settings.max_new_tokens)
    base = {"record_version": RECORD_VERSION, "benchmark": "switch", "task": task.name, "tokenizer": tok_id,
            "histories": {"count": settings.generative_histories, "min_tokens": settings.history_tokens,
                          "pool": settings.pool, "seed": settings.seed, "turns_per_base": task.turns_per_base},
            "max_new_tokens": max_new_tokens, "stop": list(task.stop)}
    reference = conditions["target"]
    runs = []
    for name, condition in conditions.items():
        standalone = name in ("target", "source")
        settings = {} if standalone else {"exact_prefix": condition.exact_prefix,
                                          "recompute": condition.recompute.spec}
        key, header = _run_identity(base, name, condition, source, target, mapper, "switch", settings)
        runs.append(RecordRun(name, key, header, _turn_compute(task, condition, tokenizer, max_new_tokens,
                                                               None if standalone else reference)))
    return runs


def _turn_compute(task, condition, tokenizer, max_new_tokens, reference) -> Callable[[TurnItem], dict]:
    return lambda item: turn_record(task, condition, item, tokenizer, max_new_tokens, reference)


# -- the generative group: summaries -----------------------------------------------------------------------------


def _interval(values: Sequence[float], n_resamples: int, seed: int) -> dict:
    ci = paired_bootstrap({"x": values}, lambda s: float(s["x"].mean()), n_resamples, seed)
    return {"value": mean(values), "ci": list(ci), "per_item": [round(float(v), 6) for v in values]}


def paired_difference(ours: Sequence[float], theirs: Sequence[float], n_resamples: int = 1000,
                      seed: int = 0) -> dict:
    """Mean of ``ours`` − ``theirs`` over paired items, with a paired bootstrap interval."""
    ci = paired_bootstrap({"a": ours, "b": theirs}, lambda s: float(s["a"].mean() - s["b"].mean()), n_resamples,
                          seed)
    return {"value": mean(ours) - mean(theirs) if len(ours) else math.nan, "ci": list(ci)}


def turn_task_summary(task_name: str, items: Sequence[TurnItem], records: Mapping[str, Mapping[str, dict]],
                      n_resamples: int = 1000, seed: int = 0) -> dict:
    """Score per condition (the task metric); per switch: retention, switch − target and switch − source (paired
    bootstrap), agreement with the target alone (the same answer) and the choice KL (loglikelihood) or the KL of
    the first answer token (``answer_kl``) to it; the per-item scores (``scores``) for pooling and each
    condition's guard score (``guard_entropy``)."""
    task = get_switch_task(task_name)
    ids = [item.id for item in items]
    chance = [item.chance for item in items]
    scores = {name: [item_score(task, recs[i]) for i in ids] for name, recs in records.items()}
    base = summarise_conditions({k: v for k, v in scores.items() if k in ("target", "source")}, chance,
                                n_resamples, seed)
    transfers = {}
    for name, values in scores.items():
        if name in ("target", "source"):
            continue
        paired = summarise_conditions({"target": scores["target"], "transfer": values}, chance, n_resamples, seed)
        entry = {"accuracy": paired["accuracy"]["transfer"], "retention": paired["retention"],
                 "floor_normalised_retention": paired["floor_normalised_retention"],
                 "minus_target": paired_difference(values, scores["target"], n_resamples, seed),
                 "minus_source": paired_difference(values, scores["source"], n_resamples, seed)}
        if task.kind == LOGLIKELIHOOD:
            entry.update(agreement_with_target(task_name, records["target"], records[name], ids, n_resamples, seed,
                                               metric=task.metric))
        else:
            agree = [float(same_answer(task, records["target"][i], records[name][i])) for i in ids]
            entry["agreement"] = _interval(agree, n_resamples, seed)
            entry["answer_kl"] = _interval([records[name][i]["answer_kl"] for i in ids], n_resamples, seed + 1)
        entry.update(recompute_shares(records[name], ids))
        transfers[name] = entry
    generated = {name: mean([recs[i].get("generated_tokens", 0) for i in ids]) for name, recs in records.items()}
    lengths = [item.history_tokens for item in items]
    return {"display": task.display, "group": GROUP, "kind": task.kind, "primary_metric": task.metric,
            "n": len(items), "chance": base["chance"], "accuracy": base["accuracy"], "transfers": transfers,
            "history_tokens": [min(lengths), max(lengths)] if lengths else [],
            "mean_history_tokens": mean(lengths), "histories": len({item.history.key for item in items}),
            "question_tokens": mean([len(item.question) for item in items]),
            **({"generated_tokens": generated} if task.kind != LOGLIKELIHOOD else {}),
            "scores": {name: [round(v, 6) for v in values] for name, values in scores.items()},
            "guard_entropy": guard_entropies(records, ids), "guard_scores": switch_guard_scores(records, ids),
            "item_ids": ids}


def recompute_shares(records: Mapping[str, dict], ids: Sequence[str]) -> dict:
    """When every record of a switch counts its recompute (``recomputed`` of ``candidates``), the share each switch
    recomputed (``recompute_share``, per item) and its mean; else nothing (records written before they counted)."""
    if not ids or not all("recomputed" in records[i] for i in ids):
        return {}
    shares = [records[i]["recomputed"] / max(records[i]["candidates"], 1) for i in ids]
    return {"mean_recompute_share": mean(shares), "recompute_share": [round(v, 6) for v in shares]}


def guard_entropies(records: Mapping[str, Mapping[str, dict]], ids: Sequence[str]) -> dict[str, list[float]]:
    """Per condition whose every record carries it, its reader's guard score of each item (``guard_entropy``)."""
    return {name: [round(recs[i]["guard_entropy"], 6) for i in ids] for name, recs in records.items()
            if ids and all("guard_entropy" in recs[i] for i in ids)}


def switch_guard_scores(records: Mapping[str, Mapping[str, dict]], ids: Sequence[str]
                        ) -> dict[str, dict[str, list[float]]]:
    """Per switch condition, each guard signal that every record of the condition scores (``guard_scores``): the
    score of each item."""
    scores = {}
    for name, recs in records.items():
        if not ids or not all("guard_scores" in recs[i] for i in ids):
            continue
        signals = [signal for signal in SWITCH_GUARD_SIGNALS if all(signal in recs[i]["guard_scores"] for i in ids)]
        scores[name] = {signal: [round(recs[i]["guard_scores"][signal], 6) for i in ids] for signal in signals}
    return scores


def pooled_difference(tasks: Mapping[str, dict], condition: str, group: str = GROUP, n_resamples: int = 1000,
                      seed: int = 0) -> dict:
    """``condition`` − target alone and − source alone over the items of every task of ``group`` pooled (their
    per-item scores, ``scores``), with paired bootstrap intervals; the item and task counts."""
    ours, target, source, count = [], [], [], 0
    for task in tasks.values():
        scores = task.get("scores", {})
        if task.get("group") != group or condition not in scores:
            continue
        ours += scores[condition]
        target += scores["target"]
        source += scores["source"]
        count += 1
    return {"tasks": count, "n": len(ours),
            "minus_target": paired_difference(ours, target, n_resamples, seed),
            "minus_source": paired_difference(ours, source, n_resamples, seed)}


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
    the question), interleaved; medians of ``repeats`` after ``warmup`` untimed rounds. Beside them
    (``guard_reference_seconds``): the source reading the question over its own history cache, then rolled back —
    the reference pass a relative guard signal adds at a switch."""
    source_cache = prefill(source, torch.tensor([list(history.ids)], device=model_device(source)))[0]
    both = torch.tensor([list(history.ids) + list(question)], device=model_device(target))
    turn = torch.tensor([list(question)], device=model_device(target))
    prefills = HistoryPrefills()
    switches = {switch_name(p): SwitchOnHistory(switch_name(p), source, target, mapper, prefills, exact_prefix, p)
                for p in policies}
    times: dict[str, list[float]] = {"reprefill": [], **{name: [] for name in switches}}
    references: list[float] = []
    for round_ in range(warmup + repeats):
        timed = {"reprefill": _seconds(lambda: prefill(target, both))}
        for name, switch in switches.items():
            timed[name] = _seconds(lambda s=switch: prefill(target, turn, s.switch(history, source_cache, question)))
        reference = _seconds(lambda: question_entropy(source, source_cache, question))
        if round_ >= warmup:
            for name, seconds in timed.items():
                times[name].append(seconds)
            references.append(reference)
    medians = {name: float(np.median(values)) for name, values in times.items()}
    return {"history": history.key, "history_tokens": len(history.ids), "question_tokens": len(question),
            "seconds": medians, "guard_reference_seconds": float(np.median(references)),
            "speedup": {name: medians["reprefill"] / s for name, s in medians.items() if name != "reprefill"}}


def mean_ttft(timings: Sequence[dict]) -> dict:
    """Mean seconds per path over several histories and the speed-up of the means."""
    if not timings:
        return {}
    names = timings[0]["seconds"]
    seconds = {name: mean([t["seconds"][name] for t in timings]) for name in names}
    references = [t["guard_reference_seconds"] for t in timings if "guard_reference_seconds" in t]
    return {"histories": len(timings), "history_tokens": mean([t["history_tokens"] for t in timings]),
            "seconds": seconds, **({"guard_reference_seconds": mean(references)} if references else {}),
            "speedup": {name: seconds["reprefill"] / s for name, s in seconds.items() if name != "reprefill"}}


# -- one direction -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SwitchSettings:
    """What the switch benchmark runs: tasks, items per task from a pool, histories, policies, timing; for the
    generative group its histories per task and generation lengths per family (``max_new_tokens``, a mapping or
    pairs over `switchtasks.DEFAULT_MAX_NEW_TOKENS`)."""

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
    generative_histories: int = DEFAULT_TASK_HISTORIES
    max_new_tokens: tuple[tuple[str, int], ...] = tuple(DEFAULT_MAX_NEW_TOKENS.items())

    def __post_init__(self) -> None:
        for task in self.tasks:
            if task not in SWITCH_TASKS:
                _check_task(task)
        if self.pool not in OTHER_POOL:
            raise ConfigError(f"pool must be 'dev' or 'report', got {self.pool!r}")
        if self.histories < 1 or self.history_tokens < 1 or self.ttft_repeats < 0 or self.generative_histories < 1:
            raise ConfigError("histories, generative_histories and history_tokens must be >= 1, ttft_repeats >= 0")
        object.__setattr__(self, "policies", tuple(recompute_policies.parse(p) for p in self.policies))
        lengths = dict(self.max_new_tokens)
        unknown = sorted(set(lengths) - set(DEFAULT_MAX_NEW_TOKENS))
        if unknown or any(not isinstance(n, int) or n < 1 for n in lengths.values()):
            families = ", ".join(DEFAULT_MAX_NEW_TOKENS)
            raise ConfigError(f"max_new_tokens: a positive token count per family ({families}), got {lengths}")
        object.__setattr__(self, "max_new_tokens", tuple({**DEFAULT_MAX_NEW_TOKENS, **lengths}.items()))

    @property
    def rounds(self) -> int:
        """History rounds of a run: the most histories any of its tasks has."""
        counts = [self.generative_histories if t in SWITCH_TASKS else self.histories for t in self.tasks]
        return max(counts, default=self.histories)

    def history_entries(self) -> int:
        """History caches a run keeps per model: one per task, and a story task's stories of one slot."""
        extra = 0
        for task in self.tasks:
            per = SWITCH_TASKS[task].turns_per_base if task in SWITCH_TASKS else 1
            if per > 1:
                stories = MAX_STORY_ENTRIES if self.limit is None else \
                    -(-self.limit // (self.generative_histories * per))
                extra += min(stories, MAX_STORY_ENTRIES) - 1
        return len(self.tasks) + extra


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
    done, records, complete = _records_until(f"switch-{task}", items, runs, store_dir, progress, deadline)
    summary = switch_task_summary(task, done, records, settings.n_resamples, settings.seed) if done else {
        "display": get_task(task).display, "group": _group(task), "n": 0, "transfers": {}}
    return {**summary, "complete": complete}, histories, done


def _records_until(store_name: str, items, runs, store_dir, progress: bool, deadline: float | None):
    """(items done, their records, whether all were): the runs over ``items``, stopped at ``deadline`` with the
    records stored so far."""
    try:
        return items, run_records(store_name, items, [_bounded(r, deadline) for r in runs], store_dir, progress), True
    except TimeLimitReached:
        return (*stored_records(store_name, items, runs, store_dir), False)


def run_turn_task(source, target, mapper, tokenizer, tok_id: str, task: str, settings: SwitchSettings,
                  conditions: Mapping[str, TurnCondition], store_dir=None, progress: bool = False,
                  deadline: float | None = None, histories_used: int | None = None) -> dict:
    """A generative-group task's summary (`turn_task_summary`; ``complete`` False when the time limit stopped it:
    the items done so far); ``histories_used``: only the items of the first that many slots."""
    spec = get_switch_task(task)
    items = turn_items(task, tokenizer, settings.generative_histories, settings.history_tokens, settings.limit,
                       settings.seed, settings.pool)
    if histories_used is not None:
        items = [item for item in items if item.slot < histories_used]
    runs = turn_runs(conditions, source, target, mapper, tokenizer, tok_id, spec, settings)
    done, records, complete = _records_until(f"switch-{task}", items, runs, store_dir, progress, deadline)
    summary = turn_task_summary(task, done, records, settings.n_resamples, settings.seed) if done else {
        "display": spec.display, "group": GROUP, "kind": spec.kind, "n": 0, "transfers": {}}
    return {**summary, "complete": complete}


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
    items of each task's first that many histories; ``prefills``: history prefills shared with other directions.
    Generative-group tasks run through `run_turn_task` (no TTFT)."""
    if settings.exact_prefix is None:
        settings = replace(settings, exact_prefix=getattr(mapper, "exact_prefix", 0))
    conditions = switch_conditions(source, target, mapper, settings.policies, settings.exact_prefix,
                                   settings.all_mapped, prefills)
    turns = None
    tasks = {}
    for task in settings.tasks:
        if task in SWITCH_TASKS:
            if turns is None:
                turns = turn_conditions(source, target, mapper, settings.policies, settings.exact_prefix,
                                        conditions["target"].prefills)
            summary = tasks[task] = run_turn_task(source, target, mapper, tokenizer, tok_id, task, settings, turns,
                                                  store_dir, progress, deadline, histories_used)
            if not summary["complete"]:
                break
            continue
        summary, histories, items = run_switch_task(source, target, mapper, tokenizer, tok_id, task, settings,
                                                    conditions, store_dir, progress, deadline, histories_used)
        tasks[task] = summary
        if not summary["complete"]:
            break
        if settings.ttft_repeats and histories_used in (None, settings.rounds):
            summary["ttft"] = task_ttft(source, target, mapper, histories, items, settings)
    return tasks


def switch_tasks(spec) -> list[str]:
    """The tasks of a task spec: the multiple-choice tasks of `tasks.parse_tasks` (groups leave GSM8K, which
    generates, out; naming it is refused) and the generative group's (`switchtasks.SWITCH_TASKS`, alias
    ``generative``), in order, without repeats."""
    parts = [p.strip().lower().replace("-", "_") for p in (spec.split(",") if isinstance(spec, str) else spec)]
    names: list[str] = []
    for part in filter(None, parts):
        if part == GROUP or part in SWITCH_TASKS:
            expanded = list(SWITCH_TASKS) if part == GROUP else [part]
        else:
            try:
                expanded = parse_tasks(part)
            except ConfigError as exc:
                raise ConfigError(f"{exc}; or the generative group: {', '.join(SWITCH_TASKS)} (alias {GROUP!r})"
                                  ) from None
            if len(expanded) == 1 and get_task(expanded[0]).kind != LOGLIKELIHOOD:
                _check_task(expanded[0])
            expanded = [name for name in expanded if get_task(name).kind == LOGLIKELIHOOD]
        names += [name for name in expanded if name not in names]
    if not names:
        raise ConfigError("no tasks given")
    return names
