"""A switch's answers in llama.cpp and in transformers on the switch benchmark's generative items: on the tiny exactly
related family both engines answer as the target alone, and a rerun continues the stored result."""

import json

import pytest

from _serving_support import tiny_family
from kvhandoff.serving.decoding import end_ids

pytest.importorskip("llama_cpp")

from _llama_support import llama_model
from kvhandoff_lab.engine_quality import RemoteAnswers, run_engine_quality

#: a window that holds a CoQA history written byte by byte
LONG_CONTEXT = 8192


def test_both_engines_answer_as_the_target_alone_on_an_exact_pair(tmp_path):
    family, mappers = tiny_family(LONG_CONTEXT)
    models = {name: model for name, (model, _) in family.items()}
    tokenizer = family["small"][1]
    twins = {name: llama_model(model, tmp_path, name, context=4 * LONG_CONTEXT, sequences=8)
             for name, model in models.items()}
    out = tmp_path / "quality.json"
    try:
        first = run_engine_quality({"llama.cpp": twins, "transformers": models}, mappers, tokenizer,
                                   end_ids(models["large"], tokenizer), task="coqa_gen", limit=3, histories=1,
                                   directions=[("small", "large")], out=out, time_budget_s=0)
        assert first["summary"]["small → large"]["items"] == 0  # the budget stopped it before the first item
        result = run_engine_quality({"llama.cpp": twins, "transformers": models}, mappers, tokenizer,
                                    end_ids(models["large"], tokenizer), task="coqa_gen", limit=3, histories=1,
                                    directions=[("small", "large")], out=out)
    finally:
        for twin in twins.values():
            twin.close()
    summary = result["summary"]["small → large"]
    assert summary["items"] == 3 and summary["same_switch_answers"] == 1.0
    for engine in ("llama.cpp", "transformers"):
        assert summary[engine]["switch_minus_target"]["mean"] == 0
    records = result["records"]["llama.cpp: small → large"]
    assert all(r["switch"]["output"] == r["target"]["output"] for r in records.values())
    assert json.loads(out.read_text())["records"] == result["records"]


def test_a_task_that_scores_choices_is_refused():
    from kvhandoff.errors import ConfigError

    with pytest.raises(ConfigError, match="generative task"):
        run_engine_quality({}, {}, tiny_family()[0]["small"][1], [], task="boolq_long")


class ReferenceAnswers(RemoteAnswers):
    """A remote engine that answers every item with its first reference answer alone and nothing after a switch."""

    def __init__(self):
        self.calls = []

    def answers(self, item, source, target, max_new_tokens, stop):
        self.calls.append((source, target, max_new_tokens))
        return {"target": item.answers[0], "switch": ""}


def test_a_remote_engine_answers_each_item_itself_beside_a_local_one():
    family, mappers = tiny_family(LONG_CONTEXT)
    models = {name: model for name, (model, _) in family.items()}
    tokenizer = family["small"][1]
    remote = ReferenceAnswers()
    result = run_engine_quality({"remote": remote, "transformers": models}, mappers, tokenizer,
                                end_ids(models["large"], tokenizer), task="coqa_gen", limit=2, histories=1,
                                directions=[("small", "large")])
    summary = result["summary"]["small → large"]
    assert summary["items"] == 2 and remote.calls == [("small", "large", remote.calls[0][2])] * 2
    assert summary["remote"]["target"] == 1.0 and summary["remote"]["switch"] == 0.0
    assert summary["remote_minus_transformers"]["switch"]["mean"] <= 0
