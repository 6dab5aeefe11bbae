"""Measuring the quality guard on real conversations (`kvhandoff-lab guard-eval`): AUROC of each signal for "the answer
after the handoff differs from the answer after a re-prefill", a threshold chosen on dev conversations, and its
catch rate and false-fallback rate on held-out ones.

Conversations are CoQA stories with their questions (`workload.coqa_dialogues`), in the server's chat format: the
first turn is the chat template's rendering of the story and the first question (with the generation prompt), every
later turn what the template adds after an assistant answer: the end of the answer's message, the next question as
a user message and the generation prompt (`kvhandoff.serving.calibrate.chat_turns`). The serving model switches every
``switch_every`` turns; conversation i starts on hosted model i % 2, so both directions are measured. The split is the
product's (`kvhandoff.coqa.split_of`): every ``heldout_every``-th CoQA conversation in id order is held out (the
others are dev), by its place among all validation conversations — so at the default ``heldout_every`` 2 the
held-out conversations are never among the dev conversations `kvhandoff guard-calibrate` records a threshold from,
whatever the turn counts. Conversations run in order until the time limit, so both splits fill alike.

Each switch is recorded once for every signal (`guard.guard_records_by_signal`: the guard's score, the receiving
model's greedy answers over the mapped cache and after re-prefilling, and the KL of their first tokens'
distributions). A switch is bad as each of `LABELS` says (the answer changed; its F1 against the re-prefilled answer
fell below 0.5; the first token's KL exceeded 0.5 nats). Per label and signal: AUROC (dev, held-out, all), the
threshold maximising catch − false-fallback rate on dev (`calibrate.summarize_guard`, bounded by
``max_false_fallback`` when given) and that threshold's rates on held-out, and the rates of the server's configured
threshold (``config.switch.guard_threshold``; `SERVED_THRESHOLD` when none is configured) on all of them. With an
escalation policy every switch is also handed over with a larger recompute budget, and `escalation` compares serving
the mapped cache, re-prefilling and escalating at the switches a signal flags.
"""

from __future__ import annotations

import time
from pathlib import Path

import kvhandoff
from kvhandoff.coqa import coqa_places, split_of
from kvhandoff.errors import ConfigError
from kvhandoff.files import atomic_write_json
from kvhandoff.runtime.policy import RecomputePolicy
from kvhandoff.runtime.switch.guard import GUARD_SIGNALS
from kvhandoff.serving.calibrate import (
    GuardRecord,
    WithinTime,
    auroc,
    chat_turns,
    flag_rates,
    guard_records_by_signal,
    summarize_guard,
    switching_schedule,
)
from kvhandoff.serving.decoding import end_ids
from kvhandoff.serving.settings import ServeConfig
from kvhandoff_lab.evaluation.metrics import paired_bootstrap, token_f1
from kvhandoff_lab.serving.client import machine_facts
from kvhandoff_lab.serving.workload import coqa_dialogues

GUARD_EVAL_FORMAT = "kvhandoff-serve-guard/1"
#: the threshold the reports compare every signal against when the config names none: the entropy threshold the
#: server used for every pair before guards were recorded per mapper (chosen on the default pair's dev
#: conversations, docs/SERVING.md)
SERVED_THRESHOLD = 1.79


def heldout_conversations(dialogues, heldout_every: int = 2) -> set[int]:
    """The indices of ``dialogues`` that are held out: by each one's place among all CoQA validation conversations
    (`kvhandoff.coqa.split_of`; a dialogue CoQA does not hold goes by its index)."""
    places = coqa_places()
    return {i for i, dialogue in enumerate(dialogues)
            if split_of(places.get(dialogue.id, i), heldout_every) == "heldout"}


def rates(records: list[GuardRecord], threshold: float | None) -> dict:
    """Catch rate (changed answers with score > threshold) and false-fallback rate (unchanged ones above it) of
    ``records`` with a score; None where a class is empty or there is no threshold."""
    scored = [r for r in records if r.score is not None]
    if threshold is None:
        return {"catch_rate": None, "false_fallback_rate": None, "fallback_rate": None}
    catch, false_rate = flag_rates([r.score for r in scored], [r.differs for r in scored], threshold)
    return {"catch_rate": catch, "false_fallback_rate": false_rate,
            "fallback_rate": sum(r.score > threshold for r in scored) / len(scored) if scored else None}


def _auroc(records: list[GuardRecord]) -> float | None:
    scored = [r for r in records if r.score is not None]
    return auroc([r.score for r in scored], [r.differs for r in scored])


def auroc_interval(records: list[GuardRecord], n_resamples: int = 1000, seed: int = 0) -> list[float] | None:
    """95 % bootstrap interval of the AUROC of ``records`` (handoffs resampled with replacement; resamples with one
    class only are skipped); None without both classes."""
    scored = [r for r in records if r.score is not None]
    if _auroc(scored) is None:
        return None

    def statistic(sample) -> float:
        value = auroc(list(sample["score"]), [bool(y) for y in sample["bad"]])
        return float("nan") if value is None else value

    low, high = paired_bootstrap({"score": [r.score for r in scored], "bad": [float(r.differs) for r in scored]},
                                 statistic, n_resamples, seed)
    return [low, high]


def evaluate_signal(records: list[GuardRecord], heldout: set[int], signal: str,
                    max_false_fallback: float | None = None, served_threshold: float = SERVED_THRESHOLD) -> dict:
    """One signal's numbers (module docstring) from its records; ``heldout``: the held-out conversations."""
    dev = [r for r in records if r.conversation not in heldout]
    held = [r for r in records if r.conversation in heldout]
    chosen = summarize_guard(dev, signal, max_false_fallback)
    return {
        "signal": signal,
        "auroc_dev": chosen.auroc, "auroc_heldout": _auroc(held), "auroc_all": _auroc(records),
        "auroc_heldout_ci": auroc_interval(held), "auroc_all_ci": auroc_interval(records),
        "threshold": chosen.threshold,
        "dev": {"handoffs": chosen.handoffs, "changed": chosen.changed, "catch_rate": chosen.catch_rate,
                "false_fallback_rate": chosen.false_fallback_rate},
        "heldout": {"handoffs": sum(r.score is not None for r in held),
                    "changed": sum(r.differs for r in held if r.score is not None), **rates(held, chosen.threshold)},
        "served_threshold": {"threshold": served_threshold, **rates(records, served_threshold)},
        "by_direction": {f"{source} → {target}": _direction(records, source, target, served_threshold)
                         for source, target in sorted({(r.source, r.target) for r in records})},
        "unscored": sum(r.score is None for r in records),
    }


def _direction(records: list[GuardRecord], source: str, target: str, served_threshold: float) -> dict:
    chosen = [r for r in records if (r.source, r.target) == (source, target)]
    return {"handoffs": len(chosen), "changed": sum(r.differs for r in chosen), "auroc": _auroc(chosen),
            "served_threshold": rates(chosen, served_threshold)}


#: what counts as a bad handoff (each stored record → bool): the greedy answer changed at all; its token F1 against
#: the re-prefilled answer fell below 0.5 (the meaning changed, not just the wording); the first answer token's
#: distribution moved by more than 0.5 nats of KL from the re-prefilled one
LABELS = {
    "answer_changed": lambda r: r["differs"],
    "answer_f1_below_0.5": lambda r: r["answer_f1"] < 0.5,
    "first_token_kl_above_0.5": lambda r: r["first_kl"] > 0.5,
}


def records_of(result: dict, label: str = "answer_changed") -> dict[str, list[GuardRecord]]:
    """The `GuardRecord`s of each signal stored in a `run_guard_eval` result (to summarise it again), labelled as
    ``label`` (one of `LABELS`) says."""
    if label not in LABELS:
        raise ConfigError(f"guard label must be one of {', '.join(LABELS)}, got {label!r}")
    bad = LABELS[label]
    return {signal: [GuardRecord(r["conversation"], r["turn"], r["from"], r["to"], r["mapped_tokens"],
                                 r["scores"][signal], bad(r)) for r in result["records"]]
            for signal in result["settings"]["signals"]}


def escalation(result: dict, signal: str, threshold: float | None) -> dict:
    """What the guard ``signal`` with ``threshold`` serves at the switches of ``result`` (run with an escalation
    policy): per strategy for a flagged switch — serve the mapped cache anyway ("none"), re-prefill ("fallback"),
    or hand over again with the larger recompute budget ("escalate") — the mean token F1 of the served answer
    against the re-prefilled one and the share of answers that differ from it; plus the share of switches
    flagged. Escalating every switch is the row "escalate_all"."""
    records = [r for r in result["records"] if r["scores"][signal] is not None and r.get("escalated") is not None]
    if not records or threshold is None:
        return {}
    flagged = [r["scores"][signal] > threshold for r in records]

    def served(choose):
        pairs = [choose(r, f) for r, f in zip(records, flagged, strict=True)]
        return {"mean_f1": sum(f1 for f1, _ in pairs) / len(pairs),
                "changed": sum(changed for _, changed in pairs) / len(pairs)}

    def handed(r):
        return r["answer_f1"], r["differs"]

    def escalated(r):
        return r["escalated_f1"], r["escalated"] != r["own"]

    return {"signal": signal, "threshold": threshold, "switches": len(records),
            "flagged": sum(flagged) / len(records),
            "none": served(lambda r, f: handed(r)),
            "fallback": served(lambda r, f: (1.0, False) if f else handed(r)),
            "escalate": served(lambda r, f: escalated(r) if f else handed(r)),
            "escalate_all": served(lambda r, f: escalated(r))}


def resummarize(result: dict, served_threshold: float = SERVED_THRESHOLD) -> dict:
    """``result`` (a `run_guard_eval` result, e.g. read back from its JSON) with its per-signal numbers computed
    again from its records by this version of `evaluate_signal`: "signals" for the label "answer_changed", "labels"
    for every label of `LABELS` (a stored result gets those its records hold), and
    "escalation" per signal at its dev threshold when the run handed switches over with an escalation policy."""
    heldout = {r["conversation"] for r in result["records"] if r["split"] == "heldout"}
    settings = result["settings"]
    labels = {}
    for label in LABELS:
        try:
            by_signal = records_of(result, label)
        except KeyError:  # a stored result without this label's field
            continue
        labels[label] = {signal: evaluate_signal(records, heldout, signal, settings["max_false_fallback"],
                                                 served_threshold) for signal, records in by_signal.items()}
    signals = labels["answer_changed"]
    escalations = {signal: escalation(result, signal, row["threshold"]) for signal, row in signals.items()}
    return {**result, "signals": signals, "labels": labels,
            "escalation": {signal: row for signal, row in escalations.items() if row}}


def _record_json(record: GuardRecord, scores: dict, dialogue_id: str, split: str, decode) -> dict:
    """One switch of a guard measurement as stored: the scores, the labels' inputs and the answers' texts."""
    handed, own = decode(record.handed), decode(record.own)
    row = {"conversation": record.conversation, "id": dialogue_id, "turn": record.turn, "from": record.source,
           "to": record.target, "mapped_tokens": record.mapped_tokens, "differs": record.differs, "split": split,
           "scores": scores, "first_kl": record.first_kl, "answer_f1": token_f1(handed, own), "handed": handed,
           "own": own, "escalated": None, "escalated_f1": None}
    if record.escalated is not None:
        escalated = decode(record.escalated)
        row.update(escalated=escalated, escalated_f1=token_f1(escalated, own))
    return row


def run_guard_eval(models, mappers, conversations: int = 20, turns: int = 4, switch_every: int = 1,
                   signals=GUARD_SIGNALS, max_new_tokens: int = 16, window: int = 64, heldout_every: int = 2,
                   max_false_fallback: float | None = None, time_limit_s: float | None = None,
                   story_chars: int | None = None, dialogues=None, config: ServeConfig = ServeConfig(),  # noqa: B008
                   escalate: RecomputePolicy | None = None, out: str | Path | None = None) -> dict:
    """Measure the guard of ``models`` (name → (model, tokenizer)) with ``mappers`` on CoQA conversations (module
    docstring); writes the result to ``out`` (JSON) when given and returns it. ``config`` supplies the session's
    handover, exact prefix and recompute settings and the served threshold the result compares against;
    ``escalate`` (a `RecomputePolicy`) also hands every switch over with that policy (`escalation`)."""
    names, signals = list(models), tuple(signals)
    if len(names) < 2:
        raise ConfigError("the guard measurement needs two hosted models")
    if heldout_every < 2:
        raise ConfigError(f"heldout_every must be at least 2 (every n-th conversation held out), got {heldout_every}")
    tokenizer = models[names[0]][1]
    dialogues = (dialogues if dialogues is not None else coqa_dialogues(conversations, min_turns=turns))[:conversations]
    built = [list(zip(switching_schedule(i, turns, names, switch_every),
                      chat_turns(tokenizer, dialogue, turns, story_chars), strict=True))
             for i, dialogue in enumerate(dialogues)]
    stop_ids = frozenset().union(*(end_ids(model, tok) for model, tok in models.values()))
    started, timed = time.monotonic(), WithinTime(built, time_limit_s)
    records = guard_records_by_signal({name: model for name, (model, _) in models.items()}, mappers, timed,
                                      signals, max_new_tokens, window, stop_ids, config.handover,
                                      config.switch.plan(), escalate=escalate)
    wall, ran = time.monotonic() - started, timed.started
    first = records[signals[0]]
    heldout = heldout_conversations(dialogues[:ran], heldout_every)

    def decode(ids) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    settings = {"conversations": conversations, "turns": turns, "switch_every": switch_every,
                "signals": list(signals), "max_new_tokens": max_new_tokens, "window": window,
                "heldout_every": heldout_every, "max_false_fallback": max_false_fallback, "time_limit_s": time_limit_s,
                "story_chars": story_chars, "handover": config.handover,
                "recompute": config.switch.served_recompute.spec,
                "escalate": None if escalate is None else escalate.spec,
                "labels": list(LABELS), "text": "CoQA validation conversations in the chat template"}
    result = {
        "format": GUARD_EVAL_FORMAT,
        "kvhandoff_version": kvhandoff.__version__,
        "models": names,
        "settings": settings,
        "n": {"conversations_run": ran, "conversations_dev": ran - len(heldout),
              "conversations_heldout": len(heldout), "handoffs": len(first),
              "changed": sum(r.differs for r in first)},
        "wall_s": wall,
        "records": [_record_json(r, {signal: records[signal][i].score for signal in signals},
                                 dialogues[r.conversation].id, "heldout" if r.conversation in heldout else "dev",
                                 decode)
                    for i, r in enumerate(first)],
        "machine": machine_facts(),
    }
    threshold = config.switch.guard_threshold
    result = resummarize(result, SERVED_THRESHOLD if threshold is None else threshold)
    if out is not None:
        atomic_write_json(Path(out), result)
    return result


def guard_table(result: dict):
    """A rich table: per label and signal AUROC, the dev threshold and its held-out rates."""
    from rich.table import Table  # rich is only needed to print, not to measure

    n = result["n"]
    table = Table(title=(f"guard on {n['conversations_run']} conversations ({n['conversations_dev']} dev, "
                         f"{n['conversations_heldout']} held out): {n['handoffs']} handoffs, {n['changed']} changed "
                         f"answers"))
    for column in ("label", "signal", "AUROC dev", "AUROC held-out", "threshold (dev)", "catch held-out",
                   "false fallback held-out", "served threshold: catch / false"):
        table.add_column(column, justify="right")

    def cell(value, digits=3):
        return "-" if value is None else f"{value:.{digits}f}"

    for label, by_signal in result["labels"].items():
        for signal, row in by_signal.items():
            served = row["served_threshold"]
            table.add_row(label, signal, cell(row["auroc_dev"]), cell(row["auroc_heldout"]),
                          cell(row["threshold"], 4), cell(row["heldout"]["catch_rate"]),
                          cell(row["heldout"]["false_fallback_rate"]),
                          f"{cell(served['catch_rate'])} / {cell(served['false_fallback_rate'])}")
    return table
