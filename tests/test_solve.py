import pytest
import torch

from kvhandoff.config import GCV_LAMBDAS
from kvhandoff.fit import solve
from kvhandoff.fit.pipeline import collect_statistics
from kvhandoff.fit.solve import layers_per_solve, residual_variance, ridge_by_gcv, ridge_from_covariance, solve_layers

from conftest import random_batches, tiny_model


def test_ridge_matches_closed_form_and_lambda_is_relative_to_mean_variance():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(500, 6, generator=gen, dtype=torch.float64) * 10
    y = x @ torch.randn(6, 3, generator=gen, dtype=torch.float64) + 0.1 * torch.randn(
        500, 3, dtype=torch.float64
    )
    xc, yc = x - x.mean(0), y - y.mean(0)
    cov_xx, cov_xy = xc.T @ xc / 500, xc.T @ yc / 500
    lam = 0.01
    expected = torch.linalg.solve(
        cov_xx + lam * cov_xx.diagonal().mean() * torch.eye(6, dtype=torch.float64), cov_xy
    )
    weights = ridge_from_covariance(cov_xx, cov_xy, lam)
    assert torch.allclose(weights, expected, atol=1e-10)
    # scaling the data leaves the (relative) ridge solution unchanged
    assert torch.allclose(ridge_from_covariance(cov_xx * 100, cov_xy * 10, lam), weights / 10, atol=1e-10)
    resid = residual_variance(weights, cov_xx, cov_xy, yc.var(0, unbiased=False))
    assert torch.allclose(resid, (yc - xc @ weights).var(0, unbiased=False), atol=1e-8)


def test_rank_deficient_input_still_solves():
    x = torch.randn(100, 2, dtype=torch.float64)
    x = torch.cat([x, x], 1)  # duplicated features
    cov = x.T @ x / 100
    weights = ridge_from_covariance(cov, cov[:, :1], 1e-9)
    assert torch.isfinite(weights).all()


def _covariances(signal: float, n: int = 400, features: int = 20, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=gen, dtype=torch.float64)
    y = signal * x @ torch.randn(features, 4, generator=gen, dtype=torch.float64)
    y = y + torch.randn(n, 4, generator=gen, dtype=torch.float64)
    xc, yc = x - x.mean(0), y - y.mean(0)
    return xc.T @ xc / n, xc.T @ yc / n, yc.var(0, unbiased=False), n


def test_gcv_weights_equal_plain_ridge_at_the_chosen_lambda():
    from kvhandoff.fit.solve import ridge_by_gcv

    cov_xx, cov_xy, var_y, n = _covariances(signal=1.0)
    weight, chosen = ridge_by_gcv(cov_xx, cov_xy, var_y, n, (0.3,), group_width=2)
    assert chosen == [0.3, 0.3]
    assert torch.allclose(weight, ridge_from_covariance(cov_xx, cov_xy, 0.3), atol=1e-10)


def test_gcv_picks_small_lambda_for_signal_and_large_for_noise():
    from kvhandoff.fit.solve import ridge_by_gcv

    grid = (0.001, 0.01, 0.1, 1.0, 10.0)
    _, strong = ridge_by_gcv(*_covariances(signal=3.0), grid, group_width=4)
    _, noise = ridge_by_gcv(*_covariances(signal=0.0, n=60), grid, group_width=4)
    assert strong[0] <= 0.01 and noise[0] >= 1.0


def test_gcv_config_fits_and_records_chosen_lambdas():
    from kvhandoff import FitConfig, fit_mapper

    from conftest import random_batches, tiny_model

    mapper = fit_mapper(tiny_model("qwen2"), tiny_model("qwen2", seed=3), random_batches(3),
                        FitConfig(ridge_lambda="gcv"), progress=False)
    chosen = mapper.manifest["fit_metrics"]["ridge_lambda_per_target_layer"]
    assert len(chosen["K"]) == 2 and all(lam > 0 for lam in chosen["K"] + chosen["V"])


def _whole_solve(stats, modality: int, target_layers, source_layers, ridge_lambda):
    """Every target layer's columns against one solve, from dense covariances: the reference for `solve_layers`."""
    idx_x = stats.source.layer_indices(modality, source_layers)
    idx_y = stats.target.layer_indices(modality, target_layers)
    mean_x, mean_y = stats.sum_x / stats.count, stats.sum_y / stats.count
    local_x, local_y = idx_x - modality * stats.source.modality_width, idx_y - modality * stats.target.modality_width
    gram, cross = stats.block("xx", modality, modality), stats.block("xy", modality, modality)
    cov_xx = gram[local_x][:, local_x] / stats.count - torch.outer(mean_x[idx_x], mean_x[idx_x])
    cov_xy = cross[local_x][:, local_y] / stats.count - torch.outer(mean_x[idx_x], mean_y[idx_y])
    var_y = (stats.sum_y_squared / stats.count - mean_y**2)[idx_y]
    if ridge_lambda == "gcv":
        weight, chosen = ridge_by_gcv(cov_xx, cov_xy, var_y, stats.count, GCV_LAMBDAS, stats.target.layer_width)
    else:
        weight, chosen = ridge_from_covariance(cov_xx, cov_xy, ridge_lambda), [ridge_lambda] * len(target_layers)
    return weight, mean_y[idx_y] - weight.T @ mean_x[idx_x], residual_variance(weight, cov_xx, cov_xy, var_y), chosen


@pytest.mark.parametrize("per_solve", [1, 2, 3])
def test_solves_of_a_few_layers_at_a_time_equal_one_solve_of_all_columns(per_solve, monkeypatch):
    monkeypatch.setattr(solve, "layers_per_solve", lambda inputs, width: per_solve)
    stats = collect_statistics(tiny_model("qwen2", layers=3), tiny_model("llama", layers=4, head_dim=8, seed=4),
                               random_batches(3), progress=False)
    width, heads = stats.target.layer_width, stats.target.num_kv_heads
    target_layers, source_layers = [0, 2, 3], [0, 2]
    for ridge_lambda in (0.01, "gcv"):
        weight, bias, resid, chosen = _whole_solve(stats, 1, target_layers, source_layers, ridge_lambda)
        solved = list(solve_layers(stats, 1, target_layers, source_layers, ridge_lambda))
        assert len(solved) == len(target_layers)
        for i, (w, b, r2, lam) in enumerate(solved):
            columns = slice(i * width, (i + 1) * width)
            torch.testing.assert_close(w, weight[:, columns], rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(b, bias[columns], rtol=1e-9, atol=1e-12)
            variance = stats.var_y(stats.target.layer_slice(1, target_layers[i]))
            expected_r2 = 1 - resid[columns].view(heads, -1).sum(-1) / variance.view(heads, -1).sum(-1)
            torch.testing.assert_close(r2, expected_r2, rtol=1e-9, atol=1e-12)
            assert lam == pytest.approx(chosen[i])


def test_narrow_layers_are_solved_several_at_a_time_within_the_factorisations_size():
    assert layers_per_solve(3072, 256) == 1  # the default pair: 0.5B → 1.5B
    assert layers_per_solve(7168, 128) == 7  # and back: the 0.5B's layers are narrower
    assert layers_per_solve(100, 256) == 1
