"""Conditions and scoring: cached-context choice scoring, the identity transfer, greedy generation."""

from __future__ import annotations

import pytest
import torch

from _eval_support import IdentityMapper, NoisyMapper, full_sequence_logprob, short_items
from kvhandoff.errors import ConfigError
from kvhandoff.runtime.plan import HandoffPlan
from kvhandoff.runtime.policy import Deviation, NoRecompute, Recent, Sinks
from kvhandoff_lab.evaluation import scoring as S
from kvhandoff_lab.evaluation.tasks import Choice, GenItem, MCItem, load_items

from conftest import BYTE_MODEL, ByteTokenizer, tiny_model

TOK = ByteTokenizer()
EOS = TOK.eos_token_id


@pytest.fixture(scope="module")
def models():
    return tiny_model("qwen2", seed=0, **BYTE_MODEL), tiny_model("qwen2", seed=1, **BYTE_MODEL)


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
    conds = S.standard_conditions(target, target, IdentityMapper(), recompute=NoRecompute())  # nothing to blur it
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
    bos = ByteTokenizer(bos=257)
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

    ids = TOK.encode("Some context for a generation test")
    full = S.generate_greedy(S.Standalone("target", target), TOK, ids, 10)
    assert len(full.encode("utf-8", errors="ignore")) <= 10 * 4
    assert len(full) >= 4  # so that a stop string inside the continuation exists
    stop = full[2:4]
    cut = S.generate_greedy(S.Standalone("target", target), TOK, ids, 10, stop=(stop,))
    assert cut == full[: full.find(stop)] and len(cut) < len(full)


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


# -- shared few-shot prefixes ---------------------------------------------------------------------------------

FEWSHOT = "Answer with a letter.\n\nQ: Sky colour?\nA. blue\nB. red\nAnswer: A\n\n"


def fewshot_items(prefix: str = FEWSHOT, questions=("Two plus two?", "Grass colour?", "Ice is?"), lead="Q: "):
    """MMLU-like items sharing ``prefix`` (a short one keeps the byte-level models fast)."""
    items = []
    for i, question in enumerate(questions):
        context = f"{prefix}{lead}{question}\nA. one\nB. two\nAnswer:"
        choices = tuple(Choice(context, f" {letter}", 1) for letter in "AB")
        items.append(MCItem(id=f"fewshot-{i}", choices=choices, gold=i % 2, shared_prefix=prefix))
    return items


class ForwardTokens:
    """Counts the tokens a model runs forward (a forward pre-hook)."""

    def __init__(self, model) -> None:
        self.lengths: list[int] = []
        self.handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.lengths.append(int(ids.shape[1]))

    def close(self) -> None:
        self.handle.remove()


def forward_lengths(cond: S.Condition, items, *models) -> list[list[int]]:
    """Score ``items`` under ``cond``; the token counts each of ``models`` ran forward, per call."""
    counters = [ForwardTokens(model) for model in models]
    try:
        for item in items:
            S.evaluate_mc_item(cond, TOK, item)
    finally:
        for counter in counters:
            counter.close()
    return [counter.lengths for counter in counters]


@pytest.fixture(scope="module")
def fitted_mapper(models):
    from kvhandoff import FitConfig, fit_mapper

    from conftest import random_batches

    target, source = models
    return fit_mapper(source, target, random_batches(4, tokens=32), FitConfig(ridge_lambda=1e-3), progress=False)


def _conditions(kind, models, fitted_mapper, prefix_entries):
    target, source = models
    if kind == "target":
        return S.Standalone("target", target, prefix_entries=prefix_entries)
    if kind == "source":
        return S.Standalone("source", source, prefix_entries=prefix_entries)
    if kind == "transfer-noisy":
        return S.Transfer("transfer", source, target, NoisyMapper(scale=0.3), exact_prefix=0,
                          prefix_entries=prefix_entries)
    if kind == "transfer-exact-prefix":
        return S.Transfer("transfer", source, target, NoisyMapper(scale=0.3), exact_prefix=5,
                          prefix_entries=prefix_entries)
    # a real (fitted) mapper between two different models, with its own exact_prefix setting
    return S.Transfer("transfer", source, target, fitted_mapper, prefix_entries=prefix_entries)


@pytest.mark.parametrize("kind", ["target", "source", "transfer-noisy", "transfer-exact-prefix", "transfer-fitted"])
def test_prefix_reuse_matches_full_prefill(models, fitted_mapper, kind):
    items = fewshot_items()
    gen = GenItem(id="fewshot-gen", context=FEWSHOT + "Q: One more?\nA. x\nB. y\nAnswer:", answer="A",
                  shared_prefix=FEWSHOT)
    reuse, full = (_conditions(kind, models, fitted_mapper, n) for n in (4, 0))
    assert full.prefixes is None
    for item in items:
        with_reuse = S.evaluate_mc_item(reuse, TOK, item)["loglikelihoods"]
        without = S.evaluate_mc_item(full, TOK, item)["loglikelihoods"]
        assert with_reuse == pytest.approx(without, abs=1e-4)
    assert S.evaluate_gen_item(reuse, TOK, gen, 8) == S.evaluate_gen_item(full, TOK, gen, 8)
    assert (reuse.prefixes.misses, reuse.prefixes.hits, reuse.prefixes.mismatches) == (1, len(items), 0)
    assert reuse.prefixes.keys() == [tuple(TOK.encode(FEWSHOT))]


def test_prefix_reuse_differs_from_a_wrong_cache(models):
    """The agreement above can fail: a prefix cache from the wrong model changes the scores."""
    target, source = models
    items = fewshot_items()
    full = [S.evaluate_mc_item(S.Standalone("t", target, 0), TOK, it)["loglikelihoods"] for it in items]
    cond = S.Standalone("t", target)
    prefix_ids = TOK.encode(FEWSHOT)
    cond.prefixes.copy_of(prefix_ids, lambda: S.Standalone("s", source, 0).prefill(torch.tensor([prefix_ids])))
    wrong = [S.evaluate_mc_item(cond, TOK, it)["loglikelihoods"] for it in items]
    assert cond.prefixes.hits == len(items)
    assert all(w != pytest.approx(f, abs=1e-3) for w, f in zip(wrong, full, strict=True))


@pytest.mark.parametrize("kind", ["target", "transfer"])
def test_prefix_prefilled_once_for_several_items(models, kind):
    target, source = models
    items = fewshot_items()
    prefix_len = len(TOK.encode(FEWSHOT))
    item_lens = [len(TOK.encode(it.choices[0].context)) - 1 for it in items]  # each item's prefill
    totals = {}
    for entries in (4, 0):
        if kind == "target":
            cond, prefiller = S.Standalone("target", target, prefix_entries=entries), target
        else:  # the source prefills; the target only reads on (exact_prefix 0)
            cond = S.Transfer("transfer", source, target, IdentityMapper(), exact_prefix=0, prefix_entries=entries)
            prefiller = source
        (totals[entries],) = forward_lengths(cond, items, prefiller)
    if kind == "transfer":
        assert sorted(totals[0]) == sorted(item_lens)  # the source runs only the prefills
        assert totals[4] == [prefix_len] + [n - prefix_len for n in item_lens]
    assert sum(totals[0]) - sum(totals[4]) == (len(items) - 1) * prefix_len
    assert totals[4].count(prefix_len) == 1 and totals[0].count(prefix_len) == 0


def test_history_transfer_maps_the_history_and_the_target_reads_the_question(models):
    from kvhandoff.runtime.handoff import handoff_cache

    target, source = models
    items = fewshot_items()
    # identity mapping of the target's own cache: exactly the target's scores
    identity = S.standard_conditions(target, target, IdentityMapper(), mapped="history")["transfer"]
    own = S.Standalone("target", target, prefix_entries=0)
    for item in items:
        assert S.evaluate_mc_item(identity, TOK, item)["loglikelihoods"] == pytest.approx(
            S.evaluate_mc_item(own, TOK, item)["loglikelihoods"], abs=1e-4)
    # a noisy mapper: the same as handoff_cache with the question as the target's tail, unlike mapping it all
    history = S.TransferHistory("transfer", source, target, NoisyMapper(scale=0.3), exact_prefix=0)
    whole = S.Transfer("transfer", source, target, NoisyMapper(scale=0.3), exact_prefix=0)
    prefix_len = len(TOK.encode(FEWSHOT))
    context_ids = S.encode(TOK, items[0].choices[0].context)
    ids = torch.tensor([context_ids[:-1]])
    expected = handoff_cache(source, target, NoisyMapper(scale=0.3), ids, 0, target_tail=ids.shape[1] - prefix_len)
    got = history.prefill(ids, prefix_len)
    for a, b in zip(got.layers, expected.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys)
        torch.testing.assert_close(a.values, b.values)
    assert S.evaluate_mc_item(history, TOK, items[0]) != S.evaluate_mc_item(whole, TOK, items[0])


def test_history_transfer_runs_the_source_once_per_history(models):
    target, source = models
    items = fewshot_items()
    prefix_len = len(TOK.encode(FEWSHOT))
    cond = S.TransferHistory("transfer", source, target, IdentityMapper(), exact_prefix=0, prefix_entries=0)
    source_lengths, target_lengths = forward_lengths(cond, items, source, target)
    # no reuse (prefix_entries 0): each item maps its history anew; the target prefills only the question
    item_lens = [len(TOK.encode(it.choices[0].context)) - 1 for it in items]
    assert source_lengths == [prefix_len] * len(items)
    assert [n for n in target_lengths if n > 2] == [n - prefix_len for n in item_lens]
    cond = S.TransferHistory("transfer", source, target, IdentityMapper(), exact_prefix=0)
    (source_lengths,) = forward_lengths(cond, items, source)
    assert source_lengths == [prefix_len]  # with reuse: one source prefill of the shared history


def test_history_transfer_refuses_items_without_a_history(models):
    target, source = models
    (item,) = short_items("arc_challenge")
    cond = S.standard_conditions(source, target, IdentityMapper(), mapped="history")["transfer"]
    with pytest.raises(ConfigError, match="few-shot history"):
        S.evaluate_mc_item(cond, TOK, item)
    with pytest.raises(ConfigError, match="mapped"):
        S.standard_conditions(source, target, IdentityMapper(), mapped="question")


def test_prefix_boundary_mismatch_falls_back(models):
    """A BPE merge across the prefix boundary ("h" + "e" → "he") makes the prefix's tokens no prefix of the
    context's: the context is prefilled in full; a boundary that tokenizes alike is reused."""
    from conftest import tiny_tokenizer

    target, _ = models
    tok = tiny_tokenizer()
    split = FEWSHOT + "Q: which is h"
    items = fewshot_items(split, ("ello?", "eat?"), lead="")
    assert tok.encode(split) != tok.encode(items[0].choices[0].context)[: len(tok.encode(split))]
    reuse, full = S.Standalone("target", target), S.Standalone("target", target, prefix_entries=0)
    for item in items:
        assert S.evaluate_mc_item(reuse, tok, item) == S.evaluate_mc_item(full, tok, item)  # the same path
    assert (reuse.prefixes.mismatches, reuse.prefixes.misses, len(reuse.prefixes)) == (len(items), 0, 0)

    ok = fewshot_items()  # ends in "\n\n": the same tokens on both sides of the boundary
    for item in ok:
        assert S.evaluate_mc_item(reuse, tok, item)["loglikelihoods"] == pytest.approx(
            S.evaluate_mc_item(full, tok, item)["loglikelihoods"], abs=1e-4)
    assert (reuse.prefixes.misses, reuse.prefixes.hits) == (1, len(ok) - 1)


def test_reusable_prefix_len():
    assert S.reusable_prefix_len([1, 2, 3, 4], [1, 2]) == 2
    assert S.reusable_prefix_len([1, 2, 3, 4], [1, 2, 3]) == 3  # the whole prefill ([:-1]) may be the prefix
    assert S.reusable_prefix_len([1, 2, 3, 4], [1, 2, 3, 4]) == 0  # the prefill covers only [:-1]
    assert S.reusable_prefix_len([1, 2, 3, 4], [1, 5]) == 0
    assert S.reusable_prefix_len([1, 2, 3, 4], None) == S.reusable_prefix_len([1, 2, 3, 4], []) == 0


def test_prefix_cache_lru_bound_and_copies():
    built = []

    def build(name):
        return lambda: built.append(name) or {"cache": [name]}

    lru = S.PrefixCache(max_entries=2)
    a = lru.copy_of([1], build("a"))
    a["cache"].append("mutated")  # callers get copies: the stored cache is untouched
    assert lru.copy_of([1], build("a")) == {"cache": ["a"]}
    lru.copy_of([2], build("b"))
    lru.copy_of([1], build("a"))  # a is now the most recently used
    lru.copy_of([3], build("c"))  # evicts b
    assert len(lru) == 2 and lru.keys() == [(1,), (3,)] and [2] not in lru
    lru.copy_of([2], build("b"))  # rebuilt, evicting a
    assert built == ["a", "b", "c", "b"] and lru.keys() == [(3,), (2,)]
    assert (lru.hits, lru.misses) == (2, 4)
    none = S.PrefixCache(0)
    none.copy_of([1], build("x"))
    assert len(none) == 0
    with pytest.raises(ConfigError):
        S.PrefixCache(-1)


def test_condition_prefix_cache_is_bounded(models):
    target, _ = models
    cond = S.Standalone("target", target, prefix_entries=2)
    prefixes = [f"Topic {t}.\n\n" for t in "abc"]
    for prefix in prefixes + prefixes[:1]:  # a, b, c, then a again (evicted by c)
        S.evaluate_mc_item(cond, TOK, fewshot_items(prefix, ("Why?",))[0])
    assert len(cond.prefixes) == 2
    assert cond.prefixes.keys() == [tuple(TOK.encode(prefixes[2])), tuple(TOK.encode(prefixes[0]))]
    assert (cond.prefixes.misses, cond.prefixes.hits) == (4, 0)


@pytest.mark.parametrize("task", ["mmlu", "gsm8k"])
def test_real_fewshot_prefixes_are_reused_token_prefixes(task):
    """The MMLU and GSM8K prompts end their few-shot block at a boundary that both tokenizers keep."""
    from conftest import tiny_tokenizer

    item = load_items(task)[0]
    context = item.choices[0].context if isinstance(item, MCItem) else item.context
    for tok in (TOK, ByteTokenizer(bos=257), tiny_tokenizer()):
        prefix_ids = S.prefix_ids_of(tok, item)
        assert prefix_ids and S.reusable_prefix_len(S.encode(tok, context), prefix_ids) == len(prefix_ids)


def test_generation_stops_at_every_end_of_text_token():
    from conftest import chat_tokenizer, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    assert S.eos_token_ids(tokenizer) == {tokenizer.eos_token_id}
    # a chat model's GGUF config names only the turn end; the document end stops generation too
    chat = chat_tokenizer()
    ids = S.eos_token_ids(chat)
    assert ids == {chat.convert_tokens_to_ids("<|im_end|>"), chat.convert_tokens_to_ids("<|endoftext|>")}


def test_transfer_with_a_recompute_policy(models):
    """A transfer condition's recompute policy: every mapped position recomputed → the target's own scores; a
    partial budget changes the noisy transfer's; the history condition recomputes the history it maps."""
    from kvhandoff_lab.evaluation.options import EvalOptions

    target, _ = models
    (item,) = short_items("arc_challenge")
    own = S.evaluate_mc_item(S.Standalone("target", target), TOK, item)
    noisy = S.evaluate_mc_item(S.Transfer("transfer", target, target, NoisyMapper(), exact_prefix=0), TOK, item)
    full = S.evaluate_mc_item(S.Transfer("transfer", target, target, NoisyMapper(), exact_prefix=0,
                                         recompute=Deviation(1.0)), TOK, item)
    some = S.evaluate_mc_item(S.Transfer("transfer", target, target, NoisyMapper(), exact_prefix=0,
                                         recompute=Recent(0.2)), TOK, item)
    assert full["loglikelihoods"] == pytest.approx(own["loglikelihoods"], abs=1e-4)
    assert some["loglikelihoods"] != noisy["loglikelihoods"]
    conditions = S.standard_conditions(target, target, NoisyMapper(), 0, "history", recompute=Sinks(0.5))
    assert conditions["transfer"].recompute.spec == "sinks:50%"
    assert conditions["transfer"].plan == HandoffPlan(0, Sinks(0.5))
    # the lab's options are an edge: a spec is parsed there, once, into the policy the conditions receive
    assert EvalOptions(recompute="recent:0.1").recompute == Recent(0.1) and EvalOptions().recompute is None
    with pytest.raises(ConfigError):
        EvalOptions(recompute="recent")
    with pytest.raises(ConfigError, match="RecomputePolicy"):  # below the edge a spec is refused
        S.Transfer("transfer", target, target, NoisyMapper(), exact_prefix=0, recompute="recent:20%")


@pytest.mark.parametrize("recompute", [None, Recent(0.3)])
def test_a_transfer_reads_the_last_context_token_in_the_forward_that_recomputes(models, recompute):
    """The transfer condition's target recomputes the exact prefix (and the policy's picks) in the forward that
    reads the last context token: one forward, the log-probs of the handoff that recomputes first."""
    target, _ = models
    condition = S.Transfer("transfer", target, target, NoisyMapper(), exact_prefix=4, prefix_entries=0,
                           recompute=recompute)
    context = torch.tensor([TOK.encode("Question: which colour is the sky? Answer:")])
    calls = []
    handle = target.model.register_forward_pre_hook(lambda module, args: calls.append(args))
    try:
        with torch.inference_mode():
            cache, fused = condition.read_context(context)
            reads = len(calls)
            reference_cache, reference = S.Condition.read_context(condition, context)
    finally:
        handle.remove()
    assert reads == 2  # the source's prefill and one target forward (the two-step path: three)
    assert len(calls) - reads == 3
    assert cache.get_seq_length() == reference_cache.get_seq_length() == context.shape[1]
    assert (fused - reference).abs().max() <= 1e-5
    noisy, _ = S.Transfer("transfer", target, target, NoisyMapper(), exact_prefix=0, prefix_entries=0,
                          recompute=recompute).read_context(context)
    assert (noisy.layers[0].values[:, :, :4] - cache.layers[0].values[:, :, :4]).abs().max() > 1e-3
