import torch

from kvhandoff.solve import residual_variance, ridge_from_covariance


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
    from kvhandoff.solve import ridge_by_gcv

    cov_xx, cov_xy, var_y, n = _covariances(signal=1.0)
    weight, chosen = ridge_by_gcv(cov_xx, cov_xy, var_y, n, (0.3,), group_width=2)
    assert chosen == [0.3, 0.3]
    assert torch.allclose(weight, ridge_from_covariance(cov_xx, cov_xy, 0.3), atol=1e-10)


def test_gcv_picks_small_lambda_for_signal_and_large_for_noise():
    from kvhandoff.solve import ridge_by_gcv

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
