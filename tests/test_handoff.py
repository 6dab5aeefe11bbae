import contextlib

import pytest
import torch

from kvhandoff import (
    FitConfig,
    HandoffPlan,
    PrefixStore,
    SwitchingSession,
    catch_up,
    fit_mapper,
    handoff_cache,
    handoff_generate,
    map_for_target,
    prefill,
)
from kvhandoff.errors import ConfigError

from conftest import GEOMETRY_CHANGES, exact_pair, exactly_related, random_batches, tiny_model

#: an exact relation, fitted as exactly as float32 captures allow: every map, every calibration token, tiny λ
EXACT_FIT = FitConfig(top_k="all", ridge_lambda=1e-10, token_stride=1)
#: every position mapped, nothing recomputed
MAPPED = HandoffPlan.of(0, "none")
#: the mapper's exact prefix, no recompute policy
NO_POLICY = HandoffPlan.of(recompute="none")


def plan_of(exact_prefix=None, recompute=None):
    return HandoffPlan.of(exact_prefix, recompute)


@pytest.fixture(scope="module")
def related_pairs():
    pairs = {}
    for family in ("llama", "qwen2", "qwen3", "mistral"):
        source = tiny_model(family, layers=3)
        target = exactly_related(source)
        mapper = fit_mapper(source, target, random_batches(), EXACT_FIT, progress=False)
        pairs[family] = (source, target, mapper)
    return pairs


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_exactly_related_pair_fits_and_hands_off_exactly(related_pairs, family):
    source, target, mapper = related_pairs[family]
    metrics = mapper.manifest["fit_metrics"]
    assert min(metrics["r2_k_per_target_layer"]) >= 0.9999
    assert min(metrics["r2_v_per_target_layer"]) >= 0.9999

    ids = torch.randint(0, 128, (2, 70), generator=torch.Generator().manual_seed(5))
    own_cache, _ = prefill(target, ids[:, :-1])
    mapped = handoff_cache(source, target, mapper, ids[:, :-1])
    _, own_logits = prefill(target, ids[:, -1:], cache=own_cache)
    _, handoff_logits = prefill(target, ids[:, -1:], cache=mapped)
    assert (own_logits - handoff_logits).abs().max() <= 1e-4

    own = target.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False
    )
    handed = handoff_generate(source, target, mapper, ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(own, handed)


def assert_hands_off_exactly(source, target, mapper, seed: int = 5):
    """The target reading on from the mapped cache (every position mapped: exact_prefix=0) computes its own logits at
    every later position (≤ 1e-4), and its greedy continuation is its own, token for token."""
    ids = torch.randint(0, 128, (2, 60), generator=torch.Generator().manual_seed(seed))
    context, later = ids[:, :44], ids[:, 44:]
    own_cache, _ = prefill(target, context)
    mapped = handoff_cache(source, target, mapper, context, HandoffPlan(exact_prefix=0))
    assert mapped.get_seq_length() == 44
    with torch.inference_mode():
        own = target(input_ids=later, cache=own_cache, use_cache=True).logits
        handed = target(input_ids=later, cache=mapped, use_cache=True).logits
    assert (own - handed).abs().max() <= 1e-4

    own_tokens = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    handed_tokens = handoff_generate(source, target, mapper, ids, HandoffPlan(exact_prefix=0), max_new_tokens=8,
                                     do_sample=False)
    assert torch.equal(own_tokens, handed_tokens)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("change", GEOMETRY_CHANGES)
def test_exact_pair_of_different_geometry_hands_off_exactly(change, family):
    """Target with more/fewer layers (identity layers), KV heads (duplicated heads), a 2×/½ head dim (pairs moved to
    the frequency index they share): the map is exact, so the handoff is."""
    source, target = exact_pair(change, family)
    s, t = source.config, target.config
    differs = {"layers": "num_hidden_layers", "kv_heads": "num_key_value_heads", "heads": "head_dim"}
    key = differs[change.split("_", 1)[1]]
    assert (getattr(t, key) > getattr(s, key)) == change.startswith(("more", "wider"))
    assert getattr(t, key) != getattr(s, key)
    mapper = fit_mapper(source, target, random_batches(), EXACT_FIT, progress=False)
    assert min(mapper.manifest["fit_metrics"]["r2_k_per_target_layer"]) >= 0.9999
    assert min(mapper.manifest["fit_metrics"]["r2_v_per_target_layer"]) >= 0.9999
    assert_hands_off_exactly(source, target, mapper)


@pytest.mark.parametrize(
    ("family", "source_rope", "target_rope"),
    [
        ("llama", "llama3", "default"),
        ("llama", "default", "llama3"),
        ("llama", "yarn", "default"),
        ("llama", "default", "yarn"),
        ("qwen2", "linear", "default"),
        ("qwen2", "default", "linear"),
        ("qwen3", "yarn", "llama3"),
        ("qwen2", "partial", "default"),
        ("qwen2", "default", "partial"),
    ],
)
def test_exact_pair_of_different_rope_hands_off_exactly(family, source_rope, target_rope):
    """Both models attend only in their last layer, so content K/V are exactly linear in each other whatever the
    RoPE; the logits then depend on the source RoPE being stripped and the target's applied exactly."""
    source, target = exact_pair("rope", family, source_rope, target_rope)
    assert source.config.rope_parameters != target.config.rope_parameters
    mapper = fit_mapper(source, target, random_batches(), EXACT_FIT, progress=False)
    assert_hands_off_exactly(source, target, mapper)


def test_related_pair_cache_really_differs_from_source(related_pairs):
    source, target, _ = related_pairs["qwen2"]
    ids = torch.randint(0, 128, (1, 20))
    s_cache, _ = prefill(source, ids)
    t_cache, _ = prefill(target, ids)
    assert not torch.allclose(s_cache.layers[0].keys, t_cache.layers[0].keys, atol=1e-2)


def test_handoff_with_sampling_kwargs(related_pairs):
    source, target, mapper = related_pairs["llama"]
    ids = torch.randint(0, 128, (1, 12))
    torch.manual_seed(0)
    out = handoff_generate(source, target, mapper, ids, max_new_tokens=5, do_sample=True, temperature=0.7)
    assert out.shape == (1, 17)


def test_different_geometry_pair_fits_transfers_and_decodes():
    source = tiny_model("qwen2", layers=4, head_dim=16)
    target = tiny_model("qwen2", layers=6, head_dim=32, kv_heads=1, seed=3)
    mapper = fit_mapper(source, target, random_batches(4), FitConfig(top_k=2), progress=False)
    assert mapper.selected.shape == (6, 2)
    ids = torch.randint(0, 128, (2, 30))
    cache = handoff_cache(source, target, mapper, ids)
    assert len(cache.layers) == 6 and cache.layers[0].keys.shape == (2, 1, 30, 32)
    out = handoff_generate(source, target, mapper, ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (2, 34)


def test_handoff_rejects_bad_input_ids(related_pairs):
    source, target, mapper = related_pairs["qwen2"]
    with pytest.raises(ConfigError, match="at least 2 token"):
        handoff_generate(source, target, mapper, torch.tensor([[3]]))
    with pytest.raises(ConfigError, match=r"\[batch, tokens\]"):
        handoff_cache(source, target, mapper, torch.tensor([1, 2, 3]))


def test_exact_prefix_restores_the_targets_own_leading_positions():
    source = tiny_model("qwen2", layers=2)
    target = tiny_model("qwen2", layers=2, seed=9)
    mapper = fit_mapper(source, target, random_batches(2), FitConfig(top_k=1), progress=False)
    ids = torch.randint(0, 128, (1, 20))
    own, _ = prefill(target, ids)
    plain = handoff_cache(source, target, mapper, ids, MAPPED)
    patched = handoff_cache(source, target, mapper, ids, plan_of(3, "none"))
    default = handoff_cache(source, target, mapper, ids)  # the mapper's own setting (FitConfig default 4)
    assert mapper.exact_prefix == 4
    assert torch.allclose(default.layers[0].keys[:, :, :4], own.layers[0].keys[:, :, :4], atol=1e-5)
    for p_layer, o_layer, m_layer in zip(patched.layers, own.layers, plain.layers, strict=True):
        assert torch.allclose(p_layer.keys[:, :, :3], o_layer.keys[:, :, :3], atol=1e-5)
        assert torch.equal(p_layer.values[:, :, 3:], m_layer.values[:, :, 3:])
    assert not torch.allclose(plain.layers[0].keys[:, :, :3], own.layers[0].keys[:, :, :3], atol=1e-3)


def test_handoff_cache_from_a_given_source_cache(related_pairs):
    source, target, mapper = related_pairs["qwen2"]
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(2))
    given, _ = prefill(source, ids[:, :12])  # a prefix cache, extended by the rest
    prefill(source, ids[:, 12:], cache=given)
    fresh = handoff_cache(source, target, mapper, ids, HandoffPlan(exact_prefix=3))
    reused = handoff_cache(source, target, mapper, ids, HandoffPlan(exact_prefix=3), source_cache=given)
    for a, b in zip(fresh.layers, reused.layers, strict=True):
        assert torch.allclose(a.keys, b.keys, atol=1e-5) and torch.allclose(a.values, b.values, atol=1e-5)
    with pytest.raises(ConfigError, match="source_cache"):
        handoff_cache(source, target, mapper, ids[:, :20], source_cache=given)


def test_target_tail_is_prefilled_by_the_target_itself():
    source = tiny_model("qwen2", layers=2)
    target = tiny_model("qwen2", layers=2, seed=9)
    mapper = fit_mapper(source, target, random_batches(2), FitConfig(top_k=1), progress=False)
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(3))
    own, _ = prefill(target, ids)
    # only the first token mapped, and the exact prefix recomputes it: the whole cache is the target's own
    everything = handoff_cache(source, target, mapper, ids, HandoffPlan(exact_prefix=1), target_tail=19)
    for a, b in zip(everything.layers, own.layers, strict=True):
        assert torch.allclose(a.keys, b.keys, atol=1e-4) and torch.allclose(a.values, b.values, atol=1e-4)
    tail = handoff_cache(source, target, mapper, ids, MAPPED, target_tail=5)
    plain = handoff_cache(source, target, mapper, ids, MAPPED)
    assert tail.get_seq_length() == 20
    assert torch.equal(tail.layers[1].values[:, :, :15], plain.layers[1].values[:, :, :15])  # mapped part
    assert not torch.allclose(tail.layers[1].values[:, :, 15:], plain.layers[1].values[:, :, 15:], atol=1e-3)
    with pytest.raises(ConfigError, match="target_tail"):
        handoff_cache(source, target, mapper, ids, target_tail=20)


def test_catch_up_maps_only_the_missing_positions_at_their_own_positions():
    source = tiny_model("qwen2", layers=2)
    target = tiny_model("qwen2", layers=3, head_dim=32, seed=4)
    mapper = fit_mapper(source, target, random_batches(2), FitConfig(), progress=False)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(6))
    source_cache, _ = prefill(source, ids)
    whole = mapper.transfer(source_cache)
    # the target's cache of the first 25 positions (its own), brought up to 40 by mapping positions 25..39
    own, _ = prefill(target, ids[:, :25])
    kept = [layer.keys.clone() for layer in own.layers]
    caught = catch_up(own, source_cache, mapper, plan=NO_POLICY)
    assert caught.cache.native is own and caught.pending.numel() == 0 and own.get_seq_length() == 40
    for layer, before, mapped in zip(own.layers, kept, whole.layers, strict=True):
        assert torch.equal(layer.keys[:, :, :25], before)  # the target's own positions are untouched
        torch.testing.assert_close(layer.keys[:, :, 25:], mapped.keys[:, :, 25:])  # RoPE at positions 25..39
        torch.testing.assert_close(layer.values[:, :, 25:], mapped.values[:, :, 25:])
    assert catch_up(own, source_cache, mapper).cache.length == 40  # nothing missing: nothing mapped
    longer, _ = prefill(target, ids)
    prefill(target, ids[:, :3], cache=longer)
    with pytest.raises(ConfigError, match="more than the source"):
        catch_up(longer, source_cache, mapper)


@pytest.fixture(scope="module")
def two_way_pair(related_pairs):
    """An exactly related qwen2 pair with mappers both ways (the relation is invertible)."""
    source, target, forward = related_pairs["qwen2"]
    backward = fit_mapper(target, source, random_batches(), EXACT_FIT, progress=False)
    return {"a": source, "b": target}, {("a", "b"): forward, ("b", "a"): backward}


@pytest.mark.parametrize("handover", ["incremental", "all"])
def test_switching_session_serves_one_conversation_with_two_models(two_way_pair, handover):
    models, mappers = two_way_pair
    ids = torch.randint(0, 128, (1, 45), generator=torch.Generator().manual_seed(8))[0].tolist()
    session = SwitchingSession(models, mappers, handover, HandoffPlan(exact_prefix=0))
    session.read("a", ids[:20])
    own_a = [layer.keys[:, :, :20].clone() for layer in session.cache("a").layers]
    session.read("b", ids[20:30])
    assert (session.cache("a") is None) == (handover == "all")  # "all" hands the one cache over
    got = session.read("a", ids[30:])
    assert session.owner == "a" and session.tokens == ids and session.cache("a").get_seq_length() == 45
    # the mappers are exact, so the conversation reads as if model a had served it alone
    _, alone = prefill(models["a"], torch.tensor([ids]))
    torch.testing.assert_close(got, alone[0].float().log_softmax(-1), atol=1e-4, rtol=0)
    own_cache, _ = prefill(models["a"], torch.tensor([ids]))
    for mine, own in zip(session.cache("a").layers, own_cache.layers, strict=True):  # b's turn mapped back too
        torch.testing.assert_close(mine.keys, own.keys, atol=1e-4, rtol=0)
        torch.testing.assert_close(mine.values, own.values, atol=1e-4, rtol=0)
    kept = all(torch.equal(layer.keys[:, :, :20], before)
               for layer, before in zip(session.cache("a").layers, own_a, strict=True))
    assert kept == (handover == "incremental")  # incremental: a's own positions never made a round trip
    # decoding past the conversation is rolled back to what every cache agrees on
    prefill(models["a"], torch.tensor([[1, 2, 3]]), session.cache("a"))
    session.rollback("a")
    assert session.cache("a").get_seq_length() == 45
    # also when the caller does not: the next switch maps only the conversation, not what a decoded
    prefill(models["a"], torch.tensor([[1, 2, 3]]), session.cache("a"))
    session.read("b", ids[:2])
    assert session.cache("b").get_seq_length() == len(session.tokens) == 47


def test_switching_session_refuses_bad_requests(two_way_pair):
    models, mappers = two_way_pair
    with pytest.raises(ConfigError, match="handover"):
        SwitchingSession(models, mappers, handover="lazy")
    session = SwitchingSession(models, {("a", "b"): mappers[("a", "b")]})
    with pytest.raises(ConfigError, match="unknown model"):
        session.read("c", [1, 2])
    with pytest.raises(ConfigError, match="at least one token"):
        session.read("a", [])
    session.read("a", [1, 2, 3])
    session.read("b", [4])
    with pytest.raises(ConfigError, match="b → a"):
        session.read("a", [5])


def test_switching_session_generates_answers_that_join_the_conversation(two_way_pair):
    models, mappers = two_way_pair
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(9))[0].tolist()
    session = SwitchingSession(models, mappers, plan=HandoffPlan(exact_prefix=0))
    first = session.generate("a", ids[:20], max_new_tokens=4, do_sample=False)
    assert len(first) == 4 and session.tokens == ids[:20] + first
    assert session.cache("a").get_seq_length() == 24  # the answer is cached, its last token included
    second = session.generate("b", ids[20:], max_new_tokens=4, do_sample=False)  # a switch
    assert session.tokens == ids[:20] + first + ids[20:] + second and session.cache("b").get_seq_length() == 38
    # exact mappers and a pair with equal outputs: model a alone answers the same
    alone = models["a"].generate(input_ids=torch.tensor([ids[:20] + first + ids[20:]]), max_new_tokens=4,
                                 do_sample=False, attention_mask=torch.ones(1, 34, dtype=torch.long))
    assert alone[0, 34:].tolist() == second
    with pytest.raises(ConfigError, match="at least one token"):
        session.generate("a", [])


@pytest.mark.real_models
def test_real_pair_switching_session():
    """The default pair's cached default mappers (fitted on first use: slow) serve one CoQA conversation; a second
    conversation of the same opening copies the 1.5B's exact prefix from the shared store and answers alike."""
    from kvhandoff.demo import demo_script
    from kvhandoff.model.loading import DEFAULT_SOURCE, DEFAULT_TARGET
    from kvhandoff.workflow import load_named_pair, obtain_mapper

    pair = load_named_pair(DEFAULT_SOURCE, DEFAULT_TARGET, progress=False)
    small, large, tokenizer = pair.source, pair.target, pair.models.tokenizer
    up = obtain_mapper(pair, progress=False)[0]
    down = obtain_mapper(pair.reversed(), progress=False)[0]
    story = demo_script().story
    opening = tokenizer(story + "\n\nQ: What is this story about?\n\nA:")["input_ids"]
    store, answers = PrefixStore(), []
    for _ in range(2):
        session = SwitchingSession({"small": small, "large": large}, {("small", "large"): up, ("large", "small"): down},
                                   plan=HandoffPlan(prefix_store=store))
        first = session.generate("small", opening, max_new_tokens=20, do_sample=False)
        question = tokenizer("\n\nQ: What was the man's name?\n\nA:")["input_ids"]
        second = session.generate("large", question, max_new_tokens=20, do_sample=False)
        texts = [tokenizer.decode(answer, skip_special_tokens=True).strip() for answer in (first, second)]
        assert all(texts), texts
        assert session.cache("large").get_seq_length() == len(session.tokens)
        answers.append(texts)
    assert (store.hits, store.misses) == (1, 1) and answers[0] == answers[1]


@pytest.fixture(scope="module")
def unrelated_pair():
    """A mapper fitted for (source, target) and a second target of the same geometry it was not fitted for."""
    source = tiny_model("qwen2", layers=2, max_position_embeddings=64)
    target = tiny_model("qwen2", layers=3, head_dim=32, seed=4, max_position_embeddings=64)
    other = tiny_model("qwen2", layers=3, head_dim=32, seed=11, max_position_embeddings=64)
    mapper = fit_mapper(source, target, random_batches(2, tokens=32), FitConfig(), progress=False)
    return source, target, other, mapper


def test_handoff_cache_refuses_a_mapper_fitted_for_another_pair(unrelated_pair):
    from kvhandoff.errors import MapperMismatchError

    source, target, other, mapper = unrelated_pair
    ids = torch.randint(0, 128, (1, 12))
    assert handoff_cache(source, target, mapper, ids).get_seq_length() == 12
    with pytest.raises(MapperMismatchError, match="different target model"):
        handoff_cache(source, other, mapper, ids)
    with pytest.raises(MapperMismatchError, match="different source model"):
        handoff_cache(other, target, mapper, ids)


def test_handoff_cache_refuses_a_context_past_the_target_window_before_any_work(unrelated_pair):
    from kvhandoff.errors import ContextTooLongError

    source, target, _, mapper = unrelated_pair
    ids = torch.randint(0, 128, (1, target.config.max_position_embeddings + 1))
    with counting_forwards(source) as source_calls, counting_forwards(target) as target_calls:
        with pytest.raises(ContextTooLongError, match="65 tokens exceeds the target's max_position_embeddings"):
            handoff_cache(source, target, mapper, ids)
        with pytest.raises(ContextTooLongError, match="65 tokens"):  # the target's tail counts too
            handoff_cache(source, target, mapper, ids, target_tail=2)
    assert source_calls == [] and target_calls == []


def test_catch_up_checks_the_pair_the_target_cache_and_the_window(unrelated_pair):
    from kvhandoff.errors import ContextTooLongError, MapperMismatchError

    source, target, other, mapper = unrelated_pair
    ids = torch.randint(0, 128, (1, 30))
    source_cache, _ = prefill(source, ids)
    own, _ = prefill(target, ids[:, :10])
    with pytest.raises(MapperMismatchError, match="different target model"):
        catch_up(own, source_cache, mapper, source, other)
    assert own.get_seq_length() == 10  # refused before anything was appended
    wrong, _ = prefill(source, ids[:, :10])  # a cache of the source's geometry handed in as the target's
    with pytest.raises(MapperMismatchError, match="this mapper maps to 3"):
        catch_up(wrong, source_cache, mapper, plan=NO_POLICY)
    long_ids = torch.randint(0, 128, (1, 70))
    long_source, _ = prefill(source, long_ids)
    with pytest.raises(ContextTooLongError, match="70 tokens"):
        catch_up(own, long_source, mapper, source, target)
    assert own.get_seq_length() == 10
    assert catch_up(own, source_cache, mapper, source, target, plan=NO_POLICY).cache.length == 30


# -- the fused first forward: exact prefix + recompute + the target's reading of the new tokens, in one forward --------


def _two_step(source, target, mapper, ids, new_tokens, exact_prefix, recompute):
    """The reference: map, recompute the exact prefix by its own prefill, the policy's picks by a sparse prefill,
    then the target reads the new tokens (three forwards)."""
    from kvhandoff.runtime import policy
    from kvhandoff.runtime.policy import SelectionInfo
    from kvhandoff.runtime.recompute import recompute_positions

    history, new = ids[:, :-new_tokens], ids[:, -new_tokens:]
    source_cache, _ = prefill(source, history)
    cache = mapper.transfer(source_cache, dtype=target.dtype)
    if exact_prefix:
        own, _ = prefill(target, history[:, :exact_prefix])
        for mapped, mine in zip(cache.layers, own.layers, strict=True):
            mapped.keys[:, :, :exact_prefix], mapped.values[:, :, :exact_prefix] = mine.keys, mine.values
    info = SelectionInfo(start=min(exact_prefix, history.shape[1]))
    picked = policy.parse(recompute).positions(target, cache, history, info, source, source_cache)
    recompute_positions(target, cache, history, picked)
    logits = target(input_ids=new, cache=cache, use_cache=True, logits_to_keep=new_tokens).logits
    return cache, logits


def read_after_handoff(source, target, mapper, ids, new_tokens=1, plan=None, logits_to_keep=1):
    """All but the last ``new_tokens`` mapped, the target reads them in the forward that recomputes: (the target's
    cache of all tokens, the logits of the last ``logits_to_keep``)."""
    mapped = map_for_target(source, target, mapper, ids[:, :-new_tokens], plan)
    logits = mapped.read(target, ids[:, -new_tokens:], logits_to_keep)
    return mapped.cache.native, logits


UNRELATED = {  # (source settings, target settings): unrelated models of one family, several geometries
    "llama": ({"layers": 2}, {"layers": 3, "head_dim": 32, "seed": 1}),
    "qwen2": ({"layers": 2}, {"layers": 3, "kv_heads": 4, "heads": 8, "seed": 1}),
    "qwen3": ({"layers": 3}, {"layers": 2, "seed": 1}),
    "mistral": ({"layers": 2, "kv_heads": 1}, {"layers": 2, "seed": 1, "attn_implementation": "sdpa"}),
}


@pytest.fixture(scope="module")
def unrelated_pairs():
    pairs = {}
    for family, (source_settings, target_settings) in UNRELATED.items():
        source, target = tiny_model(family, **source_settings), tiny_model(family, **target_settings)
        pairs[family] = (source, target, fit_mapper(source, target, random_batches(2), FitConfig(top_k=1),
                                                    progress=False))
    return pairs


@pytest.mark.parametrize("family", sorted(UNRELATED))
@pytest.mark.parametrize(("new_tokens", "exact_prefix", "recompute"), [
    (1, 4, "none"), (6, 4, "none"), (1, 0, "none"), (3, 4, "deviation:25%"), (1, 2, "sinks:10%"),
    (2, 4, "source_attention:20%"), (1, 0, "mix:30%"),
])
def test_the_fused_first_forward_equals_the_two_step_handoff(unrelated_pairs, family, new_tokens, exact_prefix,
                                                             recompute):
    """`MappedCache.read` (one target forward) = the exact-prefix prefill, the recompute and the read in turn: the
    same logits and the same cache, on a mapped cache far from the target's own (so every recomputed position
    matters)."""
    source, target, mapper = unrelated_pairs[family]
    ids = torch.randint(0, 128, (2, 41), generator=torch.Generator().manual_seed(7))
    reference_cache, reference = _two_step(source, target, mapper, ids, new_tokens, exact_prefix, recompute)
    cache, logits = read_after_handoff(source, target, mapper, ids, new_tokens, plan_of(exact_prefix, recompute),
                                       logits_to_keep=new_tokens)
    assert logits.shape == reference.shape == (2, new_tokens, 128)
    assert (logits - reference).abs().max() <= 1e-5
    assert cache.get_seq_length() == 41
    for a, b in zip(cache.layers, reference_cache.layers, strict=True):
        assert (a.keys - b.keys).abs().max() <= 1e-5 and (a.values - b.values).abs().max() <= 1e-5
    unpatched, _ = read_after_handoff(source, target, mapper, ids, new_tokens, MAPPED)
    if exact_prefix:  # what is compared is not the mapped cache itself
        assert (unpatched.layers[-1].values[:, :, :exact_prefix]
                - cache.layers[-1].values[:, :, :exact_prefix]).abs().max() > 1e-3


def test_a_mapped_cache_recomputes_its_pending_positions_at_the_first_forward(unrelated_pairs):
    """`map_for_target` leaves the exact prefix pending; `read` and `settle` both empty it; handoff_cache with a tail
    is the fused read; the prefix alone (`settle`) then the read gives the same logits."""
    source, target, mapper = unrelated_pairs["qwen2"]
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(8))
    fused = map_for_target(source, target, mapper, ids[:, :-3], NO_POLICY)
    assert fused.pending.tolist() == [[0, 1, 2, 3]]
    logits = fused.read(target, ids[:, -3:], logits_to_keep=2)
    assert fused.pending.numel() == 0 and fused.cache.length == 30
    settled = map_for_target(source, target, mapper, ids[:, :-3], NO_POLICY)
    cache = settled.settle(target)
    assert settled.pending.numel() == 0 and settled.settle(target) is cache
    reference = target(input_ids=ids[:, -3:], cache=cache.native, use_cache=True, logits_to_keep=2).logits
    assert (logits - reference).abs().max() <= 1e-5
    tail = handoff_cache(source, target, mapper, ids, NO_POLICY, target_tail=3)
    for a, b in zip(tail.layers, cache.native.layers, strict=True):
        assert (a.keys - b.keys).abs().max() <= 1e-5 and (a.values - b.values).abs().max() <= 1e-5
    with pytest.raises(ConfigError, match="logits_to_keep"):
        map_for_target(source, target, mapper, ids[:, :-3]).read(target, ids[:, -3:], logits_to_keep=4)


# -- the exact prefix kept in a store; generate's first forward as the fused read ------------------------------------


@contextlib.contextmanager
def counting_forwards(model):
    """A list that grows by one at every forward of ``model``'s decoder body while the block runs."""
    calls = []
    handle = model.model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        yield calls
    finally:
        handle.remove()


def test_a_prefix_store_copies_the_exact_prefix_instead_of_recomputing_it(unrelated_pairs):
    """The first handoff of an opening recomputes its exact prefix and stores it; the next one copies it in, leaves
    only the new tokens (and the policy's picks) to the forward, and gives the same logits and cache."""
    source, target, mapper = unrelated_pairs["qwen2"]
    ids = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(11))
    store = PrefixStore(capacity=3)
    stored = HandoffPlan.of(recompute="none", prefix_store=store)
    first = map_for_target(source, target, mapper, ids[:, :-1], stored)
    assert first.pending.tolist() == [[0, 1, 2, 3]] * 2 and len(store) == 0
    logits = first.read(target, ids[:, -1:])
    assert len(store) == 2 and (store.hits, store.misses) == (0, 1)  # one entry per row
    again = map_for_target(source, target, mapper, ids[:, :-1], stored)
    assert again.pending.numel() == 0 and store.hits == 1
    assert (again.read(target, ids[:, -1:]) - logits).abs().max() <= 1e-5
    for a, b in zip(again.cache.native.layers, first.cache.native.layers, strict=True):
        assert (a.keys - b.keys).abs().max() <= 1e-5 and (a.values - b.values).abs().max() <= 1e-5
    # under a policy only its picks stay pending; the fused read equals the one without a store
    picked = map_for_target(source, target, mapper, ids[:, :-1], HandoffPlan.of(None, "recent:10%", store))
    assert picked.pending.tolist() == [[26, 27, 28]] * 2
    reference = read_after_handoff(source, target, mapper, ids, plan=plan_of(recompute="recent:10%"))[1]
    assert (picked.read(target, ids[:, -1:]) - reference).abs().max() <= 1e-5
    # a row the store lacks: nothing is copied, the prefix is recomputed and stored
    other = torch.cat([ids[:1], torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(12))])
    mixed = map_for_target(source, target, mapper, other[:, :-1], stored)
    assert mixed.pending.shape == (2, 4)
    mixed.settle(target)
    assert len(store) == 3  # the new opening joined; the capacity drops the least recently used first
    store.remember(target, torch.randint(0, 128, (1, 4), generator=torch.Generator().manual_seed(13)), mixed.cache)
    assert len(store) == 3
    store.clear()
    assert len(store) == 0
    with pytest.raises(ConfigError, match="capacity"):
        PrefixStore(capacity=0)


def test_a_primed_store_serves_a_target_without_custom_masks(unrelated_pairs, monkeypatch):
    """`PrefixStore.prime` stores a prefill of the opening; a target whose attention takes no 4D mask copies it
    too (it would otherwise prefill the prefix on its own)."""
    from kvhandoff.runtime.seam import TransformersCache

    source, target, mapper = unrelated_pairs["llama"]
    ids = torch.randint(0, 128, (1, 25), generator=torch.Generator().manual_seed(14))
    store = PrefixStore()
    store.prime(target, ids[:, :4])
    reference = map_for_target(source, target, mapper, ids[:, :-1], NO_POLICY).settle(target)
    monkeypatch.setattr(TransformersCache, "supports_recompute", lambda self, model: False)
    with counting_forwards(target) as calls:
        copied = map_for_target(source, target, mapper, ids[:, :-1], HandoffPlan.of(None, "none", store))
    assert copied.pending.numel() == 0 and not calls and store.hits == 1
    for a, b in zip(copied.cache.native.layers, reference.native.layers, strict=True):
        assert (a.keys - b.keys).abs().max() <= 1e-5 and (a.values - b.values).abs().max() <= 1e-5


@pytest.mark.parametrize(("target_tail", "recompute"), [(0, "none"), (0, "deviation:25%"), (3, "none")])
def test_handoff_generate_runs_one_target_forward_per_new_token(unrelated_pairs, target_tail, recompute):
    """`generate`'s first forward recomputes the pending positions and reads the unmapped tokens: a handoff that
    generates n tokens runs n target forwards (not n + 1) and answers as the two-step handoff does."""
    source, target, mapper = unrelated_pairs["qwen2"]
    plan = plan_of(recompute=recompute)
    ids = torch.randint(0, 128, (1, 33), generator=torch.Generator().manual_seed(15))
    cut = ids.shape[1] - 1 - target_tail
    with counting_forwards(target) as two_step:
        settled = map_for_target(source, target, mapper, ids[:, :cut], plan).settle(target).native
        reference = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=settled,
                                    max_new_tokens=5, do_sample=False)
    with counting_forwards(target) as calls:
        out = handoff_generate(source, target, mapper, ids, plan, target_tail=target_tail, max_new_tokens=5,
                               do_sample=False)
    assert len(two_step) == 6 and len(calls) == 5 and out.shape == (1, 38)
    assert out.tolist() == reference.tolist()
    assert "forward" not in target.__dict__  # the model's own forward is back
    hook = target.forward  # a forward replaced on the instance (as accelerate's device hooks do) stays in place
    target.forward = lambda *args, **kwargs: hook(*args, **kwargs)
    try:
        replaced = target.forward
        again = handoff_generate(source, target, mapper, ids, plan, target_tail=target_tail, max_new_tokens=5,
                                 do_sample=False)
        assert again.tolist() == reference.tolist() and target.forward is replaced
    finally:
        del target.forward
    with pytest.raises(ConfigError, match="target_tail"):
        handoff_generate(source, target, mapper, ids, target_tail=32)


def test_switching_session_generates_after_a_switch_in_one_forward_per_token(two_way_pair):
    """A switch then an answer: the receiving model's first forward is the fused read; with a shared prefix store
    a second conversation of the same opening copies the exact prefix."""
    models, mappers = two_way_pair
    store = PrefixStore()
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(16))[0].tolist()
    answers = []
    for _ in range(2):
        session = SwitchingSession(models, mappers, plan=HandoffPlan(prefix_store=store))
        session.read("a", ids[:20])
        with counting_forwards(models["b"]) as calls:
            answers.append(session.generate("b", ids[20:], max_new_tokens=3, do_sample=False))
        assert len(calls) == 3 + 1  # 3 forwards to answer, 1 to cache the answer's last token
    assert answers[0] == answers[1] and store.hits == 1 and store.misses == 1
