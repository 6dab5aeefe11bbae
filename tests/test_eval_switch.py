import time

import numpy as np
import pytest
import torch

from _eval_support import IdentityMapper, NoisyMapper, full_sequence_logprob
from kvhandoff import FitConfig, fit_mapper
from kvhandoff.errors import ConfigError
from kvhandoff.model.cache import prefill, rollback
from kvhandoff.runtime.handoff import handoff_cache
from kvhandoff.runtime.plan import HandoffPlan
from kvhandoff.runtime.policy import Deviation, NoRecompute, Recent, Sinks, TurnAttention, budget_count
from kvhandoff.runtime.switch.guard import GUARD_SIGNALS, guard_score
from kvhandoff_lab.evaluation import switch as W
from kvhandoff_lab.evaluation.tasks import pool_of

from conftest import BYTE_MODEL, ByteTokenizer, exactly_related, random_batches, tiny_model

TOK = ByteTokenizer()
HISTORY_TOKENS = 160  # short histories keep the byte-level tests fast


@pytest.fixture(scope="module")
def models():
    return tiny_model(seed=0, **BYTE_MODEL), tiny_model(seed=1, **BYTE_MODEL)


def items_of(task: str, limit: int = 4, histories: int = 2):
    hist = W.build_histories(task, TOK, histories, HISTORY_TOKENS, pool="dev")
    return hist, W.switch_items(task, TOK, hist, limit, pool="dev")


def fresh_scores(model, item) -> list[float]:
    """Reference: each choice from a full forward over history + turn, nothing shared."""
    scores = []
    for turn, count in zip(item.turns, item.continuation_lengths, strict=True):
        context = list(item.history.ids) + list(turn[:-count])
        scores.append(full_sequence_logprob(model, context, list(turn[-count:])))
    return scores


def test_histories_are_long_distinct_and_drawn_from_the_other_pool():
    histories, items = items_of("arc_challenge", limit=6, histories=3)
    assert len(histories) == 3 and all(len(h.ids) >= HISTORY_TOKENS for h in histories)
    assert len({h.ids for h in histories}) == 3
    used = [e for h in histories for e in h.exemplars]
    assert all(pool_of("arc_challenge", e) == "report" for e in used)
    assert all(pool_of("arc_challenge", item.id) == "dev" for item in items)
    assert [item.history.key for item in items] == [f"arc_challenge-h{i % 3}" for i in range(6)]
    mmlu = W.build_histories("mmlu", TOK, 1, HISTORY_TOKENS)[0]
    assert TOK.decode(mmlu.ids).startswith(W.HISTORY_HEADERS["mmlu"])
    with pytest.raises(ConfigError, match="generates"):
        W.build_histories("gsm8k", TOK)
    with pytest.raises(ConfigError, match="fewer than"):
        W.build_histories("arc_challenge", TOK, 1, 10**6)


def test_new_turns_are_the_items_without_their_own_fewshot_prefix():
    _, (item,) = items_of("mmlu", limit=1, histories=1)
    text = TOK.decode(item.turns[0])
    assert text.startswith(TOK.decode(item.question)) and not text.startswith("The following")
    assert item.continuation_lengths == (2, 2, 2, 2)  # " A" … " D" in bytes
    assert W.shared_length(item.turns, item.continuation_lengths) == len(item.turns[0]) - 2


@pytest.mark.parametrize("task", ["arc_challenge", "winogrande", "mmlu"])
def test_batched_choices_equal_one_at_a_time_and_a_full_forward(models, task):
    model = models[0]
    _, items = items_of(task, limit=2)
    for item in items:
        cache = prefill(model, torch.tensor([list(item.history.ids)]))[0]
        batched = W.score_turns(model, cache, item.turns, item.continuation_lengths)
        assert cache.get_seq_length() == len(item.history.ids)  # restored
        single = [W.score_turns(model, cache, [turn], [count])[0]
                  for turn, count in zip(item.turns, item.continuation_lengths, strict=True)]
        assert batched == pytest.approx(single, abs=1e-5)
        assert batched == pytest.approx(fresh_scores(model, item), abs=1e-4)


def test_turns_without_a_shared_first_token_are_refused():
    with pytest.raises(ConfigError, match="share no leading token"):
        W.shared_length([(1, 2, 3), (2, 2, 3)], (1, 1))


def test_history_sharing_gives_the_scores_of_unshared_prefills(models):
    source, target = models
    mapper = NoisyMapper(scale=0.3)
    _, items = items_of("arc_challenge", limit=4)
    conditions = W.switch_conditions(source, target, mapper, (NoRecompute(), Recent(0.2)), exact_prefix=2)
    for item in sorted(items, key=lambda item: item.history.key):  # the runner's order
        ids = torch.tensor([list(item.history.ids)])
        unshared = {
            "target": prefill(target, ids)[0],
            "source": prefill(source, ids)[0],
            "switch": handoff_cache(source, target, mapper, ids, HandoffPlan(2, NoRecompute())),
            "switch:recent:20%": handoff_cache(source, target, mapper, ids, HandoffPlan(2, Recent(0.2))),
        }
        for name, cache in unshared.items():
            reader = source if name == "source" else target
            expected = W.score_turns(reader, cache, item.turns, item.continuation_lengths)
            assert conditions[name].score(item) == pytest.approx(expected, abs=1e-6), name
    assert conditions["target"].prefills.prefills == 4  # two histories, two models: one prefill each
    assert W.switch_name(Recent(0.2)) == "switch:recent:20%" and W.switch_name(NoRecompute()) == "switch"


def test_all_mapped_with_an_identity_handover_is_the_target_alone(models):
    target = models[1]
    _, items = items_of("winogrande", limit=2)
    conditions = W.switch_conditions(target, target, IdentityMapper(), exact_prefix=0)
    for item in items:
        own = conditions["target"].score(item)
        assert conditions["all_mapped"].score(item) == pytest.approx(own, abs=1e-5)
        assert conditions["switch"].score(item) == pytest.approx(own, abs=1e-5)


@pytest.fixture(scope="module")
def related():
    source = tiny_model(layers=3, **BYTE_MODEL)
    target = exactly_related(source)
    config = FitConfig(top_k="all", ridge_lambda=1e-10, token_stride=1)
    return source, target, fit_mapper(source, target, random_batches(), config, progress=False)


def test_switch_with_an_exactly_related_pair_equals_the_target_alone(related):
    source, target, mapper = related
    _, items = items_of("arc_challenge", limit=3)
    conditions = W.switch_conditions(source, target, mapper, (NoRecompute(), Deviation(0.1)), exact_prefix=0)
    for item in items:
        own = conditions["target"].score(item)
        for name in ("switch", "switch:deviation:10%", "all_mapped"):
            assert conditions[name].score(item) == pytest.approx(own, abs=1e-3), name


def test_multiple_choice_switch_records_count_what_each_switch_recomputed(models):
    source, target = models
    covering = TurnAttention(0.3, coverage=0.2)
    mapper = NoisyMapper(scale=0.3)
    conditions = W.switch_conditions(source, target, mapper, (Recent(0.2), covering), exact_prefix=2)
    histories, items = items_of("arc_challenge", limit=2, histories=1)
    runs = {run.name: run for run in W.switch_runs(conditions, source, target, mapper, "tok", "arc_challenge",
                                                      histories, 2)}
    for item in items:
        candidates = len(item.history.ids) - 2
        recent = runs["switch:recent:20%"].compute(item)
        assert (recent["recomputed"], recent["candidates"]) == (budget_count(0.2, candidates), candidates)
        assert 1 <= runs[W.switch_name(covering)].compute(item)["recomputed"] < budget_count(0.3, candidates)
        assert "recomputed" not in runs["target"].compute(item) and "recomputed" not in runs["all_mapped"].compute(item)


def test_direction_summary_resumes_from_the_store_and_stops_at_the_time_limit(models, tmp_path):
    source, target = models
    settings = W.SwitchSettings(tasks=("arc_challenge",), limit=4, pool="dev", histories=2,
                                history_tokens=HISTORY_TOKENS, policies=("none", "sinks:5%"), exact_prefix=0,
                                ttft_repeats=1, n_resamples=50)
    mapper = NoisyMapper(scale=0.3)
    tasks = W.run_switch_direction(source, target, mapper, TOK, "bytes", settings, tmp_path)
    task = tasks["arc_challenge"]
    assert task["complete"] and task["n"] == 4
    assert set(task["transfers"]) == {"switch", "switch:sinks:5%", "all_mapped"}
    assert set(task["accuracy"]) == {"target", "source"}
    assert set(task["ttft"]["mean"]["speedup"]) == {"switch", "switch:sinks:5%"}
    assert len(task["ttft"]["per_history"]) == 2
    # the source's reference pass over the question is timed beside the paths, and counted in none of them
    assert all(t["guard_reference_seconds"] > 0 and "guard_reference" not in t["seconds"]
               for t in task["ttft"]["per_history"])
    assert task["ttft"]["mean"]["guard_reference_seconds"] > 0
    again = W.run_switch_direction(source, target, mapper, TOK, "bytes", settings.__class__(
        **{**settings.__dict__, "ttft_repeats": 0}), tmp_path, deadline=time.monotonic() - 1)
    assert again["arc_challenge"]["complete"]  # all stored: nothing to compute, the past deadline never bites
    assert str(again["arc_challenge"]["transfers"]) == str(task["transfers"])  # NaN retention: compare text
    more = W.SwitchSettings(**{**settings.__dict__, "limit": 6, "ttft_repeats": 0})
    partial = W.run_switch_direction(source, target, mapper, TOK, "bytes", more, tmp_path,
                                     deadline=time.monotonic() - 1)
    assert not partial["arc_challenge"]["complete"] and partial["arc_challenge"]["n"] == 4


def test_mean_retention_over_a_group():
    tasks = {
        "a": {"group": "core", "transfers": {"switch": {"retention": {"value": 1.0},
                                                        "floor_normalised_retention": {"value": 1.0}}}},
        "b": {"group": "core", "transfers": {"switch": {"retention": {"value": 0.5},
                                                        "floor_normalised_retention": {"value": 0.0}}}},
        "c": {"group": "heldout", "transfers": {"switch": {"retention": {"value": 0.0},
                                                           "floor_normalised_retention": {"value": 0.0}}}},
    }
    summary = W.mean_retention(tasks, "switch")
    assert {k: summary[k] for k in ("tasks", "mean_retention", "retention_tasks", "mean_floor_normalised_retention",
                                    "floor_normalised_retention_tasks")} == {
        "tasks": 2, "mean_retention": 0.75, "retention_tasks": 2, "mean_floor_normalised_retention": 0.5,
        "floor_normalised_retention_tasks": 2}
    assert summary["agreement_tasks"] == 0  # summaries without agreement (older runs) leave it undefined
    assert W.mean_retention(tasks, "switch", "all")["tasks"] == 3
    tasks["c"]["transfers"]["switch"]["retention"]["value"] = float("nan")  # the target alone scored 0
    summary = W.mean_retention(tasks, "switch", "all")
    assert summary["mean_retention"] == 0.75 and summary["retention_tasks"] == 2 and summary["tasks"] == 3


def test_settings_are_validated():
    with pytest.raises(ConfigError):
        W.SwitchSettings(pool="train")
    with pytest.raises(ConfigError):
        W.SwitchSettings(tasks=("gsm8k",))
    assert W.SwitchSettings(policies=("recent:0.05",)).policies == (Recent(0.05),)  # the settings read specs once
    mixed = W.SwitchSettings(policies=("recent:0.05", Sinks(0.1))).policies
    assert [p.spec for p in mixed] == ["recent:5%", "sinks:10%"]


def test_agreement_with_target_counts_same_answers_and_choice_kl():
    target = {"a": {"loglikelihoods": [-1.0, -2.0], "norm_lengths": [1, 1], "gold": 0},
              "b": {"loglikelihoods": [-3.0, -1.0], "norm_lengths": [1, 1], "gold": 0}}
    same = W.agreement_with_target("arc_easy", target, target, ["a", "b"], n_resamples=20)
    assert same["agreement"]["value"] == 1.0 and same["choice_kl"]["value"] == pytest.approx(0.0)
    flipped = {k: {**v, "loglikelihoods": v["loglikelihoods"][::-1]} for k, v in target.items()}
    other = W.agreement_with_target("arc_easy", target, flipped, ["a", "b"], n_resamples=20)
    p = np.exp([-1.0, -2.0]) / np.exp([-1.0, -2.0]).sum()
    kl_a = float(np.sum(p * np.log(p / p[::-1])))
    p = np.exp([-3.0, -1.0]) / np.exp([-3.0, -1.0]).sum()
    kl_b = float(np.sum(p * np.log(p / p[::-1])))
    assert other["agreement"]["value"] == 0.0
    assert other["choice_kl"]["value"] == pytest.approx((kl_a + kl_b) / 2)


# -- the generative group ----------------------------------------------------------------------------------------

GEN_TASKS = ("nq_open", "gsm8k_cot", "coqa_gen", "boolq_long", "squad_gen", "drop_gen")


def turn_items_of(task: str, limit: int = 4, histories: int = 2, pool: str = "dev"):
    return W.turn_items(task, TOK, histories, HISTORY_TOKENS, limit, pool=pool)


@pytest.mark.parametrize("task", GEN_TASKS)
def test_generative_histories_are_long_distinct_and_from_the_other_pool(task):
    spec = W.SWITCH_TASKS[task]
    items = turn_items_of(task, limit=16, histories=8)
    slots = {}
    for item in items:
        slots.setdefault(item.slot, set()).add(item.history.key)
    assert [item.slot for item in items] == [i % 8 for i in range(16)] and len(slots) == 8
    histories = {item.history.key: item.history for item in items}
    assert len({h.ids for h in histories.values()}) == len(histories)  # distinct
    assert all(len(h.ids) >= HISTORY_TOKENS and len(h.exemplars) >= spec.min_exemplars for h in histories.values())
    assert all(pool_of(spec.data_task, e) == "report" for h in histories.values() for e in h.exemplars)
    item = items[0]
    text = TOK.decode(item.history.ids)
    if task in ("squad_gen", "drop_gen"):  # pooled by passage: the item's own is in no history
        assert all(TOK.decode(i.extension) not in TOK.decode(i.history.ids) for i in items)
    else:
        assert all(pool_of(spec.data_task, i.id.rsplit("-t", 1)[0].removeprefix("coqa-")) == "dev" for i in items)
    assert text.startswith(spec.header) and text.endswith("\n\n")
    if task == "coqa_gen":
        assert text.count("Passage: ") >= 2 and "\nAnswer: " not in text.rsplit("Passage: ", 1)[1]  # its story last
        later = next(i for i in items if i.extension)
        assert TOK.decode(later.extension).startswith("Question: ") and later.history.key.startswith("coqa_gen-h")
    if task == "boolq_long":
        assert TOK.decode(item.extension).endswith("\n") and len(item.extension) > 50  # the passage
        assert TOK.decode(item.turns[1]).endswith("Answer: yes") and item.continuation_lengths == (3, 4)
    if task in ("squad_gen", "drop_gen"):
        assert TOK.decode(item.extension).startswith(("Title: ", "Passage: ")) and item.turns == () and item.answers
    if task in ("nq_open", "gsm8k_cot"):
        assert item.extension == ()
    assert TOK.decode(item.question).startswith(("Question: ", "Q: "))


def fresh_greedy(model, ids: list[int], steps: int) -> list[int]:
    """Reference: greedy tokens by a full forward over the whole sequence at every step, no cache."""
    out = []
    with torch.no_grad():
        for _ in range(steps):
            out.append(int(model(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax()))
    return out


def test_generative_answers_equal_a_fresh_greedy_decode_and_restore_the_cache(models):
    model = models[0]
    prefills = W.HistoryPrefills()
    alone = W.AloneOnTurn("target", model, prefills)
    spec = W.SWITCH_TASKS["coqa_gen"]
    item = next(i for i in turn_items_of("coqa_gen", limit=8) if i.extension)
    record = W.turn_record(spec, alone, item, TOK, 6, reference=None)
    tokens = fresh_greedy(model, list(item.history.ids + item.extension + item.question), 6)
    eos = [k for k, t in enumerate(tokens) if t == TOK.eos_token_id]
    expected = TOK.decode(tokens[: eos[0]] if eos else tokens)
    assert record["output"] == expected.split("\n")[0].split("Question:")[0].split("Q:")[0]
    assert prefills.extended(model, item.history, item.extension).get_seq_length() == item.history_tokens
    again = W.turn_record(spec, alone, item, TOK, 6)
    assert again == record and prefills.prefills == 1  # the history prefilled once, its extension kept
    fresh = W.AloneOnTurn("target", model, prefills)  # keeps nothing yet: reads the question again
    assert torch.allclose(fresh.first_logprobs(item), alone.first_logprobs(item), atol=1e-5)


def test_history_extensions_replace_each_other(models):
    model = models[0]
    item = turn_items_of("boolq_long", limit=2, histories=1)
    prefills = W.HistoryPrefills()
    for one in (item[0], item[1], item[0]):
        cache = prefills.extended(model, one.history, one.extension)
        fresh = prefill(model, torch.tensor([list(one.history.ids + one.extension)]))[0]
        assert cache.get_seq_length() == one.history_tokens
        assert torch.allclose(cache.layers[-1].keys, fresh.layers[-1].keys, atol=1e-5)
    assert prefills.of(model, item[0].history).get_seq_length() == len(item[0].history.ids)
    assert prefills.prefills == 1


def test_identity_switch_answers_as_the_target_and_a_noisy_one_as_its_handoff(models):
    source, target = models
    spec = W.SWITCH_TASKS["nq_open"]
    items = turn_items_of("nq_open", limit=2)
    same = W.turn_conditions(target, target, IdentityMapper(), exact_prefix=0)
    for item in items:
        own = W.turn_record(spec, same["target"], item, TOK, 5)
        switched = W.turn_record(spec, same["switch"], item, TOK, 5, same["target"])
        assert switched["output"] == own["output"] and switched["answer_kl"] == pytest.approx(0.0, abs=1e-6)
    mapper = NoisyMapper(scale=0.3)
    noisy = W.turn_conditions(source, target, mapper, (Recent(0.2),), exact_prefix=2)
    for item in turn_items_of("boolq_long", limit=2, histories=1):  # one history, two passages: mapped per item
        ids = torch.tensor([list(item.history.ids + item.extension)])
        handed = handoff_cache(source, target, mapper, ids, HandoffPlan(2, Recent(0.2)))
        expected = W.score_turns(target, handed, item.turns, item.continuation_lengths)
        got = W.turn_record(W.SWITCH_TASKS["boolq_long"], noisy["switch:recent:20%"], item, TOK, 0)
        assert got["loglikelihoods"] == pytest.approx(expected, abs=1e-5)


def test_records_carry_their_readers_guard_entropy_over_the_question(models):
    source, target = models
    conditions = W.turn_conditions(source, target, NoisyMapper(scale=0.3), (NoRecompute(), Recent(0.2)),
                                    exact_prefix=2)
    for task in ("nq_open", "boolq_long"):
        item = turn_items_of(task, limit=1, histories=1)[0]
        cache = conditions["switch"].turn_cache(item)
        length = cache.get_seq_length()
        with torch.no_grad():
            logits = target(input_ids=torch.tensor([list(item.question)]), cache=cache, use_cache=True).logits
        rollback(cache, length)
        served = logits[0, -W.DEFAULT_GUARD_WINDOW:].float().log_softmax(-1)
        expected = float(-(served.exp() * served).sum(-1).mean())
        for name in ("switch", "switch:recent:20%"):
            record = W.turn_record(W.SWITCH_TASKS[task], conditions[name], item, TOK, 2)
            assert record["guard_entropy"] > 0
        switched = W.turn_record(W.SWITCH_TASKS[task], conditions["switch"], item, TOK, 2)
        assert switched["guard_entropy"] == pytest.approx(expected, rel=1e-4)
        assert conditions["switch"].turn_cache(item).get_seq_length() == length  # restored
        own = conditions["source"].turn_cache(item)
        with torch.no_grad():
            logits = source(input_ids=torch.tensor([list(item.question)]), cache=own, use_cache=True).logits
        rollback(own, length)
        reference = logits[0, -W.DEFAULT_GUARD_WINDOW:].float().log_softmax(-1)
        expected = float(-(reference.exp() * reference).sum(-1).mean())
        record = W.turn_record(W.SWITCH_TASKS[task], conditions["source"], item, TOK, 2)
        assert record["guard_entropy"] == pytest.approx(expected, rel=1e-4) and "guard_scores" not in record
        # a switch scores every guard signal the server has for a turn, against the source's pass on its own cache
        assert set(switched["guard_scores"]) == set(W.SWITCH_GUARD_SIGNALS) == set(GUARD_SIGNALS) - {"mapped_share"}
        for signal, score in switched["guard_scores"].items():
            assert score == pytest.approx(guard_score(signal, served, reference, item.question), rel=1e-3, abs=1e-5)
        assert switched["guard_scores"]["entropy_gain"] == pytest.approx(switched["guard_entropy"]
                                                                          - record["guard_entropy"], abs=1e-4)
        assert conditions["source"].turn_cache(item).get_seq_length() == length  # the reference pass rolled back


def test_the_sources_pass_over_a_question_is_shared_by_its_record_and_every_switchs_reference(models):
    source, target = models
    conditions = W.turn_conditions(source, target, NoisyMapper(scale=0.3), (NoRecompute(), Recent(0.2)),
                                    exact_prefix=2)
    prefills = conditions["source"].prefills
    first, second = turn_items_of("nq_open", limit=2, histories=1)[:2]
    for item in (first, second):
        records = {name: W.turn_record(W.SWITCH_TASKS["nq_open"], condition, item, TOK, 0)
                   for name, condition in conditions.items()}
        own = records["source"]["guard_entropy"]
        for name in ("switch", "switch:recent:20%"):
            gain = records[name]["guard_scores"]["entropy_gain"]
            assert gain == pytest.approx(records[name]["guard_entropy"] - own, abs=1e-4)
    assert prefills.question_passes == 4  # per item one pass of each model, however many switches read it
    kept = prefills.question_logprobs(source, second.history, second.extension, second.question)
    assert prefills.question_passes == 4
    assert torch.equal(kept, W.question_logprobs(source, conditions["source"].turn_cache(second), second.question))
    prefills.question_logprobs(source, first.history, first.extension, first.question)
    assert prefills.question_passes == 5  # another question: read again


def test_switch_records_count_what_each_switch_recomputed(models):
    source, target = models
    budget = TurnAttention(0.3)
    covering = TurnAttention(0.3, coverage=0.2)
    conditions = W.turn_conditions(source, target, NoisyMapper(scale=0.3),
                                   (NoRecompute(), Recent(0.2), budget, covering), exact_prefix=2)
    records = {name: {} for name in conditions}
    items = turn_items_of("nq_open", limit=3, histories=1)
    for item in items:
        candidates = len(item.history.ids) + len(item.extension) - 2
        for name, condition in conditions.items():
            reference = None if name in ("target", "source") else conditions["target"]
            records[name][item.id] = W.turn_record(W.SWITCH_TASKS["nq_open"], condition, item, TOK, 0, reference)
        assert records["switch"][item.id]["recomputed"] == 0
        assert records["switch"][item.id]["candidates"] == candidates
        assert records["switch:recent:20%"][item.id]["recomputed"] == budget_count(0.2, candidates)
        assert records[W.switch_name(budget)][item.id]["recomputed"] == budget_count(0.3, candidates)
        assert 1 <= records[W.switch_name(covering)][item.id]["recomputed"] < budget_count(0.3, candidates)
        assert "recomputed" not in records["target"][item.id]
    ids = [item.id for item in items]
    shares = W.recompute_shares(records["switch:recent:20%"], ids)
    expected = [budget_count(0.2, r["candidates"]) / r["candidates"] for r in records["switch:recent:20%"].values()]
    assert shares["recompute_share"] == pytest.approx(expected, abs=1e-6)
    assert shares["mean_recompute_share"] == pytest.approx(float(np.mean(expected)))
    assert W.recompute_shares(records["target"], ids) == {}  # the models alone recompute nothing to count
    summary = W.turn_task_summary("nq_open", items, records)
    assert summary["transfers"][W.switch_name(covering)]["mean_recompute_share"] < 0.3
    assert "mean_recompute_share" in summary["transfers"]["switch"]


def test_guard_entropies_only_for_conditions_whose_every_record_has_one():
    records = {"target": {"a": {}, "b": {}}, "switch": {"a": {"guard_entropy": 1.25}, "b": {"guard_entropy": 2.0}},
               "switch:recent:5%": {"a": {"guard_entropy": 1.0}, "b": {}}}
    assert W.guard_entropies(records, ["b", "a"]) == {"switch": [2.0, 1.25]}
    assert W.guard_entropies(records, []) == {}


def test_first_token_kl_over_a_shared_vocabulary():
    p = torch.tensor([0.7, 0.2, 0.1]).log()
    q = torch.tensor([0.5, 0.3, 0.2]).log()
    assert W.first_token_kl(p, q) == pytest.approx(float((p.exp() * (p - q)).sum()), abs=1e-6)
    assert W.first_token_kl(p, torch.cat([q, torch.tensor([-30.0])])) == pytest.approx(W.first_token_kl(p, q),
                                                                                        abs=1e-6)


def test_generative_direction_resumes_and_stops_at_the_time_limit(models, tmp_path):
    source, target = models
    settings = W.SwitchSettings(tasks=("nq_open", "boolq_long"), limit=4, pool="dev", histories=1,
                                history_tokens=HISTORY_TOKENS, policies=("none", "recent:10%"), exact_prefix=0,
                                ttft_repeats=0, n_resamples=50, generative_histories=2,
                                max_new_tokens={"answer": 3})
    assert settings.rounds == 2 and dict(settings.max_new_tokens) == {"answer": 3, "cot": 256}
    mapper = NoisyMapper(scale=0.3)
    tasks = W.run_switch_direction(source, target, mapper, TOK, "bytes", settings, tmp_path)
    nq, boolq = tasks["nq_open"], tasks["boolq_long"]
    assert nq["complete"] and nq["n"] == 4 and nq["group"] == "generative" and nq["histories"] == 2
    assert set(nq["transfers"]) == {"switch", "switch:recent:10%"} and set(nq["accuracy"]) == {"target", "source"}
    switch = nq["transfers"]["switch"]
    assert {"minus_target", "minus_source", "agreement", "answer_kl", "retention"} <= set(switch)
    assert switch["answer_kl"]["value"] > 0 and 0 <= switch["agreement"]["value"] <= 1
    assert "choice_kl" in boolq["transfers"]["switch"] and len(boolq["scores"]["target"]) == 4
    assert set(nq["guard_entropy"]) == {"target", "source", "switch", "switch:recent:10%"}
    assert len(nq["guard_entropy"]["switch"]) == 4
    assert set(nq["guard_scores"]) == {"switch", "switch:recent:10%"}
    assert set(nq["guard_scores"]["switch"]) == set(W.SWITCH_GUARD_SIGNALS)
    assert len(nq["guard_scores"]["switch"]["kl"]) == 4 and min(nq["guard_scores"]["switch"]["kl"]) >= 0
    assert switch["minus_target"]["value"] == pytest.approx(
        np.mean(nq["scores"]["switch"]) - np.mean(nq["scores"]["target"]))
    stores = sorted(p.name.split("-")[0] for p in (tmp_path / "switch-nq_open").glob("*.jsonl"))
    assert len(stores) == 4  # target, source, two switches
    again = W.run_switch_direction(source, target, mapper, TOK, "bytes", settings, tmp_path,
                                   deadline=time.monotonic() - 1)
    assert again["nq_open"]["complete"] and str(again) == str(tasks)  # all stored: nothing computed again
    more = W.SwitchSettings(**{**settings.__dict__, "limit": 6})
    partial = W.run_switch_direction(source, target, mapper, TOK, "bytes", more, tmp_path,
                                     deadline=time.monotonic() - 1)
    assert not partial["nq_open"]["complete"] and partial["nq_open"]["n"] == 4 and "boolq_long" not in partial
    first = W.run_switch_direction(source, target, mapper, TOK, "bytes", settings, tmp_path, histories_used=1)
    assert first["nq_open"]["n"] == 2 and first["nq_open"]["histories"] == 1


def test_switch_task_specs_take_the_generative_group():
    assert W.switch_tasks("generative") == list(GEN_TASKS)
    assert W.switch_tasks("winogrande,nq-open,generative") == ["winogrande", *GEN_TASKS]
    assert W.switch_tasks("core") == ["arc_challenge", "hellaswag", "winogrande", "mmlu"]
    with pytest.raises(ConfigError, match="generates"):
        W.switch_tasks("gsm8k")
    with pytest.raises(ConfigError, match="generative group"):
        W.switch_tasks("nq")
    with pytest.raises(ConfigError, match="max_new_tokens"):
        W.SwitchSettings(tasks=("nq_open",), max_new_tokens={"essay": 5})
    mixed = W.SwitchSettings(tasks=("arc_challenge", "coqa_gen"), histories=3, generative_histories=5, limit=40)
    assert mixed.rounds == 5 and mixed.history_entries() == 2 + 1  # two stories of a slot at 40 items
    assert W.SwitchSettings(tasks=("arc_challenge",), histories=3).rounds == 3


def test_pooled_difference_pools_the_items_of_a_group():
    def task(group, ours, target, source):
        return {"group": group, "scores": {"switch": ours, "target": target, "source": source}}

    tasks = {"a": task("generative", [1.0, 0.0], [1.0, 1.0], [0.0, 0.0]),
             "b": task("generative", [0.5], [0.5], [1.0]), "c": task("core", [0.0], [1.0], [1.0])}
    pooled = W.pooled_difference(tasks, "switch", n_resamples=200)
    assert pooled["tasks"] == 2 and pooled["n"] == 3
    assert pooled["minus_target"]["value"] == pytest.approx(-1 / 3)
    assert pooled["minus_source"]["value"] == pytest.approx(0.5 / 3)
    lo, hi = pooled["minus_target"]["ci"]
    assert -1.0 <= lo <= pooled["minus_target"]["value"] <= hi <= 0.0
    assert W.pooled_difference(tasks, "switch:recent:5%")["n"] == 0
