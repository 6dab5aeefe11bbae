"""The selective-recompute policies (kvhandoff.runtime.policy): one class per rule, the registry, the spec grammar,
the runtime's default."""

import dataclasses

import pytest
import torch

from _runtime_support import exact_pair, ids_of, inexact_pair, max_kv_diff
from kvhandoff import FitConfig, HandoffPlan, handoff_cache, prefill
from kvhandoff.errors import ConfigError
from kvhandoff.mapper.manifest import MapperManifest
from kvhandoff.runtime import policy
from kvhandoff.runtime.deviation import blend_scores
from kvhandoff.runtime.policy import (
    DEFAULT_RECOMPUTE,
    RECOMPUTE_BUDGETS,
    RULES,
    Blend,
    Deviation,
    LeadingLayers,
    Mix,
    NoRecompute,
    Recent,
    RecomputePolicy,
    SelectionInfo,
    Sinks,
    SourceAttention,
    TargetTurnAttention,
    TurnAttention,
    budget_count,
    parse,
    policy_for,
    turn_marker_ids,
)

from conftest import tiny_tokenizer

RANKED = ("sinks", "recent", "deviation", "source_attention", "mix")




@pytest.fixture(scope="module")
def exact():
    return exact_pair()


@pytest.fixture(scope="module")
def inexact():
    return inexact_pair()


def test_budget_rounding():
    assert [budget_count(b, 30) for b in RECOMPUTE_BUDGETS] == [0, 1, 2, 3, 6, 15, 30]
    assert budget_count(0.05, 10) == 1 and budget_count(0.04, 10) == 0 and budget_count(1.0, 0) == 0
    with pytest.raises(ConfigError):
        budget_count(1.5, 10)


def test_one_registry_names_every_rule_class():
    assert tuple(RULES) == ("none", "sinks", "recent", "deviation", "source_attention", "mix", "layers",
                            "turn_attention", "target_turn_attention", "blend")
    assert all(kind.rule == name and issubclass(kind, RecomputePolicy) for name, kind in RULES.items())
    assert policy_for("recent", 0.2) == Recent(0.2) and policy_for("none") == NoRecompute()
    assert policy_for("source_attention", 0.1, window=8) == SourceAttention(0.1, source_window=8)
    for rule, options in (("nearby", {}), ("recent", {"window": 8}), ("sinks", {"shares": ()})):
        with pytest.raises(ConfigError):
            policy_for(rule, 0.1, **options)


@pytest.mark.parametrize("rule", RANKED)
def test_every_rule_at_zero_and_full_budget(exact, rule):
    source, target, mapper = exact
    ids = ids_of(batch=2, tokens=30)
    cache = handoff_cache(source, target, mapper, ids, HandoffPlan(exact_prefix=0))
    info = SelectionInfo(start=4, turn_starts=(10, 20), source_attention=torch.rand(2, 30))
    assert policy_for(rule, 0.0).positions(target, cache, ids, info).shape == (2, 0)
    assert torch.equal(policy_for(rule, 1.0).positions(target, cache, ids, info), torch.arange(4, 30).expand(2, -1))
    for budget in RECOMPUTE_BUDGETS:
        picked = policy_for(rule, budget).positions(target, cache, ids, info)
        assert picked.shape == (2, budget_count(budget, 26))
        assert bool((picked >= 4).all()) and all(len(set(row)) == len(row) for row in picked.tolist())
        assert torch.equal(picked, picked.sort(dim=1).values)


def test_sinks_take_the_first_tokens_of_the_context_and_of_every_turn():
    ids = ids_of(tokens=40)
    assert Sinks(0.1).positions(None, None, ids, SelectionInfo()).tolist() == [[0, 1, 2, 3]]
    info = SelectionInfo(start=2, turn_starts=(15, 30))
    assert Sinks(3 / 38).positions(None, None, ids, info).tolist() == [[2, 15, 30]]
    assert Sinks(6 / 38).positions(None, None, ids, info).tolist() == [[2, 3, 15, 16, 30, 31]]
    marked = ids.clone()
    marked[0, [9, 25]] = 127
    detected = Sinks(3 / 40).positions(None, None, marked, SelectionInfo(marker_ids=(127,)))
    assert detected.tolist() == [[0, 9, 25]]


def test_turn_markers_come_from_the_tokenizer():
    from tokenizers import AddedToken

    tokenizer = tiny_tokenizer()
    assert turn_marker_ids(tokenizer) == ()
    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken("<|im_start|>", special=True)]})
    assert turn_marker_ids(tokenizer) == (tokenizer.convert_tokens_to_ids("<|im_start|>"),)


def test_recent_takes_the_last_tokens():
    assert Recent(0.2).positions(None, None, ids_of(tokens=20), SelectionInfo()).tolist() == [[16, 17, 18, 19]]


def test_deviation_finds_the_positions_whose_mapped_kv_were_corrupted(exact):
    source, target, mapper = exact
    ids = ids_of(batch=2, tokens=40)
    cache = handoff_cache(source, target, mapper, ids, HandoffPlan(exact_prefix=0))
    corrupt = [[5, 17, 33, 38], [1, 2, 20, 21]]
    for row, positions in enumerate(corrupt):
        cache.layers[0].keys[row, :, positions] += 3.0
        cache.layers[0].values[row, :, positions[:2]] *= -2.0
    assert Deviation(0.1).positions(target, cache, ids).tolist() == corrupt


def test_blend_finds_the_positions_whose_context_dependent_rows_deviate(exact):
    # layer 1's rows depend on the context: a corrupted position there is found, one corrupted at layer 0 alone not
    source, target, mapper = exact
    ids = ids_of(batch=2, tokens=40)
    cache = handoff_cache(source, target, mapper, ids, HandoffPlan(exact_prefix=0))
    assert blend_scores(target, cache, ids).max() < 1e-6  # the exact pair's mapped rows are the target's own
    corrupt = [[5, 17, 33, 38], [1, 2, 20, 21]]
    for row, positions in enumerate(corrupt):
        cache.layers[1].keys[row, :, positions] += 3.0
        cache.layers[0].keys[row, :, [10, 11]] += 9.0
    assert Blend(0.1).positions(target, cache, ids).tolist() == corrupt
    assert parse("blend:10%") == Blend(0.1) and "blend" in policy.RULES


def test_mix_shares_the_budget_between_rules_without_overlap(exact):
    source, target, mapper = exact
    ids = ids_of(tokens=40)
    cache = handoff_cache(source, target, mapper, ids, HandoffPlan(exact_prefix=0))
    picked = Mix(0.25, shares=(("sinks", 0.5), ("recent", 0.5))).positions(target, cache, ids, SelectionInfo())
    assert picked.tolist() == [[0, 1, 2, 3, 4, 35, 36, 37, 38, 39]]
    overlap = Mix(1.0, shares=(("recent", 0.5), ("sinks", 0.5))).positions(target, cache, ids, SelectionInfo())
    assert overlap.tolist() == [list(range(40))]
    assert Mix(0.1).positions(target, cache, ids).shape == (1, 4)  # the default shares


def test_a_policy_ranking_by_the_source_attention_needs_the_source(inexact):
    source, target, mapper = inexact
    ids = ids_of(tokens=20)
    cache = handoff_cache(source, target, mapper, ids, HandoffPlan(exact_prefix=0))
    assert NoRecompute().positions(target, cache, ids).shape == (1, 0)
    assert Recent(0.1).positions(target, cache, ids, SelectionInfo(start=5)).tolist() == [[18, 19]]
    with pytest.raises(ConfigError, match="source model"):
        SourceAttention(0.1).positions(target, cache, ids)
    source_cache, _ = prefill(source, ids)
    picked = SourceAttention(0.1).positions(target, cache, ids, source_model=source, source_cache=source_cache)
    assert picked.shape == (1, 2)
    assert SourceAttention(0.1).needs_source_attention and Mix(0.1, (("source_attention", 1.0),)).needs_source_attention
    assert not Mix(0.1).needs_source_attention and not Recent(0.1).needs_source_attention


def test_blocks_of_the_source_attention_are_taken_whole():
    # start 2, blocks of 4 over positions 2..13: [2..5], [6..9], [10..13]; one sharp peak at 11 beside a flat block
    scores = torch.full((1, 14), 0.1)
    scores[0, 7:10] = 1.0
    scores[0, 11] = 2.5
    info = SelectionInfo(start=2, source_attention=scores)
    assert SourceAttention(4 / 12).positions(None, None, ids_of(tokens=14), info).tolist() == [[7, 8, 9, 11]]
    blocks = SourceAttention(4 / 12, block=4).positions(None, None, ids_of(tokens=14), info)
    assert blocks.tolist() == [[6, 7, 8, 9]]  # mean 0.775 against 0.7
    # a budget past one block starts on the next best, earliest position first; a short last block is a mean too
    assert SourceAttention(6 / 12, block=4).positions(None, None, ids_of(tokens=14), info).tolist() == \
        [[6, 7, 8, 9, 10, 11]]
    short = policy.block_scores(torch.tensor([[9.0, 1.0, 3.0, 1.0, 4.0]]), 1, 3)
    assert torch.allclose(short, torch.tensor([[9.0, 5 / 3, 5 / 3, 5 / 3, 4.0]]))
    assert policy.block_scores(scores, 2, 1) is scores


def test_a_coverage_recomputes_only_what_holds_that_share_of_the_attention():
    """coverage: the budget a ceiling; a focused read recomputes its few positions, a diffuse one up to the budget;
    a batch takes what its neediest row needs."""
    focused = torch.tensor([[5.0, 0.1, 0.1, 6.0, 3.0, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]])
    info = SelectionInfo(start=1, source_attention=focused)
    ids = ids_of(tokens=12)
    assert SourceAttention(0.5).positions(None, None, ids, info).shape == (1, 6)
    covered = SourceAttention(0.5, coverage=0.8).positions(None, None, ids, info)
    assert covered.tolist() == [[3, 4]]  # 9 of the candidates' 9.9
    diffuse = SelectionInfo(start=1, source_attention=torch.ones(1, 12))
    assert SourceAttention(0.5, coverage=0.8).positions(None, None, ids, diffuse).shape == (1, 6)  # the ceiling
    batch = SelectionInfo(start=1, source_attention=torch.cat([focused, torch.ones(1, 12)]))
    assert SourceAttention(0.5, coverage=0.3).positions(None, None, ids_of(batch=2, tokens=12), batch).shape[1] == 4
    assert policy.covering_count(torch.tensor([[1.0, 1.0, 2.0]]), 0.5) == 1
    assert policy.covering_count(torch.tensor([[1.0, 1.0, 2.0]]), 1.0) == 3
    assert policy.covering_count(torch.zeros(1, 0), 0.5) == 0


def test_a_read_leaning_on_the_mapped_rows_escalates_to_the_larger_budget():
    """reliance/escalate: a read with at least ``reliance`` of its attention over the cache on the candidates picks
    what the larger budget picks, any other what the base budget picks; a batch escalates when any row does; the
    base budget may be 0 (recompute only the reads that lean on the history)."""
    ids = ids_of(tokens=21)
    leaning = SelectionInfo(start=1, source_attention=torch.cat([torch.tensor([[4.0]]), torch.arange(1.0, 21.0)[None]],
                                                                dim=1))
    light = SelectionInfo(start=1, source_attention=torch.cat([torch.tensor([[400.0]]), torch.arange(1.0, 21.0)[None]],
                                                              dim=1))
    assert policy.history_reliance(leaning.source_attention, 1).item() == pytest.approx(210 / 214)
    assert policy.history_reliance(light.source_attention, 1).item() == pytest.approx(210 / 610)
    rule = SourceAttention(0.1, reliance=0.5, escalate=0.2)
    assert rule.ceiling == 0.2 and rule.escalates(leaning.source_attention, 1)
    assert torch.equal(rule.positions(None, None, ids, leaning), SourceAttention(0.2).positions(None, None, ids,
                                                                                                   leaning))
    assert torch.equal(rule.positions(None, None, ids, light), SourceAttention(0.1).positions(None, None, ids, light))
    assert rule.positions(None, None, ids, leaning).shape == (1, 4)
    assert rule.positions(None, None, ids, light).tolist() == [[19, 20]]
    both = SelectionInfo(start=1, source_attention=torch.cat([leaning.source_attention, light.source_attention]))
    assert rule.positions(None, None, ids_of(batch=2, tokens=21), both).shape == (2, 4)
    only = SourceAttention(0.0, reliance=0.5, escalate=0.2)
    assert only.active and only.positions(None, None, ids, light).shape == (1, 0)
    assert only.positions(None, None, ids, leaning).shape == (1, 4)
    assert not SourceAttention(0.1).escalates(leaning.source_attention, 1)


def test_policy_parses_and_validates():
    assert policy.parse("deviation:10%") == Deviation(0.1)
    assert policy.parse("recent:0.05").spec == "recent:5%"
    assert policy.parse("none") == NoRecompute() and not NoRecompute().active
    assert not policy.parse("sinks:0").active and policy.parse("sinks:0").spec == "none"
    custom = policy.parse("mix(sinks=0.25,deviation=0.75):20%:window=8")
    assert custom.shares == (("sinks", 0.25), ("deviation", 0.75)) and custom.window == 8
    assert policy.parse(custom.spec) == custom
    assert isinstance(policy.parse("source_attention:2%"), SourceAttention)
    assert policy.parse("source_attention:2%:window=8").window == 8
    assert policy.parse(Recent(0.1)) == Recent(0.1)  # a policy as it is
    assert policy.parse("turn_attention:10%:window=8") == TurnAttention(0.1, source_window=8)
    assert TurnAttention(0.1).reads_new_turn and not Recent(0.1).reads_new_turn
    blocks = policy.parse("turn_attention:10%:block=32")
    assert blocks == TurnAttention(0.1, block=32) and blocks.spec == "turn_attention:10%:block=32"
    own = policy.parse("target_turn_attention:5%:lookahead=4:block=8")
    assert own == TargetTurnAttention(0.05, block=8, lookahead=4) and policy.parse(own.spec) == own
    assert own.reads_new_turn and not own.needs_source_attention
    ahead = policy.parse("turn_attention:5%:lookahead=8")
    assert ahead == TurnAttention(0.05, lookahead=8) and ahead.spec == "turn_attention:5%:lookahead=8"
    assert policy.parse("turn_attention:5%:lookahead=0").spec == "turn_attention:5%"
    assert policy.parse(policy.parse("turn_attention:5%:block=4:lookahead=2").spec) == TurnAttention(
        0.05, block=4, lookahead=2)
    covering = policy.parse("turn_attention:20%:coverage=60%:lookahead=2")
    assert covering == TurnAttention(0.2, coverage=0.6, lookahead=2) and policy.parse(covering.spec) == covering
    assert covering.spec == "turn_attention:20%:coverage=60%:lookahead=2"
    assert policy.parse("turn_attention:20%:coverage=1").spec == "turn_attention:20%"
    escalating = policy.parse("turn_attention:10%:escalate=20%:reliance=0.5")
    assert escalating == TurnAttention(0.1, reliance=0.5, escalate=0.2) and policy.parse(escalating.spec) == escalating
    assert escalating.spec == "turn_attention:10%:reliance=50%:escalate=20%"
    only = "turn_attention:0%:reliance=50%:escalate=20%"
    assert policy.parse(only).spec == only
    both = policy.parse("source_attention:5%:block=16:window=8")
    assert both == SourceAttention(0.05, source_window=8, block=16) and policy.parse(both.spec) == both
    layers = policy.parse("layers:25%")
    assert layers == LeadingLayers(0.25) and layers.spec == "layers:25%" and layers.active
    assert [layers.leading_layers(n) for n in (28, 24, 2)] == [7, 6, 1]
    assert Recent(0.5).leading_layers(28) == 0 and LeadingLayers(0).leading_layers(28) == 0
    for bad in ("deviation", "nearby:10%", "recent:150%", "recent:-1", "recent:x", "mix(sinks=0.5):10%",
                "mix(sinks=0.5,mix=0.5):10%", "mix(layers=0.5,recent=0.5):10%", "layers:10%:window=8",
                "recent:10%:depth=2", "recent:10%:window=8", "recent:10%:block=4", "mix:10%:block=4",
                "turn_attention:10%:block=0", "turn_attention:10%:block=4:block=8", "turn_attention:10%:block=x",
                "recent:10%:lookahead=4", "source_attention:10%:lookahead=4", "turn_attention:10%:lookahead=-1",
                "mix(target_turn_attention=0.5,recent=0.5):10%", "recent:10%:coverage=50%",
                "turn_attention:10%:coverage=0", "turn_attention:10%:coverage=120%", "turn_attention:10%:coverage=x",
                "turn_attention:10%:coverage=50%:coverage=60%", "turn_attention:10%:escalate=20%",
                "turn_attention:10%:reliance=50%", "turn_attention:10%:reliance=50%:escalate=10%",
                "turn_attention:10%:reliance=150%:escalate=20%", "recent:10%:reliance=50%:escalate=20%",
                "turn_attention:10%:reliance=50%:escalate=20%:escalate=30%", 3):
        with pytest.raises(ConfigError):
            policy.parse(bad)
    for bad_policy in (lambda: Recent(1.5), lambda: Recent("0.1"), lambda: SourceAttention(0.1, source_window=0),
                       lambda: Mix(0.1, (("recent", 0.4),)),
                       lambda: TurnAttention(0.1, lookahead=-2)):
        with pytest.raises(ConfigError):
            bad_policy()
    with pytest.raises(dataclasses.FrozenInstanceError):
        Recent(0.1).budget = 0.2


def test_the_default_lives_in_the_runtime_not_in_the_fit_config(exact):
    """The runtime's default is Recent(5%); FitConfig has no recompute setting; a manifest written with an old config
    `recompute` entry still loads; a plan's recompute is what a handoff runs."""
    assert Recent(0.05) == DEFAULT_RECOMPUTE and DEFAULT_RECOMPUTE.spec == "recent:5%"
    assert HandoffPlan().recompute is DEFAULT_RECOMPUTE and HandoffPlan.of().recompute is DEFAULT_RECOMPUTE
    assert not any(field.name == "recompute" for field in dataclasses.fields(FitConfig))
    assert "recompute" not in FitConfig().to_dict()
    with pytest.raises(TypeError):
        FitConfig(recompute="none")

    source, target, mapper = exact
    record = mapper.manifest.to_dict()
    record["config"] = {**record["config"], "recompute": "sinks:100%"}  # written before the setting moved
    assert MapperManifest.from_dict(record).config == mapper.manifest.config

    # a plan that recomputes everything makes a handoff exact even with a broken map; the default plan does not
    broken = type(mapper)(torch.zeros_like(mapper.weight), mapper.bias, mapper.selected, mapper.manifest)
    ids = ids_of(tokens=30)
    own, _ = prefill(target, ids)
    assert max_kv_diff(own, handoff_cache(source, target, broken, ids, HandoffPlan.of(recompute="sinks:100%"))) <= 1e-4
    assert max_kv_diff(own, handoff_cache(source, target, broken, ids)) > 1e-2
    assert max_kv_diff(own, handoff_cache(source, target, broken, ids, HandoffPlan.of(recompute="none"))) > 1e-2
