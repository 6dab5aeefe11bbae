"""A switch's answers in llama.cpp against the same switch in transformers, on the switch benchmark's generative
items (`switch.turn_items`: a history of few-shot exemplars, the item's own passage, a question answered greedily).

Per direction and engine, through the public `SwitchingSession` (one session per history, forked per item; greedy
answers read a token at a time, so both engines decode alike):
"target" — the target reads the history and the passage itself and answers; "switch" — the source reads them, the
target answers on the mapped cache (the default recompute policy unless given). Scored by the task's metric
(`switchtasks.item_score`), with paired bootstrap intervals of the differences that matter: each engine's switch
against its target alone, and llama.cpp's switch against transformers'. Histories are taken one at a time, each
in every direction and engine, so a run stopped by its budget leaves items scored by both engines. The result is
rewritten after every item and a rerun with the same file continues where it stopped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvhandoff.errors import ConfigError
from kvhandoff.files import atomic_write_json
from kvhandoff.runtime.plan import HandoffPlan
from kvhandoff.runtime.policy import RecomputePolicy
from kvhandoff.runtime.session import SwitchingSession
from kvhandoff_lab.evaluation.switch import paired_difference, turn_items
from kvhandoff_lab.evaluation.switchtasks import DEFAULT_MAX_NEW_TOKENS, get_switch_task, item_score
from kvhandoff_lab.evaluation.tasks import cut_at_stop
from kvhandoff_lab.resume import stored_part

logger = logging.getLogger(__name__)


class RemoteAnswers:
    """An engine behind servers (e.g. `kvhandoff_lab.vllm_bench.VllmAnswers`): it answers an item itself under each
    of `CONDITIONS`, the target's greedy answer as text cut at the task's stop strings."""

    def answers(self, item, source: str, target: str, max_new_tokens: int, stop) -> dict[str, str]:
        raise NotImplementedError

ENGINE_QUALITY_FORMAT = "kvhandoff-engine-quality/1"
CONDITIONS = ("target", "switch")


def greedy_answer(session: SwitchingSession, server: str, question, tokenizer, max_new_tokens: int, stop,
                  end_ids) -> tuple[str, float]:
    """``server`` reads ``question`` (switching to it) and answers greedily, one `SwitchingSession.read` a token, up to
    an end id or the first stop string; the answer and the seconds to its first token's distribution."""
    begin = time.perf_counter()
    logprobs = session.read(server, list(question))
    first = time.perf_counter() - begin
    generated: list[int] = []
    text = ""
    for step in range(max_new_tokens):
        token = int(logprobs.argmax())
        if token in end_ids:
            break
        generated.append(token)
        text, stopped = cut_at_stop(tokenizer.decode(generated, skip_special_tokens=True), stop)
        if stopped:
            break
        if step + 1 < max_new_tokens:
            logprobs = session.read(server, [token])
    return text, first


def run_engine_quality(engines: dict, mappers: dict, tokenizer, end_ids: Sequence[int], task: str = "coqa_gen",
                       limit: int = 40, histories: int = 8, directions: Sequence[tuple[str, str]] | None = None,
                       recompute: RecomputePolicy | None = None, out: Path | None = None,
                       time_budget_s: float | None = None) -> dict:
    """engines: engine name → {model name → model} (the same models, e.g. transformers and their llama.cpp twins), or
    an engine behind servers (`RemoteAnswers`: its own answers per condition); mappers: (source, target) → `Mapper`.
    Items of the report pool; see the module docstring."""
    switch_task = get_switch_task(task)
    if not switch_task.family:
        raise ConfigError(f"{task} scores choices; the engines' answers are compared on a generative task "
                          "(coqa_gen, nq_open, gsm8k_cot)")
    max_new_tokens = DEFAULT_MAX_NEW_TOKENS[switch_task.family]
    items = turn_items(task, tokenizer, histories=histories, limit=limit)
    plan = HandoffPlan.of(recompute=recompute)
    directions = list(directions or mappers)
    result = {"format": ENGINE_QUALITY_FORMAT, "task": task, "items": len(items), "histories": histories,
              "recompute": plan.recompute.spec, "directions": [" → ".join(d) for d in directions],
              "engines": list(engines)}
    result["records"] = stored_part(out, {key: result[key] for key in ("format", "task", "recompute", "histories")})
    started = time.perf_counter()
    groups: dict[str, list] = {}
    for item in items:
        groups.setdefault(item.history.key, []).append(item)
    for group in groups.values():  # history by history, every direction and engine on it: a stopped run is paired
        for source, target in directions:
            for engine, models in engines.items():
                done = result["records"].setdefault(f"{engine}: {source} → {target}", {})
                todo = [item for item in group if item.id not in done]
                if not todo:
                    continue
                if time_budget_s is not None and time.perf_counter() - started > time_budget_s:
                    break
                bases = None if isinstance(models, RemoteAnswers) else \
                    _history_sessions(models, mappers, source, target, todo[0].history, plan)
                for item in todo:
                    if bases is None:
                        outputs = models.answers(item, source, target, max_new_tokens, switch_task.stop)
                    else:
                        outputs = _item_outputs(bases, item, source, target, tokenizer, switch_task, max_new_tokens,
                                                end_ids)
                    done[item.id] = _scored(item, switch_task, outputs)
                    if out is not None:
                        atomic_write_json(out, {**result, "summary": summarize_quality(result)})
    result["summary"] = summarize_quality(result)
    if out is not None:
        atomic_write_json(out, result)
    return result


def _history_sessions(models: dict, mappers: dict, source: str, target: str, history, plan: HandoffPlan) -> dict:
    """The two conditions' sessions of one history: the target alone has read it, the source has read it for a
    switch to the target."""
    alone = SwitchingSession(models, {}, plan=plan)
    alone.read(target, history.ids)
    switching = SwitchingSession(models, {(source, target): mappers[source, target]}, plan=plan)
    switching.read(source, history.ids)
    return {"target": alone, "switch": switching}


def _item_outputs(bases: dict, item, source: str, target: str, tokenizer, switch_task, max_new_tokens: int,
                  end_ids) -> dict[str, str]:
    """One item's answer under each condition (each on a fork of its history's session)."""
    outputs = {}
    for condition, base in bases.items():
        session = base.fork()
        if item.extension:
            session.read(target if condition == "target" else source, item.extension)
        outputs[condition], _ = greedy_answer(session, target, item.question, tokenizer, max_new_tokens,
                                              switch_task.stop, end_ids)
    return outputs


def _scored(item, switch_task, outputs: dict[str, str]) -> dict:
    """One item's record: its reference answers, and each condition's answer with its score."""
    record: dict = {"answers": list(item.answers)}
    for condition, output in outputs.items():
        record[condition] = {"output": output,
                             "score": item_score(switch_task, {"output": output, "answers": list(item.answers)})}
    return record


def summarize_quality(result: dict) -> dict:
    """Per direction: each engine's mean per condition, switch − target with its interval, and llama.cpp's switch
    − transformers' on the items both engines scored."""
    summary: dict = {}
    for direction in result["directions"]:
        by_engine = {engine: result["records"].get(f"{engine}: {direction}", {}) for engine in result["engines"]}
        common = sorted(set.intersection(*(set(records) for records in by_engine.values()))) if by_engine else []
        entry: dict = {"items": len(common)}
        scores = {engine: {c: np.array([records[i][c]["score"] for i in common]) for c in CONDITIONS}
                  for engine, records in by_engine.items()}
        for engine, per in scores.items():
            entry[engine] = {c: float(per[c].mean()) if common else None for c in CONDITIONS}
            if common:
                entry[engine]["switch_minus_target"] = _difference(per["switch"], per["target"])
        engines = list(scores)
        if len(engines) == 2 and common:
            first, second = engines
            entry[f"{first}_minus_{second}"] = {c: _difference(scores[first][c], scores[second][c])
                                                for c in CONDITIONS}
            entry["same_switch_answers"] = float(np.mean([
                by_engine[first][i]["switch"]["output"].strip() == by_engine[second][i]["switch"]["output"].strip()
                for i in common]))
        summary[direction] = entry
    return summary


def _difference(a: np.ndarray, b: np.ndarray) -> dict:
    difference = paired_difference(a, b)
    return {"mean": difference["value"], "ci95": difference["ci"]}
