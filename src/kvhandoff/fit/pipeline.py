"""Fitting: capture both models on calibration batches → statistics → layer selection → ridge solve → Mapper.

Where the statistics of a whole pair do not fit in memory, the target layers are fitted in blocks
(`layer_block`): one pass over the calibration windows per block of consecutive target layers, each accumulating
only that block's sums, which are solved and dropped before the next pass. Selection and solve of a target layer
read only its own columns of the statistics, so the blocks give the whole path's mapper (to float64 round-off).
The source Gram is summed in the first pass only and shared by the later ones. `estimate_memory` says what a pass
and its solve hold, so a block size can be chosen (`layer_block_for_budget`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from kvhandoff.config import FitConfig
from kvhandoff.errors import ConfigError, StatisticsError
from kvhandoff.fit.compact import solve_compact
from kvhandoff.fit.selection import layer_r2_matrix, resolve_k, select_layers
from kvhandoff.fit.solve import layers_per_solve, solve_layers
from kvhandoff.fit.statistics import CalibrationStats, sum_shapes
from kvhandoff.fit.weighting import RowWeighting, UniformRows, row_weighting
from kvhandoff.mapper.dense import DenseMapper
from kvhandoff.mapper.manifest import MapperManifest
from kvhandoff.mapper.mapper import Mapper, mapper_class
from kvhandoff.model.capture import MODALITIES, ContentKV, FeatureLayout, capture_content_kv, nonfinite_layers
from kvhandoff.model.geometry import check_pair, model_fingerprint, read_geometry
from kvhandoff.progress import Progress, as_progress


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


def layer_blocks(num_layers: int, layer_block: int | None) -> list[range]:
    """Consecutive blocks of at most `layer_block` layers covering `num_layers` (None: one block of all)."""
    if layer_block is None:
        return [range(num_layers)]
    if isinstance(layer_block, bool) or not isinstance(layer_block, int) or layer_block < 1:
        raise ConfigError(f"layer_block must be a positive number of target layers, got {layer_block!r}")
    return [range(start, min(start + layer_block, num_layers)) for start in range(0, num_layers, layer_block)]


def empty_statistics(source_model, target_model, target_layers: range | None = None, source_sums: bool = True,
                     target_gram: bool = False, kv_cross: bool = False) -> CalibrationStats:
    """Zero statistics of the pair's layouts (the target restricted to `target_layers`), to `add_batch` to."""
    target_layout = feature_layout(target_model)
    return CalibrationStats(feature_layout(source_model),
                            target_layout if target_layers is None else target_layout.block(target_layers),
                            source_sums=source_sums, target_gram=target_gram, kv_cross=kv_cross)


def capture_batch(source_model, target_model, input_ids: torch.Tensor, target_layers: range | None = None,
                  weighting: RowWeighting = UniformRows(),  # noqa: B008 - stateless
                  ) -> tuple[ContentKV, ContentKV, torch.Tensor | None]:
    """Both models' forwards over one calibration batch [batch, tokens] with their content K/V captured (the
    target's `target_layers` only; None: all), and the positions' weights under `weighting` (None: uniform; from
    all the target's layers)."""
    if input_ids.dim() != 2:
        raise StatisticsError(f"calibration batches must be [batch, tokens] token ids, got {tuple(input_ids.shape)}")
    source = capture_content_kv(source_model, input_ids)
    target = capture_content_kv(target_model, input_ids, with_queries=weighting.needs_queries)
    weights = weighting.position_weights(target_model, target)
    return source, ContentKV(target.keys, target.values).layers(target_layers), weights


def add_batch(stats: CalibrationStats, source_model, target_model, input_ids: torch.Tensor,
              config: FitConfig = FitConfig(),  # noqa: B008 - frozen, immutable default
              target_layers: range | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One calibration batch [batch, tokens] into `stats` (`capture_batch`, then the kept rows summed, weighted
    as `config.row_weights` says). Returns the rows (`CalibrationStats.update`)."""
    source, target, weights = capture_batch(source_model, target_model, input_ids, target_layers,
                                            row_weighting(config.row_weights))
    return stats.update(source, target, token_stride=config.token_stride, skip_first_tokens=config.skip_first_tokens,
                        position_weights=weights)


def collect_statistics(
    source_model,
    target_model,
    batches: Iterable[torch.Tensor],
    config: FitConfig = FitConfig(),  # noqa: B008 - frozen, immutable default
    progress: Progress | bool = False,
    feature_writer=None,
    target_layers: range | None = None,
    source_sums: bool = True,
    target_gram: bool = False,
    kv_cross: bool | None = None,
) -> CalibrationStats:
    """One pass over calibration batches [batch, tokens]: capture both models, accumulate statistics.

    progress: a bar over the batches (`kvhandoff.progress`).
    feature_writer: a `features.FeatureShardWriter` that also receives every kept row (for the MLP mapper).
    target_layers: accumulate only these (consecutive) target layers' sums; source_sums=False: skip x and xxᵀ
    (a later block's pass, which adopts them from the first: `CalibrationStats.adopt_source_sums`).
    target_gram: sum the target's Gram too, so the statistics serve the reverse direction (`reversed`).
    kv_cross: sum the K–V cross moments (None: when the config's maps read source K and V together).
    """
    kv_cross = config.joint_inputs if kv_cross is None else kv_cross
    stats = empty_statistics(source_model, target_model, target_layers, source_sums, target_gram, kv_cross)
    total = len(batches) if hasattr(batches, "__len__") else None
    desc = "calibration" if target_layers is None else (f"calibration (target layers {target_layers.start}-"
                                                        f"{target_layers.stop - 1})")
    for input_ids in as_progress(progress)(batches, total=total, desc=desc, unit="batch"):
        rows = add_batch(stats, source_model, target_model, input_ids, config, target_layers)
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
    fitted = FittedMaps(stats.source, stats.target, stats.count, plan, selected, solution,
                        time.perf_counter() - started)
    return fitted.mapper(config, source_fingerprint, target_fingerprint, calibration, max_position_embeddings)


@dataclass
class FittedMaps:
    """Everything a ridge mapper is made of: the layouts, the statistics' token count, the plan, the padded
    selection [Lt, k], the solved maps and the seconds the selection and solves took."""

    source: FeatureLayout
    target: FeatureLayout
    count: int
    plan: LayerPlan
    selected: torch.Tensor
    solution: RidgeSolution
    solve_seconds: float = 0.0

    def mapper(self, config: FitConfig, source_fingerprint: dict, target_fingerprint: dict,
               calibration: dict | None, max_position_embeddings: tuple[int, int],
               extra_metrics: dict | None = None) -> Mapper:
        require_finite_solution(self.solution)
        solution, plan = self.solution, self.plan
        r2 = solution.r2
        manifest = MapperManifest(
            method="ridge",
            config=config,
            source_fingerprint=source_fingerprint,
            target_fingerprint=target_fingerprint,
            source_max_position_embeddings=max_position_embeddings[0],
            target_max_position_embeddings=max_position_embeddings[1],
            source_layout=self.source,
            target_layout=self.target,
            selected_layers=self.selected.tolist(),
            source_layers_per_target_layer=plan.source_layers if plan.is_ragged() else None,
            calibration={**(calibration or {}), "tokens_in_statistics": self.count},
            fit_metrics={
                **r2_metrics(r2),
                "ridge_lambda_per_target_layer": {"K": solution.lambdas[0], "V": solution.lambdas[1]},
                "solve_seconds": round(self.solve_seconds, 3),
                **(extra_metrics or {}),
            },
        )
        return DenseMapper(solution.weight, solution.bias, self.selected, manifest).stored()


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
            "calibration rows, not statistics alone; fit it with kvhandoff.fit.heldout.fit_heldout_mapper "
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

    @classmethod
    def empty(cls, source: FeatureLayout, target: FeatureLayout, k: int, blocks: int) -> RidgeSolution:
        """Zero maps of `k` source layers in `blocks` input column blocks (K, or K then V) per target layer."""
        return cls(
            weight=empty_weight(source, target, k, blocks),
            bias=torch.empty(2, target.num_layers, target.layer_width),
            r2=torch.empty(2, target.num_layers, target.num_kv_heads),
            lambdas=[[0.0] * target.num_layers for _ in MODALITIES],
        )


def empty_weight(source: FeatureLayout, target: FeatureLayout, k: int, blocks: int) -> torch.Tensor:
    """Zero maps [2, target layers, blocks·k·Fs, Ft]. When every target layer reads every source layer they are a
    view of the dense layout the mapper computes with (`DenseMapper._lay_out`), which then holds them without a copy."""
    inputs, layers, width = blocks * k * source.layer_width, target.num_layers, target.layer_width
    if k != source.num_layers:
        return torch.zeros(2, layers, inputs, width)
    if blocks == 2:  # each map reads K and V: [inputs, K|V, target layers, Ft]
        return torch.zeros(inputs, 2, layers, width).permute(1, 2, 0, 3)
    return torch.zeros(2, inputs, layers, width).permute(0, 2, 1, 3)


def solve_plan(stats: CalibrationStats, config: FitConfig, plan: LayerPlan, selected: torch.Tensor,
               solution: RidgeSolution | None = None, first_layer: int = 0) -> RidgeSolution:
    """Solve every (K|V, target layer) map of ``plan``; ``selected`` [Lt, k]: the padded layout (padding source
    layers keep zero weights). solution: write into these maps (of the whole target) from target layer
    `first_layer` on, when `stats` cover a block of target layers starting there."""
    tgt, width = stats.target, stats.source.layer_width
    k = selected.shape[1]
    blocks = len(config.input_modalities(0))  # input column blocks (K, or K then V) of k source layers each
    if solution is None:
        solution = RidgeSolution.empty(stats.source, tgt, k, blocks)
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
                rows, at = selected[layer].tolist(), first_layer + layer
                for block in range(blocks):
                    for i, source_layer in enumerate(source_layers):
                        p = block * k + rows.index(source_layer)
                        q = block * len(source_layers) + i
                        solution.weight[modality, at, p * width : (p + 1) * width] = w[q * width : (q + 1) * width]
                solution.bias[modality, at], solution.r2[modality, at] = b, layer_r2
                solution.lambdas[modality][at] = lam
    return solution


#: a pass over the calibration windows for one block of target layers: (target layers, whether to sum the source
#: Gram) → that block's statistics
BlockPass = Callable[[range, bool], CalibrationStats]


def fit_in_blocks(collect: BlockPass, source: FeatureLayout, target: FeatureLayout, config: FitConfig,
                  layer_block: int) -> FittedMaps:
    """The maps of every target layer, one block of `layer_block` target layers at a time: `collect` runs a pass
    for the block, its maps are selected and solved, and its statistics dropped before the next pass. The first
    pass sums the source Gram, which the later ones adopt (they sum only what involves the target)."""
    if config.top_k == "heldout":
        raise ConfigError("top_k='heldout' chooses on held-out rows of the whole target; fit it without layer blocks")
    k = resolve_k(config.top_k, source.num_layers)
    solution = RidgeSolution.empty(source, target, k, len(config.input_modalities(0)))
    source_layers: list[list[int]] = []
    lambdas: list[list] = [[], []]
    selected, shared, count, solve_seconds = [], None, 0, 0.0
    for layers in layer_blocks(target.num_layers, layer_block):
        stats = collect(layers, shared is None)
        started = time.perf_counter()
        if shared is None:
            shared = stats.source_only()
        else:
            stats.adopt_source_sums(shared)
        r2_matrix = layer_r2_matrix(stats, config.probe_lambda)
        plan = default_plan(r2_matrix, config)
        selected.append(plan.padded(r2_matrix))
        solve_plan(stats, config, plan, selected[-1], solution, first_layer=layers.start)
        source_layers += plan.source_layers
        lambdas = [lambdas[m] + plan.lambdas[m] for m in range(len(MODALITIES))]
        count, solve_seconds = stats.count, solve_seconds + time.perf_counter() - started
        del stats  # the next pass allocates its own block's sums
    return FittedMaps(source, target, count, LayerPlan(source_layers, lambdas), torch.cat(selected), solution,
                      solve_seconds)


def blocked_metrics(target: FeatureLayout, layer_block: int) -> dict:
    """What the manifest records of a fit in blocks (`fit_in_blocks`)."""
    blocks = layer_blocks(target.num_layers, layer_block)
    return {"layer_block": layer_block, "statistics_passes": len(blocks),
            "target_layer_blocks": [[layers.start, layers.stop - 1] for layers in blocks]}


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
    progress: Progress | bool = False,
    layer_block: int | None = None,
) -> Mapper:
    """Fit a content-space ridge mapper from `source_model`'s KV cache to `target_model`'s.

    batches: iterable of token-id tensors [batch, tokens] from the shared tokenizer (a sequence or another
    re-iterable with `layer_block`: it is read once per block).
    calibration: a description of the calibration data, stored in the manifest.
    layer_block: fit the target layers in blocks of this many, one pass over `batches` each, so the statistics
    held at once are one block's (`estimate_memory`); the mapper equals the whole pass's to round-off.
    progress: a bar over each pass (`kvhandoff.progress`).
    """
    check_pair(source_model, target_model, source_tokenizer, target_tokenizer)
    fingerprints = model_fingerprint(source_model, source_tokenizer), model_fingerprint(target_model, target_tokenizer)
    positions = source_model.config.max_position_embeddings, target_model.config.max_position_embeddings
    started = time.perf_counter()
    if layer_block is not None:
        if iter(batches) is batches:
            raise ConfigError("a fit in layer blocks reads the calibration batches once per block: give a list (or "
                              "another re-iterable), not an iterator")
        target = feature_layout(target_model)
        fitted = fit_in_blocks(lambda layers, source_sums: collect_statistics(
            source_model, target_model, batches, config, progress, target_layers=layers, source_sums=source_sums),
            feature_layout(source_model), target, config, layer_block)
        seconds = time.perf_counter() - started - fitted.solve_seconds
        return fitted.mapper(config, *fingerprints, calibration, positions,
                             {**blocked_metrics(target, layer_block), "collect_seconds": round(seconds, 3)})
    stats = collect_statistics(source_model, target_model, batches, config, progress)
    collect_seconds = time.perf_counter() - started
    mapper = mapper_from_statistics(stats, config, *fingerprints, calibration, max_position_embeddings=positions)
    mapper.manifest = mapper.manifest.with_metrics(collect_seconds=round(collect_seconds, 3))
    return mapper


# -- memory ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a ridge fit holds besides the models, from the tensors' shapes: the float64 sums of one pass (every
    process of a distributed run holds one copy), the working set of the largest solve and the float32 maps
    (both on rank 0 only, after the pass). The solve's working set counts the copies the code makes (the input
    covariance and the Cholesky factor that overwrites its regularised copy; the cross-covariance, solved columns
    and residual terms of the few target layers solved at once, `solve.layers_per_solve`) for a fixed λ; λ='gcv'
    adds an eigendecomposition of the same size."""

    statistics_bytes: int
    solve_bytes: int
    mapper_bytes: int

    @property
    def peak_bytes(self) -> int:
        """What rank 0 (the one process of a one-process fit) holds at the end of a pass: all three."""
        return self.statistics_bytes + self.solve_bytes + self.mapper_bytes

    def to_dict(self) -> dict:
        return {"statistics_bytes": self.statistics_bytes, "solve_bytes": self.solve_bytes,
                "mapper_bytes": self.mapper_bytes, "peak_bytes": self.peak_bytes}


def estimate_memory(source: FeatureLayout, target: FeatureLayout,
                    config: FitConfig = FitConfig(),  # noqa: B008 - frozen
                    layer_block: int | None = None, target_gram: bool = False) -> MemoryEstimate:
    """What a fit of this geometry holds (`MemoryEstimate`) with the target fitted in blocks of `layer_block`
    layers (None: all at once). k is the config's (top_k 'heldout' counts as all source layers); the K–V cross
    moments are summed when its maps read source K and V together. target_gram: the pass sums the target's Gram too
    (statistics for both directions, `CalibrationStats`)."""
    layers = min(layer_block or target.num_layers, target.num_layers)
    block = target.block(range(layers))
    shapes = sum_shapes(source, block, target_gram=target_gram, kv_cross=config.joint_inputs)
    statistics = 8 * sum(math.prod(shape) for shape in shapes.values())
    k = source.num_layers if config.top_k == "heldout" else resolve_k(config.top_k, source.num_layers)
    inputs = k * source.layer_width * len(config.input_modalities(0))
    columns = layers_per_solve(inputs, target.layer_width) * target.layer_width
    solve = 8 * (2 * inputs * inputs + 6 * inputs * columns)
    mapper = 4 * len(MODALITIES) * target.num_layers * (inputs + 1) * target.layer_width
    return MemoryEstimate(statistics, solve, mapper)


def layer_block_for_budget(source: FeatureLayout, target: FeatureLayout, budget_bytes: int,
                           config: FitConfig = FitConfig()) -> int | None:  # noqa: B008 - frozen
    """The largest block of target layers whose fit stays within `budget_bytes` (`estimate_memory(...).peak_bytes`;
    the models not counted); None when the whole target fits in one pass. ConfigError when not even one target
    layer per pass fits (the source Gram, which every pass holds, is the floor)."""
    if estimate_memory(source, target, config).peak_bytes <= budget_bytes:
        return None
    fitting = [b for b in range(1, target.num_layers) if estimate_memory(source, target, config, b).peak_bytes
               <= budget_bytes]
    if not fitting:
        floor = estimate_memory(source, target, config, 1).peak_bytes
        raise ConfigError(f"a statistics memory of {budget_bytes / 2**30:.1f} GiB is too small for this pair: even one "
                          f"target layer per pass needs {floor / 2**30:.1f} GiB (the source Gram is held in every "
                          "pass); give more, or a smaller top_k")
    return fitting[-1]
