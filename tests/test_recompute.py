"""Selective recompute on a mapped cache (kvhandoff.runtime.recompute: the sparse prefill, the source's attention) and
the plan's policy threaded through every handoff path."""

import pytest
import torch

from _runtime_support import exact_pair, ids_of, inexact_pair, max_kv_diff
from kvhandoff import FitConfig, HandoffPlan, SwitchingSession, catch_up, fit_mapper, handoff_cache, prefill
from kvhandoff.errors import ConfigError
from kvhandoff.model.cache import cache_of, cache_view
from kvhandoff.runtime.deviation import layer0_kv
from kvhandoff.runtime.policy import SelectionInfo, SourceAttention, TargetTurnAttention, TurnAttention
from kvhandoff.runtime.recompute import (
    attention_from_queries,
    leading_layer_rows,
    read_turn,
    recompute_and_read,
    recompute_positions,
    record_queries,
    source_attention_scores,
    turn_attention_scores,
)

from conftest import random_batches, tiny_model

RULES = ("sinks", "recent", "deviation", "source_attention", "mix")



def junk_like(cache, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return cache_of((torch.randn(layer.keys.shape, generator=gen), torch.randn(layer.values.shape, generator=gen))
                    for layer in cache.layers)


def next_logits(model, cache, later):
    """The logits of ``later`` read on ``cache`` (left as it was: the model extends a view of it)."""
    with torch.inference_mode():
        return model(input_ids=later, cache=cache_view(cache, 0), use_cache=True).logits



@pytest.fixture(scope="module")
def exact():
    return exact_pair()


@pytest.fixture(scope="module")
def inexact():
    return inexact_pair()


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
        cache = handoff_cache(source, target, mapper, context, HandoffPlan.of(0, f"{rule}:{budget}"))
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
        cache = handoff_cache(source, target, mapper, context, HandoffPlan.of(recompute=spec))
        errors[spec] = (next_logits(target, cache, later) - reference).abs().max().item()
    assert errors["none"] > 1e-2
    assert errors["deviation:100%"] <= 1e-4 and errors["sinks:100%"] <= 1e-4
    assert errors["recent:50%"] < errors["none"]
    # the target reads the tail itself after the recompute; with target_tail the recompute covers the mapped part only
    cache = handoff_cache(source, target, mapper, ids[:, :44], HandoffPlan.of(recompute="recent:100%"), target_tail=4)
    assert (next_logits(target, cache, ids[:, 44:]) - next_logits(target, prefill(target, ids[:, :44])[0],
                                                                  ids[:, 44:])).abs().max() <= 1e-4


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
    assert torch.equal(SourceAttention(3 / 36).positions(target, cache, ids, SelectionInfo(source_attention=scores)),
                       top)
    with pytest.raises(ConfigError, match="source's attention"):
        SourceAttention(0.1).positions(target, cache, ids)



def test_catch_up_recomputes_among_the_newly_mapped_positions(inexact):
    source, target, mapper = inexact
    ids = ids_of(tokens=40)
    source_cache, _ = prefill(source, ids)
    own, _ = prefill(target, ids)
    kept, _ = prefill(target, ids[:, :25])
    catch_up(kept, source_cache, mapper, source, target, ids, HandoffPlan.of(recompute="recent:100%")).settle(target)
    assert kept.get_seq_length() == 40 and max_kv_diff(own, kept) <= 1e-4
    partial, _ = prefill(target, ids[:, :25])
    catch_up(partial, source_cache, mapper, source, target, ids, HandoffPlan.of(recompute="sinks:20%")).settle(target)
    # 3 of the 15 newly mapped positions
    assert max_kv_diff(own, partial, slice(25, 28)) <= 1e-4 and max_kv_diff(own, partial, slice(28, 40)) > 1e-2
    with pytest.raises(ConfigError, match="input_ids"):
        catch_up(prefill(target, ids[:, :25])[0], source_cache, mapper, source, target,
                 plan=HandoffPlan.of(recompute="recent:10%"))
    with pytest.raises(ConfigError, match="recompute='none'"):  # the default policy is active
        catch_up(prefill(target, ids[:, :25])[0], source_cache, mapper, source, target)
    # no active policy: mapping alone needs no ids
    mapped = catch_up(prefill(target, ids[:, :25])[0], source_cache, mapper, source, target,
                      plan=HandoffPlan.of(recompute="none"))
    assert mapped.pending.numel() == 0 and mapped.cache.length == 40
    # the picks are left to the target's next forward: read recomputes them with the new tokens
    pending = catch_up(prefill(target, ids[:, :25])[0], source_cache, mapper, source, target, ids,
                       HandoffPlan.of(recompute="recent:100%"))
    assert pending.pending.tolist() == [list(range(25, 40))]
    more = ids_of(tokens=3, seed=9)
    logits = pending.read(target, more, logits_to_keep=3)
    assert pending.pending.numel() == 0
    assert (logits - target(input_ids=more, cache=cache_view(own, 0), use_cache=True).logits).abs().max() <= 1e-4


def test_a_session_recomputes_at_every_handover_and_knows_the_turns(inexact):
    source, target, mapper = inexact
    reverse = fit_mapper(target, source, random_batches(count=2), FitConfig(top_k=1), progress=False)
    turns = [ids_of(tokens=n, seed=n).tolist()[0] for n in (12, 9, 7)]
    own = SwitchingSession({"small": source, "large": target}, {})
    plain = SwitchingSession({"small": source, "large": target},
                             {("small", "large"): mapper, ("large", "small"): reverse})
    full = SwitchingSession({"small": source, "large": target},
                            {("small", "large"): mapper, ("large", "small"): reverse},
                            plan=HandoffPlan.of(recompute="sinks:100%"))
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
                                  plan=HandoffPlan.of(0, "sinks:10%"))
    sinks_only.read("small", turns[0])
    sinks_only.read("small", turns[1])
    sinks_only.switch_to("large")
    cache = sinks_only.cache("large")
    mapped = handoff_cache(source, target, mapper, torch.tensor([turns[0] + turns[1]]), HandoffPlan.of(0, "none"))
    changed = [p for p in range(21) if (cache.layers[0].keys[0, :, p] - mapped.layers[0].keys[0, :, p]).abs().max()
               > 1e-6]
    assert changed == [0, 12]  # 10% of 21 positions: the two turn starts
    with pytest.raises(ConfigError):
        HandoffPlan.of(recompute="fast:1")
    with pytest.raises(ConfigError, match="HandoffPlan"):  # below the edge a spec is refused, never parsed
        SwitchingSession({"small": source}, {}, plan="sinks:10%")


def test_turn_attention_ranks_by_what_the_source_attends_to_reading_the_new_turn(exact):
    """The scores equal the eager attention weights the source's new-turn queries pay the history, summed over
    layers, heads and the turn; the source's cache is left as it was; the policy picks the top positions by them and,
    without a new turn, ranks as source_attention does."""
    source, target, _ = exact
    ids = ids_of(batch=1, tokens=44)
    history, turn = ids[:, :36], ids[:, 36:]
    with torch.inference_mode():
        out = source(input_ids=ids, output_attentions=True, use_cache=True)
    reference = sum(att[:, :, 36:, :36].sum(dim=(1, 2)) for att in out.attentions)
    source_cache, _ = prefill(source, history)
    scores = turn_attention_scores(source, source_cache, turn)
    assert source_cache.get_seq_length() == 36 and (scores - reference).abs().max() <= 1e-4
    cache, _ = prefill(target, history)
    policy = TurnAttention(4 / 36)
    picked = policy.positions(target, cache, history, SelectionInfo(new_turn=tuple(turn[0].tolist())), source,
                              source_cache)
    assert torch.equal(picked, reference.topk(4, dim=1).indices.sort(dim=1).values)
    fallback = policy.positions(target, cache, history, SelectionInfo(), source, source_cache)
    assert torch.equal(fallback, SourceAttention(4 / 36).positions(target, cache, history, SelectionInfo(), source,
                                                                    source_cache))
    with pytest.raises(ConfigError, match="source model"):
        policy.positions(target, cache, history, SelectionInfo(new_turn=(1, 2)))


def test_one_read_of_the_turn_gives_its_attention_and_its_log_probs(exact):
    """read_turn: the attention of turn_attention_scores and the model's own log-probs after the turn's last keep
    tokens (those of a prefill of history + turn), from one forward; the cache is left as it was; the lookahead adds
    to the attention and leaves the log-probs those of the turn; keep outside the turn is refused."""
    source, _, _ = exact
    ids = ids_of(batch=1, tokens=40)
    history, turn = ids[:, :32], ids[:, 32:]
    source_cache, _ = prefill(source, history)
    read = read_turn(source, source_cache, turn, keep=3)
    with torch.inference_mode():
        own = source(input_ids=ids).logits[:, -3:].float().log_softmax(-1)
    assert source_cache.get_seq_length() == 32 and read.logprobs.shape == own.shape
    torch.testing.assert_close(read.logprobs, own, atol=1e-4, rtol=0)
    assert torch.equal(read.scores, turn_attention_scores(source, source_cache, turn))
    ahead = read_turn(source, source_cache, turn, keep=3, lookahead=2)
    assert torch.equal(ahead.logprobs, read.logprobs)
    assert torch.equal(ahead.scores, turn_attention_scores(source, source_cache, turn, lookahead=2))
    for bad in (0, 9, True, 1.0):
        with pytest.raises(ConfigError, match="keep"):
            read_turn(source, source_cache, turn, keep=bad)


def test_turn_attention_ranks_by_the_sources_read_the_caller_made(exact, monkeypatch):
    """SelectionInfo.source_turn_read: turn_attention without lookahead picks by it without reading the turn again
    (the same picks as reading it); a lookahead or the target's own read reads the turn themselves; a read that does
    not cover the conversation is refused."""
    from kvhandoff.runtime.seam import TransformersCache

    source, target, _ = exact
    ids = ids_of(batch=1, tokens=44)
    history, turn = ids[:, :36], ids[:, 36:]
    source_cache, _ = prefill(source, history)
    cache, _ = prefill(target, history)
    new_turn = tuple(turn[0].tolist())
    scores = turn_attention_scores(source, source_cache, turn)
    expected = TurnAttention(4 / 36).positions(target, cache, history, SelectionInfo(new_turn=new_turn), source,
                                               source_cache)
    reads = []
    real = TransformersCache.read_turn
    monkeypatch.setattr(TransformersCache, "read_turn",
                        lambda cache, model, *rest: reads.append(model) or real(cache, model, *rest))
    shared = SelectionInfo(new_turn=new_turn, source_turn_read=scores)
    assert torch.equal(TurnAttention(4 / 36).positions(target, cache, history, shared, source, source_cache),
                       expected)
    assert reads == [] and TurnAttention(0.1).ranks_by_source_turn_read
    TurnAttention(4 / 36, lookahead=2).positions(target, cache, history, shared, source, source_cache)
    TargetTurnAttention(4 / 36).positions(target, cache, history, shared, source, source_cache)
    assert reads == [source, target]
    assert not any(p.ranks_by_source_turn_read for p in (TurnAttention(0.1, lookahead=2), TargetTurnAttention(0.1),
                                                         TurnAttention(0.0), SourceAttention(0.1)))
    with pytest.raises(ConfigError, match="source_turn_read"):
        TurnAttention(4 / 36).positions(target, cache, history, SelectionInfo(new_turn=new_turn,
                                        source_turn_read=scores[:, :30]), source, source_cache)


def test_turn_attention_with_lookahead_adds_the_sources_greedy_answer(exact):
    """With a lookahead the scores add the attention the source's next greedy tokens pay the history: equal to the
    eager attention over history + turn + those tokens; the source's cache is left as it was."""
    source, target, _ = exact
    ids = ids_of(batch=1, tokens=40)
    history, turn = ids[:, :32], ids[:, 32:]
    answer = turn
    with torch.inference_mode():
        for _ in range(3):
            answer = torch.cat([answer, source(input_ids=torch.cat([history, answer], 1)).logits[:, -1:].argmax(-1)],
                               dim=1)
        out = source(input_ids=torch.cat([history, answer], 1), output_attentions=True)
    reference = sum(att[:, :, 32:, :32].sum(dim=(1, 2)) for att in out.attentions)
    source_cache, _ = prefill(source, history)
    scores = turn_attention_scores(source, source_cache, turn, lookahead=3)
    assert source_cache.get_seq_length() == 32 and (scores - reference).abs().max() <= 1e-4
    assert not torch.allclose(scores, turn_attention_scores(source, source_cache, turn))
    picked = TurnAttention(4 / 32, lookahead=3).positions(
        target, prefill(target, history)[0], history, SelectionInfo(new_turn=tuple(turn[0].tolist())), source,
        source_cache)
    assert torch.equal(picked, reference.topk(4, dim=1).indices.sort(dim=1).values)
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="lookahead"):
            turn_attention_scores(source, source_cache, turn, lookahead=bad)


def test_target_turn_attention_ranks_by_the_targets_read_of_the_new_turn_on_the_handed_cache(inexact):
    """The target reads the new turn on the cache it is handed (here mapped, nothing recomputed yet); its attention
    picks the positions; the cache is left as it was; a handoff under the rule recomputes exactly those positions."""
    source, target, mapper = inexact
    ids = ids_of(batch=1, tokens=44)
    history, turn = ids[:, :36], ids[:, 36:]
    mapped = handoff_cache(source, target, mapper, history, HandoffPlan.of(0, "none"))
    expected = turn_attention_scores(target, mapped, turn)
    assert mapped.get_seq_length() == 36
    policy = TargetTurnAttention(4 / 36)
    info = SelectionInfo(new_turn=tuple(turn[0].tolist()))
    picked = policy.positions(target, mapped, history, info)
    assert torch.equal(picked, expected.topk(4, dim=1).indices.sort(dim=1).values)
    assert not torch.equal(picked, TurnAttention(4 / 36).positions(target, mapped, history, info, source,
                                                                   prefill(source, history)[0]))
    handed = handoff_cache(source, target, mapper, history, HandoffPlan.of(0, policy), selection_info=info)
    changed = [p for p in range(36) if (handed.layers[-1].keys[0, :, p] - mapped.layers[-1].keys[0, :, p]).abs().max()
               > 1e-6]
    assert changed == picked[0].tolist()
    with pytest.raises(ConfigError, match="target model"):
        policy.positions(None, None, history, info)


def test_a_session_hands_the_new_turn_to_a_policy_that_reads_it(inexact, monkeypatch):
    from kvhandoff.runtime.seam import TransformersCache

    source, target, mapper = inexact
    seen = []
    real = TransformersCache.read_turn
    monkeypatch.setattr(TransformersCache, "read_turn", lambda cache, model, turn, *rest:
                        seen.append(turn[0].tolist()) or real(cache, model, turn, *rest))
    session = SwitchingSession({"small": source, "large": target}, {("small", "large"): mapper},
                               plan=HandoffPlan.of(0, "turn_attention:20%"))
    first, turn = ids_of(tokens=20, seed=1)[0].tolist(), ids_of(tokens=6, seed=2)[0].tolist()
    session.read("small", first)
    session.read("large", turn)
    assert seen == [turn]


# -- whole layers ----------------------------------------------------------------------------------------------------


def first_layers(cache, count):
    return cache_of((layer.keys, layer.values) for layer in cache.layers[:count])


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_leading_layer_rows_are_the_targets_own_first_layers(family):
    target = tiny_model(family, layers=4)
    ids = ids_of(batch=2, tokens=30)
    own, _ = prefill(target, ids)
    rows = leading_layer_rows(target, ids, 2)
    assert len(rows.layers) == 2 and rows.get_seq_length() == 30
    assert max_kv_diff(first_layers(own, 2), rows) <= 1e-5
    # read on top of the rows before them: the same K/V at the later positions
    later = leading_layer_rows(target, ids[:, 18:], 3, cache_view(own, 0, 18))
    assert later.get_seq_length() == 12 and max_kv_diff(first_layers(cache_view(own, 18), 3), later) <= 1e-5
    for bad in (0, 5, True):
        with pytest.raises(ConfigError, match="leading layers"):
            leading_layer_rows(target, ids, bad)


def test_layers_recompute_makes_the_first_layers_exact_and_keeps_the_others_mapped(inexact):
    source, target, mapper = inexact
    ids = ids_of(tokens=48)
    context, later = ids[:, :40], ids[:, 40:]
    own, _ = prefill(target, context)
    mapped = handoff_cache(source, target, mapper, context, HandoffPlan.of(0, "none"))
    cache = handoff_cache(source, target, mapper, context, HandoffPlan.of(0, "layers:67%"))  # 2 of 3 layers
    mapped_part = cache.layers[2]
    assert max_kv_diff(first_layers(own, 2), first_layers(cache, 2)) <= 1e-4
    assert torch.equal(mapped_part.keys, mapped.layers[2].keys) and torch.equal(mapped_part.values,
                                                                                 mapped.layers[2].values)
    reference = next_logits(target, own, later)
    error = {name: (next_logits(target, c, later) - reference).abs().max().item() for name, c in
             (("none", mapped), ("layers", cache))}
    assert error["layers"] < error["none"]
    full = handoff_cache(source, target, mapper, context, HandoffPlan.of(0, "layers:100%"))
    assert max_kv_diff(own, full) <= 1e-4
    # at a catch-up only the newly mapped positions' first layers are recomputed, on top of the kept ones
    source_cache, _ = prefill(source, context)
    kept, _ = prefill(target, context[:, :25])
    pending = catch_up(kept, source_cache, mapper, source, target, context, HandoffPlan.of(recompute="layers:34%"))
    assert pending.pending.numel() == 0 and kept.get_seq_length() == 40
    assert max_kv_diff(first_layers(own, 1), first_layers(kept, 1)) <= 1e-4
    assert (kept.layers[1].keys[:, :, 25:] - own.layers[1].keys[:, :, 25:]).abs().max() > 1e-2
    assert max_kv_diff(own, kept, slice(0, 25)) <= 1e-6


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
