"""Closed-form ridge regression from covariance blocks.

λ is relative: the system solved is (C_xx + λ · mean(diag C_xx) · I) W = C_xy with C the centred
covariances (Gram / token count). So λ = 0.01 means "1% of the average input variance", whatever the
number of calibration tokens or the activation scale. The bias makes the map exact on the means.

Target layers that read the same source layers share one factorisation of C_xx, and their columns are solved a few
target layers at a time against it (`layers_per_solve`): the working set beyond the factorisation is those layers'
C_xy and weights, not every layer's at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from kvhandoff.config import GCV_LAMBDAS
from kvhandoff.fit.statistics import CalibrationStats

#: C_xy [in, out] → W [in, out] against one factorisation of C_xx
RidgeSolver = Callable[[torch.Tensor], torch.Tensor]


def ridge_solver(cov_xx: torch.Tensor, ridge_lambda: float) -> RidgeSolver:
    """C_xy ↦ W = (C_xx + λ·mean(diag)·I)⁻¹ C_xy, factorised once here (Cholesky: the regularised matrix is
    positive definite). The factor overwrites the one copy of C_xx the system is made of, so C_xx is held twice,
    not three times."""
    shift = ridge_lambda * cov_xx.diagonal().mean().clamp_min(1e-12)
    system = cov_xx.clone()
    system.diagonal().add_(shift)  # no identity matrix: big pairs' systems are GBs
    info = torch.empty((), dtype=torch.int32)
    torch.linalg.cholesky_ex(system, out=(system, info))
    if int(info) != 0:  # numerically indefinite (tiny λ on rank-deficient data): fall back to lstsq
        system = cov_xx.clone()  # the failed factorisation overwrote the first copy
        system.diagonal().add_(shift)
        return lambda cov_xy: torch.linalg.lstsq(system, cov_xy).solution
    return lambda cov_xy: torch.cholesky_solve(cov_xy, system)


def ridge_from_covariance(cov_xx: torch.Tensor, cov_xy: torch.Tensor, ridge_lambda: float) -> torch.Tensor:
    """W = (C_xx + λ·mean(diag)·I)⁻¹ C_xy (`ridge_solver` for one right-hand side)."""
    return ridge_solver(cov_xx, ridge_lambda)(cov_xy)


def residual_variance(
    weights: torch.Tensor, cov_xx: torch.Tensor, cov_xy: torch.Tensor, var_y: torch.Tensor
) -> torch.Tensor:
    """Per-output residual variance of y ≈ Wᵀx on the calibration data: var − 2·diag(WᵀC_xy) + diag(WᵀC_xxW)."""
    return var_y - 2 * (weights * cov_xy).sum(0) + (weights * (cov_xx @ weights)).sum(0)


def layers_per_solve(inputs: int, layer_width: int) -> int:
    """Target layers solved at once against one factorisation of an `inputs`-wide C_xx: as many as keep their
    working set (about six copies of inputs × their columns) within ¾ of the factorisation's inputs², at least
    one. Fewer make the triangular solves slower where layers are narrow (few right-hand sides each); more hold
    more memory."""
    return max(1, inputs // (8 * layer_width))


def solve_layers(
    stats: CalibrationStats, modality: int, target_layers, source_layers, ridge_lambda: float | str,
    input_modalities: tuple[int, ...] | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]:
    """Ridge maps for target layers that read the same source layers, all their KV heads at once.

    Every head of those target layers sees the same input (all KV heads of the selected source layers), so
    solving all their columns against one factorisation is identical to one ridge per (layer, head), at a
    fraction of the cost; the columns are solved `layers_per_solve` target layers at a time. ridge_lambda "gcv"
    picks λ per target layer (see `ridge_by_gcv`).
    input_modalities: the source modalities read, in input-column order (default: the map's own, `modality`).
    Yields per target layer, in order, (weight [in, out], bias [out], R² per KV head, λ used), float64.
    """
    idx_x = torch.cat([stats.source.layer_indices(m, source_layers) for m in input_modalities or (modality,)])
    cov_xx, mean_x = stats.cov_xx(idx_x), stats.mean_x(idx_x)
    width, heads = stats.target.layer_width, stats.target.num_kv_heads
    gcv = gcv_solver(cov_xx, stats.count, GCV_LAMBDAS, width) if ridge_lambda == "gcv" else None
    ridge = None if gcv is not None else ridge_solver(cov_xx, ridge_lambda)
    target_layers, per_solve = list(target_layers), layers_per_solve(len(idx_x), width)
    for start in range(0, len(target_layers), per_solve):
        layers = target_layers[start : start + per_solve]
        idx_y = torch.cat([stats.target.layer_indices(modality, [layer]) for layer in layers])
        cov_xy, var_y = stats.cov_xy(idx_x, idx_y), stats.var_y(idx_y)
        if gcv is not None:
            weight, chosen = gcv(cov_xy, var_y)
        else:
            weight, chosen = ridge(cov_xy), [float(ridge_lambda)] * len(layers)
        bias = stats.mean_y(idx_y) - weight.T @ mean_x
        resid = residual_variance(weight, cov_xx, cov_xy, var_y)
        r2 = 1 - resid.view(-1, heads, width // heads).sum(-1) / var_y.view(-1, heads, width // heads).sum(
            -1).clamp_min(1e-30)
        for i in range(len(layers)):
            columns = slice(i * width, (i + 1) * width)
            yield weight[:, columns], bias[columns], r2[i], chosen[i]


#: (C_xy [in, out], var_y [out]) → (W [in, out], the relative λ chosen per group of outputs)
GcvSolver = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, list[float]]]


def gcv_solver(cov_xx: torch.Tensor, count: int, lambdas, group_width: int) -> GcvSolver:
    """Ridge with λ chosen per group of `group_width` outputs (one target layer) by generalised CV, against one
    eigendecomposition of C_xx (made here).

    GCV(λ) = RSS(λ) / (1 − df(λ)/n)², df = Σ dᵢ/(dᵢ + s) over the eigenvalues dᵢ of C_xx, s = λ·mean(d).
    Both terms come from the covariances alone (RSS in the eigenbasis: var − Σᵢ pᵢ²(dᵢ + 2s)/(dᵢ + s)² with
    p = Vᵀ C_xy), so no held-out pass is needed. Calibration tokens of one sequence are correlated, so n
    overstates the independent samples and GCV leans towards small λ; the grid bounds that.
    """
    eigenvalues, vectors = torch.linalg.eigh(cov_xx)
    eigenvalues = eigenvalues.clamp_min(0)
    scale = eigenvalues.mean().clamp_min(1e-12)

    def solve(cov_xy: torch.Tensor, var_y: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
        projected = vectors.T @ cov_xy  # [in, out]
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

    return solve


def ridge_by_gcv(
    cov_xx: torch.Tensor, cov_xy: torch.Tensor, var_y: torch.Tensor, count: int, lambdas, group_width: int
) -> tuple[torch.Tensor, list[float]]:
    """Ridge with λ chosen per group of `group_width` outputs by generalised CV (`gcv_solver` for one
    right-hand side). Returns (weight [in, out], chosen relative λ per group)."""
    return gcv_solver(cov_xx, count, lambdas, group_width)(cov_xy, var_y)
