"""Fitting: capture both models on calibration batches → statistics → layer selection → ridge solve → Mapper."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from kvhandoff.capture import capture_content_kv, nonfinite_layers
from kvhandoff.compact import solve_compact
from kvhandoff.config import FitConfig
from kvhandoff.errors import ConfigError, StatisticsError
from kvhandoff.geometry import check_pair, model_fingerprint, read_geometry
from kvhandoff.manifest import MapperManifest
from kvhandoff.mapper import Mapper, mapper_class
from kvhandoff.selection import layer_r2_matrix, select_layers
from kvhandoff.solve import solve_layers
from kvhandoff.statistics import MODALITIES, CalibrationStats, FeatureLayout


@dataclass(frozen=True)
class LayerPlan:
    """What each target layer's maps read: source layers per target layer (ascending; their number may differ
    between layers) and λ per (K|V, target layer) (a float or "gcv")."""

    source_layers: list[list[int]]
    lambdas: list[list[float | str]]

    def is_ragged(self) -> bool:
        return len({len(layers) for layers in self.source_layers}) > 1

    def padded(self, r2_matrix: torch.Tensor) -> torch.Tensor:
        """[target layers, k_max] selection for the mapper: layers reading fewer than k_max source layers are
        padded with their next-best ones (by probe R²), which get zero weights, so one batched GEMM applies all."""
        k_max = max(len(layers) for layers in self.source_layers)
        score = r2_matrix.mean(0)
        rows = []
        for target_layer, layers in enumerate(self.source_layers):
            extra = [int(i) for i in score[target_layer].argsort(descending=True) if int(i) not in layers]
            rows.append(sorted([*layers, *extra[: k_max - len(layers)]]))
        return torch.tensor(rows, dtype=torch.long)


def feature_layout(model) -> FeatureLayout:
    geometry = read_geometry(model)
    return FeatureLayout(geometry.num_layers, geometry.num_kv_heads, geometry.head_dim)


def collect_statistics(
    source_model,
    target_model,
    batches: Iterable[torch.Tensor],
    config: FitConfig = FitConfig(),  # noqa: B008 - frozen, immutable default
    progress: bool = True,
    feature_writer=None,
) -> CalibrationStats:
    """One pass over calibration batches [batch, tokens]: capture both models, accumulate statistics.

    feature_writer: a `features.FeatureShardWriter` that also receives every kept row (for the MLP mapper).
    """
    stats = CalibrationStats(feature_layout(source_model), feature_layout(target_model))
    total = len(batches) if hasattr(batches, "__len__") else None
    for input_ids in tqdm(batches, total=total, desc="calibration", unit="batch", disable=not progress):
        if input_ids.dim() != 2:
            raise StatisticsError(
                f"calibration batches must be [batch, tokens] token ids, got {tuple(input_ids.shape)}"
            )
        rows = stats.update(
            capture_content_kv(source_model, input_ids),
            capture_content_kv(target_model, input_ids),
            token_stride=config.token_stride,
            skip_first_tokens=config.skip_first_tokens,
        )
        if feature_writer is not None:
            feature_writer.append(*rows)
    return stats


def mapper_from_statistics(
    stats: CalibrationStats,
    config: FitConfig,
    source_fingerprint: dict,
    target_fingerprint: dict,
    calibration: dict | None = None,
    max_position_embeddings: tuple[int, int] = (32768, 32768),
    r2_matrix: torch.Tensor | None = None,
    plan: LayerPlan | None = None,
) -> Mapper:
    """Select layers and solve the ridge maps from existing statistics (any k, no pass over data).

    plan: source layers per target layer and λ per (K|V, target layer) chosen elsewhere (`heldout.py`);
    required for config top_k="heldout", which statistics alone cannot decide.
    """
    started = time.perf_counter()
    if r2_matrix is None:
        r2_matrix = layer_r2_matrix(stats, config.probe_lambda)
    if config.compact:
        if plan is not None:
            raise ConfigError("a compact mapper chooses its own layers; it takes no LayerPlan")
        return compact_mapper(stats, config, (source_fingerprint, target_fingerprint), calibration,
                              max_position_embeddings, r2_matrix, started)
    if plan is None:
        plan = default_plan(r2_matrix, config)
    selected = plan.padded(r2_matrix)
    solution = solve_plan(stats, config, plan, selected)
    require_finite_solution(solution)
    r2 = solution.r2
    manifest = MapperManifest(
        method="ridge",
        config=config,
        source_fingerprint=source_fingerprint,
        target_fingerprint=target_fingerprint,
        source_max_position_embeddings=max_position_embeddings[0],
        target_max_position_embeddings=max_position_embeddings[1],
        source_layout=stats.source,
        target_layout=stats.target,
        selected_layers=selected.tolist(),
        source_layers_per_target_layer=plan.source_layers if plan.is_ragged() else None,
        calibration={**(calibration or {}), "tokens_in_statistics": stats.count},
        fit_metrics={**r2_metrics(r2),
                     "ridge_lambda_per_target_layer": {"K": solution.lambdas[0], "V": solution.lambdas[1]},
                     "solve_seconds": round(time.perf_counter() - started, 3)},
    )
    return Mapper(solution.weight, solution.bias, selected, manifest).stored()


def r2_metrics(r2: torch.Tensor) -> dict:
    """The manifest's in-sample R² entries from R² [K|V, target layer, KV head]."""
    return {
        "r2_k_per_target_layer": r2[0].mean(-1).tolist(),
        "r2_v_per_target_layer": r2[1].mean(-1).tolist(),
        "r2_k_mean": float(r2[0].mean()),
        "r2_v_mean": float(r2[1].mean()),
        "r2_per_head": {"K": r2[0].tolist(), "V": r2[1].tolist()},
    }


def compact_mapper(stats: CalibrationStats, config: FitConfig, fingerprints: tuple[dict, dict],
                   calibration: dict | None, max_position_embeddings: tuple[int, int], r2_matrix: torch.Tensor,
                   started: float) -> Mapper:
    """The compact mapper of `config` (`compact.solve_compact`), with its manifest."""
    solution = solve_compact(stats, config, r2_matrix)
    ragged = len({len(layers) for layers in solution.source_layers}) > 1
    manifest = MapperManifest(
        method=solution.method, config=config, source_fingerprint=fingerprints[0],
        target_fingerprint=fingerprints[1], source_max_position_embeddings=max_position_embeddings[0],
        target_max_position_embeddings=max_position_embeddings[1], source_layout=stats.source,
        target_layout=stats.target, selected_layers=solution.selected.tolist(),
        source_layers_per_target_layer=solution.source_layers if ragged else None,
        calibration={**(calibration or {}), "tokens_in_statistics": stats.count},
        fit_metrics={**r2_metrics(solution.r2), "compact": solution.record,
                     "ridge_lambda_per_target_layer": {m: [float(config.ridge_lambda)] * stats.target.num_layers
                                                       for m in MODALITIES},
                     "solve_seconds": round(time.perf_counter() - started, 3)},
    )
    tensors = {**solution.tensors, "selected": solution.selected}
    return mapper_class(solution.method).from_tensors(tensors, manifest).stored()


def default_plan(r2_matrix: torch.Tensor, config: FitConfig) -> LayerPlan:
    """The plan statistics alone decide: the config's k best source layers per target layer, its one λ."""
    if config.top_k == "heldout":
        raise ConfigError(
            "top_k='heldout' chooses k per target layer on held-out calibration windows: it needs the "
            "calibration rows, not statistics alone; fit it with kvhandoff.heldout.fit_heldout_mapper "
            "(or `kvhandoff fit --top-k heldout`)"
        )
    selected = select_layers(r2_matrix, config.top_k)
    return LayerPlan([row.tolist() for row in selected], [[config.ridge_lambda] * len(selected)] * 2)


@dataclass
class RidgeSolution:
    """Solved maps in the mapper's layout: weight [2, Lt, blocks·k·Fs, Ft], bias [2, Lt, Ft], R² per
    (K|V, target layer, KV head) and the λ used per (K|V, target layer)."""

    weight: torch.Tensor
    bias: torch.Tensor
    r2: torch.Tensor
    lambdas: list[list[float]]


def solve_plan(stats: CalibrationStats, config: FitConfig, plan: LayerPlan, selected: torch.Tensor) -> RidgeSolution:
    """Solve every (K|V, target layer) map of ``plan``; ``selected`` [Lt, k]: the padded layout (padding source
    layers keep zero weights)."""
    tgt, width = stats.target, stats.source.layer_width
    k = selected.shape[1]
    blocks = len(config.input_modalities(0))  # input column blocks (K, or K then V) of k source layers each
    solution = RidgeSolution(
        weight=torch.zeros(2, tgt.num_layers, blocks * k * width, tgt.layer_width),
        bias=torch.empty(2, tgt.num_layers, tgt.layer_width),
        r2=torch.empty(2, tgt.num_layers, tgt.num_kv_heads),
        lambdas=[[0.0] * tgt.num_layers for _ in MODALITIES],
    )
    for modality in range(len(MODALITIES)):
        # target layers reading the same source layers with the same λ share one factorisation
        readers: dict[tuple, list[int]] = {}
        for layer in range(tgt.num_layers):
            key = (tuple(plan.source_layers[layer]), plan.lambdas[modality][layer])
            readers.setdefault(key, []).append(layer)
        for (source_layers, ridge_lambda), target_layers in readers.items():
            solved = solve_layers(stats, modality, target_layers, list(source_layers), ridge_lambda,
                                  config.input_modalities(modality))
            for layer, (w, b, layer_r2, lam) in zip(target_layers, solved, strict=True):
                rows = selected[layer].tolist()
                for block in range(blocks):
                    for i, source_layer in enumerate(source_layers):
                        p = block * k + rows.index(source_layer)
                        q = block * len(source_layers) + i
                        solution.weight[modality, layer, p * width : (p + 1) * width] = w[q * width : (q + 1) * width]
                solution.bias[modality, layer], solution.r2[modality, layer] = b, layer_r2
                solution.lambdas[modality][layer] = lam
    return solution


def require_finite_solution(solution: RidgeSolution) -> None:
    """StatisticsError naming the (K|V, target layer) maps whose solved weights hold NaN/Inf."""
    bad = [
        f"{name} of target layer {layer}"
        for m, name in enumerate(MODALITIES)
        for layer in sorted({*nonfinite_layers(solution.weight[m], 0), *nonfinite_layers(solution.bias[m], 0)})
    ]
    if bad:
        raise StatisticsError(
            f"the ridge solve gave NaN/Inf weights for {', '.join(bad)}: the calibration statistics hold NaN/Inf or "
            "are degenerate; re-collect them (or raise ridge_lambda)"
        )


def fit_mapper(
    source_model,
    target_model,
    batches: Iterable[torch.Tensor],
    config: FitConfig = FitConfig(),  # noqa: B008 - frozen, immutable default
    source_tokenizer=None,
    target_tokenizer=None,
    calibration: dict | None = None,
    progress: bool = True,
) -> Mapper:
    """Fit a content-space ridge mapper from `source_model`'s KV cache to `target_model`'s.

    batches: iterable of token-id tensors [batch, tokens] from the shared tokenizer.
    calibration: a description of the calibration data, stored in the manifest.
    """
    check_pair(source_model, target_model, source_tokenizer, target_tokenizer)
    started = time.perf_counter()
    stats = collect_statistics(source_model, target_model, batches, config, progress)
    collect_seconds = time.perf_counter() - started
    mapper = mapper_from_statistics(
        stats,
        config,
        model_fingerprint(source_model, source_tokenizer),
        model_fingerprint(target_model, target_tokenizer),
        calibration,
        max_position_embeddings=(
            source_model.config.max_position_embeddings,
            target_model.config.max_position_embeddings,
        ),
    )
    mapper.manifest = mapper.manifest.with_metrics(collect_seconds=round(collect_seconds, 3))
    return mapper
