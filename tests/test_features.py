import pytest
import torch

from kvhandoff.errors import StatisticsError
from kvhandoff.fit.features import FeatureShardWriter, features_complete, load_features
from kvhandoff.fit.pipeline import collect_statistics, feature_layout
from kvhandoff.model.capture import FeatureLayout

from conftest import random_batches, tiny_model


def test_rows_written_during_calibration_are_the_rows_the_statistics_add(tmp_path):
    source, target = tiny_model("qwen2", layers=2), tiny_model("llama", layers=3, head_dim=8, seed=4)
    writer = FeatureShardWriter(tmp_path / "f", feature_layout(source), feature_layout(target))
    stats = collect_statistics(source, target, random_batches(3), progress=False, feature_writer=writer)
    assert not features_complete(tmp_path / "f")  # published only by close()
    writer.close({"note": "test"})
    x, y, shard = load_features(tmp_path / "f")
    assert x.shape == (stats.count, stats.source.width) and y.shape == (stats.count, stats.target.width)
    assert shard.tolist() == sorted(shard.tolist()) and int(shard.max()) == 2  # one shard per batch
    # float16 storage: sums agree with the float64 statistics to float16 precision
    assert torch.allclose(x.double().sum(0), stats.sum_x, rtol=2e-3, atol=2e-2 * stats.count)
    assert torch.allclose(y.double().square().sum(0), stats.sum_y_squared, rtol=5e-3)


def test_column_selection_and_incomplete_folders(tmp_path):
    layout = FeatureLayout(2, 1, 4)
    writer = FeatureShardWriter(tmp_path / "f", layout, layout)
    x, y = torch.randn(5, layout.width), torch.randn(5, layout.width)
    writer.append(x, y)
    writer.append(x[:0], y[:0])  # empty batches leave no shard
    with pytest.raises(StatisticsError, match="did not finish"):
        load_features(tmp_path / "f")
    writer.close()
    cols = torch.tensor([3, 0])
    xs, ys, shard = load_features(tmp_path / "f", cols, cols)
    assert torch.allclose(xs, x[:, cols], atol=1e-2) and torch.allclose(ys, y[:, cols], atol=1e-2)
    assert shard.tolist() == [0] * 5


def test_damaged_shard_names_the_file(tmp_path):
    layout = FeatureLayout(1, 1, 2)
    writer = FeatureShardWriter(tmp_path / "f", layout, layout)
    writer.append(torch.randn(3, layout.width), torch.randn(3, layout.width))
    folder = writer.close()
    shard = folder / "shard-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:20])
    with pytest.raises(StatisticsError, match="shard-00000"):
        load_features(folder)
