"""The quality guard: its two signals, AUROC and the threshold choice, and its measurement on dev conversations
(an exact mapper against a noisy one must separate)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from _serving_support import EXACT_FIT, VOCAB, tiny_family
from kvhandoff import fit_mapper
from kvhandoff.errors import ConfigError
from kvhandoff.runtime.policy import Recent
from kvhandoff.runtime.session import SwitchingSession
from kvhandoff.serving.guard import (
    GuardRecord,
    WithinTime,
    auroc,
    choose_threshold,
    guard_records_by_signal,
    guard_score,
    measure_guard,
    needs_reference,
    reference_logprobs,
    summarize_guard,
)

from conftest import exactly_related, random_batches, tiny_model

pytestmark = pytest.mark.timeout(120)


def test_signals_are_zero_on_equal_distributions_and_grow_with_a_worse_one():
    gen = torch.Generator().manual_seed(0)
    reference = torch.randn(5, 11, generator=gen).log_softmax(-1)
    ids = [3, 1, 4, 1, 5]
    assert guard_score("logloss", reference, reference, ids) == pytest.approx(0.0)
    assert guard_score("kl", reference, reference, ids) == pytest.approx(0.0, abs=1e-6)
    worse = (reference + 3 * torch.randn(5, 11, generator=gen)).log_softmax(-1)
    assert guard_score("kl", worse, reference, ids) > 0.1
    # logloss: the served model's loss on the turn's next tokens minus the reference's
    following = torch.tensor(ids[1:])[:, None]
    expected = (-worse[:-1].gather(1, following).mean() + reference[:-1].gather(1, following).mean()).item()
    assert guard_score("logloss", worse, reference, ids) == pytest.approx(expected)
    # the last k positions of a longer turn predict its last k - 1 tokens
    assert guard_score("logloss", worse[-3:], reference[-3:], [9, 9, *ids]) == pytest.approx(
        (-worse[-3:-1].gather(1, following[-2:]).mean() + reference[-3:-1].gather(1, following[-2:]).mean()).item())
    assert guard_score("logloss", worse[:1], reference[:1], ids[:1]) is None  # nothing predicted inside the turn
    with pytest.raises(ConfigError, match="guard signal"):
        guard_score("vibes", worse, reference, ids)


def test_the_answer_entropy_and_mapped_share_signals():
    gen = torch.Generator().manual_seed(1)
    reference = torch.randn(4, 7, generator=gen).log_softmax(-1)
    served = torch.randn(4, 7, generator=gen).log_softmax(-1)
    ids = [1, 2, 3, 4]
    # kl_answer: the KL of the last position only (the distribution of the answer's first token)
    last = (reference[-1].exp() * (reference[-1] - served[-1])).sum().item()
    assert guard_score("kl_answer", served, reference, ids) == pytest.approx(last, rel=1e-5)
    # entropy: the served model's mean entropy, with or without a reference
    entropy = (-(served.exp() * served).sum(-1)).mean().item()
    assert guard_score("entropy", served, None, ids) == pytest.approx(entropy, rel=1e-5)
    uniform = torch.full((4, 7), 1 / 7).log()
    assert guard_score("entropy", uniform, None, ids) == pytest.approx(math.log(7), rel=1e-5)
    assert guard_score("mapped_share", served, None, ids, mapped_share=0.25) == 0.25
    assert [needs_reference(s) for s in ("logloss", "kl", "kl_answer", "entropy", "mapped_share")] == [
        True, True, True, False, False]
    with pytest.raises(ConfigError, match="reference"):
        guard_score("kl", served, None, ids)
    with pytest.raises(ConfigError, match="share of positions"):
        guard_score("mapped_share", served, None, ids)


def test_auroc_and_threshold_choice():
    assert auroc([0.1, 0.2, 0.8, 0.9], [False, False, True, True]) == 1.0
    assert auroc([0.9, 0.8, 0.2, 0.1], [False, False, True, True]) == 0.0
    assert auroc([0.5, 0.5], [False, True]) == 0.5
    assert auroc([0.1, 0.2], [True, True]) is None
    threshold, catch, false = choose_threshold([0.1, 0.2, 0.8, 0.9], [False, False, True, True])
    assert 0.2 <= threshold < 0.8 and catch == 1.0 and false == 0.0
    threshold, catch, false = choose_threshold([0.1, 0.7, 0.6, 0.9], [False, False, True, True],
                                               max_false_fallback=0.0)
    assert threshold == 0.7 and catch == 0.5 and false == 0.0
    summary = summarize_guard([GuardRecord(0, 1, "a", "b", 5, s, y) for s, y in
                               ((0.1, False), (None, True), (0.9, True))], "kl")
    assert summary.handoffs == 2 and summary.changed == 1 and summary.auroc == 1.0
    assert summary.to_dict()["catch_rate"] == 1.0


def test_reference_logprobs_leave_the_cache_as_it_was():
    models, _ = tiny_family()
    model = models["small"][0]
    session = SwitchingSession({"small": model}, {})
    session.read("small", list(range(10, 30)))
    cache = session.cache("small")
    before = [layer.keys.clone() for layer in cache.layers]
    got = reference_logprobs(model, cache, [40, 41, 42], keep=2)
    assert got.shape == (2, model.config.vocab_size) and cache.get_seq_length() == 20
    assert all(torch.equal(layer.keys, old) for layer, old in zip(cache.layers, before, strict=True))
    own = session.read_logprobs("small", [40, 41, 42], keep=2)
    torch.testing.assert_close(got, own)


def noisy(mapper, scale: float, seed: int = 0):
    """A copy of ``mapper`` with Gaussian noise of ``scale`` × its weights' std added to its weights."""
    copied = copy.deepcopy(mapper)
    weight, _ = copied.map_tensors()
    gen = torch.Generator().manual_seed(seed)
    weight.add_(torch.randn(weight.shape, generator=gen) * weight.std() * scale)
    return copied


@pytest.fixture(scope="module")
def confident_pair():
    """An exactly related pair whose next-token distributions are sharp (LM head × 20: random init is near uniform,
    where no signal can tell a good cache from a bad one), exact mappers both ways, and dev conversations whose turns
    the models predict well (sampled from them): two switches each, small → large → small."""
    small = tiny_model("qwen2", layers=3, vocab_size=VOCAB, seed=3)
    with torch.no_grad():
        small.lm_head.weight.mul_(20.0)
    large = exactly_related(small)
    mappers = {("small", "large"): fit_mapper(small, large, random_batches(), EXACT_FIT, progress=False),
               ("large", "small"): fit_mapper(large, small, random_batches(), EXACT_FIT, progress=False)}
    gen = torch.Generator().manual_seed(5)
    torch.manual_seed(0)

    def turn() -> list[int]:
        start = torch.randint(0, 256, (1, 4), generator=gen)
        out = small.generate(input_ids=start, attention_mask=torch.ones_like(start), max_new_tokens=16,
                             do_sample=True, temperature=1.0, top_k=0)
        return out[0].tolist()

    conversations = [[(server, turn()) for server in ("small", "large", "small")] for _ in range(3)]
    return {"small": small, "large": large}, mappers, conversations


@pytest.mark.parametrize("signal", ["logloss", "kl"])
def test_measured_guard_separates_an_exact_mapper_from_a_noisy_one(confident_pair, signal):
    models, mappers, conversations = confident_pair
    exact_summary, exact = measure_guard(models, mappers, conversations, signal, max_new_tokens=6)
    bad = {pair: noisy(mapper, 1.0, seed=i) for i, (pair, mapper) in enumerate(mappers.items())}
    _, degraded = measure_guard(models, bad, conversations, signal, max_new_tokens=6)
    assert len(exact) == len(degraded) == 6  # two switches per conversation
    assert not any(r.differs for r in exact)  # exact maps: the same answers as a re-prefill
    assert exact_summary.auroc is None and exact_summary.changed == 0
    assert all(abs(r.score) < 1e-3 for r in exact) and all(r.mapped_tokens > 0 for r in exact)
    assert sum(r.differs for r in degraded) >= 4
    assert min(r.score for r in degraded) > 0.5
    summary = summarize_guard(exact + degraded, signal)
    assert summary.auroc > 0.9 and summary.catch_rate == 1.0 and summary.false_fallback_rate <= 0.2
    assert max(r.score for r in exact) <= summary.threshold < min(r.score for r in degraded if r.differs)


def test_records_carry_both_answers_and_an_escalated_one(confident_pair):
    models, mappers, conversations = confident_pair
    bad = {pair: noisy(mapper, 1.0, seed=i) for i, (pair, mapper) in enumerate(mappers.items())}
    records = guard_records_by_signal(models, bad, conversations[:2], ("entropy", "mapped_share"),
                                      max_new_tokens=6, escalate=Recent(1.0))
    assert len(records["entropy"]) == len(records["mapped_share"]) == 4
    for record in records["mapped_share"]:
        assert record.differs == (record.handed != record.own) and record.first_kl >= 0
        assert record.escalated == record.own  # everything recomputed: the target's own cache
        assert 0 < record.score <= 1
    with pytest.raises(ConfigError, match="RecomputePolicy"):  # a spec is read at the edge, not here
        guard_records_by_signal(models, bad, conversations[:1], ("entropy",), escalate="recent:100%")
    first, second = records["mapped_share"][:2]
    assert first.score == 1.0 and second.score < 1.0  # the second switch maps only the turn the model missed
    assert sum(r.differs for r in records["entropy"]) >= 2


def test_within_time_counts_what_started_and_stops_when_time_is_up(monkeypatch):
    timed = WithinTime(["a", "b", "c"], None)
    assert list(timed) == ["a", "b", "c"] and timed.started == 3
    clock = iter([0.0, 1.0, 5.0])  # begun at 0; checked at 1 (within 4 s), then at 5 (past it)
    monkeypatch.setattr("kvhandoff.serving.guard.time.monotonic", lambda: next(clock))
    timed = WithinTime(["a", "b", "c"], 4.0)
    assert list(timed) == ["a"] and timed.started == 1
