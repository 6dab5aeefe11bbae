"""Closed-form ridge regression from covariance blocks.

λ is relative: the system solved is (C_xx + λ · mean(diag C_xx) · I) W = C_xy with C the centred
covariances (Gram / token count). So λ = 0.01 means "1% of the average input variance", whatever the
number of calibration tokens or the activation scale. The bias makes the map exact on the means.
"""

from __future__ import annotations

import torch

from kvhandoff.statistics import CalibrationStats


def ridge_from_covariance(cov_xx: torch.Tensor, cov_xy: torch.Tensor, ridge_lambda: float) -> torch.Tensor:
    """W = (C_xx + λ·mean(diag)·I)⁻¹ C_xy via Cholesky (the regularised matrix is positive definite)."""
    shift = ridge_lambda * cov_xx.diagonal().mean().clamp_min(1e-12)
    system = cov_xx + shift * torch.eye(cov_xx.shape[0], dtype=cov_xx.dtype)
    factor, info = torch.linalg.cholesky_ex(system)
    if int(info) != 0:  # numerically indefinite (tiny λ on rank-deficient data): fall back to lstsq
        return torch.linalg.lstsq(system, cov_xy).solution
    return torch.cholesky_solve(cov_xy, factor)


def residual_variance(
    weights: torch.Tensor, cov_xx: torch.Tensor, cov_xy: torch.Tensor, var_y: torch.Tensor
) -> torch.Tensor:
    """Per-output residual variance of y ≈ Wᵀx on the calibration data: var − 2·diag(WᵀC_xy) + diag(WᵀC_xxW)."""
    return var_y - 2 * (weights * cov_xy).sum(0) + (weights * (cov_xx @ weights)).sum(0)


def solve_layers(
    stats: CalibrationStats, modality: int, target_layers, source_layers, ridge_lambda: float
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Ridge maps for target layers that read the same source layers, all their KV heads at once.

    Every head of those target layers sees the same input (all KV heads of the selected source layers), so
    solving all their columns against one factorisation is identical to one ridge per (layer, head), at a
    fraction of the cost. Returns per target layer (weight [in, out], bias [out], R² per KV head), float64.
    """
    idx_x = stats.source.layer_indices(modality, source_layers)
    idx_y = torch.cat(
        [torch.arange(s.start, s.stop) for s in (stats.target.layer_slice(modality, layer) for layer in target_layers)]
    )
    cov_xx, cov_xy = stats.cov_xx(idx_x), stats.cov_xy(idx_x, idx_y)
    weight = ridge_from_covariance(cov_xx, cov_xy, ridge_lambda)
    bias = stats.mean_y(idx_y) - weight.T @ stats.mean_x(idx_x)
    var_y = stats.var_y(idx_y)
    resid = residual_variance(weight, cov_xx, cov_xy, var_y)
    heads, width = stats.target.num_kv_heads, stats.target.layer_width
    r2 = 1 - resid.view(-1, heads, width // heads).sum(-1) / var_y.view(-1, heads, width // heads).sum(-1).clamp_min(
        1e-30
    )
    return [
        (weight[:, i * width : (i + 1) * width], bias[i * width : (i + 1) * width], r2[i])
        for i in range(len(target_layers))
    ]
