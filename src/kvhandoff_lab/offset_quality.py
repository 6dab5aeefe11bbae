"""The switch benchmark with the history behind other instructions (`kvhandoff-lab eval-offset`): an agent handoff's
quality and time, per recompute policy, against the receiving model reading everything again.

Each generative item of the switch benchmark (`switch.turn_items`: a history of exemplars, the item's own passage,
a question answered greedily) is served twice over. The *held* conversation: the source model has read
``SOURCE_INSTRUCTIONS`` then the history and the passage (the run). The *prompt*: ``TARGET_INSTRUCTIONS`` (another
agent's, of another length), the same run, then the question, answered by the target. Conditions:

- "reread": the target reads the whole prompt itself (what a prefix cache gives when the beginning differs);
- one per recompute policy: the run's rows of the held conversation (the source's, mapped when the source is
  another model: `offset.mapped_run`) are moved behind the target's instructions (`SwitchingSession.reuse`) and the
  target recomputes its instructions and the policy's picks with the question's read (`turn_attention`: ranked by
  the source's read of the question on the held conversation, `SwitchingSession.preview_turn`, moved to the prompt).

A direction whose source is its target is the same-model case (a changed system prompt). Scored by the task's
metric, with paired bootstrap intervals of each policy against the re-read; the time to the answer's first token
per condition: the re-read's reads (its instructions and the history read once per history, their time counted for
each item), or the reuse's map, recompute and the question's read. Histories are taken one at a time, each in
every direction; the result is rewritten after every item and a rerun with the same file continues.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvhandoff.errors import ConfigError
from kvhandoff.files import atomic_write_json
from kvhandoff.runtime.offset import check_offset_policy, mapped_run
from kvhandoff.runtime.plan import HandoffPlan
from kvhandoff.runtime.policy import RecomputePolicy
from kvhandoff.runtime.session import SwitchingSession
from kvhandoff_lab.engine_quality import greedy_answer
from kvhandoff_lab.evaluation.switch import paired_difference, turn_items
from kvhandoff_lab.evaluation.switchtasks import DEFAULT_MAX_NEW_TOKENS, get_switch_task, item_score
from kvhandoff_lab.resume import stored_part

logger = logging.getLogger(__name__)

OFFSET_FORMAT = "kvhandoff-offset-quality/1"
#: the held conversation's instructions (the agent that read the history) and the prompt's (the one it hands to)
SOURCE_INSTRUCTIONS = ("You are the front-desk agent of a reading club. Greet members, look their records up and "
                       "pass hard questions on to a specialist.\n\n")
TARGET_INSTRUCTIONS = ("You are the club's specialist analyst. Read the material below closely, then answer the "
                       "question with the exact words of the text, as briefly as possible. Do not explain.\n\n")
REREAD = "reread"


def run_offset_quality(models: dict, mappers: dict, tokenizer, end_ids: Sequence[int], policies:
                       Sequence[RecomputePolicy], directions: Sequence[tuple[str, str]], task: str = "coqa_gen",
                       limit: int = 80, histories: int = 8, pool: str = "report", out: Path | None = None,
                       time_budget_s: float | None = None) -> dict:
    """models: name → model (one family); mappers: (source, target) → `Mapper` for the directions between two
    models; policies: the recompute policies tried (each one a condition); see the module docstring."""
    switch_task = get_switch_task(task)
    if not switch_task.family:
        raise ConfigError(f"{task} scores choices; the offset benchmark answers a generative task (coqa_gen, "
                          "nq_open, gsm8k_cot)")
    policies = [check_offset_policy(policy, source_read=True) for policy in policies]
    missing = [f"{a} → {b}" for a, b in directions if a != b and (a, b) not in mappers]
    if missing:
        raise ConfigError(f"no mapper for {', '.join(missing)}")
    max_new_tokens = DEFAULT_MAX_NEW_TOKENS[switch_task.family]
    items = turn_items(task, tokenizer, histories=histories, limit=limit, pool=pool)
    source_ids = tokenizer(SOURCE_INSTRUCTIONS, add_special_tokens=False)["input_ids"]
    target_ids = tokenizer(TARGET_INSTRUCTIONS, add_special_tokens=False)["input_ids"]
    settings = {"format": OFFSET_FORMAT, "task": task, "pool": pool, "histories": histories,
                "conditions": [REREAD, *(policy.spec for policy in policies)],
                "directions": [" → ".join(d) for d in directions],
                "instructions": {"source": len(source_ids), "target": len(target_ids)}}
    result = {**settings, "items": len(items), "records": stored_part(out, settings)}
    started = time.perf_counter()
    groups: dict[str, list] = {}
    for item in items:
        groups.setdefault(item.history.key, []).append(item)
    for group in groups.values():
        for source, target in directions:
            done = result["records"].setdefault(f"{source} → {target}", {})
            todo = [item for item in group if item.id not in done]
            if not todo or (time_budget_s is not None and time.perf_counter() - started > time_budget_s):
                continue
            held = SwitchingSession(models, {})
            held.read(source, source_ids + list(todo[0].history.ids))
            reread, begin = SwitchingSession(models, {}), time.perf_counter()
            reread.read(target, target_ids + list(todo[0].history.ids))
            reread_history_s = time.perf_counter() - begin
            for item in todo:
                done[item.id] = _item_record(models, mappers.get((source, target)), (held, reread, reread_history_s),
                                             item, source, target, source_ids, target_ids, policies, tokenizer,
                                             switch_task, max_new_tokens, end_ids)
                if out is not None:
                    atomic_write_json(out, {**result, "summary": summarize_offset(result)})
    result["summary"] = summarize_offset(result)
    if out is not None:
        atomic_write_json(out, result)
    return result


def _item_record(models, mapper, bases, item, source: str, target: str, source_ids, target_ids, policies,
                 tokenizer, switch_task, max_new_tokens: int, end_ids) -> dict:
    """One item's answer, score and first-token seconds under every condition. ``bases``: the history group's held
    conversation (the source's read of its instructions and the history), the target's read of its own
    instructions and the history, and the seconds that read took (part of every re-read's time)."""
    held, reread_base, reread_history_s = bases
    run = list(item.history.ids) + list(item.extension)
    conversation = held.fork()
    if item.extension:
        conversation.read(source, list(item.extension))
    record: dict = {"answers": list(item.answers), "run_tokens": len(run)}

    def answer(session: SwitchingSession, begin: float) -> dict:
        prepared = time.perf_counter() - begin  # the re-read's history read, or the reuse's map and placing
        output, first = greedy_answer(session, target, item.question, tokenizer, max_new_tokens, switch_task.stop,
                                      end_ids)
        return {"output": output, "first_token_s": round(prepared + first, 4)}

    # the re-read: the target reads its instructions, the run and the question itself (its instructions and the
    # history once per group, the same computation in two forwards: that read's time counts for every item)
    begin = time.perf_counter() - reread_history_s
    reread = reread_base.fork()
    if item.extension:
        reread.read(target, list(item.extension))
    record[REREAD] = answer(reread, begin)
    begin = time.perf_counter()
    rows = conversation.export(source, len(source_ids), len(source_ids) + len(run))
    if source != target:
        rows = mapped_run(mapper, rows, len(source_ids), dtype=next(models[target].parameters()).dtype)
    mapping = time.perf_counter() - begin
    read, reading = None, 0.0
    if any(policy.ranks_by_source_turn_read for policy in policies):  # one read of the question serves them all
        begin = time.perf_counter()
        _, read = conversation.preview_turn(source, item.question, attention=True)
        reading = time.perf_counter() - begin
    for policy in policies:
        # every policy's time counts the one map, and the source's read of the question when it ranks by it
        begin = time.perf_counter() - mapping - (reading if policy.ranks_by_source_turn_read else 0.0)
        session = SwitchingSession(models, {}, plan=HandoffPlan(recompute=policy))
        session.reuse(target, target_ids, run, rows, len(source_ids), source=source,
                      source_turn_read=read if policy.ranks_by_source_turn_read else None)
        record[policy.spec] = answer(session, begin)
    for condition in (REREAD, *(policy.spec for policy in policies)):
        entry = record[condition]
        entry["score"] = item_score(switch_task, {"output": entry["output"], "answers": list(item.answers)})
    return record


def summarize_offset(result: dict) -> dict:
    """Per direction: the items, each condition's mean score and mean seconds to the answer's first token (the
    re-read: instructions, run and question read; a policy: the map, the reuse and the question's read), each
    policy's difference against the re-read with its paired interval."""
    summary: dict = {}
    for direction in result["directions"]:
        records = result["records"].get(direction, {})
        ids = sorted(records)
        entry: dict = {"items": len(ids)}
        if not ids:
            summary[direction] = entry
            continue
        reread = np.array([records[i][REREAD]["score"] for i in ids])
        for condition in result["conditions"]:
            scores = np.array([records[i][condition]["score"] for i in ids])
            entry[condition] = {"score": float(scores.mean()), "first_token_s": float(np.mean(
                [records[i][condition]["first_token_s"] for i in ids]))}
            if condition != REREAD:
                entry[condition]["minus_reread"] = paired_difference(scores, reread)
        summary[direction] = entry
    return summary
