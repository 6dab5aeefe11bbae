"""The healing benchmark (`kvhandoff_lab.heal_quality`): on the tiny exactly related family the mapped, the healed
and the own-cache conditions answer alike, healing reads the approximate positions after each turn, the summary
pairs the turns after a switch, and a rerun continues the stored result."""

import json

import pytest

from _serving_support import tiny_family
from kvhandoff.errors import ConfigError
from kvhandoff.runtime.plan import HandoffPlan
from kvhandoff.serving.decoding import end_ids
from kvhandoff_lab.evaluation.multiturn import Conversation, Turn
from kvhandoff_lab.heal_quality import run_heal_quality, schedule

CONVERSATIONS = [Conversation(f"c{index}", f"Tom has {index + 2} cats. They sleep on the red mat.",
                              tuple(Turn(question, (answer,)) for question, answer in
                                    (("Who has cats?", "Tom"), ("How many?", str(index + 2)),
                                     ("Where do they sleep?", "the mat"), ("What colour?", "red"))))
                 for index in range(2)]


def test_schedule_switches_every_few_turns():
    assert schedule(5, ["a", "b"], 2) == ["a", "a", "b", "b", "a"]
    assert schedule(3, ["a", "b"], 1, first=1) == ["b", "a", "b"]
    with pytest.raises(ConfigError, match="every"):
        schedule(3, ["a", "b"], 0)


def test_on_an_exact_pair_every_condition_answers_alike_and_healing_reads_the_mapped_rows(tmp_path):
    family, mappers = tiny_family(2048)
    models = {name: model for name, (model, _) in family.items()}
    tokenizer = family["small"][1]
    plans = {pair: HandoffPlan(0) for pair in mappers}
    out = tmp_path / "heal.json"
    options = {"every": 2, "max_new_tokens": 4, "out": out}
    stopped = run_heal_quality(models, mappers, plans, tokenizer, end_ids(models["large"], tokenizer),
                               CONVERSATIONS, time_budget_s=0, **options)
    assert stopped["summary"]["conversations"] == 0  # the budget stopped it before the first conversation
    first = run_heal_quality(models, mappers, plans, tokenizer, end_ids(models["large"], tokenizer),
                             CONVERSATIONS[:1], **options)
    result = run_heal_quality(models, mappers, plans, tokenizer, end_ids(models["large"], tokenizer), CONVERSATIONS,
                              **options)
    assert json.loads(out.read_text())["records"]["c0"] == first["records"]["c0"]  # kept, not run again
    for record in result["records"].values():
        answers = {condition: [turn["answer"] for turn in record[condition]] for condition in ("own", "switch",
                                                                                              "healed")}
        assert answers["switch"] == answers["own"] == answers["healed"]
        switches = [t for t in range(1, 4) if record["servers"][t] != record["servers"][t - 1]]
        assert switches == [2]
        assert record["healed"][2]["healed"] > 0  # the switch's turn left mapped rows behind
        assert all(turn["healed"] == 0 for turn in record["healed"][:2])  # nothing mapped before the switch
    summary = result["summary"]
    assert summary["after_switch"]["turns"] == 2 and summary["at_switch"]["turns"] == 2
    assert summary["after_switch"]["healed"]["minus_own"]["value"] == 0
    assert summary["healing"]["heals"] >= 2
    with pytest.raises(ConfigError, match="two models"):
        run_heal_quality({"small": models["small"]}, {}, {}, tokenizer, [], CONVERSATIONS)
