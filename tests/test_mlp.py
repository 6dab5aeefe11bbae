import json

import pytest
import torch

from kvhandoff import FitConfig, Mapper, prefill
from kvhandoff.config import MAPPER_FORMAT_VERSION, MLPConfig
from kvhandoff.errors import ConfigError, MapperFormatError, StatisticsError
from kvhandoff.files import sha256_json
from kvhandoff.fit.features import FeatureShardWriter
from kvhandoff.fit.mlp import fit_mlp_mapper, input_columns, output_columns
from kvhandoff.fit.pipeline import collect_statistics, feature_layout, mapper_from_statistics
from kvhandoff.fit.selection import layer_r2_matrix
from kvhandoff.fit.statistics import CalibrationStats
from kvhandoff.mapper.mlp import MLPMapper, ResidualMLP
from kvhandoff.model.capture import FeatureLayout
from kvhandoff.model.geometry import model_fingerprint

from conftest import random_batches, tiny_model


def _write_rows(folder, source, target, x, y, windows):
    writer = FeatureShardWriter(folder, source, target)
    for xs, ys in zip(x.chunk(windows), y.chunk(windows), strict=True):
        writer.append(xs, ys)
    return writer.close()


@pytest.fixture(scope="module")
def nonlinear_pair(tmp_path_factory):
    """Rows where the target is a nonlinear function of the source: ridge cannot fit it, an MLP can."""
    source, target = FeatureLayout(2, 1, 4), FeatureLayout(2, 1, 4)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6000, source.width, generator=generator)
    mixing = torch.randn(source.width, target.width, generator=generator) / source.width**0.5
    y = torch.tanh(2 * x @ mixing) + 0.5 * (x @ mixing) ** 2
    folder = _write_rows(tmp_path_factory.mktemp("rows") / "f", source, target, x, y, windows=12)
    stats = CalibrationStats.from_rows(source, target, x.half().float(), y.half().float())
    base = mapper_from_statistics(stats, FitConfig(top_k="all", exact_prefix=0), {}, {})
    return base, stats, folder


def test_mlp_learns_what_ridge_cannot(nonlinear_pair):
    base, stats, folder = nonlinear_pair
    mapper = fit_mlp_mapper(base, folder, layer_r2_matrix(stats), MLPConfig(hidden=64, input_layers=2, epochs=15,
                                                                            batch_size=256), progress=False)
    metrics = mapper.manifest["fit_metrics"]["mlp"]
    assert metrics["heldout_windows"] == 1 and metrics["heldout_rows"] == 500
    assert metrics["heldout_loss_mlp"] < 0.3 * metrics["heldout_loss_ridge"]
    assert mapper.manifest["method"] == "mlp" and mapper.manifest["format_version"] == MAPPER_FORMAT_VERSION


def test_early_stopping_never_ends_worse_than_ridge_on_heldout(nonlinear_pair):
    base, stats, folder = nonlinear_pair
    # a learning rate this large diverges: every layer must fall back to epoch 0, i.e. the ridge mapper exactly
    mapper = fit_mlp_mapper(base, folder, layer_r2_matrix(stats), MLPConfig(hidden=16, input_layers=1, epochs=2,
                                                                            learning_rate=1e3), progress=False)
    metrics = mapper.manifest["fit_metrics"]["mlp"]
    assert all(a <= b for a, b in zip(metrics["heldout_loss_mlp_per_layer"],
                                      metrics["heldout_loss_ridge_per_layer"], strict=True))
    rows = torch.randn(7, base.source.width)
    chosen_zero = [i for i, e in enumerate(metrics["epoch_per_layer"]) if e == 0]
    assert chosen_zero, "a diverging run should keep the ridge for some layer"
    mapped, linear = mapper.map_feature_rows(rows), base.map_feature_rows(rows)
    for layer in chosen_zero:
        assert torch.allclose(mapped[:, output_columns(base.target)[layer]],
                              linear[:, output_columns(base.target)[layer]], atol=1e-5)


def test_applied_layout_matches_the_training_layout():
    """What the mapper adds at transfer time is the MLP of exactly the columns it was trained on."""
    source, target = FeatureLayout(3, 2, 4), FeatureLayout(2, 1, 6)
    x = torch.randn(500, source.width)
    stats = CalibrationStats.from_rows(source, target, x, torch.randn(500, target.width))
    base = mapper_from_statistics(stats, FitConfig(top_k=2, exact_prefix=0), {}, {})
    input_layers = torch.tensor([[2, 0], [1, 2]])
    mlp = ResidualMLP(2, 2 * 2 * source.layer_width, 8, 2 * target.layer_width, seed=3)
    torch.nn.init.normal_(mlp.w3)
    mapper = MLPMapper(base.weight, base.bias, base.selected, base.manifest, input_layers, mlp)
    rows = torch.randn(9, source.width)
    expected = base.map_feature_rows(rows)
    with torch.no_grad():
        correction = mlp(rows[:, input_columns(source, input_layers)].transpose(0, 1))  # [Lt, n, 2·Ft]
    for layer, columns in enumerate(output_columns(target)):
        expected[:, columns] += correction[layer]
    assert torch.allclose(mapper.map_feature_rows(rows), expected, atol=1e-5)


def test_save_load_round_trip_and_refusals(tmp_path):
    source, target = tiny_model("qwen2", layers=2), tiny_model("qwen2", layers=3, head_dim=32, seed=5)
    writer = FeatureShardWriter(tmp_path / "rows", feature_layout(source), feature_layout(target))
    stats = collect_statistics(source, target, random_batches(4), progress=False, feature_writer=writer)
    writer.close()
    base = mapper_from_statistics(stats, FitConfig(top_k=1), model_fingerprint(source), model_fingerprint(target),
                                  max_position_embeddings=(source.config.max_position_embeddings,
                                                           target.config.max_position_embeddings))
    mapper = fit_mlp_mapper(base, tmp_path / "rows", layer_r2_matrix(stats), MLPConfig(hidden=8, epochs=2,
                                                                                       input_layers=2),
                            progress=False)
    mapper.save(tmp_path / "m")
    loaded = Mapper.load(tmp_path / "m", source_model=source, target_model=target)
    assert isinstance(loaded, MLPMapper) and loaded.num_parameters() > base.num_parameters()
    lazy = Mapper.load(tmp_path / "m", lazy=True)  # answers from the manifest, then from its tensors: the same
    assert lazy.num_parameters() == loaded.num_parameters() == mapper.num_parameters()
    assert lazy.pending and lazy.nbytes() == 0
    lazy.input_layers  # noqa: B018 - the first use reads the tensors
    assert not lazy.pending and lazy.num_parameters() == mapper.num_parameters()
    assert lazy.nbytes() == mapper.nbytes() > base.nbytes()
    cache, _ = prefill(source, torch.randint(0, 128, (1, 19)))
    a, b = mapper.transfer(cache), loaded.transfer(cache)
    for la, lb in zip(a.layers, b.layers, strict=True):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
    # reversed rows train the opposite direction; mismatched rows are refused
    with pytest.raises(StatisticsError, match="another model pair or direction"):
        fit_mlp_mapper(base, tmp_path / "rows", layer_r2_matrix(stats), MLPConfig(epochs=1), reverse=True,
                       progress=False)
    manifest_path = tmp_path / "m" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "method": "quantum"}))
    with pytest.raises(MapperFormatError, match="does not match its checksum"):
        Mapper.load(tmp_path / "m")
    body = {**{k: v for k, v in manifest.items() if k != "checksum"}, "method": "quantum"}
    manifest_path.write_text(json.dumps({**body, "checksum": sha256_json(body)}))
    with pytest.raises(MapperFormatError, match="unknown method 'quantum'"):
        Mapper.load(tmp_path / "m")


def test_reverse_direction_trains_from_the_forward_rows(tmp_path):
    source, target = tiny_model("llama", layers=2), tiny_model("llama", layers=3, seed=5)
    writer = FeatureShardWriter(tmp_path / "rows", feature_layout(source), feature_layout(target))
    stats = collect_statistics(source, target, random_batches(3), progress=False, feature_writer=writer,
                               target_gram=True).reversed()
    writer.close()
    base = mapper_from_statistics(stats, FitConfig(), {}, {})
    mapper = fit_mlp_mapper(base, tmp_path / "rows", layer_r2_matrix(stats), MLPConfig(hidden=8, epochs=1),
                            reverse=True, progress=False)
    assert mapper.input_layers.shape == (2, 3)  # the small model is the target; all 3 source layers (k ≤ 3)


def test_mlp_config_is_validated():
    with pytest.raises(ConfigError, match="validation_fraction"):
        MLPConfig(validation_fraction=1.0)
    with pytest.raises(ConfigError, match="hidden"):
        MLPConfig(hidden=0)


def test_mlp_mapper_moves_with_to_and_a_nan_mlp_is_refused(tmp_path):
    from kvhandoff.errors import NonFiniteError
    from kvhandoff.fit.mlp import require_finite_mlp

    source, target = tiny_model("qwen2", layers=2), tiny_model("qwen2", layers=3, head_dim=32, seed=5)
    writer = FeatureShardWriter(tmp_path / "rows", feature_layout(source), feature_layout(target))
    stats = collect_statistics(source, target, random_batches(3), progress=False, feature_writer=writer)
    writer.close()
    base = mapper_from_statistics(stats, FitConfig(top_k=1), model_fingerprint(source), model_fingerprint(target))
    mapper = fit_mlp_mapper(base, tmp_path / "rows", layer_r2_matrix(stats), MLPConfig(hidden=8, epochs=1),
                            progress=False)
    assert isinstance(mapper.manifest.mlp_config, MLPConfig) and mapper.manifest.mlp_config.hidden == 8
    cache, _ = prefill(source, torch.randint(0, 128, (1, 13)))
    reference = mapper.transfer(cache)
    double = MLPMapper(mapper.weight, mapper.bias, mapper.selected, mapper.manifest, mapper.input_layers,
                       ResidualMLP.from_tensors(mapper.mlp.tensors())).to(dtype=torch.float64)
    assert double.mlp.w1.dtype == double.weight.dtype == torch.float64
    for got, want in zip(double.transfer(cache).layers, reference.layers, strict=True):
        assert torch.allclose(got.keys, want.keys, atol=1e-5) and torch.allclose(got.values, want.values, atol=1e-5)
    tensors = mapper.mlp.tensors()
    tensors["w2"] = tensors["w2"].clone()
    tensors["w2"][1, 0, 0] = float("nan")
    broken = ResidualMLP.from_tensors(tensors)
    with pytest.raises(StatisticsError, match=r"target layer\(s\) \[1\]"):
        require_finite_mlp(broken)
    nan_mapper = MLPMapper(mapper.weight, mapper.bias, mapper.selected, mapper.manifest, mapper.input_layers, broken)
    with pytest.raises(NonFiniteError, match=r"mlp\.w2 holds NaN/Inf \(target layer\(s\) \[1\]\)"):
        nan_mapper.save(tmp_path / "m")
    assert not (tmp_path / "m").exists()
