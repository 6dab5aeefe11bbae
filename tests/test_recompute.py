"""Selective recompute on a mapped cache (kvhandoff.runtime.recompute) and the policy threaded through every handoff
path."""

import dataclasses

import pytest
import torch

from kvhandoff import FitConfig, SwitchingSession, catch_up, fit_mapper, handoff_cache, prefill
from kvhandoff.runtime.policy import DEFAULT_RECOMPUTE, RECOMPUTE_BUDGETS, RecomputePolicy
from kvhandoff.errors import ConfigError
from kvhandoff.model.cache import cache_of, cache_view
from kvhandoff.runtime.recompute import (
    SelectionInfo,
    apply_policy,
    attention_from_queries,
    budget_count,
    deviation,
    layer0_kv,
    mix,
    recent,
    recompute_and_read,
    recompute_positions,
    record_queries,
    select,
    sinks,
    source_attention,
    source_attention_scores,
    turn_marker_ids,
)

from conftest import exactly_related, random_batches, tiny_model, tiny_tokenizer

EXACT_FIT = FitConfig(top_k="all", ridge_lambda=1e-10, token_stride=1)
RULES = ("sinks", "recent", "deviation", "source_attention", "mix")


def ids_of(batch=1, tokens=40, seed=3):
    return torch.randint(0, 128, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def junk_like(cache, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return cache_of((torch.randn(layer.keys.shape, generator=gen), torch.randn(layer.values.shape, generator=gen))
                    for layer in cache.layers)


def next_logits(model, cache, later):
    """The logits of ``later`` read on ``cache`` (left as it was: the model extends a view of it)."""
    with torch.inference_mode():
        return model(input_ids=later, cache=cache_view(cache, 0), use_cache=True).logits


def max_kv_diff(a, b, positions=slice(None)):
    return max(max((x.keys[:, :, positions] - y.keys[:, :, positions]).abs().max().item(),
                   (x.values[:, :, positions] - y.values[:, :, positions]).abs().max().item())
               for x, y in zip(a.layers, b.layers, strict=True))


@pytest.fixture(scope="module")
def exact():
    source = tiny_model("qwen2", layers=3)
    target = exactly_related(source)
    return source, target, fit_mapper(source, target, random_batches(), EXACT_FIT, progress=False)


@pytest.fixture(scope="module")
def inexact():
    """Two unrelated tiny models and a ridge mapper between them: the mapped cache is far from the target's own."""
    source = tiny_model("qwen2", layers=2, seed=0)
    target = tiny_model("qwen2", layers=3, head_dim=32, seed=1)
    return source, target, fit_mapper(source, target, random_batches(count=2), FitConfig(top_k=1), progress=False)


# -- the sparse prefill ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_recomputing_every_position_gives_the_targets_own_prefill(family, attention):
    target = tiny_model(family, layers=3, attn_implementation=attention)
    ids = ids_of(batch=2, tokens=44)
    context, later = ids[:, :36], ids[:, 36:]
    own, _ = prefill(target, context)
    cache = junk_like(own)
    assert recompute_positions(target, cache, context, torch.arange(36)) is cache
    assert cache.get_seq_length() == 36
    assert max_kv_diff(own, cache) <= 1e-5
    assert (next_logits(target, own, later) - next_logits(target, cache, later)).abs().max() <= 1e-4


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_recomputed_keys_sit_at_their_true_positions(family):
    """Layer 0's K/V depend on the token and its position alone: a recomputed position's layer-0 key (RoPE at that
    position) and value equal the target's own there, whatever the rest of the cache holds; the rest is untouched."""
    target = tiny_model(family, layers=2, rope_parameters={"rope_type": "default", "rope_theta": 100.0})
    ids = ids_of(tokens=30)
    own, _ = prefill(target, ids)
    cache = junk_like(own)
    before = junk_like(own)
    picked = torch.tensor([3, 11, 12, 29])
    recompute_positions(target, cache, ids, picked)
    layer, reference = cache.layers[0], own.layers[0]
    assert (layer.keys[:, :, picked] - reference.keys[:, :, picked]).abs().max() <= 1e-5
    assert (layer.values[:, :, picked] - reference.values[:, :, picked]).abs().max() <= 1e-5
    shifted = layer.keys[:, :, picked[:-1] + 1]  # another position's key is not this one's
    assert (shifted - reference.keys[:, :, picked[:-1]]).abs().max() > 1e-2
    rest = torch.tensor([p for p in range(30) if p not in picked.tolist()])
    assert max_kv_diff(cache, before, rest) == 0
    keys, values = layer0_kv(target, ids)
    assert (keys - reference.keys).abs().max() <= 1e-5 and (values - reference.values).abs().max() <= 1e-5


def test_a_recomputed_prefix_is_exact_at_every_layer_and_rows_may_differ():
    """Causal attention: recomputing positions 0..k−1 on a junk cache gives the target's own K/V there at every layer;
    batch rows may pick different positions; an empty set changes nothing."""
    target = tiny_model("qwen2", layers=3)
    ids = ids_of(batch=2, tokens=24)
    own, _ = prefill(target, ids)
    cache = junk_like(own)
    recompute_positions(target, cache, ids, torch.tensor([[2, 0, 1, 3, 4], [0, 1, 2, 3, 20]]))
    assert max_kv_diff(own, cache, slice(0, 5)) > 0  # row 1 did not recompute position 4
    assert max(max((a.keys[0, :, :5] - b.keys[0, :, :5]).abs().max().item() for a, b in
                   zip(own.layers, cache.layers, strict=True)), 0) <= 1e-5
    assert max((a.keys[1, :, :4] - b.keys[1, :, :4]).abs().max().item()
               for a, b in zip(own.layers, cache.layers, strict=True)) <= 1e-5
    snapshot = [layer.keys.clone() for layer in cache.layers]
    recompute_positions(target, cache, ids, torch.empty(0, dtype=torch.long))
    assert all(torch.equal(a, b.keys) for a, b in zip(snapshot, cache.layers, strict=True))
    with pytest.raises(ConfigError):
        recompute_positions(target, cache, ids, torch.tensor([24]))
    with pytest.raises(ConfigError):
        recompute_positions(target, cache, ids[:, :10], torch.tensor([1]))


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_recompute_and_read_is_the_recompute_then_the_read_in_one_forward(family, attention):
    """Rows may recompute different positions; the new tokens see the recomputed K/V; the cache grows by them."""
    target = tiny_model(family, layers=3, attn_implementation=attention)
    ids = ids_of(batch=2, tokens=30)
    context, new = ids[:, :26], ids[:, 26:]
    junk = junk_like(prefill(target, context)[0])
    positions = torch.tensor([[0, 1, 2, 3, 17], [5, 0, 1, 2, 3]])
    reference = junk_like(junk)
    recompute_positions(target, reference, context, positions)
    expected = next_logits(target, reference, new)[:, -2:]
    logits = recompute_and_read(target, junk, context, positions, new, logits_to_keep=2)
    assert (logits - expected).abs().max() <= 1e-5
    prefill(target, new, reference)
    assert junk.get_seq_length() == 30 and max_kv_diff(junk, reference) <= 1e-5
    plain = junk_like(reference)  # nothing to recompute: the plain read
    assert (recompute_and_read(target, plain, ids, torch.empty(0, dtype=torch.long), ids[:, :1])
            - next_logits(target, junk_like(reference), ids[:, :1])[:, -1:]).abs().max() <= 1e-5
    with pytest.raises(ConfigError, match="new_ids"):
        recompute_and_read(target, junk_like(reference), ids, positions, ids[:, :0])


@pytest.mark.parametrize("rule", RULES)
def test_any_selection_on_an_exactly_mapped_cache_is_the_targets_own(exact, rule):
    source, target, mapper = exact
    ids = ids_of(tokens=50)
    context, later = ids[:, :40], ids[:, 40:]
    own, _ = prefill(target, context)
    for budget in (0.1, 0.5):
        cache = handoff_cache(source, target, mapper, context, exact_prefix=0, recompute=f"{rule}:{budget}")
        assert cache.get_seq_length() == 40
        assert max_kv_diff(own, cache) <= 1e-3
        assert (next_logits(target, own, later) - next_logits(target, cache, later)).abs().max() <= 1e-4


def test_full_budget_makes_an_inexact_handoff_exact_and_partial_budgets_help(inexact):
    source, target, mapper = inexact
    ids = ids_of(tokens=48)
    context, later = ids[:, :40], ids[:, 40:]
    own, _ = prefill(target, context)
    reference = next_logits(target, own, later)
    errors = {}
    for spec in ("none", "recent:50%", "deviation:100%", "sinks:100%"):
        cache = handoff_cache(source, target, mapper, context, recompute=spec)
        errors[spec] = (next_logits(target, cache, later) - reference).abs().max().item()
    assert errors["none"] > 1e-2
    assert errors["deviation:100%"] <= 1e-4 and errors["sinks:100%"] <= 1e-4
    assert errors["recent:50%"] < errors["none"]
    # the target reads the tail itself after the recompute; with target_tail the recompute covers the mapped part only
    cache = handoff_cache(source, target, mapper, ids[:, :44], recompute="recent:100%", target_tail=4)
    assert (next_logits(target, cache, ids[:, 44:]) - next_logits(target, prefill(target, ids[:, :44])[0],
                                                                  ids[:, 44:])).abs().max() <= 1e-4


# -- the rules -----------------------------------------------------------------------------------------------------


def test_budget_rounding():
    assert [budget_count(b, 30) for b in RECOMPUTE_BUDGETS] == [0, 1, 2, 3, 6, 15, 30]
    assert budget_count(0.05, 10) == 1 and budget_count(0.04, 10) == 0 and budget_count(1.0, 0) == 0
    with pytest.raises(ConfigError):
        budget_count(1.5, 10)


@pytest.mark.parametrize("rule", RULES)
def test_every_rule_at_zero_and_full_budget(exact, rule):
    source, target, mapper = exact
    ids = ids_of(batch=2, tokens=30)
    cache = handoff_cache(source, target, mapper, ids, exact_prefix=0)
    info = SelectionInfo(start=4, turn_starts=(10, 20), source_attention=torch.rand(2, 30))
    functions = {"sinks": sinks, "recent": recent, "deviation": deviation, "source_attention": source_attention,
                 "mix": mix}
    assert functions[rule](target, cache, ids, 0.0, info).shape == (2, 0)
    assert torch.equal(functions[rule](target, cache, ids, 1.0, info), torch.arange(4, 30).expand(2, -1))
    for budget in RECOMPUTE_BUDGETS:
        picked = select(rule, target, cache, ids, budget, info)
        assert picked.shape == (2, budget_count(budget, 26))
        assert bool((picked >= 4).all()) and all(len(set(row)) == len(row) for row in picked.tolist())
        assert torch.equal(picked, picked.sort(dim=1).values)


def test_sinks_take_the_first_tokens_of_the_context_and_of_every_turn():
    ids = ids_of(tokens=40)
    assert sinks(None, None, ids, 0.1, SelectionInfo()).tolist() == [[0, 1, 2, 3]]
    info = SelectionInfo(start=2, turn_starts=(15, 30))
    assert sinks(None, None, ids, 3 / 38, info).tolist() == [[2, 15, 30]]
    assert sinks(None, None, ids, 6 / 38, info).tolist() == [[2, 3, 15, 16, 30, 31]]
    marked = ids.clone()
    marked[0, [9, 25]] = 127
    detected = sinks(None, None, marked, 3 / 40, SelectionInfo(marker_ids=(127,)))
    assert detected.tolist() == [[0, 9, 25]]


def test_turn_markers_come_from_the_tokenizer():
    from tokenizers import AddedToken

    tokenizer = tiny_tokenizer()
    assert turn_marker_ids(tokenizer) == ()
    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken("<|im_start|>", special=True)]})
    assert turn_marker_ids(tokenizer) == (tokenizer.convert_tokens_to_ids("<|im_start|>"),)


def test_recent_takes_the_last_tokens():
    assert recent(None, None, ids_of(tokens=20), 0.2, SelectionInfo()).tolist() == [[16, 17, 18, 19]]


def test_deviation_finds_the_positions_whose_mapped_kv_were_corrupted(exact):
    source, target, mapper = exact
    ids = ids_of(batch=2, tokens=40)
    cache = handoff_cache(source, target, mapper, ids, exact_prefix=0)
    corrupt = [[5, 17, 33, 38], [1, 2, 20, 21]]
    for row, positions in enumerate(corrupt):
        cache.layers[0].keys[row, :, positions] += 3.0
        cache.layers[0].values[row, :, positions[:2]] *= -2.0
    assert deviation(target, cache, ids, 0.1).tolist() == corrupt


def test_source_attention_is_the_attention_the_sources_last_queries_paid(exact):
    """From the cache (re-reading the last window) or recorded at prefill, the scores equal the eager attention
    weights of the source's own prefill, summed over layers, heads and the last `window` queries."""
    source, target, _ = exact
    ids = ids_of(batch=2, tokens=36)
    window = 8
    with torch.inference_mode():
        out = source(input_ids=ids, output_attentions=True, use_cache=True)
    reference = sum(att[:, :, -window:].sum(dim=(1, 2)) for att in out.attentions)
    cache = out.cache
    scores = source_attention_scores(source, cache, ids, window)
    assert cache.get_seq_length() == 36
    assert (scores - reference).abs().max() <= 1e-4
    with record_queries(source, window) as queries:
        recorded_cache, _ = prefill(source, ids)
    assert (attention_from_queries(source, queries, recorded_cache) - reference).abs().max() <= 1e-4
    assert not any(layer.self_attn.q_proj._forward_hooks for layer in source.model.layers)
    top = reference.topk(3, dim=1).indices.sort(dim=1).values
    assert torch.equal(source_attention(target, cache, ids, 3 / 36, SelectionInfo(source_attention=scores)), top)
    with pytest.raises(ConfigError, match="source's attention"):
        source_attention(target, cache, ids, 0.1)


def test_mix_shares_the_budget_between_rules_without_overlap(exact):
    source, target, mapper = exact
    ids = ids_of(tokens=40)
    cache = handoff_cache(source, target, mapper, ids, exact_prefix=0)
    picked = mix(target, cache, ids, 0.25, SelectionInfo(), shares=(("sinks", 0.5), ("recent", 0.5)))
    assert picked.tolist() == [[0, 1, 2, 3, 4, 35, 36, 37, 38, 39]]
    overlap = mix(target, cache, ids, 1.0, SelectionInfo(), shares=(("recent", 0.5), ("sinks", 0.5)))
    assert overlap.tolist() == [list(range(40))]
    assert mix(target, cache, ids, 0.1).shape == (1, 4)  # the default shares


# -- the policy ----------------------------------------------------------------------------------------------------


def test_policy_parses_and_validates():
    assert RecomputePolicy.parse("deviation:10%") == RecomputePolicy("deviation", 0.1)
    assert RecomputePolicy.parse("recent:0.05").spec == "recent:5%"
    assert RecomputePolicy.parse("none") == RecomputePolicy() and not RecomputePolicy().active
    assert not RecomputePolicy.parse("sinks:0").active
    custom = RecomputePolicy.parse("mix(sinks=0.25,deviation=0.75):20%:window=8")
    assert custom.mix == (("sinks", 0.25), ("deviation", 0.75)) and custom.window == 8
    assert RecomputePolicy.parse(custom.spec) == custom
    assert RecomputePolicy.parse("source_attention:2%").rules == ("source_attention",)
    for bad in ("deviation", "nearby:10%", "recent:150%", "recent:-1", "recent:x", "mix(sinks=0.5):10%",
                "mix(sinks=0.5,mix=0.5):10%", "recent:10%:depth=2", 3):
        with pytest.raises(ConfigError):
            RecomputePolicy.parse(bad)


def test_the_default_lives_in_the_fit_config_and_the_manifest(exact):
    assert FitConfig().recompute == DEFAULT_RECOMPUTE == "recent:5%" and "recompute" not in FitConfig().to_dict()
    assert FitConfig(recompute="none").to_dict()["recompute"] == "none"
    config = FitConfig(recompute="recent:0.5")
    assert config.recompute == "recent:50%" and config.to_dict()["recompute"] == "recent:50%"
    assert config.recompute_policy == RecomputePolicy("recent", 0.5)
    with pytest.raises(ConfigError):
        FitConfig(recompute="fast:1")

    source, target, mapper = exact
    assert mapper.recompute == DEFAULT_RECOMPUTE
    # a mapper whose fit config says "recompute everything" makes its handoffs exact even with a broken map
    broken = type(mapper)(torch.zeros_like(mapper.weight), mapper.bias, mapper.selected,
                          dataclasses.replace(mapper.manifest, config=FitConfig(recompute="sinks:100%")))
    ids = ids_of(tokens=30)
    own, _ = prefill(target, ids)
    assert max_kv_diff(own, handoff_cache(source, target, broken, ids)) <= 1e-4
    assert max_kv_diff(own, handoff_cache(source, target, broken, ids, recompute="none")) > 1e-2


def test_apply_policy_returns_the_positions_and_needs_the_source_for_its_attention(inexact):
    source, target, mapper = inexact
    ids = ids_of(tokens=20)
    cache = handoff_cache(source, target, mapper, ids, exact_prefix=0)
    assert apply_policy("none", target, cache, ids).shape == (1, 0)
    assert apply_policy("recent:10%", target, cache, ids, SelectionInfo(start=5)).tolist() == [[18, 19]]
    with pytest.raises(ConfigError, match="source model"):
        apply_policy("source_attention:10%", target, cache, ids)
    source_cache, _ = prefill(source, ids)
    picked = apply_policy("source_attention:10%", target, cache, ids, source_model=source, source_cache=source_cache)
    assert picked.shape == (1, 2)


def test_catch_up_recomputes_among_the_newly_mapped_positions(inexact):
    source, target, mapper = inexact
    ids = ids_of(tokens=40)
    source_cache, _ = prefill(source, ids)
    own, _ = prefill(target, ids)
    kept, _ = prefill(target, ids[:, :25])
    catch_up(kept, source_cache, mapper, source, target, ids, recompute="recent:100%")
    assert kept.get_seq_length() == 40 and max_kv_diff(own, kept) <= 1e-4
    partial, _ = prefill(target, ids[:, :25])
    catch_up(partial, source_cache, mapper, source, target, ids, recompute="sinks:20%")  # 3 of 15
    assert max_kv_diff(own, partial, slice(25, 28)) <= 1e-4 and max_kv_diff(own, partial, slice(28, 40)) > 1e-2
    with pytest.raises(ConfigError, match="input_ids"):
        catch_up(prefill(target, ids[:, :25])[0], source_cache, mapper, source, target, recompute="recent:10%")
    with pytest.raises(ConfigError, match="recompute='none'"):  # the mapper's default policy is active
        catch_up(prefill(target, ids[:, :25])[0], source_cache, mapper, source, target)
    # no active policy: mapping alone needs no ids
    catch_up(prefill(target, ids[:, :25])[0], source_cache, mapper, source, target, recompute="none")


def test_a_session_recomputes_at_every_handover_and_knows_the_turns(inexact):
    source, target, mapper = inexact
    reverse = fit_mapper(target, source, random_batches(count=2), FitConfig(top_k=1), progress=False)
    turns = [ids_of(tokens=n, seed=n).tolist()[0] for n in (12, 9, 7)]
    own = SwitchingSession({"small": source, "large": target}, {})
    plain = SwitchingSession({"small": source, "large": target},
                             {("small", "large"): mapper, ("large", "small"): reverse})
    full = SwitchingSession({"small": source, "large": target},
                            {("small", "large"): mapper, ("large", "small"): reverse}, recompute="sinks:100%")
    for session in (plain, full):
        session.read("small", turns[0])
        session.read("small", turns[1])
    assert full._turn_starts == [0, 12]
    reference = own.read("large", turns[0] + turns[1] + turns[2])
    assert (full.read("large", turns[2]) - reference).abs().max() <= 1e-4
    assert (plain.read("large", turns[2]) - reference).abs().max() > 1e-3
    # back to the small model: it catches up on the large model's turn, recomputing it whole
    back = full.read("small", turns[0][:3])
    alone = SwitchingSession({"small": source}, {}).read("small", turns[0] + turns[1] + turns[2] + turns[0][:3])
    assert (back - alone).abs().max() <= 1e-4
    sinks_only = SwitchingSession({"small": source, "large": target}, {("small", "large"): mapper},
                                  exact_prefix=0, recompute="sinks:10%")
    sinks_only.read("small", turns[0])
    sinks_only.read("small", turns[1])
    sinks_only.switch_to("large")
    cache = sinks_only.cache("large")
    mapped = handoff_cache(source, target, mapper, torch.tensor([turns[0] + turns[1]]), exact_prefix=0,
                           recompute="none")
    changed = [p for p in range(21) if (cache.layers[0].keys[0, :, p] - mapped.layers[0].keys[0, :, p]).abs().max()
               > 1e-6]
    assert changed == [0, 12]  # 10% of 21 positions: the two turn starts
    with pytest.raises(ConfigError):
        SwitchingSession({"small": source}, {}, recompute="fast:1")


def test_stacked_query_attention_is_sdpa_without_copying_the_cache():
    """The query heads of each KV head stacked along the query axis: transformers' sdpa (which copies every key and
    value once per query head) to float32 precision; a model's attention setting is restored after a sparse
    forward."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kvhandoff.runtime.recompute import stacked_query_attention

    gen = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(shape, generator=gen) for shape in ((2, 12, 5, 16), (2, 2, 40, 16),
                                                                         (2, 2, 40, 16)))
    visible = torch.rand(2, 1, 5, 40, generator=gen) > 0.3
    mask = torch.zeros(visible.shape).masked_fill_(~visible, torch.finfo(torch.float32).min)
    module = SimpleNamespace(num_key_value_groups=6, is_causal=True)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    stacked, _ = stacked_query_attention(module, query, key, value, mask, scaling=0.3)
    assert stacked.shape == expected.shape == (2, 5, 12, 16)
    assert (stacked - expected).abs().max() <= 1e-6
    target = tiny_model("qwen2", layers=2, attn_implementation="sdpa")
    ids = ids_of(tokens=12)
    recompute_and_read(target, junk_like(prefill(target, ids[:, :10])[0]), ids[:, :10], torch.arange(4), ids[:, 10:])
    assert target.config._attn_implementation == "sdpa"
