"""The switch benchmark's generative and long-input tasks: their data, prompts, items and per-item scores.

Every item is a new turn (``question``) after a history: a header, solved exemplars of the pool other than the
evaluated one, then what the item itself puts in the history (``base``, shared by the items of one story, and
``extension``, the item's own).

- ``nq_open``: NQ-open validation (``hf_datasets/nq_open``); exemplars ``"Question: {q}\\nAnswer: {a}\\n\\n"``;
  the new turn ``"Question: {q}\\nAnswer:"``, answered greedily; exact match against any alias.
- ``gsm8k_cot``: GSM8K test (the OLMES request dump), exemplars ``"Q: {q}\\nA: {worked solution}\\n\\n"``
  (`tasks.gsm8k_worked_answer`, at least `GSM8K_SHOTS` of them); ``"Q: {q}\\nA:"``, a greedy chain of thought;
  final-answer exact match (`tasks.extract_gsm8k_answer`, flexible).
- ``coqa_gen``: CoQA validation conversations; exemplar conversations (the story and its first turns), then the
  item's story (``base``) and its earlier turns with their first reference answer (``extension``); the turn's
  question answered greedily; token F1 against the references (`metrics.max_f1`).
- ``boolq_long``: BoolQ validation; exemplars with their passages, then the item's passage (``extension``); the
  question ``"Question: {q}?\\nAnswer:"`` read by the target, ``" no"`` / ``" yes"`` scored by loglikelihood (acc).
- ``squad_gen`` and ``drop_gen``, reading comprehension with the passage in the history: SQuAD and DROP validation
  (the OLMES request dumps); exemplars with their passages and answers, then the item's passage (``extension``:
  SQuAD ``"Title: {t}\\nBackground: {passage}\\n"``, DROP ``"Passage: {passage}\\n"``); the question
  ``"Question: {q}\\nAnswer:"`` answered greedily; token F1 against the references (DROP: each reference's spans
  joined). One question per passage; a passage's pool is that of its text.

Pools: `tasks.pool_of` of the dataset's task name and the item's (CoQA: the conversation's) id, the split the
`eval` tasks of the same data use.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvhandoff.coqa import load_coqa_conversations
from kvhandoff.errors import ConfigError
from kvhandoff.files import sha256_bytes
from kvhandoff_lab.evaluation.data import hf_rows, oe_requests
from kvhandoff_lab.evaluation.metrics import exact_match, max_f1, normalise_text
from kvhandoff_lab.evaluation.tasks import (
    GENERATE,
    GSM8K_SHOTS,
    GSM8K_STOP,
    LOGLIKELIHOOD,
    POOLS,
    extract_gsm8k_answer,
    gsm8k_exact_match,
    gsm8k_gold,
    gsm8k_id,
    gsm8k_worked_answer,
    mc_item_metrics,
    normalise_answer,
    pool_of,
    until_end_of_text,
)

#: generation lengths per task family (`SwitchTask.family`), overridable per family
DEFAULT_MAX_NEW_TOKENS = {"answer": 32, "cot": 256}
#: histories per task, each shared by an equal share of the items
DEFAULT_TASK_HISTORIES = 8
#: evaluated turns of each CoQA conversation (the items of one story share its prefill)
TURNS_PER_STORY = 4
#: turns of an exemplar conversation
EXEMPLAR_TURNS = 5
SHORT_ANSWER_STOP = ("\n", "Question:", "Q:")
COQA_HEADER = ("Below is a passage followed by a conversation so far, where each turn in the conversation contains a "
               "question and an answer. Please answer the final question by referring to the passage and the "
               "previous questions.\n\n")


@dataclass(frozen=True)
class Exemplar:
    """A solved exemplar of a history: its pool id and its text (ending in a blank line)."""

    id: str
    text: str


@dataclass(frozen=True)
class TaskItem:
    """An item: its new turn (``question``), what it puts in the history (``base``, shared by the items of one
    ``base_id``; ``extension``, its own) and what scores it (``answers``; ``choices`` and ``gold``)."""

    id: str
    question: str
    answers: tuple[str, ...] = ()
    choices: tuple[str, ...] = ()
    gold: int = 0
    base: str = ""
    base_id: str = ""
    extension: str = ""

    @property
    def pool_id(self) -> str:
        return self.base_id or self.id

    @property
    def history_base(self) -> str:
        """What tells the histories of one slot apart: the id of the base the item adds to them, if any (an item
        whose passage is its own ``extension`` shares its slot's history with the slot's other items)."""
        return self.base_id if self.base else ""


@dataclass(frozen=True)
class SwitchTask:
    """A task of the switch benchmark's generative group: how it is read, scored and split."""

    name: str
    display: str
    kind: str  # tasks.GENERATE or tasks.LOGLIKELIHOOD
    metric: str
    family: str  # its `DEFAULT_MAX_NEW_TOKENS` entry ("" when it does not generate)
    data_task: str  # the `pool_of` task name of its data
    header: str
    stop: tuple[str, ...]
    min_exemplars: int
    items: Callable[[], tuple[TaskItem, ...]]
    exemplars: Callable[[], tuple[Exemplar, ...]]
    turns_per_base: int = 1


# -- data --------------------------------------------------------------------------------------------------------


@functools.cache
def _nq_open() -> tuple[tuple[TaskItem, ...], tuple[Exemplar, ...]]:
    items, exemplars = [], []
    for index, row in enumerate(hf_rows("nq_open/none/validation")):
        answers = tuple(str(a) for a in row["answer"])
        item = TaskItem(f"nq_open-{index}", f"Question: {row['question']}\nAnswer:", answers)
        items.append(item)
        exemplars.append(Exemplar(item.id, f"{item.question} {answers[0]}\n\n"))
    return tuple(items), tuple(exemplars)


@functools.cache
def _gsm8k() -> tuple[tuple[TaskItem, ...], tuple[Exemplar, ...]]:
    items, exemplars = [], []
    for request in oe_requests("gsm8k/gold_bpb_5shot"):
        doc = request["doc"]
        item = TaskItem(gsm8k_id(doc), f"Q: {doc['question']}\nA:", (gsm8k_gold(doc["answer"]),))
        items.append(item)
        exemplars.append(Exemplar(item.id, f"{item.question} {gsm8k_worked_answer(doc['answer'])}\n\n"))
    return tuple(items), tuple(exemplars)


def _qa_block(question: str, answer: str) -> str:
    return f"Question: {question}\nAnswer: {answer}\n\n"


@functools.cache
def _coqa() -> tuple[tuple[TaskItem, ...], tuple[Exemplar, ...]]:
    items, exemplars = [], []
    for conversation in sorted(load_coqa_conversations(min_turns=1, num_turns=None), key=lambda c: c.id):
        base = f"Passage: {conversation.story}\n\n"
        blocks = [_qa_block(turn.question, turn.answers[0]) for turn in conversation.turns]
        exemplars.append(Exemplar(conversation.id, base + "".join(blocks[:EXEMPLAR_TURNS])))
        for index, turn in enumerate(conversation.turns):
            items.append(TaskItem(f"coqa-{conversation.id}-t{index}", f"Question: {turn.question}\nAnswer:",
                                  tuple(turn.answers), base=base, base_id=conversation.id,
                                  extension="".join(blocks[:index])))
    return tuple(items), tuple(exemplars)


@functools.cache
def _boolq() -> tuple[tuple[TaskItem, ...], tuple[Exemplar, ...]]:
    items, exemplars = [], []
    for index, row in enumerate(hf_rows("boolq/none/validation")):
        gold = int(bool(row["answer"]))
        item = TaskItem(f"boolq-{index}", f"Question: {row['question']}?\nAnswer:", choices=(" no", " yes"),
                        gold=gold, extension=f"{row['passage']}\n")
        items.append(item)
        exemplars.append(Exemplar(item.id, item.extension + item.question + item.choices[gold] + "\n\n"))
    return tuple(items), tuple(exemplars)


def _passage_items(rows, prefix: str) -> tuple[tuple[TaskItem, ...], tuple[Exemplar, ...]]:
    """Items and exemplars of (id, passage text, question, answers) rows: the passage in the history, the question
    the new turn. A passage several questions share is one pool id (``base_id``), so it is never both an item of
    one pool and an exemplar in the other's histories; the items draw one question per passage, the exemplars the
    first."""
    items, exemplars = [], {}
    for item_id, passage, question, answers in rows:
        extension = f"{passage.strip()}\n"
        key = f"{prefix}-{sha256_bytes(extension.encode(), 8)}"
        item = TaskItem(f"{prefix}-{item_id}", f"Question: {question.strip()}\nAnswer:", answers, base_id=key,
                        extension=extension)
        items.append(item)
        exemplars.setdefault(key, Exemplar(key, f"{extension}{item.question} {answers[0]}\n\n"))
    return tuple(items), tuple(exemplars.values())


@functools.cache
def _squad() -> tuple[tuple[TaskItem, ...], tuple[Exemplar, ...]]:
    rows = []
    for request in oe_requests("squad/bpb_5shot"):
        doc = request["doc"]
        passage, _, question = doc["query"].rpartition("\nQuestion:")
        rows.append((doc["id"], passage, question.removesuffix("\nAnswer:"), tuple(doc["answers_text"])))
    return _passage_items(rows, "squad")


@functools.cache
def _drop() -> tuple[tuple[TaskItem, ...], tuple[Exemplar, ...]]:
    rows = []
    for request in oe_requests("drop/bpb_5shot"):
        doc = request["doc"]
        answers = tuple(dict.fromkeys(" ".join(spans) for spans in doc["answers"] if spans))
        rows.append((doc["query_id"], f"Passage: {doc['passage']}", doc["question"], answers))
    return _passage_items(rows, "drop")


def _part(loader, index: int) -> Callable[[], tuple]:
    return lambda: loader()[index]


SWITCH_TASKS: dict[str, SwitchTask] = {
    task.name: task
    for task in (
        SwitchTask("nq_open", "NQ-open", GENERATE, "exact_match", "answer", "nq_open", "", SHORT_ANSWER_STOP,
                   1, _part(_nq_open, 0), _part(_nq_open, 1)),
        SwitchTask("gsm8k_cot", "GSM8K CoT", GENERATE, "exact_match", "cot", "gsm8k", "", GSM8K_STOP,
                   GSM8K_SHOTS, _part(_gsm8k, 0), _part(_gsm8k, 1)),
        SwitchTask("coqa_gen", "CoQA", GENERATE, "f1", "answer", "coqa", COQA_HEADER, SHORT_ANSWER_STOP, 1,
                   _part(_coqa, 0), _part(_coqa, 1), TURNS_PER_STORY),
        SwitchTask("boolq_long", "BoolQ, passage in history", LOGLIKELIHOOD, "acc", "", "boolq", "", (), 1,
                   _part(_boolq, 0), _part(_boolq, 1)),
        SwitchTask("squad_gen", "SQuAD, passage in history", GENERATE, "f1", "answer", "squad", "", SHORT_ANSWER_STOP,
                   1, _part(_squad, 0), _part(_squad, 1)),
        SwitchTask("drop_gen", "DROP, passage in history", GENERATE, "f1", "answer", "drop", "", SHORT_ANSWER_STOP,
                   1, _part(_drop, 0), _part(_drop, 1)),
    )
}
#: the group alias of these tasks
GROUP = "generative"


def get_switch_task(name: str) -> SwitchTask:
    try:
        return SWITCH_TASKS[name]
    except KeyError:
        raise ConfigError(f"unknown generative switch task {name!r}; choose from {', '.join(SWITCH_TASKS)}") from None


# -- items and exemplars per pool --------------------------------------------------------------------------------


def _check_pool(pool: str) -> None:
    if pool not in POOLS:
        raise ConfigError(f"pool must be one of {POOLS}, got {pool!r}")


def pool_exemplars(task: SwitchTask, pool: str) -> list[Exemplar]:
    """The task's exemplars of ``pool``, in dataset order."""
    _check_pool(pool)
    return [e for e in task.exemplars() if pool_of(task.data_task, e.id) == pool]


def pool_items(task: SwitchTask, pool: str, histories: int, limit: int | None, seed: int = 0
               ) -> list[tuple[int, TaskItem]]:
    """``limit`` items of ``pool`` (all when None), each with its history slot, in evaluation order: item i on slot
    i mod ``histories``; a task with stories (``turns_per_base`` > 1) gives each slot whole stories in turn, with
    ``turns_per_base`` seeded turns of each. The same seed gives the same items; a larger limit extends a smaller
    one."""
    _check_pool(pool)
    if histories < 1 or (limit is not None and limit < 1):
        raise ConfigError(f"need histories >= 1 and limit >= 1, got {histories} and {limit}")
    groups: dict[str, list[TaskItem]] = {}
    for item in task.items():
        if pool_of(task.data_task, item.pool_id) == pool:
            groups.setdefault(item.pool_id, []).append(item)
    order = list(groups.values())
    random.Random(f"{seed}/{task.name}/{pool}").shuffle(order)
    per = task.turns_per_base
    if per > 1:
        order = [sorted(random.Random(f"{seed}/{task.name}/{g[0].pool_id}").sample(g, min(per, len(g))),
                        key=g.index) for g in order]
    chosen: list[tuple[int, TaskItem]] = []
    span = histories * per * -(-len(order) // histories)
    for i in range(span):
        if limit is not None and len(chosen) >= limit:
            break
        slot, k = i % histories, i // histories
        group = slot + histories * (k // per)
        if group < len(order) and k % per < len(order[group]):
            chosen.append((slot, order[group][k % per]))
    return chosen


def exemplar_order(task: SwitchTask, pool: str, slot: int, seed: int = 0) -> list[Exemplar]:
    """The exemplars slot ``slot``'s histories draw from, in its seeded order: those of the pool other than
    ``pool`` (the evaluated one)."""
    other = POOLS[1 - POOLS.index(pool)]
    order = pool_exemplars(task, other)
    random.Random(f"{seed}/{task.name}/history-{slot}").shuffle(order)
    return order


# -- per-item scores ---------------------------------------------------------------------------------------------


def final_answer(output: str) -> str:
    """A GSM8K output's final answer, normalised (the last number, `tasks.extract_gsm8k_answer`)."""
    return normalise_answer(extract_gsm8k_answer(until_end_of_text(output), "flexible"))


def item_score(task: SwitchTask, record: Mapping) -> float:
    """The task metric of one stored record: exact match (any alias; GSM8K: the final answer), F1, or acc."""
    if task.kind == LOGLIKELIHOOD:
        return mc_item_metrics(record)[task.metric]
    output, answers = until_end_of_text(record["output"]), record["answers"]
    if task.name == "gsm8k_cot":
        return max((gsm8k_exact_match(final_answer(output), a) for a in answers), default=0.0)
    if task.metric == "f1":
        return max_f1(output, answers)
    return exact_match(output, answers)


def answer_of(task: SwitchTask, record: Mapping) -> str:
    """What two conditions must share to give the same answer: the chosen choice, the final answer (GSM8K) or the
    normalised output."""
    if task.kind == LOGLIKELIHOOD:
        return str(int(np.argmax(record["loglikelihoods"])))
    output = until_end_of_text(record["output"])
    return final_answer(output) if task.name == "gsm8k_cot" else normalise_text(output)


def same_answer(task: SwitchTask, a: Mapping, b: Mapping) -> bool:
    return answer_of(task, a) == answer_of(task, b)


def max_new_tokens_of(task: SwitchTask, lengths: Mapping[str, int] | Sequence[tuple[str, int]]) -> int:
    """The generation length of ``task`` from a family → tokens table (0 for a task that does not generate)."""
    table = {**DEFAULT_MAX_NEW_TOKENS, **dict(lengths)}
    return table[task.family] if task.family else 0
