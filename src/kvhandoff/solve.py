"""Closed-form ridge regression from covariance blocks.

λ is relative: the system solved is (C_xx + λ · mean(diag C_xx) · I) W = C_xy with C the centred
covariances (Gram / token count). So λ = 0.01 means "1% of the average input variance", whatever the
number of calibration tokens or the activation scale. The bias makes the map exact on the means.
"""

from __future__ import annotations

import torch

from kvhandoff.config import GCV_LAMBDAS
from kvhandoff.statistics import CalibrationStats


def ridge_from_covariance(cov_xx: torch.Tensor, cov_xy: torch.Tensor, ridge_lambda: float) -> torch.Tensor:
    """W = (C_xx + λ·mean(diag)·I)⁻¹ C_xy via Cholesky (the regularised matrix is positive definite)."""
    shift = ridge_lambda * cov_xx.diagonal().mean().clamp_min(1e-12)
    system = cov_xx.clone()
    system.diagonal().add_(shift)  # no identity matrix: big pairs' systems are GBs
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
    stats: CalibrationStats, modality: int, target_layers, source_layers, ridge_lambda: float | str,
    input_modalities: tuple[int, ...] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]:
    """Ridge maps for target layers that read the same source layers, all their KV heads at once.

    Every head of those target layers sees the same input (all KV heads of the selected source layers), so
    solving all their columns against one factorisation is identical to one ridge per (layer, head), at a
    fraction of the cost. ridge_lambda "gcv" picks λ per target layer (see `ridge_by_gcv`).
    input_modalities: the source modalities read, in input-column order (default: the map's own, `modality`).
    Returns per target layer (weight [in, out], bias [out], R² per KV head, λ used), float64.
    """
    idx_x = torch.cat([stats.source.layer_indices(m, source_layers) for m in input_modalities or (modality,)])
    slices = [stats.target.layer_slice(modality, layer) for layer in target_layers]
    idx_y = torch.cat([torch.arange(s.start, s.stop) for s in slices])
    cov_xx, cov_xy = stats.cov_xx(idx_x), stats.cov_xy(idx_x, idx_y)
    var_y = stats.var_y(idx_y)
    width = stats.target.layer_width
    if ridge_lambda == "gcv":
        weight, chosen = ridge_by_gcv(cov_xx, cov_xy, var_y, stats.count, GCV_LAMBDAS, width)
    else:
        weight = ridge_from_covariance(cov_xx, cov_xy, ridge_lambda)
        chosen = [float(ridge_lambda)] * len(target_layers)
    bias = stats.mean_y(idx_y) - weight.T @ stats.mean_x(idx_x)
    resid = residual_variance(weight, cov_xx, cov_xy, var_y)
    heads = stats.target.num_kv_heads
    r2 = 1 - resid.view(-1, heads, width // heads).sum(-1) / var_y.view(-1, heads, width // heads).sum(-1).clamp_min(
        1e-30
    )
    return [
        (weight[:, i * width : (i + 1) * width], bias[i * width : (i + 1) * width], r2[i], chosen[i])
        for i in range(len(target_layers))
    ]


def ridge_by_gcv(
    cov_xx: torch.Tensor, cov_xy: torch.Tensor, var_y: torch.Tensor, count: int, lambdas, group_width: int
) -> tuple[torch.Tensor, list[float]]:
    """Ridge with λ chosen per group of `group_width` outputs (one target layer) by generalised CV.

    GCV(λ) = RSS(λ) / (1 − df(λ)/n)², df = Σ dᵢ/(dᵢ + s) over the eigenvalues dᵢ of C_xx, s = λ·mean(d).
    Both terms come from the covariances alone (RSS in the eigenbasis: var − Σᵢ pᵢ²(dᵢ + 2s)/(dᵢ + s)² with
    p = Vᵀ C_xy), so no held-out pass is needed. Calibration tokens of one sequence are correlated, so n
    overstates the independent samples and GCV leans towards small λ; the grid bounds that.
    Returns (weight [in, out], chosen relative λ per group).
    """
    eigenvalues, vectors = torch.linalg.eigh(cov_xx)
    eigenvalues = eigenvalues.clamp_min(0)
    projected = vectors.T @ cov_xy  # [in, out]
    scale = eigenvalues.mean().clamp_min(1e-12)
    groups = cov_xy.shape[1] // group_width
    best_score = torch.full((groups,), float("inf"), dtype=cov_xx.dtype)
    best = torch.zeros(groups, dtype=torch.long)
    for i, lam in enumerate(lambdas):
        shift = lam * scale
        explained = (projected**2 * ((eigenvalues + 2 * shift) / (eigenvalues + shift) ** 2)[:, None]).sum(0)
        rss = (var_y - explained).clamp_min(0).view(groups, group_width).sum(1)
        dof = (eigenvalues / (eigenvalues + shift)).sum()
        score = rss / (1 - dof / count).clamp_min(1e-6) ** 2
        improved = score < best_score
        best_score = torch.where(improved, score, best_score)
        best = torch.where(improved, torch.full_like(best, i), best)
    shifts = torch.tensor([lambdas[int(i)] for i in best], dtype=cov_xx.dtype) * scale
    shift_per_column = shifts.repeat_interleave(group_width)
    weight = vectors @ (projected / (eigenvalues[:, None] + shift_per_column[None, :]))
    return weight, [float(lambdas[int(i)]) for i in best]
