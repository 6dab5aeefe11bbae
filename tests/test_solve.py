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
