"""Choosing k per target layer and λ per (K|V, target layer) on held-out calibration windows
(`top_k="heldout"`, `ridge_lambda="heldout"`).

One global k and λ suit some target layers and not others, and in-sample R² always prefers more inputs. Here
a share of the calibration windows is held out: its statistics (from the rows kept on disk, `features.py`)
are removed from the pass's, every candidate (HELDOUT_KS × HELDOUT_LAMBDAS) is solved on the rest and scored
by its squared error on the held-out rows relative to each output's variance (1 − R²). Each target layer takes
the k whose error, averaged over its K and V maps at each map's best λ, is lowest; each map then takes its best
λ at that k. The final maps are solved on all windows with those choices (`fit.LayerPlan`).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from kvhandoff.config import HELDOUT_FRACTION, HELDOUT_KS, HELDOUT_LAMBDAS, FitConfig
from kvhandoff.errors import ConfigError
from kvhandoff.fit.features import check_layouts, load_features, read_manifest, validation_shards
from kvhandoff.fit.pipeline import LayerPlan, mapper_from_statistics
from kvhandoff.fit.selection import layer_r2_matrix, resolve_k, select_layers
from kvhandoff.fit.statistics import CalibrationStats
from kvhandoff.mapper.mapper import Mapper
from kvhandoff.model.capture import MODALITIES


def split_heldout(
    stats: CalibrationStats, features: str | Path, reverse: bool = False, fraction: float = HELDOUT_FRACTION,
    seed: int = 0,
) -> tuple[CalibrationStats, torch.Tensor, torch.Tensor, list[int]]:
    """(statistics without the held-out windows, held-out x rows, held-out y rows, held-out window indices)."""
    manifest = read_manifest(features)
    check_layouts(features, manifest, reverse, stats.source, stats.target)
    windows = validation_shards(len(manifest["shards"]), fraction, seed)
    x, y, _ = load_features(features, shards=windows.tolist())
    if reverse:
        x, y = y, x
    held_out = CalibrationStats.from_rows(stats.source, stats.target, x, y)
    return stats.without(held_out), x, y, sorted(windows.tolist())


def heldout_losses(
    train: CalibrationStats, x: torch.Tensor, y: torch.Tensor, ks=HELDOUT_KS, lambdas=HELDOUT_LAMBDAS,
    r2_matrix: torch.Tensor | None = None,
) -> torch.Tensor:
    """Held-out error [k, λ, K|V, target layer] of each candidate solved on `train`, in units of each
    (K|V, target layer) output block's held-out variance."""
    tgt = train.target
    if r2_matrix is None:
        r2_matrix = layer_r2_matrix(train)
    variance = y.var(0).view(len(MODALITIES), tgt.num_layers, -1).sum(-1).clamp_min(1e-12)
    losses = torch.empty(len(ks), len(lambdas), len(MODALITIES), tgt.num_layers)
    for i, k in enumerate(ks):
        for j, ridge_lambda in enumerate(lambdas):
            mapper = mapper_from_statistics(train, FitConfig(top_k=k, ridge_lambda=ridge_lambda), {}, {},
                                            r2_matrix=r2_matrix)
            error = (mapper.map_feature_rows(x) - y).pow(2).mean(0)
            losses[i, j] = error.view(len(MODALITIES), tgt.num_layers, -1).sum(-1) / variance
    return losses


def choose_plan(losses: torch.Tensor, r2_matrix: torch.Tensor, ks=HELDOUT_KS, lambdas=HELDOUT_LAMBDAS):
    """The per-layer choice from `heldout_losses` as a LayerPlan (source layers ranked by `r2_matrix`), plus
    the chosen k per target layer and the held-out loss of the choice [K|V, target layer]."""
    best_over_lambda, best_lambda = losses.min(dim=1)  # [k, modality, layer]
    k_index = best_over_lambda.mean(1).argmin(0)  # [layer]
    num_source = r2_matrix.shape[2]
    chosen_k = [resolve_k(ks[int(i)], num_source) for i in k_index]
    source_layers = [select_layers(r2_matrix, k)[layer].tolist() for layer, k in enumerate(chosen_k)]
    layer_index = torch.arange(losses.shape[3])
    lambda_index = best_lambda[k_index, :, layer_index]  # [layer, modality]
    plan_lambdas = [[float(lambdas[int(lambda_index[layer, m])]) for layer in layer_index] for m in range(2)]
    chosen_loss = best_over_lambda[k_index, :, layer_index].T  # [modality, layer]
    return LayerPlan(source_layers, plan_lambdas), chosen_k, chosen_loss


def fit_heldout_mapper(
    stats: CalibrationStats,
    features: str | Path,
    config: FitConfig,
    source_fingerprint: dict,
    target_fingerprint: dict,
    calibration: dict | None = None,
    max_position_embeddings: tuple[int, int] = (32768, 32768),
    reverse: bool = False,
    seed: int = 0,
    r2_matrix: torch.Tensor | None = None,
) -> Mapper:
    """A ridge mapper with k per target layer and λ per map chosen on held-out windows (see module doc).
    r2_matrix: `layer_r2_matrix(stats, config.probe_lambda)` when the caller has it already."""
    if config.top_k != "heldout":
        raise ConfigError(f"fit_heldout_mapper is for top_k='heldout', got {config.top_k!r}")
    started = time.perf_counter()
    train, x, y, windows = split_heldout(stats, features, reverse, HELDOUT_FRACTION, seed)
    train_r2 = layer_r2_matrix(train, config.probe_lambda)
    losses = heldout_losses(train, x, y, HELDOUT_KS, HELDOUT_LAMBDAS, train_r2)
    full_r2 = layer_r2_matrix(stats, config.probe_lambda) if r2_matrix is None else r2_matrix
    plan, chosen_k, chosen_loss = choose_plan(losses, full_r2)
    mapper = mapper_from_statistics(stats, config, source_fingerprint, target_fingerprint, calibration,
                                    max_position_embeddings, r2_matrix=full_r2, plan=plan)
    mapper.manifest = mapper.manifest.with_metrics(heldout_choice={
        "candidates": {"k": [str(k) for k in HELDOUT_KS], "lambda": list(HELDOUT_LAMBDAS)},
        "heldout_windows": windows, "heldout_rows": int(x.shape[0]),
        "k_per_target_layer": chosen_k,
        "heldout_loss_chosen": {"K": chosen_loss[0].tolist(), "V": chosen_loss[1].tolist()},
        "heldout_loss_table": losses.tolist(),
        "choose_seconds": round(time.perf_counter() - started, 1),
    })
    return mapper
