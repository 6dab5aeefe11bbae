"""The evaluation's option sets validate on creation, naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvhandoff.errors import ConfigError
from kvhandoff_lab.evaluation.options import EvalOptions, OutputOptions, ScoringOptions


def test_eval_options_expand_tasks_and_refuse_bad_values():
    options = EvalOptions("core,perplexity", limit=3)
    assert "perplexity" in options.tasks and "perplexity" not in options.benchmark_tasks()
    assert "winogrande" in options.benchmark_tasks()
    assert EvalOptions(("mmlu",)).tasks == ("mmlu",)
    for kwargs, field in (({"tasks": "nope"}, "tasks"), ({"tasks": ""}, "tasks"), ({"limit": 0}, "limit"),
                          ({"seed": "x"}, "seed"), ({"mapped": "turn"}, "mapped"),
                          ({"exact_prefix": -1}, "exact_prefix")):
        with pytest.raises(ConfigError, match=field):
            EvalOptions(**kwargs)
    assert EvalOptions(limit=None).limit is None


def test_scoring_and_output_options():
    for field in ("max_new_tokens", "n_resamples", "perplexity_docs", "prefix_len", "coqa_turns"):
        with pytest.raises(ConfigError, match=field):
            ScoringOptions(**{field: 0})
    with pytest.raises(ConfigError, match="confidence"):
        ScoringOptions(confidence=1.5)
    output = OutputOptions("out", "forward")
    assert output.out_dir == Path("out") and output.store_dir == Path("out") / "items"
    assert OutputOptions().store_dir is None
    with pytest.raises(ConfigError, match="result_name"):
        OutputOptions(result_name="a/b")
