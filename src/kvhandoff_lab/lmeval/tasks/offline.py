"""Loaders the task configs of this folder name with `custom_dataset: !function offline.<name>` (lm-eval loads
this file by its path)."""

from kvhandoff_lab.lmeval import arc_dataset, mmlu_dataset

__all__ = ["arc_dataset", "mmlu_dataset"]
