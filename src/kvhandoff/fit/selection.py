"""Top-k cross-layer selection from single-source R² probes.

For each (source layer s, target layer t) a ridge probe maps all KV heads of s to each KV head of t,
separately for content-space K and V; R² is averaged over target heads. Ranking uses the mean of K and V.
Everything comes from the same statistics, so any k costs no further pass over data.
"""

from __future__ import annotations

import torch

from kvhandoff.config import require_positive
from kvhandoff.errors import ConfigError
from kvhandoff.fit.solve import residual_variance, ridge_from_covariance
from kvhandoff.fit.statistics import CalibrationStats
from kvhandoff.model.capture import MODALITIES


def layer_r2_matrix(stats: CalibrationStats, ridge_lambda: float = 0.01) -> torch.Tensor:
    """R² [modality (K, V), target_layer, source_layer], each averaged over the target layer's KV heads."""
    src, tgt = stats.source, stats.target
    r2 = torch.zeros(len(MODALITIES), tgt.num_layers, src.num_layers, dtype=torch.float64)
    for modality in range(len(MODALITIES)):
        idx_y = slice(modality * tgt.modality_width, (modality + 1) * tgt.modality_width)
        var_y = stats.var_y(idx_y)
        head_var = var_y.view(tgt.num_layers, tgt.num_kv_heads, -1).sum(-1)
        for source_layer in range(src.num_layers):
            idx_x = src.layer_slice(modality, source_layer)
            cov_xx, cov_xy = stats.cov_xx(idx_x), stats.cov_xy(idx_x, idx_y)
            weight = ridge_from_covariance(cov_xx, cov_xy, ridge_lambda)
            resid = residual_variance(weight, cov_xx, cov_xy, var_y)
            head_resid = resid.view(tgt.num_layers, tgt.num_kv_heads, -1).sum(-1)
            r2[modality, :, source_layer] = (1 - head_resid / head_var.clamp_min(1e-30)).mean(-1)
    return r2


def resolve_k(top_k: int | str, num_source_layers: int) -> int:
    if top_k == "all":
        return num_source_layers
    require_positive("top_k", top_k)
    return min(top_k, num_source_layers)


def parse_ks(text: str, option: str = "--ks") -> list[int | str]:
    """'1,4,all' → [1, 4, 'all']; anything but positive integers and 'all', or nothing at all, is an error
    naming `option`."""
    ks: list[int | str] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if part == "all":
            ks.append(part)
            continue
        try:
            value: int | str = int(part)
        except ValueError:
            value = part
        try:
            require_positive(option, value)
        except ConfigError as exc:
            raise ConfigError(f"{option} takes positive integers or 'all', got {part!r}") from exc
        ks.append(value)
    if not ks:
        raise ConfigError(f"{option} is empty; give e.g. 1,4,all")
    return ks


def select_layers(r2: torch.Tensor, top_k: int | str) -> torch.Tensor:
    """Indices [target_layers, k] of the k source layers with the best mean (K, V) R², in ascending layer order."""
    score = r2.mean(0)  # [target, source]
    k = resolve_k(top_k, score.shape[1])
    best = score.topk(k, dim=1).indices
    return best.sort(dim=1).values
