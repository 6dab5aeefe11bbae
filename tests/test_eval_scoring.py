"""Conditions and scoring: cached-context choice scoring, the identity transfer, greedy generation."""

from __future__ import annotations

import pytest
import torch

from _eval_support import (
    EOS,
    BosByteTokenizer,
    ByteTokenizer,
    IdentityMapper,
    NoisyMapper,
    full_sequence_logprob,
    short_items,
    tiny_qwen2,
)
from kvhandoff.errors import ConfigError
from kvhandoff.evaluation import scoring as S
from kvhandoff.evaluation.tasks import GenItem, load_items

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def models():
    return tiny_qwen2(seed=0), tiny_qwen2(seed=1)


class Counting(S.Condition):
    """Wraps a condition and counts its prefills."""

    def __init__(self, inner: S.Condition) -> None:
        self.inner, self.name, self.reader, self.calls = inner, inner.name, inner.reader, []

    def prefill(self, input_ids):
        self.calls.append(input_ids.shape[1])
        return self.inner.prefill(input_ids)


@pytest.mark.parametrize("task", ["arc_challenge", "hellaswag", "winogrande", "mmlu", "piqa", "boolq"])
def test_cached_choice_scoring_equals_full_sequences(models, task):
    target, source = models
    conditions = {
        "target": (S.Standalone("target", target), target),
        "source": (S.Standalone("source", source), source),
        # an identity "mapper" with source == target: the transfer must score like the target from scratch
        "transfer": (S.Transfer("transfer", target, target, IdentityMapper()), target),
    }
    for item in short_items(task, 2):
        for cond, reader in conditions.values():
            record = S.evaluate_mc_item(cond, TOK, item)
            for choice, ll in zip(item.choices, record["loglikelihoods"], strict=True):
                ctx, cont = S.encode_pair(TOK, choice.context, choice.continuation)
                assert ll == pytest.approx(full_sequence_logprob(reader, ctx, cont), abs=1e-4)
            assert record["gold"] == item.gold and record["id"] == item.id


def test_context_prefilled_once_per_distinct_context(models):
    target, source = models
    arc = load_items("arc_challenge")[0]
    cond = Counting(S.Standalone("target", target))
    S.evaluate_mc_item(cond, TOK, arc)
    assert cond.calls == [len(TOK.encode(arc.choices[0].context)) - 1]  # one prefill of context[:-1]
    (wino,) = short_items("winogrande")
    cond = Counting(S.Transfer("transfer", source, target, IdentityMapper()))
    S.evaluate_mc_item(cond, TOK, wino)
    assert len(cond.calls) == 2  # WinoGrande: one prefill per option context


def test_identity_transfer_equals_target_exactly(models):
    target, _ = models
    conds = S.standard_conditions(target, target, IdentityMapper())
    for task in ["arc_challenge", "winogrande", "mmlu"]:
        (item,) = short_items(task)
        records = {n: S.evaluate_mc_item(c, TOK, item) for n, c in conds.items()}
        assert records["transfer"]["loglikelihoods"] == records["target"]["loglikelihoods"]
        assert records["source"]["loglikelihoods"] == records["target"]["loglikelihoods"]


def test_transfer_uses_the_mapped_cache_and_the_target_reads(models):
    target, source = models
    item = load_items("arc_challenge")[0]
    mapper = IdentityMapper()
    tr = S.evaluate_mc_item(S.Transfer("transfer", source, target, mapper), TOK, item)
    assert mapper.calls == 1
    noisy = S.evaluate_mc_item(S.Transfer("transfer", target, target, NoisyMapper()), TOK, item)
    own = S.evaluate_mc_item(S.Standalone("target", target), TOK, item)
    assert noisy["loglikelihoods"] != own["loglikelihoods"]
    # source-prefilled identity transfer = target reading on from the source's cache: differs from both
    src = S.evaluate_mc_item(S.Standalone("source", source), TOK, item)
    assert tr["loglikelihoods"] != own["loglikelihoods"] and tr["loglikelihoods"] != src["loglikelihoods"]


def test_continuation_logprobs_rolls_back_between_choices(models):
    target, _ = models
    cond = S.Standalone("target", target)
    ctx = TOK.encode("Question: why is the sky blue?\nAnswer:")
    conts = [TOK.encode(" Rayleigh scattering."), TOK.encode(" X"), TOK.encode(" because of the sea.")]
    together = S.score_continuations(cond, ctx, conts)
    alone = [S.score_continuations(cond, ctx, [c])[0] for c in conts]
    assert together == pytest.approx(alone, abs=1e-5)
    state = S.open_context(cond, ctx)
    assert state.cache.get_seq_length() == len(ctx)


def test_encode_pair_follows_lm_eval():
    ctx, cont = S.encode_pair(TOK, "Answer: ", "yes")  # trailing space moves to the continuation
    assert TOK.decode(ctx) == "Answer:" and TOK.decode(cont) == " yes"
    bos = BosByteTokenizer()
    ctx, cont = S.encode_pair(bos, "Q:", " a")
    assert ctx == [257, *b"Q:"] and cont == list(b" a")


def test_short_context_and_empty_continuation_are_refused(models):
    target, _ = models
    cond = S.Standalone("target", target)
    with pytest.raises(ConfigError):
        S.score_continuations(cond, [5], [[6]])
    with pytest.raises(ConfigError):
        S.score_continuations(cond, [5, 6], [[]])


def test_greedy_generation_matches_hf_generate(models):
    target, _ = models
    ids = TOK.encode("Q: Janet has 3 apples and buys 4 more. How many now?\nA:")
    new = 12
    with torch.no_grad():
        ref = target.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, eos_token_id=EOS,
                              pad_token_id=EOS)[0, len(ids):].tolist()
    ref = ref[: ref.index(EOS)] if EOS in ref else ref
    state = S.open_context(S.Standalone("target", target), ids)
    text, generated = S.greedy_from(state, TOK, new)
    assert generated == ref
    assert text == TOK.decode(ref)


def test_generation_stops_at_stop_strings(models):
    target, _ = models

    class Scripted(ByteTokenizer):
        pass

    ids = TOK.encode("Some context for a generation test")
    full = S.generate_greedy(S.Standalone("target", target), TOK, ids, 10)
    assert len(full.encode("utf-8", errors="ignore")) <= 10 * 4
    stop = full[2:4] if len(full) >= 4 else None
    if stop:
        cut = S.generate_greedy(S.Standalone("target", target), TOK, ids, 10, stop=(stop,))
        assert cut == full[: full.find(stop)]
    assert S._cut_at_stop("12. The answer is 3.\n\nQ: next", ("Q:", "\n\n")) == ("12. The answer is 3.", True)


def test_generation_item_record(models):
    target, _ = models
    item = GenItem(id="g1", context="Q: 2 + 2?\nA:", answer="4", stop=("\n\n",))
    conds = S.standard_conditions(target, target, IdentityMapper())
    records = {n: S.evaluate_item(c, TOK, item, max_new_tokens=6) for n, c in conds.items()}
    assert records["transfer"] == records["target"]
    assert set(records["target"]) == {"id", "output", "gold"} and records["target"]["gold"] == "4"


def test_exact_prefix_recomputes_the_leading_positions(models):
    target, _ = models
    (item,) = short_items("arc_challenge")
    own = S.evaluate_mc_item(S.Standalone("target", target), TOK, item)
    noisy = S.evaluate_mc_item(S.Transfer("transfer", target, target, NoisyMapper()), TOK, item)
    patched = S.evaluate_mc_item(S.Transfer("transfer", target, target, NoisyMapper(), exact_prefix=4), TOK, item)
    everything = S.evaluate_mc_item(S.Transfer("transfer", target, target, NoisyMapper(), exact_prefix=10_000),
                                    TOK, item)
    assert everything["loglikelihoods"] == pytest.approx(own["loglikelihoods"], abs=1e-4)
    assert patched["loglikelihoods"] != noisy["loglikelihoods"]
    with pytest.raises(ConfigError):
        S.Transfer("transfer", target, target, NoisyMapper(), exact_prefix=-1)
