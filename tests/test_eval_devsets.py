"""Dev sets of `kvhandoff-lab tune`: validated on creation; each kind yields a divergence and its description."""

from __future__ import annotations

import pytest

from kvhandoff.errors import ConfigError
from kvhandoff.workflow import load_named_pair
from kvhandoff_lab.evaluation.devsets import DEV_SETS, DevSet, dev_divergence, tune_table

from conftest import save_tiny_pair


def test_dev_sets_refuse_bad_values():
    assert DevSet().kind == "prose" and set(DEV_SETS) == {"prose", "mmlu", "gsm8k", "zeroshot"}
    for kwargs, field in (({"kind": "poems"}, "kind"), ({"docs": 0}, "docs"), ({"prefix_len": -1}, "prefix_len"),
                          ({"continuation_len": 0}, "continuation_len")):
        with pytest.raises(ConfigError, match=field):
            DevSet(**kwargs)


def test_a_prose_dev_set_and_its_table(tmp_path):
    pair = load_named_pair(*save_tiny_pair(tmp_path), progress=False)
    divergence, info = dev_divergence(pair, DevSet("prose", docs=1, prefix_len=40, continuation_len=8))
    assert info["kind"] == "heldout" and len(divergence.documents) == 1
    reference = divergence.source_reference()
    row = {"top_k": 1, "ridge_lambda": 0.01, "exact_prefix": 0, "target_tail": 0, "r2_k": 0.5, "r2_v": 0.5,
           **reference}
    table = tune_table({"source": "s", "target": "t", "rows": [row], "source_reference": reference})
    assert table.row_count == 1 and "dev sweep s → t" in str(table.title)
