"""Compact mappers, solved from the same float64 statistics as the full ridge map (no further calibration).

The full map gives every (K|V, target layer) all KV heads of its k source layers (its size: `Mapper.nbytes`).
Three structures cut that (`FitConfig`):

- heads="aligned": target KV head h reads only its group of source KV heads (`head_groups`).
- k_tolerance > 0: each target layer reads the fewest source layers whose in-sample R² is within the tolerance
  of top_k's (`choose_layer_ks`).
- rank r > 0: every target layer's K (V) map reads one shared rank-r projection of all source layers' K (V)
  (`mapper.lowrank.LowRankMapper`): reduced-rank ridge ("rrr") or principal components of the source Gram ("pca").

The first two are `mapper.blocks.BlockMapper`s: dense blocks, each reading a set of source columns and writing a
set of target columns, blocks of one shape applied as one batched GEMM. This module solves them; the solution's
tensors are what the mapper class reads (`pipeline.compact_mapper`). Weight storage in float16/bfloat16
(`FitConfig.storage_dtype`) applies to every mapper (`Mapper.save`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvhandoff.config import LAYER_KS, FitConfig
from kvhandoff.errors import ConfigError
from kvhandoff.fit.selection import select_layers
from kvhandoff.fit.solve import residual_variance, ridge_from_covariance
from kvhandoff.fit.statistics import CalibrationStats
from kvhandoff.mapper.blocks import BLOCK_PARTS
from kvhandoff.model.capture import MODALITIES, FeatureLayout


@dataclass
class CompactSolution:
    """A solved compact map: its method and saved tensors, the [Lt, k_max] selection the manifest records, the
    source layers each target layer reads, in-sample R² [K|V, target layer, KV head] and what to record."""

    method: str
    tensors: dict[str, torch.Tensor]
    selected: torch.Tensor
    source_layers: list[list[int]]
    r2: torch.Tensor
    record: dict = field(default_factory=dict)


def head_groups(source_heads: int, target_heads: int, aligned: bool) -> list[list[int]]:
    """The source KV heads each target KV head reads: all of them, or (aligned) head h when the counts are
    equal, heads h·n … h·n + n − 1 when the source has n times the target's, head h // n when the target has n
    times the source's. ConfigError when aligned and neither count divides the other."""
    if not aligned:
        return [list(range(source_heads))] * target_heads
    if source_heads % target_heads == 0:
        n = source_heads // target_heads
        return [list(range(h * n, (h + 1) * n)) for h in range(target_heads)]
    if target_heads % source_heads == 0:
        n = target_heads // source_heads
        return [[h // n] for h in range(target_heads)]
    raise ConfigError(f"heads='aligned' needs KV head counts that divide one another; the source has "
                      f"{source_heads}, the target {target_heads}: use heads='all'")


def block_specs(src: FeatureLayout, tgt: FeatureLayout, config: FitConfig,
                source_layers: list[list[int]]) -> dict[tuple[int, ...], list[int]]:
    """{source columns read: target columns written} for every (K|V, target layer, target head); outputs that
    read the same columns are merged into one block (so they share one factorisation and one GEMM)."""
    groups = head_groups(src.num_kv_heads, tgt.num_kv_heads, config.heads == "aligned")
    blocks: dict[tuple[int, ...], list[int]] = {}
    for modality in range(len(MODALITIES)):
        for layer, layers in enumerate(source_layers):
            for head, source_heads in enumerate(groups):
                columns = [src.layer_slice(m, s).start + h * src.head_dim + d
                           for m in config.input_modalities(modality) for s in layers for h in source_heads
                           for d in range(src.head_dim)]
                start = tgt.layer_slice(modality, layer).start + head * tgt.head_dim
                blocks.setdefault(tuple(columns), []).extend(range(start, start + tgt.head_dim))
    return blocks


def solve_blocks(stats: CalibrationStats, blocks: dict[tuple[int, ...], list[int]], ridge_lambda: float):
    """Ridge-solve every block; returns [(inputs, outputs, weight [in, out], bias [out])] and the residual
    variance of every target column (float64)."""
    solved, residual = [], torch.empty(stats.target.width, dtype=torch.float64)
    for columns, outputs in blocks.items():
        idx_x, idx_y = torch.tensor(columns), torch.tensor(outputs)
        cov_xx, cov_xy = stats.cov_xx(idx_x), stats.cov_xy(idx_x, idx_y)
        weight = ridge_from_covariance(cov_xx, cov_xy, ridge_lambda)
        bias = stats.mean_y(idx_y) - weight.T @ stats.mean_x(idx_x)
        residual[idx_y] = residual_variance(weight, cov_xx, cov_xy, stats.var_y(idx_y))
        solved.append((idx_x, idx_y, weight, bias))
    return solved, residual


def head_r2(stats: CalibrationStats, residual: torch.Tensor) -> torch.Tensor:
    """In-sample R² [K|V, target layer, KV head] from every target column's residual variance."""
    tgt = stats.target
    shape = (len(MODALITIES), tgt.num_layers, tgt.num_kv_heads, tgt.head_dim)
    variance = stats.var_y().view(shape).sum(-1)
    return 1 - residual.view(shape).sum(-1) / variance.clamp_min(1e-30)


def group_blocks(solved) -> dict[str, torch.Tensor]:
    """Solved blocks as saved tensors: blocks of one (in, out) shape stacked into a group (float32)."""
    by_shape: dict[tuple[int, int], list] = {}
    for block in solved:
        by_shape.setdefault((len(block[0]), len(block[1])), []).append(block)
    tensors = {}
    for g, members in enumerate(by_shape.values()):
        idx_x, idx_y, weight, bias = (torch.stack(parts) for parts in zip(*members, strict=True))
        parts = (weight.float(), bias.float(), idx_x, idx_y)
        tensors.update({f"blocks.{g}.{name}": t for name, t in zip(BLOCK_PARTS, parts, strict=True)})
    return tensors


def choose_layer_ks(stats: CalibrationStats, config: FitConfig, r2_matrix: torch.Tensor) -> tuple[list[int], dict]:
    """k per target layer: the fewest source layers (LAYER_KS up to top_k) whose in-sample R² (mean over K, V
    and heads) is within `config.k_tolerance` of top_k's. Returns (k per target layer, R² per candidate k)."""
    num_source = stats.source.num_layers
    top = num_source if config.top_k == "all" else min(int(config.top_k), num_source)
    candidates = sorted({k for k in LAYER_KS if k < top} | {top})
    r2_by_k = {}
    for k in candidates:
        layers = select_layers(r2_matrix, k).tolist()
        _, residual = solve_blocks(stats, block_specs(stats.source, stats.target, config, layers),
                                   float(config.ridge_lambda))
        r2_by_k[k] = head_r2(stats, residual).mean(dim=(0, 2))  # [target layer]
    best = r2_by_k[top]
    chosen = [next(k for k in candidates if r2_by_k[k][t] >= best[t] - config.k_tolerance)
              for t in range(stats.target.num_layers)]
    return chosen, {str(k): r2.tolist() for k, r2 in r2_by_k.items()}


def solve_block_mapper(stats: CalibrationStats, config: FitConfig, r2_matrix: torch.Tensor) -> CompactSolution:
    """Head-aligned and/or k-per-layer blocks (config.heads, config.k_tolerance)."""
    record: dict = {"heads": config.heads}
    if config.k_tolerance:
        ks, r2_by_k = choose_layer_ks(stats, config, r2_matrix)
        record.update(k_tolerance=config.k_tolerance, k_per_target_layer=ks, r2_by_k=r2_by_k)
    else:
        ks = [int(select_layers(r2_matrix, config.top_k).shape[1])] * stats.target.num_layers
    source_layers = [select_layers(r2_matrix, k)[t].tolist() for t, k in enumerate(ks)]
    blocks = block_specs(stats.source, stats.target, config, source_layers)
    solved, residual = solve_blocks(stats, blocks, float(config.ridge_lambda))
    record["head_groups"] = head_groups(stats.source.num_kv_heads, stats.target.num_kv_heads,
                                        config.heads == "aligned")
    return CompactSolution("blocks", group_blocks(solved), padded_selection(source_layers, r2_matrix),
                           source_layers, head_r2(stats, residual), record)


def padded_selection(source_layers: list[list[int]], r2_matrix: torch.Tensor) -> torch.Tensor:
    """[Lt, k_max] rows for the manifest: each target layer's source layers, padded with its next-best ones."""
    k_max = max(len(layers) for layers in source_layers)
    score = r2_matrix.mean(0)
    rows = []
    for target_layer, layers in enumerate(source_layers):
        extra = [int(i) for i in score[target_layer].argsort(descending=True) if int(i) not in layers]
        rows.append(sorted([*layers, *extra[: k_max - len(layers)]]))
    return torch.tensor(rows, dtype=torch.long)


def solve_low_rank(stats: CalibrationStats, config: FitConfig) -> CompactSolution:
    """Per modality a rank-r projection of all source layers shared by every target layer (config.rank,
    config.projection), its output map solved from the same Gram blocks."""
    src, tgt = stats.source, stats.target
    limit = src.modality_width if config.projection == "pca" else min(src.modality_width, tgt.modality_width)
    if config.rank > limit:
        widths = "the source's K (V) width" if config.projection == "pca" else "the source's or target's K (V) width"
        raise ConfigError(f"rank {config.rank} exceeds what a {config.projection!r} projection of this pair can have "
                          f"({limit}: {widths}); give a smaller rank")
    parts = [_low_rank_modality(stats, m, config) for m in range(len(MODALITIES))]
    projection, weight, bias, residual = (torch.stack(p) for p in zip(*parts, strict=True))
    tensors = {"projection": projection.float(), "weight": weight.float(), "bias": bias.float()}
    layers = list(range(src.num_layers))
    selected = torch.tensor([layers] * tgt.num_layers, dtype=torch.long)
    return CompactSolution("lowrank", tensors, selected, [layers] * tgt.num_layers,
                           head_r2(stats, residual.reshape(-1)),
                           {"rank": config.rank, "projection": config.projection})


def _low_rank_modality(stats: CalibrationStats, modality: int, config: FitConfig):
    """(projection [Ws, r], weight [r, Wt], bias [Wt], residual variance [Wt]) of one modality, float64. The
    projected features z = xᵀP are scaled to unit variance (well within float16's range)."""
    src, tgt = stats.source, stats.target
    idx_x = torch.arange(modality * src.modality_width, (modality + 1) * src.modality_width)
    idx_y = torch.arange(modality * tgt.modality_width, (modality + 1) * tgt.modality_width)
    cov_xx, cov_xy, var_y = stats.cov_xx(idx_x), stats.cov_xy(idx_x, idx_y), stats.var_y(idx_y)
    lam = float(config.ridge_lambda)
    if config.projection == "pca":
        eigenvalues, vectors = torch.linalg.eigh(cov_xx)
        top = eigenvalues.argsort(descending=True)[: config.rank]
        values, basis = eigenvalues[top].clamp_min(1e-30), vectors[:, top]
        shift = lam * cov_xx.diagonal().mean().clamp_min(1e-12)  # the full ridge restricted to the top components
        weight = (basis.T @ cov_xy) / (values + shift)[:, None]
        projection, weight = basis / values.sqrt(), weight * values.sqrt()[:, None]
    else:
        projection, weight = _reduced_rank_ridge(cov_xx, ridge_from_covariance(cov_xx, cov_xy, lam), var_y, tgt,
                                                 config.rank)
    full = projection @ weight
    bias = stats.mean_y(idx_y) - full.T @ stats.mean_x(idx_x)
    return projection, weight, bias, residual_variance(full, cov_xx, cov_xy, var_y)


def _reduced_rank_ridge(cov_xx, ridge, var_y, tgt: FeatureLayout, rank: int):
    """The rank-r map closest to the ridge fit in predicted target variance, each target layer weighted by the
    inverse of its total variance (so each counts by its 1 − R²): with A = ridge·D (D the weights) and any S with
    SᵀS = C_xx, the top right singular vectors U of S·A — the top eigenvectors of Aᵀ·C_xx·A [Wt, Wt], so no
    [Ws, Ws] decomposition is needed — give P = A·U and output map Uᵀ·D⁻¹."""
    layer_variance = var_y.view(tgt.num_layers, -1).sum(-1).clamp_min(1e-30)
    scale = layer_variance.rsqrt().repeat_interleave(tgt.layer_width)  # D
    weighted = ridge * scale  # A [Ws, Wt]
    values, vectors = torch.linalg.eigh(weighted.T @ (cov_xx @ weighted))  # (S·A)ᵀ(S·A) = U σ² Uᵀ
    top = values.argsort(descending=True)[:rank]
    sigma = values[top].clamp_min(1e-30).sqrt()
    directions = vectors[:, top]  # U [Wt, r], orthonormal
    projection = weighted @ directions / sigma  # P·σ⁻¹: unit-variance features
    weight = (directions * sigma).T / scale  # σ·Uᵀ·D⁻¹
    return projection, weight


def solve_compact(stats: CalibrationStats, config: FitConfig, r2_matrix: torch.Tensor) -> CompactSolution:
    """The compact map `config` asks for (see module doc)."""
    if isinstance(config.ridge_lambda, str):
        raise ConfigError(f"compact mappers take one fixed ridge λ, got {config.ridge_lambda!r}")
    if config.rank:
        return solve_low_rank(stats, config)
    return solve_block_mapper(stats, config, r2_matrix)
