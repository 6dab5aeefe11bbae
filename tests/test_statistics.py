import copy
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kvhandoff.config import FitConfig
from kvhandoff.errors import StatisticsError
from kvhandoff.fit import statistics_file as statistics
from kvhandoff.fit.pipeline import collect_statistics, feature_layout, mapper_from_statistics
from kvhandoff.fit.statistics import CalibrationStats, SumsContent, sum_shapes
from kvhandoff.model.capture import FeatureLayout, capture_content_kv

from conftest import random_batches, tiny_model

#: every content a pass can sum: (target_gram, kv_cross)
CONTENTS = [(False, False), (False, True), (True, False), (True, True)]


@pytest.fixture(scope="module")
def pair():
    return tiny_model("qwen2", layers=2), tiny_model("llama", layers=3, head_dim=8, seed=4)


def _collect(pair, batches, target_gram=False, kv_cross=False, **options) -> CalibrationStats:
    source, target = pair
    return collect_statistics(source, target, batches, progress=False, target_gram=target_gram, kv_cross=kv_cross,
                              **options)


def _close(got: CalibrationStats, expected: CalibrationStats, names=None) -> None:
    """The same token count and sums (`names`: these only; default: all of them, and the same ones)."""
    assert got.count == expected.count and (names is not None or got.names() == expected.names())
    mine, theirs = got.tensors(), expected.tensors()
    for name in names or expected.names():
        torch.testing.assert_close(mine[name], theirs[name], rtol=1e-12, atol=1e-9)


def _dense_rows(pair, batches, stride: int = 4):
    """x, y [rows, width] float64 of the batches, as a pass keeps them."""
    source, target = pair
    xs, ys = [], []
    for ids in batches:
        positions = torch.arange(0, ids.shape[1], stride)
        xs.append(feature_layout(source).flatten(capture_content_kv(source, ids), positions))
        ys.append(feature_layout(target).flatten(capture_content_kv(target, ids), positions))
    return torch.cat(xs), torch.cat(ys)


def _whole(stats: CalibrationStats, kind: str) -> torch.Tensor:
    """Moment `kind` as one matrix of the whole layouts (from the modality blocks; needs the cross blocks)."""
    return torch.cat([torch.cat([stats.block(kind, a, b) for b in range(2)], 1) for a in range(2)])


@pytest.mark.parametrize(("target_gram", "kv_cross"), CONTENTS)
def test_shards_merge_to_the_one_pass_result(pair, target_gram, kv_cross):
    batches = random_batches(4)
    whole = _collect(pair, batches, target_gram, kv_cross)
    merged = _collect(pair, batches[:2], target_gram, kv_cross).merge(_collect(pair, batches[2:], target_gram,
                                                                              kv_cross))
    _close(merged, whole)


def test_the_sums_are_the_blocks_of_the_whole_moments(pair):
    batches = random_batches(2)
    x, y = _dense_rows(pair, batches)
    lean, full = _collect(pair, batches), _collect(pair, batches, True, True)
    assert lean.names() == ["sum_x", "sum_y", "sum_y_squared", "sum_xx_KK", "sum_xx_VV", "sum_xy_KK", "sum_xy_VV"]
    assert full.names() == ["sum_x", "sum_y", "sum_y_squared", "sum_xx_KK", "sum_xx_KV", "sum_xx_VV", "sum_xy_KK",
                            "sum_xy_KV", "sum_xy_VK", "sum_xy_VV", "sum_yy_KK", "sum_yy_KV", "sum_yy_VV"]
    for kind, (left, right) in {"xx": (x, x), "xy": (x, y), "yy": (y, y)}.items():
        torch.testing.assert_close(_whole(full, kind), left.T @ right, rtol=1e-12, atol=1e-9)
    torch.testing.assert_close(full.sum_y_squared, (y * y).sum(0), rtol=1e-12, atol=1e-9)
    _close(lean, full, lean.names())
    # a pass for own-modality maps holds no cross block, and says what does
    with pytest.raises(StatisticsError, match=r"no K·V cross moments.*--inputs kv"):
        lean.cov_xy(lean.source.layer_indices(0, [0]), lean.target.layer_slice(1, 0))
    # merging with statistics that hold fewer moments keeps what both hold
    assert full.merge(lean).names() == lean.names() and full.merge(lean).content == SumsContent()


def test_covariances_across_modalities_are_assembled_from_the_blocks(pair):
    batches = random_batches(2)
    x, y = _dense_rows(pair, batches)
    stats = _collect(pair, batches, kv_cross=True)
    xc, yc = x - x.mean(0), y - y.mean(0)
    cov_xx, cov_xy = xc.T @ xc / len(x), xc.T @ yc / len(x)
    idx_x = torch.cat([stats.source.layer_indices(1, [1]), stats.source.layer_indices(0, [0, 1])])  # V before K
    idx_y = torch.cat([stats.target.layer_indices(0, [2]), stats.target.layer_indices(1, [0])])
    torch.testing.assert_close(stats.cov_xx(idx_x), cov_xx[idx_x][:, idx_x], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(stats.cov_xy(idx_x, idx_y), cov_xy[idx_x][:, idx_y], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(stats.cov_xx(slice(None)), cov_xx, rtol=1e-9, atol=1e-9)  # a slice across both
    torch.testing.assert_close(stats.cov_xy(slice(100, 140), slice(None)), cov_xy[100:140], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kv_cross", [False, True])
def test_reversed_equals_collecting_the_other_direction(pair, kv_cross):
    batches = random_batches(2)
    forward = _collect(pair, batches, True, kv_cross).reversed()
    backward = _collect(pair[::-1], batches, True, kv_cross)
    assert forward.source == backward.source
    _close(forward, backward)
    with pytest.raises(StatisticsError, match=r"no target Gram.*--both-directions"):
        _collect(pair, batches, kv_cross=kv_cross).reversed()


def test_stride_and_memory_independent_of_token_count(pair):
    few = _collect(pair, random_batches(1))
    many = _collect(pair, random_batches(5))
    assert few.count == 2 * 12 and many.count == 5 * 2 * 12  # 48 tokens, stride 4, batch 2
    assert [t.shape for t in few.sums()] == [t.shape for t in many.sums()]
    assert many.block("xx", 0, 0).shape == (2 * 2 * 16, 2 * 2 * 16)  # K of 2 layers × 2 heads × 16
    assert many.block("xy", 1, 1).shape == (64, 3 * 2 * 8)


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


@pytest.mark.parametrize(("target_gram", "kv_cross"), CONTENTS)
def test_save_load_roundtrip_and_corrupt_file(pair, tmp_path, target_gram, kv_cross):
    stats = _collect(pair, random_batches(1), target_gram, kv_cross)
    path = tmp_path / "s.safetensors"
    stats.save(path)
    assert CalibrationStats.saved_content(path) == SumsContent(target_gram, kv_cross)
    loaded = CalibrationStats.load(path, target_gram, kv_cross)
    assert loaded.names() == stats.names() and loaded.count == stats.count
    assert all(torch.equal(a, b) for a, b in zip(loaded.sums(), stats.sums(), strict=True))
    _close(CalibrationStats.load(path), stats, CalibrationStats.load(path).names())  # less than it holds
    if not target_gram:
        with pytest.raises(StatisticsError, match=r"no target Gram.*--both-directions"):
            CalibrationStats.load(path, target_gram=True)
    if not kv_cross:
        with pytest.raises(StatisticsError, match=r"no K·V cross moments.*--inputs kv"):
            CalibrationStats.load(path, kv_cross=True)
    (tmp_path / "bad.safetensors").write_bytes(path.read_bytes()[:100])
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
    assert stats.count == 0 and all(not t.any() for t in stats.sums())  # nothing was added


def test_loading_checks_every_tensor_against_the_layouts(pair, tmp_path):
    stats = _collect(pair, random_batches(1), target_gram=True)
    path = tmp_path / "s.safetensors"
    stats.save(path)
    with safe_open(str(path), framework="pt") as opened:  # the metadata (layouts), written back with edits
        metadata = opened.metadata()
    tensors = load_file(str(path))
    cases = [
        ({**tensors, "sum_xy_VV": tensors["sum_xy_VV"][:, :-1].contiguous()}, "statistics tensor sum_xy_VV"),
        ({**tensors, "sum_y_squared": tensors["sum_y_squared"].float()}, "statistics tensor sum_y_squared"),
        ({**tensors, "sum_yy_KK": torch.zeros(48, 49, dtype=torch.float64)}, "statistics tensor sum_yy_KK"),
        ({k: v for k, v in tensors.items() if k != "sum_x"}, "holds tensors"),
        ({k: v for k, v in tensors.items() if k != "sum_y_squared"}, "holds tensors"),  # no variances at all
        ({k: v for k, v in tensors.items() if k != "sum_yy_VV"}, "holds tensors"),  # half a Gram
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
    for got, expected in zip(half.sums(), full.sums(), strict=True):
        assert got.dtype == torch.float64
        # bf16 keeps ~3 significant digits of each activation; the sums agree to that
        assert (got - expected).norm() <= 0.03 * expected.norm()
        assert not torch.equal(got, expected)


@pytest.mark.parametrize(("target_gram", "kv_cross"), CONTENTS)
def test_a_block_of_target_layers_is_the_whole_statistics_restricted(pair, target_gram, kv_cross):
    batches = random_batches(2)
    whole = _collect(pair, batches, target_gram, kv_cross)
    layers = range(1, 3)
    block = _collect(pair, batches, target_gram, kv_cross, target_layers=layers)
    expected = whole.for_target_layers(layers)
    assert block.target == FeatureLayout(2, whole.target.num_kv_heads, whole.target.head_dim) == expected.target
    _close(block, expected)
    # the K columns of target layer 1 in the whole layout are the block's first K columns
    k1 = whole.target.layer_slice(0, 1)
    torch.testing.assert_close(block.block("xy", 0, 0)[:, : whole.target.layer_width], whole.block("xy", 0, 0)[:, k1])


def test_a_later_block_adopts_the_source_sums_of_the_first(pair):
    batches = random_batches(2)
    first = _collect(pair, batches, target_layers=range(0, 1))
    later = _collect(pair, batches, target_layers=range(1, 3), source_sums=False)
    assert later.names() == ["sum_y", "sum_y_squared", "sum_xy_KK", "sum_xy_VV"]  # what a reduction adds up
    with pytest.raises(StatisticsError, match="source sums"):
        later.save("never-written.safetensors")
    shared = first.source_only()
    assert shared.target.num_layers == 0 and shared.block("xx", 0, 0) is first.block("xx", 0, 0)
    later.adopt_source_sums(shared)
    assert later.block("xx", 1, 1) is first.block("xx", 1, 1) and later.names() == first.names()
    _close(later, _collect(pair, batches).for_target_layers(range(1, 3)))
    with pytest.raises(StatisticsError, match="same tokens"):
        _collect(pair, batches[:1], source_sums=False).adopt_source_sums(shared)


def test_a_layer_range_outside_the_model_is_refused():
    layout = FeatureLayout(3, 2, 8)
    with pytest.raises(StatisticsError, match="consecutive layers"):
        layout.block(range(2, 4))


def _whole_matrix_file(stats: CalibrationStats, path) -> None:
    """`stats` (with the cross moments and the Gram) saved as files were before the sums were kept per modality
    pair: five whole matrices, the Gram's diagonal the only record of the target's variances."""
    layouts = {"source": stats.source.__dict__, "target": stats.target.__dict__, "count": stats.count}
    tensors = {"sum_x": stats.sum_x, "sum_y": stats.sum_y,
               **{name: _whole(stats, kind).contiguous() for kind, name in
                  (("xx", "sum_xx"), ("xy", "sum_xy"), ("yy", "sum_yy"))}}
    save_file(tensors, str(path), metadata={"kvhandoff_stats": json.dumps(layouts)})


def test_a_whole_matrix_file_loads_into_any_content_and_gives_the_same_mapper(pair, tmp_path, monkeypatch):
    full = _collect(pair, random_batches(3), True, True)
    full.sum_y_squared = _whole(full, "yy").diagonal().clone()  # what the old file holds of the variances, exactly
    path = tmp_path / "old.safetensors"
    _whole_matrix_file(full, path)
    assert CalibrationStats.saved_content(path) == SumsContent(True, True)
    monkeypatch.setattr(statistics, "ROW_CHUNK", 5)  # the diagonal is read in several blocks of rows
    loaded = {content: CalibrationStats.load(path, *content) for content in CONTENTS}
    for (target_gram, kv_cross), stats in loaded.items():
        assert stats.names() == list(sum_shapes(stats.source, stats.target, True, target_gram, kv_cross))
        assert all(torch.equal(stats.tensors()[name], full.tensors()[name]) for name in stats.names())
    fingerprints = {"name": "source"}, {"name": "target"}
    for config in (FitConfig(), FitConfig(top_k=1, ridge_lambda="gcv"), FitConfig(source_inputs="kv")):
        expected = mapper_from_statistics(full, config, *fingerprints)
        for content, stats in loaded.items():
            if config.joint_inputs and not content[1]:
                continue
            mapper = mapper_from_statistics(stats, config, *fingerprints)
            assert torch.equal(mapper.weight, expected.weight) and torch.equal(mapper.bias, expected.bias)
            assert mapper.manifest["fit_metrics"]["r2_per_head"] == expected.manifest["fit_metrics"]["r2_per_head"]
    # the reverse direction of the old file is the reverse of the statistics it was written from
    _close(loaded[True, True].reversed(), full.reversed())


def test_a_pass_of_fewer_moments_gives_the_mapper_of_a_pass_of_all(pair):
    batches = random_batches(3)
    lean, full = _collect(pair, batches), _collect(pair, batches, True, True)
    fingerprints = {"name": "source"}, {"name": "target"}
    for config in (FitConfig(), FitConfig(top_k=1, ridge_lambda="gcv")):
        a, b = mapper_from_statistics(lean, config, *fingerprints), mapper_from_statistics(full, config, *fingerprints)
        assert a.manifest["selected_layers"] == b.manifest["selected_layers"]
        torch.testing.assert_close(a.weight, b.weight, rtol=0, atol=1e-6)
        torch.testing.assert_close(a.bias, b.bias, rtol=0, atol=1e-6)


def test_a_row_of_weight_two_counts_as_the_row_twice(pair):
    x, y = _dense_rows(pair, random_batches(1))
    source, target = feature_layout(pair[0]), feature_layout(pair[1])
    weights = torch.tensor([2.0 if i % 3 == 0 else 1.0 for i in range(x.shape[0])], dtype=torch.float64)
    repeats = weights.long()
    weighted = CalibrationStats(source, target, target_gram=True, kv_cross=True)
    weighted.add_rows(x, y, weights)
    expected = CalibrationStats.from_rows(source, target, x.repeat_interleave(repeats, 0),
                                          y.repeat_interleave(repeats, 0), target_gram=True, kv_cross=True)
    _close(weighted, expected)
    assert isinstance(weighted.count, int)


def test_attention_weighted_statistics_keep_their_fractional_count_through_a_save(pair, tmp_path):
    batches = random_batches(2)
    uniform = _collect(pair, batches)
    weighted = _collect(pair, batches, config=FitConfig(row_weights="attention"))
    assert isinstance(weighted.count, float) and weighted.count == pytest.approx(uniform.count, rel=0.05)
    assert not torch.allclose(weighted.sum_y / weighted.count, uniform.sum_y / uniform.count)
    weighted.save(tmp_path / "w.safetensors")
    assert CalibrationStats.load(tmp_path / "w.safetensors").count == weighted.count
