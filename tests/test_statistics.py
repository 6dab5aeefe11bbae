import copy

import pytest
import torch

from kvhandoff.capture import capture_content_kv
from kvhandoff.errors import StatisticsError
from kvhandoff.fit import collect_statistics, feature_layout
from kvhandoff.statistics import CalibrationStats, FeatureLayout

from conftest import random_batches, tiny_model


@pytest.fixture(scope="module")
def pair():
    return tiny_model("qwen2", layers=2), tiny_model("llama", layers=3, head_dim=8, seed=4)


def test_shards_merge_to_the_one_pass_result(pair):
    source, target = pair
    batches = random_batches(4)
    whole = collect_statistics(source, target, batches, progress=False)
    merged = collect_statistics(source, target, batches[:2], progress=False).merge(
        collect_statistics(source, target, batches[2:], progress=False)
    )
    assert merged.count == whole.count
    for name in ("sum_x", "sum_y", "sum_xx", "sum_xy", "sum_yy"):
        assert torch.allclose(getattr(merged, name), getattr(whole, name), rtol=1e-12, atol=1e-9)


def test_reversed_equals_collecting_the_other_direction(pair):
    source, target = pair
    batches = random_batches(2)
    forward = collect_statistics(source, target, batches, progress=False).reversed()
    backward = collect_statistics(target, source, batches, progress=False)
    assert forward.source == backward.source and forward.count == backward.count
    for name in ("sum_x", "sum_y", "sum_xx", "sum_xy", "sum_yy"):
        assert torch.allclose(getattr(forward, name), getattr(backward, name), rtol=1e-12, atol=1e-9)


def test_stride_and_memory_independent_of_token_count(pair):
    source, target = pair
    few = collect_statistics(source, target, random_batches(1), progress=False)
    many = collect_statistics(source, target, random_batches(5), progress=False)
    assert few.count == 2 * 12 and many.count == 5 * 2 * 12  # 48 tokens, stride 4, batch 2
    assert few.sum_xx.shape == many.sum_xx.shape == (2 * 2 * 32, 2 * 2 * 32)
    assert many.sum_xy.shape == (128, 2 * 3 * 16)


def test_centred_moments_match_direct_computation(pair):
    source, target = pair
    ids = random_batches(1)[0]
    src, tgt = capture_content_kv(source, ids), capture_content_kv(target, ids)
    stats = CalibrationStats(feature_layout(source), feature_layout(target))
    stats.update(src, tgt, token_stride=1)
    x = stats.source.flatten(src, torch.arange(48))
    y = stats.target.flatten(tgt, torch.arange(48))
    idx = stats.source.layer_slice(1, 1)
    xc = x - x.mean(0)
    assert torch.allclose(stats.cov_xx(idx), (xc.T @ xc)[idx, idx] / 96, atol=1e-9)
    assert torch.allclose(stats.var_y(), y.var(0, unbiased=False), atol=1e-9)


def test_save_load_roundtrip_and_corrupt_file(pair, tmp_path):
    source, target = pair
    stats = collect_statistics(source, target, random_batches(1), progress=False)
    stats.save(tmp_path / "s.safetensors")
    loaded = CalibrationStats.load(tmp_path / "s.safetensors")
    assert loaded.count == stats.count and torch.equal(loaded.sum_xy, stats.sum_xy)
    (tmp_path / "bad.safetensors").write_bytes((tmp_path / "s.safetensors").read_bytes()[:100])
    with pytest.raises(StatisticsError, match="re-run the calibration"):
        CalibrationStats.load(tmp_path / "bad.safetensors")


def test_errors_for_empty_or_mismatched_statistics(pair):
    source, target = pair
    empty = CalibrationStats(feature_layout(source), feature_layout(target))
    with pytest.raises(StatisticsError, match="calibration token"):
        empty.mean_x()
    other = CalibrationStats(FeatureLayout(1, 1, 8), feature_layout(target))
    with pytest.raises(StatisticsError, match="different model pairs"):
        empty.merge(other)
    with pytest.raises(StatisticsError, match="same token batch"):
        empty.update(
            capture_content_kv(source, torch.zeros(1, 8, dtype=torch.long)),
            capture_content_kv(target, torch.zeros(1, 9, dtype=torch.long)),
        )


def _with_nan_in_layer(model, layer: int):
    """A copy of ``model`` whose layer ``layer`` v_proj yields NaN (as an overflowed half-precision run would)."""
    import copy

    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.model.layers[layer].self_attn.v_proj.weight[0, 0] = float("nan")
    return broken


def test_nan_or_inf_in_calibration_activations_is_refused_naming_the_layer(pair):
    source, target = pair
    stats = CalibrationStats(feature_layout(source), feature_layout(target))
    ids = torch.randint(0, 128, (1, 16))
    with pytest.raises(StatisticsError, match=r"target model's calibration V activations .*layer\(s\) \[2\]"):
        stats.update(capture_content_kv(source, ids), capture_content_kv(_with_nan_in_layer(target, 2), ids))
    with pytest.raises(StatisticsError, match=r"source model's calibration V activations .*layer\(s\) \[1\]"):
        collect_statistics(_with_nan_in_layer(source, 1), target, [ids], progress=False)
    assert stats.count == 0 and torch.equal(stats.sum_xx, torch.zeros_like(stats.sum_xx))  # nothing was added


def test_loading_checks_every_tensor_against_the_layouts(pair, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    source, target = pair
    stats = collect_statistics(source, target, random_batches(1), progress=False)
    path = tmp_path / "s.safetensors"
    stats.save(path)
    with safe_open(str(path), framework="pt") as opened:  # the metadata (layouts), written back with edits
        metadata = opened.metadata()
    tensors = load_file(str(path))
    cases = [
        ({**tensors, "sum_xy": tensors["sum_xy"][:, :-1].contiguous()}, "statistics tensor sum_xy"),
        ({**tensors, "sum_yy": tensors["sum_yy"].float()}, "statistics tensor sum_yy"),
        ({k: v for k, v in tensors.items() if k != "sum_x"}, "holds tensors"),
        ({**tensors, "extra": torch.zeros(1)}, "holds tensors"),
    ]
    for edited, message in cases:
        save_file(edited, str(tmp_path / "edited.safetensors"), metadata=metadata)
        with pytest.raises(StatisticsError, match=message):
            CalibrationStats.load(tmp_path / "edited.safetensors")


def test_a_bf16_model_is_summed_in_float64_close_to_the_fp32_model(pair):
    source, target = pair
    batches = random_batches(3)
    full = collect_statistics(source, target, batches, progress=False)
    half = collect_statistics(copy.deepcopy(source).to(torch.bfloat16), copy.deepcopy(target).to(torch.bfloat16),
                              batches, progress=False)
    assert half.count == full.count
    for name in ("sum_x", "sum_y", "sum_xx", "sum_xy", "sum_yy"):
        got, expected = getattr(half, name), getattr(full, name)
        assert got.dtype == torch.float64
        # bf16 keeps ~3 significant digits of each activation; the sums agree to that
        assert (got - expected).norm() <= 0.03 * expected.norm()
        assert not torch.equal(got, expected)


def test_a_block_of_target_layers_is_the_whole_statistics_restricted(pair):
    source, target = pair
    batches = random_batches(2)
    whole = collect_statistics(source, target, batches, progress=False)
    layers = range(1, 3)
    block = collect_statistics(source, target, batches, progress=False, target_layers=layers)
    expected = whole.for_target_layers(layers)
    assert block.target == FeatureLayout(2, whole.target.num_kv_heads, whole.target.head_dim) == expected.target
    assert block.count == whole.count
    for name in ("sum_x", "sum_y", "sum_xx", "sum_xy", "sum_yy"):
        torch.testing.assert_close(getattr(block, name), getattr(expected, name), rtol=1e-12, atol=1e-9)
    # the K columns of target layer 1 in the whole layout are the block's first K columns
    k1 = whole.target.layer_slice(0, 1)
    torch.testing.assert_close(block.sum_xy[:, : whole.target.layer_width], whole.sum_xy[:, k1])


def test_a_later_block_adopts_the_source_sums_of_the_first(pair):
    source, target = pair
    batches = random_batches(2)
    first = collect_statistics(source, target, batches, progress=False, target_layers=range(0, 1))
    later = collect_statistics(source, target, batches, progress=False, target_layers=range(1, 3), source_sums=False)
    assert later.sum_xx.numel() == 0 and len(later.sums()) == 3  # y, xyᵀ, yyᵀ: what a reduction adds up
    with pytest.raises(StatisticsError, match="source sums"):
        later.save("never-written.safetensors")
    shared = first.source_only()
    assert shared.target.num_layers == 0 and shared.sum_xx is first.sum_xx
    later.adopt_source_sums(shared)
    assert later.sum_xx is first.sum_xx and len(later.sums()) == 5
    torch.testing.assert_close(later.sum_xy, collect_statistics(source, target, batches, progress=False)
                               .for_target_layers(range(1, 3)).sum_xy)
    with pytest.raises(StatisticsError, match="same tokens"):
        collect_statistics(source, target, batches[:1], progress=False, source_sums=False).adopt_source_sums(shared)


def test_a_layer_range_outside_the_model_is_refused():
    layout = FeatureLayout(3, 2, 8)
    with pytest.raises(StatisticsError, match="consecutive layers"):
        layout.block(range(2, 4))
