"""The switch benchmark behind other instructions: on the tiny exactly related family a run reused at another offset
with every row recomputed answers as the target reading everything, in both the cross-model and the same-model
direction, also ranked by the source's read of the question; a rerun continues the stored result; a policy that
ranks by the source's last queries of the history is refused."""

import json

import pytest

from _serving_support import tiny_family
from kvhandoff.errors import ConfigError
from kvhandoff.runtime import policy
from kvhandoff.serving.decoding import end_ids
from kvhandoff_lab.offset_quality import REREAD, run_offset_quality

#: a window that holds a CoQA history written byte by byte
LONG_CONTEXT = 8192


def test_every_row_recomputed_answers_as_the_reread_and_a_rerun_continues(tmp_path):
    family, mappers = tiny_family(LONG_CONTEXT)
    models = {name: model for name, (model, _) in family.items()}
    tokenizer = family["small"][1]
    out = tmp_path / "offset.json"
    options = {"policies": [policy.parse("recent:100%"), policy.parse("turn_attention:100%"), policy.parse("none")],
               "directions": [("small", "large"), ("large", "large")], "task": "coqa_gen", "limit": 2,
               "histories": 1, "out": out}
    first = run_offset_quality(models, mappers, tokenizer, end_ids(models["large"], tokenizer), time_budget_s=0,
                               **options)
    assert first["summary"]["small → large"]["items"] == 0  # the budget stopped it before the first item
    result = run_offset_quality(models, mappers, tokenizer, end_ids(models["large"], tokenizer), **options)
    for direction in ("small → large", "large → large"):
        summary = result["summary"][direction]
        assert summary["items"] == 2
        assert summary["recent:100%"]["minus_reread"]["value"] == 0
        for record in result["records"][direction].values():
            assert record["recent:100%"]["output"] == record[REREAD]["output"]
            assert record["turn_attention:100%"]["output"] == record[REREAD]["output"]
    assert json.loads(out.read_text())["records"] == result["records"]


def test_a_policy_ranking_by_the_source_history_queries_is_refused():
    family, mappers = tiny_family()
    with pytest.raises(ConfigError, match="ranks by the source's attention"):
        run_offset_quality({}, mappers, family["small"][1], [], [policy.parse("source_attention:10%")],
                           [("small", "large")])
