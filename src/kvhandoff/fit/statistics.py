"""Streaming sufficient statistics for every later choice (layer selection, any k, the ridge solve).

Accumulated in float64: the centred covariance is formed as Gram/n − μμᵀ at solve time, and Qwen-style
k_proj biases give keys means far larger than their spread, so float32 sums would cancel catastrophically.
float64 keeps ~10 significant digits after that subtraction and makes shard merging a plain addition.

Feature layout (one row per kept token):
  source x = [K of every source layer, V of every source layer], each layer = all KV heads × head_dim
  target y = likewise for the target.
Memory is O(features²), independent of the number of calibration tokens. What is summed is what the maps read:

- x, y and Σy² (the target's variances, `sum_y_squared`);
- the second moments xxᵀ and xyᵀ per pair of modalities, K with K and V with V: a K map reads source K, a V map
  source V (`FitConfig.source_inputs` "own", the default), and layer selection probes each modality on its own;
- with `kv_cross`, the K–V cross blocks too (xxᵀ K·V, xyᵀ K·V and V·K), which maps that read source K and V
  together need (source_inputs "kv");
- with `target_gram`, the target's Gram yyᵀ (its K·K and V·V blocks, and K·V with `kv_cross`): the input
  covariance of the reverse direction, so that the same pass gives its statistics (`reversed()`).

The optional blocks multiply the memory and the work per row several times over, so a pass sums them only when
asked (`sums.sum_shapes` gives the shapes; `pipeline.estimate_memory` the bytes). A file holding the whole
matrices (not kept per modality pair) loads into any of these forms (`load`, `statistics_file`: the blocks asked
for, the variances from the Gram's diagonal), so it gives the same maps.
Where the sums of a big pair do not fit, statistics may cover a block of consecutive target layers only
(`FeatureLayout.block`, `CalibrationStats.for_target_layers`): every map of a target layer reads only its own
layer's columns, so the blocks' solves together give the whole mapper (`pipeline.fit_in_blocks`).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from kvhandoff.errors import StatisticsError
from kvhandoff.fit import statistics_file
from kvhandoff.fit.sums import (
    MOMENTS,
    ROW_CHUNK,
    SumsContent,
    as_count,
    missing_moment,
    moment_blocks,
    moment_name,
    sum_shapes,
)
from kvhandoff.model.capture import MODALITIES, ContentKV, FeatureLayout, all_finite, nonfinite_layers


def require_finite_content(side: str, content: ContentKV) -> None:
    """StatisticsError naming the layer(s) whose captured K or V holds NaN/Inf (they would poison every sum)."""
    for name, tensor in (("K", content.keys), ("V", content.values)):
        if not all_finite(tensor):
            raise StatisticsError(
                f"the {side} model's calibration {name} activations hold NaN/Inf in layer(s) "
                f"{nonfinite_layers(tensor, dim=0)}: run the calibration in float32 (or bfloat16) and check the "
                "model's weights"
            )


class CalibrationStats:
    """Sums of x, y, Σy² and the second moments xxᵀ and xyᵀ per modality pair over calibration tokens, in float64
    (module docstring); `kv_cross`: with the K–V cross blocks, `target_gram`: with the target's Gram yyᵀ.

    source_sums=False: x and xxᵀ are not summed (empty until `adopt_source_sums` takes them from another pass over
    the same tokens): a pass over a further block of target layers needs only the sums that involve y."""

    def __init__(self, source: FeatureLayout, target: FeatureLayout, source_sums: bool = True,
                 target_gram: bool = False, kv_cross: bool = False):
        shapes = sum_shapes(source, target, source_sums, target_gram, kv_cross)
        self._hold(source, target, 0, {name: torch.zeros(shape, dtype=torch.float64)
                                       for name, shape in shapes.items()}, kv_cross)

    def _hold(self, source: FeatureLayout, target: FeatureLayout, count: int, tensors: dict,
              kv_cross: bool) -> None:
        """Hold `tensors` (named as `sum_shapes` names them; no copy) as the statistics of `count` tokens."""
        self.source, self.target, self.count, self.kv_cross = source, target, count, kv_cross
        self.source_sums = "sum_x" in tensors
        self.target_gram = moment_name("yy", 0, 0) in tensors
        # x is empty until adopted from the pass that summed it (`adopt_source_sums`)
        self.sum_x = tensors.get("sum_x", torch.zeros(0, dtype=torch.float64))
        self.sum_y, self.sum_y_squared = tensors["sum_y"], tensors["sum_y_squared"]
        self.moments = {(kind, a, b): tensors[moment_name(kind, a, b)] for kind in MOMENTS
                        for a, b in moment_blocks(kind, kv_cross) if moment_name(kind, a, b) in tensors}

    @classmethod
    def holding(cls, source: FeatureLayout, target: FeatureLayout, count: int, tensors: dict,
                kv_cross: bool = False) -> CalibrationStats:
        """Statistics made of existing sum tensors (no copy), named and shaped as `sum_shapes` says (trusted)."""
        stats = cls.__new__(cls)
        stats._hold(source, target, count, tensors, kv_cross)
        return stats

    @property
    def content(self) -> SumsContent:
        return SumsContent(self.target_gram, self.kv_cross)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The sums by name, in `sum_shapes` order."""
        held = {"sum_x": self.sum_x, "sum_y": self.sum_y, "sum_y_squared": self.sum_y_squared,
                **{moment_name(*key): tensor for key, tensor in self.moments.items()}}
        names = sum_shapes(self.source, self.target, self.source_sums, self.target_gram, self.kv_cross)
        return {name: held[name] for name in names}

    def names(self) -> list[str]:
        return list(self.tensors())

    def sums(self) -> list[torch.Tensor]:
        """The float64 sum tensors themselves (`names()` order; without x and xxᵀ when they are not summed here),
        e.g. for a collective to add up in place."""
        return list(self.tensors().values())

    def block(self, kind: str, a: int, b: int) -> torch.Tensor:
        """Moment `kind`'s block of modalities (a, b) (a transposed view for the symmetric ones' V·K)."""
        if (kind, a, b) in self.moments:
            return self.moments[kind, a, b]
        if kind != "xy" and (kind, b, a) in self.moments:
            return self.moments[kind, b, a].T
        raise StatisticsError(missing_moment(kind, a, b, self.source_sums))

    # -- accumulation -----------------------------------------------------------------------------
    def update(
        self, source: ContentKV, target: ContentKV, token_stride: int = 4, skip_first_tokens: int = 0,
        position_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add one batch. Both captures must cover the same token ids; every `token_stride`-th position is kept,
        weighted by `position_weights` [batch, tokens] where given (`add_rows`).
        Returns the rows added (x [n, source width], y [n, target width], float64)."""
        tokens = source.num_tokens
        if target.num_tokens != tokens or source.keys.shape[1] != target.keys.shape[1]:
            raise StatisticsError(
                f"source and target captures differ in shape ({tuple(source.keys.shape)} vs "
                f"{tuple(target.keys.shape)}): feed both models the same token batch"
            )
        for side, content in (("source", source), ("target", target)):
            require_finite_content(side, content)
        positions = torch.arange(skip_first_tokens, tokens, token_stride)
        x = self.source.flatten(source, positions)
        y = self.target.flatten(target, positions)
        weights = None if position_weights is None else position_weights[:, positions].reshape(-1).double().cpu()
        self.add_rows(x, y, weights)
        return x, y

    def add_rows(self, x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Add feature rows x [n, source width], y [n, target width] (float64), each counting `weights` [n] where
        given (the count then sums the weights: the means and moments are the weighted ones)."""
        if weights is None:
            self.count += x.shape[0]
            weighted_x, weighted_y = x, y
        else:
            self.count = as_count(self.count + float(weights.sum()))
            weighted_x, weighted_y = x * weights[:, None], y * weights[:, None]
        if self.source_sums:
            self.sum_x += weighted_x.sum(0)
        self.sum_y += weighted_y.sum(0)
        self.sum_y_squared += (weighted_y * y).sum(0)
        # each modality's columns, as views: K of every layer, then V; the weights enter once per product
        sides = {"x": x.split(self.source.modality_width, dim=1), "y": y.split(self.target.modality_width, dim=1),
                 "wx": weighted_x.split(self.source.modality_width, dim=1),
                 "wy": weighted_y.split(self.target.modality_width, dim=1)}
        for (kind, a, b), tensor in self.moments.items():
            tensor.addmm_(sides["w" + kind[0]][a].T, sides[kind[1]][b])

    def merge(self, other: CalibrationStats) -> CalibrationStats:
        """Statistics of the union of both token sets (shards of one calibration run add up exactly); of the
        optional moments, those both hold."""
        if (self.source, self.target) != (other.source, other.target):
            raise StatisticsError("cannot merge statistics collected for different model pairs / geometries")
        if not (self.source_sums and other.source_sums):
            raise StatisticsError("cannot merge statistics whose source sums were not collected")
        return self._combine(other, self.count + other.count, torch.add)

    def without(self, part: CalibrationStats) -> CalibrationStats:
        """Statistics of these tokens minus `part`'s (a subset of them, e.g. held-out windows); of the optional
        moments, those both hold."""
        if (self.source, self.target) != (part.source, part.target) or part.count >= self.count:
            raise StatisticsError("can only remove a strict subset of the same pair's calibration tokens")
        return self._combine(part, self.count - part.count, torch.sub)

    def _combine(self, other: CalibrationStats, count: int, operation) -> CalibrationStats:
        theirs = other.tensors()
        tensors = {name: operation(mine, theirs[name]) for name, mine in self.tensors().items() if name in theirs}
        return CalibrationStats.holding(self.source, self.target, count, tensors, self.kv_cross and other.kv_cross)

    def for_target_layers(self, layers: range) -> CalibrationStats:
        """These statistics with the target restricted to `layers` (consecutive): what a pass that accumulates
        only that block of target layers collects (copies of the sums it needs)."""
        columns = self.target.block_indices(layers)
        local = slice(layers.start * self.target.layer_width, layers.stop * self.target.layer_width)
        tensors = {"sum_y": self.sum_y[columns], "sum_y_squared": self.sum_y_squared[columns]}
        if self.source_sums:
            tensors["sum_x"] = self.sum_x.clone()
        for (kind, a, b), tensor in self.moments.items():
            part = {"xx": tensor, "xy": tensor[:, local], "yy": tensor[local, local]}[kind]
            tensors[moment_name(kind, a, b)] = part.clone()
        return CalibrationStats.holding(self.source, self.target.block(layers), self.count, tensors, self.kv_cross)

    def source_only(self) -> CalibrationStats:
        """The source sums (x, xxᵀ; shared, no copy) and token count alone, with a target of no layers: what
        later passes over further target layers adopt (`adopt_source_sums`)."""
        part = CalibrationStats(self.source, FeatureLayout(0, self.target.num_kv_heads, self.target.head_dim),
                                source_sums=False, kv_cross=self.kv_cross)
        part.count = self.count
        part.adopt_source_sums(self)
        return part

    def adopt_source_sums(self, other: CalibrationStats) -> None:
        """Take x and xxᵀ (no copy) from `other`, a pass over the same tokens that summed them."""
        # weighted counts are float sums: passes over the same tokens agree to round-off
        if not other.source_sums or other.source != self.source or not math.isclose(other.count, self.count):
            raise StatisticsError(f"the source sums must come from a pass over the same tokens and source model "
                                  f"({other.count} vs {self.count} tokens)")
        gram = {("xx", a, b): other.block("xx", a, b) for a, b in moment_blocks("xx", self.kv_cross)}
        self.sum_x, self.source_sums = other.sum_x, True
        self.moments = {**gram, **{key: tensor for key, tensor in self.moments.items() if key[0] != "xx"}}

    @classmethod
    def from_rows(cls, source: FeatureLayout, target: FeatureLayout, x: torch.Tensor, y: torch.Tensor,
                  target_gram: bool = False, kv_cross: bool = False):
        """Statistics of explicit feature rows x [n, source width], y [n, target width] (e.g. held-out windows)."""
        stats = cls(source, target, target_gram=target_gram, kv_cross=kv_cross)
        stats.add_rows(x.double(), y.double())
        return stats

    # -- centred moments --------------------------------------------------------------------------
    def _require_data(self) -> None:
        if self.count < 2:
            raise StatisticsError(
                f"only {self.count} calibration token(s) collected; give more or longer calibration batches"
            )

    def mean_x(self, idx=slice(None)) -> torch.Tensor:
        self._require_data()
        return (self.sum_x / self.count)[idx]

    def mean_y(self, idx=slice(None)) -> torch.Tensor:
        self._require_data()
        return (self.sum_y / self.count)[idx]

    def gather(self, kind: str, rows, columns) -> torch.Tensor:
        """A copy of the whole moment matrix `kind`'s [rows, columns] (feature indices of the whole layouts: slices
        or index tensors), assembled from the modality blocks they fall in."""
        return assemble(lambda a, b: self.block(kind, a, b),
                        modality_parts(rows, self.target if kind == "yy" else self.source),
                        modality_parts(columns, self.source if kind == "xx" else self.target))

    def cov_xx(self, idx) -> torch.Tensor:
        """The centred covariance of the source features `idx` (a slice or an index tensor)."""
        mx = self.mean_x(idx)
        return subtract_outer_(self.gather("xx", idx, idx).div_(self.count), mx, mx)

    def cov_xy(self, idx_x, idx_y) -> torch.Tensor:
        """The centred cross-covariance of source features `idx_x` and target features `idx_y`."""
        block = self.gather("xy", idx_x, idx_y).div_(self.count)
        return subtract_outer_(block, self.mean_x(idx_x), self.mean_y(idx_y))

    def var_y(self, idx=slice(None)) -> torch.Tensor:
        my = self.mean_y(idx)
        return self.sum_y_squared[idx] / self.count - my * my

    def reversed(self) -> CalibrationStats:
        """The same statistics with source and target swapped (for fitting the opposite direction)."""
        if not self.source_sums:
            raise StatisticsError("statistics without their source sums cannot be reversed")
        if not self.target_gram:
            raise StatisticsError(missing_moment("yy", 0, 0, True))
        squares = torch.cat([self.block("xx", m, m).diagonal() for m in range(len(MODALITIES))])
        tensors = {"sum_x": self.sum_y, "sum_y": self.sum_x, "sum_y_squared": squares}
        swapped = {"xx": "yy", "yy": "xx"}
        for (kind, a, b), tensor in self.moments.items():
            if kind == "xy":
                tensors[moment_name("xy", b, a)] = tensor.T
            else:
                tensors[moment_name(swapped[kind], a, b)] = tensor
        return CalibrationStats.holding(self.target, self.source, self.count, tensors, self.kv_cross)

    # -- persistence (`statistics_file`) ----------------------------------------------------------
    def save(self, path: str | Path, info: dict | None = None) -> None:
        """Write the sums atomically; `info` (JSON) is stored in the same file, so it always describes these sums
        (`read_info`)."""
        if not self.source_sums:
            raise StatisticsError("statistics without their source sums are not saved")
        statistics_file.write_sums(path, self.source, self.target, self.count, self.tensors(), info)

    @staticmethod
    def read_info(path: str | Path) -> dict | None:
        """The `info` saved with the statistics at `path` (None when none was), without reading the tensors."""
        return statistics_file.read_info(path)

    @staticmethod
    def saved_content(path: str | Path) -> SumsContent:
        """What the statistics file at `path` holds of the optional moments, from its header (a file of whole
        matrices holds all)."""
        return statistics_file.saved_content(path)

    @classmethod
    def load(cls, path: str | Path, target_gram: bool = False, kv_cross: bool = False) -> CalibrationStats:
        """Read statistics written by `save`, holding the optional moments asked for (StatisticsError naming what
        is missing when the file does not hold them); every tensor is checked against the layouts in the metadata.
        Of a file that holds more, only the blocks asked for are read: the whole matrices of files written before
        the sums were kept per modality pair too, and their Gram's diagonal for the variances."""
        source, target, count, tensors = statistics_file.read_sums(path, target_gram, kv_cross)
        return cls.holding(source, target, count, tensors, kv_cross)


def modality_parts(index, layout: FeatureLayout) -> list[tuple[int, torch.Tensor, slice | torch.Tensor]]:
    """Feature indices of a whole layout (a slice or an index tensor) by the modality they fall in: (modality, their
    positions in `index`, their indices within that modality's block: a slice where `index` is one)."""
    width = layout.modality_width
    if isinstance(index, slice) and index.step in (None, 1):
        start, stop, _ = index.indices(layout.width)
        parts = []
        for m in range(len(MODALITIES)):
            low, high = max(start, m * width), min(stop, (m + 1) * width)
            if low < high:
                parts.append((m, torch.arange(low - start, high - start), slice(low - m * width, high - m * width)))
        return parts
    if isinstance(index, slice):
        index = torch.arange(layout.width)[index]
    modality = torch.div(index, width, rounding_mode="floor")
    return [(m, (modality == m).nonzero().flatten(), index[modality == m] - m * width)
            for m in range(len(MODALITIES)) if bool((modality == m).any())]


def assemble(block, row_parts: list, column_parts: list) -> torch.Tensor:
    """A copy of the matrix of rows ``row_parts`` and columns ``column_parts`` (`modality_parts`) of a matrix held as
    modality blocks, ``block(a, b)``: of the one block they fall in, else assembled from each block (float64)."""
    if len(row_parts) == 1 and len(column_parts) == 1:
        (a, _, local_rows), (b, _, local_columns) = row_parts[0], column_parts[0]
        return submatrix(block(a, b), local_rows, local_columns)
    out = torch.empty(sum(len(p[1]) for p in row_parts), sum(len(p[1]) for p in column_parts), dtype=torch.float64)
    for a, at_rows, local_rows in row_parts:
        for b, at_columns, local_columns in column_parts:
            out[at_rows[:, None], at_columns] = submatrix(block(a, b), local_rows, local_columns)
    return out


def submatrix(matrix: torch.Tensor, rows, columns) -> torch.Tensor:
    """A copy of matrix[rows][:, columns] (each a slice or an index tensor) that copies the block alone (indexing
    the rows first would copy whole rows of a big matrix)."""
    if isinstance(rows, torch.Tensor) and isinstance(columns, torch.Tensor):
        return matrix[rows[:, None], columns]
    if isinstance(rows, torch.Tensor):
        return matrix[:, columns][rows]
    block = matrix[rows][:, columns]
    return block if isinstance(columns, torch.Tensor) else block.clone(memory_format=torch.contiguous_format)


def subtract_outer_(block: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """block −= a bᵀ in place, a few rows at a time: the same arithmetic as `block - torch.outer(a, b)` without
    an outer product the size of the block (the solve's blocks of big pairs are GBs)."""
    for start in range(0, block.shape[0], ROW_CHUNK):
        rows = slice(start, start + ROW_CHUNK)
        block[rows].sub_(torch.outer(a[rows], b))
    return block
