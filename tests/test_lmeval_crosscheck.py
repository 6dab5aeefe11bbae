"""The cross-check of the lm-eval adapter: per-item comparison, lm-eval's logged samples as records, the offline
MMLU task's prompts, and the whole cross-check on tiny models (lm-eval's `hf` model loading the tiny target)."""

from __future__ import annotations

import json
import logging
import os

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # nothing here may reach the hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("lm_eval", reason="lm-eval is not installed (`pip install -e .[lmeval]`; the dev extra has it)")

from kvhandoff import fit_mapper
from kvhandoff.errors import ConfigError
from kvhandoff.workflow import load_named_pair
from kvhandoff_lab.evaluation.tasks import load_items
from kvhandoff_lab.lmeval.crosscheck import (
    DEFAULT_TOLERANCE,
    chosen,
    compare_records,
    doc_indices,
    history_boundaries,
    lm_eval_records,
    main,
    run_crosscheck,
)

from conftest import random_batches, save_tiny_pair


def record(item_id, lls, gold=0, lengths=None):
    return {"id": item_id, "loglikelihoods": lls, "norm_lengths": lengths or [1] * len(lls), "gold": gold}


def test_compare_counts_flipped_predictions_and_loglikelihood_differences():
    reference = {"a": record("a", [-1.0, -2.0]), "b": record("b", [-3.0, -2.9], gold=1),
                 "c": record("c", [-1.0, -5.0], gold=1, lengths=[1, 10])}
    other = {"a": record("a", [-1.0, -2.0]), "b": record("b", [-2.95, -2.96], gold=1),
             "c": record("c", [-1.0, -5.0], gold=1, lengths=[1, 10]), "unused": record("unused", [0.0, -1.0])}
    out = compare_records(reference, other, ("acc", "acc_norm"), tolerance=0.01)
    assert out["n"] == 3
    assert out["accuracy"]["acc"] == {"reference": pytest.approx(2 / 3), "other": pytest.approx(1 / 3)}
    # per character, c's long gold choice wins (-5/10 > -1/1)
    assert out["accuracy"]["acc_norm"] == {"reference": 1.0, "other": pytest.approx(2 / 3)}
    assert out["predictions_differ"] == {"acc": 1, "acc_norm": 1}
    flip, = out["differing_items"]["acc"]
    assert flip["id"] == "b" and (flip["reference"], flip["other"]) == (1, 0)
    assert flip["reference_margin"] == pytest.approx(0.1)
    diff = out["loglikelihood_difference"]
    assert diff["max"] == pytest.approx(0.06) and diff["beyond_tolerance"] == 2 and diff["choices"] == 6


def test_compare_refuses_items_missing_or_scored_differently():
    reference = {"a": record("a", [-1.0, -2.0])}
    with pytest.raises(ConfigError, match="no record"):
        compare_records(reference, {}, ("acc",))
    with pytest.raises(ConfigError, match="different choices or gold"):
        compare_records(reference, {"a": record("a", [-1.0, -2.0], gold=1)}, ("acc",))


def test_chosen_normalises_by_length_for_acc_norm():
    rec = record("x", [-4.0, -3.0], lengths=[8, 2])
    assert chosen(rec, "acc") == (1, pytest.approx(1.0))
    assert chosen(rec, "acc_norm") == (0, pytest.approx(1.0))


def test_lm_eval_samples_become_records_with_lm_evals_own_metrics():
    sample = {"doc": {"id": "Q1"}, "target": 1, "acc": 1.0, "acc_norm": 0.0,
              "arguments": [("Question: q\nAnswer:", " yes"), ("Question: q\nAnswer:", " no way")],
              "resps": [[(-2.5, False)], [(-1.5, True)]]}
    (item_id, rec), = lm_eval_records([sample]).items()
    assert item_id == "Q1"
    assert rec["loglikelihoods"] == [-2.5, -1.5] and rec["norm_lengths"] == [3, 6] and rec["gold"] == 1
    assert rec["metrics"] == {"acc": 1.0, "acc_norm": 0.0}


def test_mmlu_history_boundaries_and_document_indices():
    items = load_items("mmlu")
    ids = [items[0].id, items[500].id]
    assert doc_indices("mmlu", list(reversed(ids))) == [0, 500]
    out = history_boundaries("mmlu", ids)
    assert out["n"] == 2 and out["same_history"] + len(out["question_holds_the_delimiter"]) == 2
    blank_line = next(i for i in items if "\n\n" in i.choices[0].context[len(i.shared_prefix):])
    assert history_boundaries("mmlu", [blank_line.id])["question_holds_the_delimiter"] == [blank_line.id]


def test_offline_mmlu_task_prints_kvhandoffs_prompts():
    from lm_eval.tasks import TaskManager

    from kvhandoff_lab.lmeval import TASKS_DIR

    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    task = manager.load("kvhandoff_mmlu")["tasks"]["kvhandoff_mmlu"]
    docs = list(task.eval_docs)
    items = load_items("mmlu")
    assert len(docs) == len(items)
    for index in (0, 1234, len(items) - 1):
        doc, item = docs[index], items[index]
        assert doc["id"] == item.id
        assert task.fewshot_context(doc, 0) == item.choices[0].context
        assert [" " + c for c in task.doc_to_choice(doc)] == [c.continuation for c in item.choices]
        assert task.doc_to_target(doc) == item.gold


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("crosscheck")
    small, large = save_tiny_pair(folder)
    pair = load_named_pair(small, large, progress=False)
    mapper = fit_mapper(pair.source, pair.target, random_batches(4), progress=False)
    mapper.save(folder / "mapper")
    return folder, pair, mapper


def test_crosscheck_on_tiny_models_finds_the_harnesses_in_agreement(tiny):
    folder, pair, mapper = tiny
    result = run_crosscheck(pair, mapper, folder / "eval", "arc_easy", 3, "mmlu", 2, progress=False)
    checks = {entry["name"]: entry for entry in result["checks"]}
    assert len(checks) == 4 and all(entry["n"] in (2, 3) for entry in checks.values())
    for entry in checks.values():
        assert entry["loglikelihood_difference"]["beyond_tolerance"] == 0, entry["name"]
        assert set(entry["predictions_differ"].values()) == {0}, entry["name"]
        assert entry["accuracy"]["acc"]["reference"] == entry["accuracy"]["acc"]["other"]
    hf = checks["target alone: lm-eval hf vs kvhandoff-lab eval"]
    assert hf["lm_eval_reported"]["acc"] == hf["accuracy"]["acc"]["other"]
    assert hf["kvhandoff_eval_reported"]["acc"]["target"]["value"] == hf["accuracy"]["acc"]["reference"]
    # the adapter runs kvhandoff's own scorer: agreement far below the tolerance for lm-eval hf
    assert checks["target alone: adapter vs kvhandoff-lab eval"]["loglikelihood_difference"]["max"] < \
        DEFAULT_TOLERANCE / 10
    assert (folder / "eval" / "all" / "forward.json").is_file()
    assert (folder / "eval" / "history" / "forward.json").is_file()


def test_command_line_writes_the_result(tiny, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kvhandoff_lab")
    folder, _, _ = tiny
    out = tmp_path / "crosscheck.json"
    main(["--source", str(folder / "small"), "--target", str(folder / "large"), "--mapper", str(folder / "mapper"),
          "--task", "arc_challenge", "--limit", "2", "--history-limit", "0", "--eval-dir", str(tmp_path / "eval"),
          "--out", str(out), "--no-progress"])
    result = json.loads(out.read_text())
    assert [entry["task"] for entry in result["checks"]] == ["arc_challenge"] * 3
    assert f"wrote {out}" in caplog.text and "loglikelihood difference" in caplog.text
