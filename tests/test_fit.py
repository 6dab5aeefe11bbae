import pytest
import torch

from kvhandoff import FitConfig, fit_mapper
from kvhandoff.config import MAPPER_FORMAT_VERSION
from kvhandoff.errors import ConfigError, IncompatiblePairError, StatisticsError
from kvhandoff.fit.pipeline import (
    FittedMaps,
    collect_statistics,
    default_plan,
    estimate_memory,
    feature_layout,
    layer_block_for_budget,
    mapper_from_statistics,
    solve_plan,
)
from kvhandoff.fit.selection import layer_r2_matrix
from kvhandoff.model.capture import FeatureLayout
from kvhandoff.model.geometry import check_pair, model_fingerprint

from conftest import exactly_related, random_batches, tiny_model


def test_any_k_from_the_same_statistics():
    source = tiny_model("qwen2", layers=4)
    target = exactly_related(source)
    stats = collect_statistics(source, target, random_batches(3), progress=False)
    fps = model_fingerprint(source), model_fingerprint(target)
    for k in (1, 2, 4, "all"):
        mapper = mapper_from_statistics(stats, FitConfig(top_k=k, ridge_lambda=1e-6), *fps)
        assert mapper.top_k == (4 if k == "all" else k)
        assert mapper.manifest["fit_metrics"]["r2_k_mean"] > 0.9999


def test_calibration_description_and_token_count_recorded():
    source, target = tiny_model("llama"), tiny_model("llama", seed=1)
    mapper = fit_mapper(source, target, random_batches(2), calibration={"name": "random ids"}, progress=False)
    assert mapper.manifest["calibration"] == {"name": "random ids", "tokens_in_statistics": 2 * 2 * 12}
    assert mapper.manifest["method"] == "ridge"


def test_different_vocabularies_are_refused():
    source = tiny_model("qwen2")
    target = tiny_model("qwen2", vocab_size=200)
    with pytest.raises(IncompatiblePairError, match="different vocabulary sizes"):
        fit_mapper(source, target, random_batches(1), progress=False)


def test_different_tokenizers_are_refused():
    class FakeTokenizer:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

        def encode(self, text, add_special_tokens=True):
            return [self.vocab.get(c, 0) for c in text]

    with pytest.raises(IncompatiblePairError, match="tokenizers differ"):
        check_pair(tiny_model(), tiny_model(), FakeTokenizer({"a": 0}), FakeTokenizer({"b": 0}))


def test_bad_batches_are_refused():
    with pytest.raises(StatisticsError, match=r"\[batch, tokens\]"):
        fit_mapper(tiny_model(), tiny_model(seed=2), [torch.zeros(5, dtype=torch.long)], progress=False)


def _cross_modal_stats(source, target, rows: int = 600, seed: int = 0):
    """Synthetic rows where every target K and V is an exact linear function of source K *and* V."""
    from kvhandoff.fit.pipeline import feature_layout
    from kvhandoff.fit.statistics import CalibrationStats

    src, tgt = feature_layout(source), feature_layout(target)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, src.width, generator=gen, dtype=torch.float64)
    y = x @ torch.randn(src.width, tgt.width, generator=gen, dtype=torch.float64) / src.width**0.5 + 0.3
    return CalibrationStats.from_rows(src, tgt, x, y, kv_cross=True), x, y


@pytest.mark.parametrize("top_k", [1, "all"])
def test_joint_inputs_recover_maps_that_read_source_k_and_v(top_k):
    source, target = tiny_model("qwen2", layers=2), tiny_model("qwen2", layers=3, head_dim=32, seed=3)
    stats, x, y = _cross_modal_stats(source, target)
    fps = model_fingerprint(source), model_fingerprint(target)
    own = mapper_from_statistics(stats, FitConfig(top_k=top_k, ridge_lambda=1e-8), *fps)
    joint = mapper_from_statistics(stats, FitConfig(top_k=top_k, ridge_lambda=1e-8, source_inputs="kv"), *fps)
    assert joint.weight.shape[2] == 2 * own.weight.shape[2]
    assert joint.manifest["format_version"] == own.manifest["format_version"] == MAPPER_FORMAT_VERSION
    assert "source_inputs" not in own.manifest["config"] and joint.manifest["config"]["source_inputs"] == "kv"
    own_r2, joint_r2 = own.manifest["fit_metrics"]["r2_v_mean"], joint.manifest["fit_metrics"]["r2_v_mean"]
    assert own_r2 + 0.1 < joint_r2 <= 1.0 + 1e-9
    if top_k == "all":  # every source layer is an input: the map is exact
        assert own_r2 < 0.9 and joint_r2 > 1 - 1e-6
        assert torch.allclose(joint.map_feature_rows(x.float()), y.float(), atol=1e-4, rtol=0)


def test_joint_inputs_are_refused_with_the_heldout_choice():
    from kvhandoff.errors import ConfigError

    with pytest.raises(ConfigError, match="source_inputs"):
        FitConfig(top_k="heldout", ridge_lambda="heldout", source_inputs="kv")
    with pytest.raises(ConfigError, match="source_inputs"):
        FitConfig(source_inputs="k")


def test_nan_solved_weights_are_refused_naming_the_map():
    source, target = tiny_model("qwen2", layers=2), tiny_model("qwen2", layers=3, seed=2)
    stats = collect_statistics(source, target, random_batches(2), progress=False)
    mapper_from_statistics(stats, FitConfig(), {}, {})  # the clean statistics solve
    columns = stats.target.layer_slice(1, 2)  # V of target layer 2
    stats.block("xy", 1, 1)[:, columns.start - stats.target.modality_width] = float("nan")
    with pytest.raises(StatisticsError, match="NaN/Inf weights for V of target layer 2"):
        mapper_from_statistics(stats, FitConfig(), {}, {})


def _transfer(mapper, source, ids):
    with torch.no_grad():
        cache = source(ids, use_cache=True).past_key_values
    return mapper.transfer(cache)


@pytest.mark.parametrize(("top_k", "inputs", "layer_block"), [("all", "own", 1), (2, "own", 2), ("all", "kv", 3)])
def test_a_fit_in_layer_blocks_equals_the_whole_fit(top_k, inputs, layer_block):
    source, target = tiny_model("qwen2", layers=3), tiny_model("llama", layers=5, head_dim=8, seed=4)
    batches, config = random_batches(3), FitConfig(top_k=top_k, source_inputs=inputs)
    whole = fit_mapper(source, target, batches, config, progress=False)
    blocked = fit_mapper(source, target, batches, config, progress=False, layer_block=layer_block)
    metrics = blocked.manifest["fit_metrics"]
    assert metrics["statistics_passes"] == -(-5 // layer_block) and metrics["layer_block"] == layer_block
    assert blocked.manifest["selected_layers"] == whole.manifest["selected_layers"]
    assert blocked.manifest["calibration"] == whole.manifest["calibration"]
    torch.testing.assert_close(blocked.weight, whole.weight, rtol=0, atol=1e-6)
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(5))
    for a, b in zip(_transfer(blocked, source, ids).layers, _transfer(whole, source, ids).layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=1e-6)
        torch.testing.assert_close(a.values, b.values, rtol=0, atol=1e-6)


def test_a_fit_in_layer_blocks_needs_batches_it_can_read_again():
    source, target = tiny_model("qwen2"), tiny_model("qwen2", seed=1)
    with pytest.raises(ConfigError, match="not an iterator"):
        fit_mapper(source, target, iter(random_batches(2)), progress=False, layer_block=1)
    with pytest.raises(ConfigError, match="layer_block"):
        fit_mapper(source, target, random_batches(2), progress=False, layer_block=0)


@pytest.mark.parametrize("target_gram", [False, True])
@pytest.mark.parametrize("inputs", ["own", "kv"])
def test_the_statistics_estimate_is_the_bytes_a_pass_allocates(target_gram, inputs):
    source, target = tiny_model("qwen2", layers=3), tiny_model("llama", layers=5, head_dim=8, seed=4)
    batches, config = random_batches(1), FitConfig(source_inputs=inputs)
    for layers, layer_block in ((range(5), None), (range(0, 2), 2)):
        stats = collect_statistics(source, target, batches, config, progress=False, target_layers=layers,
                                   target_gram=target_gram)
        assert stats.kv_cross == (inputs == "kv")  # a pass sums the cross moments its config's maps read
        held = sum(t.numel() * t.element_size() for t in stats.sums())
        estimate = estimate_memory(stats.source, feature_layout(target), config, layer_block, target_gram)
        assert estimate.statistics_bytes == held


def test_the_estimate_of_a_big_pair_by_hand():
    # Qwen3-14B → Qwen3-32B: 40 and 64 layers, 8 KV heads of 128 each; k = 4
    source, target = FeatureLayout(40, 8, 128), FeatureLayout(64, 8, 128)
    whole = estimate_memory(source, target, FitConfig(top_k=4))
    ws, wt = 2 * 40 * 1024, 2 * 64 * 1024
    # x, y, Σy², then xxᵀ and xyᵀ of K with K and V with V: half of each whole matrix
    assert whole.statistics_bytes == 8 * (ws + 2 * wt + (ws * ws + ws * wt) // 2)  # ≈ 70 GB
    both = estimate_memory(source, target, FitConfig(top_k=4), target_gram=True)
    assert both.statistics_bytes == whole.statistics_bytes + 8 * wt * wt // 2  # the Gram's K·K and V·V blocks
    joint = estimate_memory(source, target, FitConfig(top_k=4, source_inputs="kv"), target_gram=True)
    # and the cross blocks: K·V of the symmetric ones, K·V and V·K of xyᵀ
    assert joint.statistics_bytes == both.statistics_bytes + 8 * (ws * ws // 4 + ws * wt // 2 + wt * wt // 4)
    inputs = 4 * 1024
    assert whole.solve_bytes == 8 * (2 * inputs * inputs + 6 * inputs * 1024)
    blocked = estimate_memory(source, target, FitConfig(top_k=4), layer_block=8)
    wb = 2 * 8 * 1024
    assert blocked.statistics_bytes == 8 * (ws + 2 * wb + (ws * ws + ws * wb) // 2)
    assert blocked.mapper_bytes == whole.mapper_bytes == 4 * 2 * 64 * (inputs + 1) * 1024
    assert blocked.peak_bytes < whole.peak_bytes


@pytest.mark.parametrize("inputs", ["own", "kv"])
def test_a_fit_of_every_source_layer_hands_its_maps_to_the_mapper_without_a_copy(inputs):
    source, target = tiny_model("qwen2", layers=3), tiny_model("llama", layers=2, head_dim=8, seed=4)
    config = FitConfig(source_inputs=inputs)
    stats = collect_statistics(source, target, random_batches(2), config, progress=False)
    r2_matrix = layer_r2_matrix(stats, config.probe_lambda)
    plan = default_plan(r2_matrix, config)
    selected = plan.padded(r2_matrix)
    solution = solve_plan(stats, config, plan, selected)
    fitted = FittedMaps(stats.source, stats.target, stats.count, plan, selected, solution)
    mapper = fitted.mapper(config, {}, {}, None, (4096, 4096))
    assert mapper.weight.untyped_storage().data_ptr() == solution.weight.untyped_storage().data_ptr()
    expected = mapper_from_statistics(stats, config, {}, {})
    assert torch.equal(mapper.weight, expected.weight)


def test_the_block_for_a_memory_budget_is_the_largest_that_fits():
    source, target = FeatureLayout(40, 8, 128), FeatureLayout(64, 8, 128)
    config = FitConfig(top_k=4)
    budget = estimate_memory(source, target, config, layer_block=10).peak_bytes
    assert layer_block_for_budget(source, target, budget, config) == 10
    assert layer_block_for_budget(source, target, budget - 1, config) == 9
    assert layer_block_for_budget(source, target, 10**15, config) is None  # everything in one pass
    with pytest.raises(ConfigError, match="even one target layer per pass needs"):
        layer_block_for_budget(source, target, 2**30, config)
