import dataclasses

import pytest
import torch

from kvhandoff import FitConfig, Mapper
from kvhandoff.config import HELDOUT_KS
from kvhandoff.errors import ConfigError, StatisticsError
from kvhandoff.fit.features import FeatureShardWriter
from kvhandoff.fit.heldout import choose_plan, fit_heldout_mapper, heldout_losses, split_heldout
from kvhandoff.fit.pipeline import mapper_from_statistics
from kvhandoff.fit.selection import layer_r2_matrix
from kvhandoff.fit.statistics import CalibrationStats
from kvhandoff.model.capture import FeatureLayout

HELDOUT = FitConfig(top_k="heldout", ridge_lambda="heldout", exact_prefix=0)


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """Target layer 0 reads source layer 0 only (noisy; few rows: extra inputs overfit); target layer 1 reads
    every source layer (needs all of them)."""
    source, target = FeatureLayout(16, 1, 4), FeatureLayout(2, 1, 4)
    gen = torch.Generator().manual_seed(0)
    n, windows = 200, 10
    x = torch.randn(n, source.width, generator=gen)
    y = torch.empty(n, target.width)
    for m in range(2):
        xm = x[:, m * source.modality_width : (m + 1) * source.modality_width]
        first = xm[:, :4] @ torch.randn(4, 4, generator=gen)
        y[:, target.layer_slice(m, 0)] = first + 0.7 * torch.randn(n, 4, generator=gen)
        y[:, target.layer_slice(m, 1)] = xm @ torch.randn(source.modality_width, 4, generator=gen)
    x, y = x.half().float(), y.half().float()  # what the shards hold
    folder = tmp_path_factory.mktemp("rows") / "f"
    writer = FeatureShardWriter(folder, source, target)
    for xs, ys in zip(x.chunk(windows), y.chunk(windows), strict=True):
        writer.append(xs, ys)
    writer.close()
    return CalibrationStats.from_rows(source, target, x, y), folder


def test_split_removes_exactly_the_heldout_windows(rows):
    stats, folder = rows
    train, x, y, windows = split_heldout(stats, folder)
    assert windows and x.shape[0] == 20 * len(windows) and train.count == stats.count - x.shape[0]
    rebuilt = train.merge(CalibrationStats.from_rows(stats.source, stats.target, x, y))
    assert all(torch.allclose(a, b, atol=1e-9) for a, b in zip(rebuilt.sums(), stats.sums(), strict=True))
    with pytest.raises(StatisticsError, match="another model pair or direction"):
        split_heldout(stats, folder, reverse=True)


def test_each_target_layer_gets_the_k_that_generalises(rows):
    stats, folder = rows
    train, x, y, _ = split_heldout(stats, folder)
    r2 = layer_r2_matrix(train)
    losses = heldout_losses(train, x, y, r2_matrix=r2)
    assert losses.shape == (len(HELDOUT_KS), 3, 2, 2)
    plan, chosen_k, chosen_loss = choose_plan(losses, layer_r2_matrix(stats))
    assert chosen_k[0] <= 2 and 0 in plan.source_layers[0]
    assert chosen_k[1] == 16
    assert (chosen_loss <= losses.min(dim=1).values[-1] + 1e-9).all()  # never worse than k = all at best λ


def test_heldout_mapper_is_ragged_padded_with_zero_weights_and_round_trips(rows, tmp_path):
    stats, folder = rows
    mapper = fit_heldout_mapper(stats, folder, HELDOUT, {}, {})
    choice = mapper.manifest["fit_metrics"]["heldout_choice"]
    assert mapper.top_k == 16 and choice["k_per_target_layer"][1] == 16
    used = set(mapper.manifest["source_layers_per_target_layer"][0])
    for position, source_layer in enumerate(mapper.selected[0].tolist()):
        block = mapper.weight[:, 0, position * 4 : (position + 1) * 4]
        assert (block.abs().sum() > 0) == (source_layer in used)
    _, x, _, _ = split_heldout(stats, folder)
    assert mapper.manifest["config"]["top_k"] == "heldout"
    mapper.manifest = dataclasses.replace(mapper.manifest, source_fingerprint={}, target_fingerprint={})
    mapper.save(tmp_path / "m")
    loaded = Mapper.load(tmp_path / "m")
    assert torch.equal(loaded.map_feature_rows(x), mapper.map_feature_rows(x))


def test_heldout_needs_rows_and_goes_with_heldout_lambda(rows):
    stats, _ = rows
    with pytest.raises(ConfigError, match="calibration rows"):
        mapper_from_statistics(stats, HELDOUT, {}, {})
    with pytest.raises(ConfigError, match="go together"):
        FitConfig(top_k="heldout")
    with pytest.raises(ConfigError, match="go together"):
        FitConfig(top_k=4, ridge_lambda="heldout")
