import pytest
import torch

from kvhandoff import FitConfig, HandoffPlan, fit_mapper, handoff_cache, prefill
from kvhandoff.config import RefineConfig
from kvhandoff.errors import ConfigError
from kvhandoff.fit.refine import handoff_kl, mapped_cache, refine_mapper, teacher_window

from conftest import exactly_related, random_batches, tiny_model

#: the mapper's exact prefix, no recompute policy (what refine fits against)
NO_POLICY = HandoffPlan.of(recompute="none")


@pytest.fixture(scope="module")
def unrelated_pair():
    """Two different tiny models (layers, head dims, KV heads differ) and a ridge mapper that maps them poorly."""
    source = tiny_model("qwen2", layers=2, head_dim=16, seed=0)
    target = tiny_model("llama", layers=3, head_dim=32, kv_heads=1, seed=1)
    with torch.no_grad():  # peaked next-token distributions: a random model's near-uniform ones hide the map's error
        target.lm_head.weight.mul_(20)
    mapper = fit_mapper(source, target, random_batches(count=4, tokens=64),
                        FitConfig(top_k="all", exact_prefix=2), progress=False)
    return source, target, mapper


def _windows(count: int, tokens: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 128, (count, tokens), generator=torch.Generator().manual_seed(seed))


def test_mapped_cache_is_the_handoff_cache(unrelated_pair):
    source, target, mapper = unrelated_pair
    ids = _windows(1, 40)
    window = teacher_window(source, target, ids, mapper.exact_prefix)
    ours = mapped_cache(mapper, target.config, window.source_rows[:, :, :30], window.own_prefix)
    reference = handoff_cache(source, target, mapper, ids[:, :30], NO_POLICY)  # refine fits the map alone
    for mine, theirs in zip(ours.layers, reference.layers, strict=True):
        assert torch.allclose(mine.keys, theirs.keys, atol=1e-4)
        assert torch.allclose(mine.values, theirs.values, atol=1e-4)


def test_handoff_kl_is_the_kl_of_the_target_reading_on_the_mapped_cache(unrelated_pair):
    source, target, mapper = unrelated_pair
    ids = _windows(1, 40)
    window = teacher_window(source, target, ids, mapper.exact_prefix)
    kl = handoff_kl(mapper, target, window, context=25, continuation=10)
    own = target(input_ids=ids[:, :35]).logits[0, 25:35].log_softmax(-1)
    cache = handoff_cache(source, target, mapper, ids[:, :25], NO_POLICY)
    mapped = target(input_ids=ids[:, 25:35], cache=cache).logits[0].log_softmax(-1)
    expected = (own.exp() * (own - mapped)).sum(-1).mean()
    assert kl.item() == pytest.approx(expected.item(), rel=1e-4, abs=1e-6)
    assert kl.item() > 0.1  # an unrelated pair: the map is far from exact


def test_an_exact_mapper_has_zero_kl():
    source = tiny_model("qwen2", layers=2)
    target = exactly_related(source)
    mapper = fit_mapper(source, target, random_batches(), FitConfig(top_k="all", ridge_lambda=1e-6), progress=False)
    window = teacher_window(source, target, _windows(1, 48), mapper.exact_prefix)
    assert handoff_kl(mapper, target, window, context=30, continuation=12).item() < 1e-5


def test_refinement_lowers_the_heldout_kl_and_leaves_the_input_mapper_alone(unrelated_pair):
    source, target, mapper = unrelated_pair
    before = mapper.weight.clone()
    flags = [p.requires_grad for p in target.parameters()]
    config = RefineConfig(steps=30, batch_size=2, learning_rate=1e-3, min_context=4, max_context=24,
                          continuation=8, validation_windows=3, validate_every=10)
    refined = refine_mapper(mapper, source, target, _windows(12, 32), config, progress=False)
    record = refined.manifest["refinement"]
    assert record["validation_kl_after"] < 0.95 * record["validation_kl_before"]
    assert record["kept_step"] > 0 and [h["step"] for h in record["history"]] == [0, 10, 20, 30]
    assert record["config"]["learning_rate"] == 1e-3
    assert torch.equal(mapper.weight, before)
    assert not torch.equal(refined.weight, before) and not refined.weight.requires_grad
    assert [p.requires_grad for p in target.parameters()] == flags  # the target is handed back as it came
    # the refined mapper is an ordinary mapper: it hands off with the target's cache layout
    ids = _windows(1, 20, seed=9)
    cache = handoff_cache(source, target, refined, ids)
    _, logits = prefill(target, ids[:, -1:], cache=cache)
    assert torch.isfinite(logits).all()


def test_a_diverging_refinement_keeps_the_unrefined_map(unrelated_pair):
    source, target, mapper = unrelated_pair
    config = RefineConfig(steps=4, batch_size=1, learning_rate=10.0, min_context=4, max_context=24,
                          continuation=8, validation_windows=2, validate_every=2)
    refined = refine_mapper(mapper, source, target, _windows(6, 32), config, progress=False)
    assert refined.manifest["refinement"]["kept_step"] == 0
    assert torch.equal(refined.weight, mapper.weight) and torch.equal(refined.bias, mapper.bias)


def test_refinement_refuses_short_windows_too_few_windows_and_mlp_mappers(unrelated_pair):
    source, target, mapper = unrelated_pair
    config = RefineConfig(max_context=24, continuation=8, validation_windows=2)
    with pytest.raises(ConfigError, match="max_context"):
        refine_mapper(mapper, source, target, _windows(6, 20), config, progress=False)
    with pytest.raises(ConfigError, match="none to train on"):
        refine_mapper(mapper, source, target, _windows(2, 32), config, progress=False)

    class NotLinear(type(mapper)):
        pass

    odd = NotLinear(mapper.weight, mapper.bias, mapper.selected, {**mapper.manifest, "method": "mlp"})
    with pytest.raises(ConfigError, match="only linear"):
        refine_mapper(odd, source, target, _windows(6, 32), config, progress=False)


@pytest.mark.real_models
def test_real_pair_refinement_lowers_the_kl_on_its_training_text():
    """A few refinement steps of the default pair's cached default mapper (fitted on first use: slow) on one real
    window, held out as a copy of itself: the handed-over 1.5B's KL on that text must fall."""
    from kvhandoff.fit.corpus import calibration_batches
    from kvhandoff.model.loading import DEFAULT_SOURCE, DEFAULT_TARGET
    from kvhandoff.workflow import load_named_pair, obtain_mapper

    pair = load_named_pair(DEFAULT_SOURCE, DEFAULT_TARGET, progress=False)
    small, large, tokenizer = pair.source, pair.target, pair.models.tokenizer
    mapper = obtain_mapper(pair, progress=False)[0]
    config = RefineConfig(steps=6, batch_size=2, learning_rate=2e-5, min_context=32, max_context=64,
                          continuation=16, validation_windows=1, validate_every=3)
    window = calibration_batches(tokenizer, 1, 96, seed=1, mix=("prose",)).input_ids
    refined = refine_mapper(mapper, small, large, torch.cat([window, window]), config, progress=False)
    record = refined.manifest["refinement"]
    assert [h["step"] for h in record["history"]] == [0, 3, 6]
    assert 0 < record["validation_kl_before"] < 2  # a working handoff to start from
    assert record["validation_kl_after"] < 0.97 * record["validation_kl_before"]
    assert record["kept_step"] > 0
