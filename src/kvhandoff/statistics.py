"""Streaming sufficient statistics for every later choice (layer selection, any k, the ridge solve).

Accumulated in float64: the centred covariance is formed as Gram/n − μμᵀ at solve time, and Qwen-style
k_proj biases give keys means far larger than their spread, so float32 sums would cancel catastrophically.
float64 keeps ~10 significant digits after that subtraction and makes shard merging a plain addition.

Feature layout (one row per kept token):
  source x = [K of every source layer, V of every source layer], each layer = all KV heads × head_dim
  target y = likewise for the target.
Memory is O(features²), independent of the number of calibration tokens (`footprint` says how much). The full
target Gram is kept too, so the same pass gives the statistics of the reverse direction (`reversed()`): one
calibration, both ways. Where the sums of a big pair do not fit, statistics may cover a block of consecutive target
layers only (`FeatureLayout.block`, `CalibrationStats.for_target_layers`): every map of a target layer reads only
its own layer's columns, so the blocks' solves together give the whole mapper (`fit.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kvhandoff.capture import ContentKV, nonfinite_layers
from kvhandoff.errors import StatisticsError
from kvhandoff.files import atomic_path

MODALITIES = ("K", "V")
_TENSORS = ("sum_x", "sum_y", "sum_xx", "sum_xy", "sum_yy")
#: metadata key of the caller's description saved with the sums (`save(info=...)`, `read_info`)
_INFO_KEY = "kvhandoff_info"


@dataclass(frozen=True)
class FeatureLayout:
    """Where (modality, layer, head) lives in a flattened feature vector."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    @property
    def layer_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def modality_width(self) -> int:
        return self.num_layers * self.layer_width

    @property
    def width(self) -> int:
        return len(MODALITIES) * self.modality_width

    def block(self, layers: range) -> FeatureLayout:
        """The layout of `layers` (consecutive layers of this one) alone."""
        if not (layers.step == 1 and 0 <= layers.start < layers.stop <= self.num_layers):
            raise StatisticsError(f"layers {layers.start}..{layers.stop - 1} are not a block of consecutive layers "
                                  f"of a model with {self.num_layers}")
        return FeatureLayout(len(layers), self.num_kv_heads, self.head_dim)

    def block_indices(self, layers: range) -> torch.Tensor:
        """The feature indices of `layers` (K of each, then V of each): the columns of `block(layers)`."""
        return torch.cat([self.layer_indices(modality, layers) for modality in range(len(MODALITIES))])

    def layer_slice(self, modality: int, layer: int) -> slice:
        start = modality * self.modality_width + layer * self.layer_width
        return slice(start, start + self.layer_width)

    def layer_indices(self, modality: int, layers) -> torch.Tensor:
        slices = [self.layer_slice(modality, int(layer)) for layer in layers]
        return torch.cat([torch.arange(s.start, s.stop) for s in slices])

    def flatten(self, content: ContentKV, positions: torch.Tensor) -> torch.Tensor:
        """[tokens kept, width] float64 rows on the CPU (where the sums are) from content K/V [layers, batch, heads,
        tokens, head_dim] of any dtype and device: the model's dtype (bfloat16, float16) is cast before any sum."""
        both = torch.stack([content.keys, content.values])[..., positions.to(content.keys.device), :]
        rows = both.permute(2, 4, 0, 1, 3, 5).reshape(-1, self.width)  # [2, L, B, H, t, D] → [B·t, width]
        return rows.to("cpu").to(torch.float64)


def require_finite_content(side: str, content: ContentKV) -> None:
    """StatisticsError naming the layer(s) whose captured K or V holds NaN/Inf (they would poison every sum)."""
    for name, tensor in (("K", content.keys), ("V", content.values)):
        if not bool(tensor.isfinite().all()):
            raise StatisticsError(
                f"the {side} model's calibration {name} activations hold NaN/Inf in layer(s) "
                f"{nonfinite_layers(tensor, dim=0)}: run the calibration in float32 (or bfloat16) and check the "
                "model's weights"
            )


class CalibrationStats:
    """Sums of x, y, xxᵀ, xyᵀ and yyᵀ over calibration tokens, in float64.

    source_sums=False: x and xxᵀ are not summed (empty until `adopt_source_sums` takes them from another pass over
    the same tokens): a pass over a further block of target layers needs only the sums that involve y."""

    def __init__(self, source: FeatureLayout, target: FeatureLayout, source_sums: bool = True):
        self.source, self.target = source, target
        self.count = 0
        self.source_sums = source_sums
        width = source.width if source_sums else 0
        self.sum_x = torch.zeros(width, dtype=torch.float64)
        self.sum_y = torch.zeros(target.width, dtype=torch.float64)
        self.sum_xx = torch.zeros(width, width, dtype=torch.float64)
        self.sum_xy = torch.zeros(source.width, target.width, dtype=torch.float64)
        self.sum_yy = torch.zeros(target.width, target.width, dtype=torch.float64)

    # -- accumulation -----------------------------------------------------------------------------
    def update(
        self, source: ContentKV, target: ContentKV, token_stride: int = 4, skip_first_tokens: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add one batch. Both captures must cover the same token ids; every `token_stride`-th position is kept.
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
        self.count += x.shape[0]
        if self.source_sums:
            self.sum_x += x.sum(0)
            self.sum_xx.addmm_(x.T, x)
        self.sum_y += y.sum(0)
        self.sum_xy.addmm_(x.T, y)
        self.sum_yy.addmm_(y.T, y)
        return x, y

    def merge(self, other: CalibrationStats) -> CalibrationStats:
        """Statistics of the union of both token sets (shards of one calibration run add up exactly)."""
        if (self.source, self.target) != (other.source, other.target):
            raise StatisticsError("cannot merge statistics collected for different model pairs / geometries")
        if not (self.source_sums and other.source_sums):
            raise StatisticsError("cannot merge statistics whose source sums were not collected")
        merged = CalibrationStats(self.source, self.target)
        merged.count = self.count + other.count
        for name in _TENSORS:
            setattr(merged, name, getattr(self, name) + getattr(other, name))
        return merged

    def for_target_layers(self, layers: range) -> CalibrationStats:
        """These statistics with the target restricted to `layers` (consecutive): what a pass that accumulates
        only that block of target layers collects (copies of the sums it needs)."""
        block = CalibrationStats.__new__(CalibrationStats)
        columns = self.target.block_indices(layers)
        block.source, block.target, block.count = self.source, self.target.block(layers), self.count
        block.source_sums = self.source_sums
        block.sum_x, block.sum_xx = self.sum_x.clone(), self.sum_xx.clone()
        block.sum_y, block.sum_xy = self.sum_y[columns], self.sum_xy[:, columns]
        block.sum_yy = self.sum_yy[columns][:, columns]
        return block

    def source_only(self) -> CalibrationStats:
        """The source sums (x, xxᵀ; shared, no copy) and token count alone, with a target of no layers: what
        later passes over further target layers adopt (`adopt_source_sums`)."""
        part = CalibrationStats(self.source, FeatureLayout(0, self.target.num_kv_heads, self.target.head_dim),
                                source_sums=False)
        part.count = self.count
        part.adopt_source_sums(self)
        return part

    def sums(self) -> list[torch.Tensor]:
        """The float64 sum tensors themselves (x, y, xxᵀ, xyᵀ, yyᵀ; without x and xxᵀ when they are not summed
        here), e.g. for a collective to add up in place."""
        return [getattr(self, name) for name in _TENSORS if self.source_sums or name not in ("sum_x", "sum_xx")]

    def adopt_source_sums(self, other: CalibrationStats) -> None:
        """Take x and xxᵀ (no copy) from `other`, a pass over the same tokens that summed them."""
        if not other.source_sums or other.source != self.source or other.count != self.count:
            raise StatisticsError(f"the source sums must come from a pass over the same tokens and source model "
                                  f"({other.count} vs {self.count} tokens)")
        self.sum_x, self.sum_xx, self.source_sums = other.sum_x, other.sum_xx, True

    @classmethod
    def from_rows(cls, source: FeatureLayout, target: FeatureLayout, x: torch.Tensor, y: torch.Tensor):
        """Statistics of explicit feature rows x [n, source width], y [n, target width] (e.g. held-out windows)."""
        stats = cls(source, target)
        x, y = x.double(), y.double()
        stats.count = x.shape[0]
        stats.sum_x, stats.sum_y = x.sum(0), y.sum(0)
        stats.sum_xx, stats.sum_xy, stats.sum_yy = x.T @ x, x.T @ y, y.T @ y
        return stats

    def without(self, part: CalibrationStats) -> CalibrationStats:
        """Statistics of these tokens minus `part`'s (a subset of them, e.g. held-out windows)."""
        if (self.source, self.target) != (part.source, part.target) or part.count >= self.count:
            raise StatisticsError("can only remove a strict subset of the same pair's calibration tokens")
        rest = CalibrationStats(self.source, self.target)
        rest.count = self.count - part.count
        for name in _TENSORS:
            setattr(rest, name, getattr(self, name) - getattr(part, name))
        return rest

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

    def cov_xx(self, idx) -> torch.Tensor:
        mx = self.mean_x(idx)
        block = self.sum_xx[idx][:, idx] if isinstance(idx, torch.Tensor) else self.sum_xx[idx, idx].clone()
        return block.div_(self.count).sub_(torch.outer(mx, mx))  # in place: big pairs' blocks are GBs

    def cov_xy(self, idx_x, idx_y) -> torch.Tensor:
        rows = self.sum_xy[idx_x]
        block = rows[:, idx_y]
        return block / self.count - torch.outer(self.mean_x(idx_x), self.mean_y(idx_y))

    def var_y(self, idx=slice(None)) -> torch.Tensor:
        my = self.mean_y(idx)
        return self.sum_yy.diagonal()[idx] / self.count - my * my

    def reversed(self) -> CalibrationStats:
        """The same statistics with source and target swapped (for fitting the opposite direction)."""
        flipped = CalibrationStats.__new__(CalibrationStats)
        if not self.source_sums:
            raise StatisticsError("statistics without their source sums cannot be reversed")
        flipped.source, flipped.target, flipped.count = self.target, self.source, self.count
        flipped.source_sums = True
        flipped.sum_x, flipped.sum_y = self.sum_y, self.sum_x
        flipped.sum_xx, flipped.sum_yy = self.sum_yy, self.sum_xx
        flipped.sum_xy = self.sum_xy.T
        return flipped

    # -- persistence ------------------------------------------------------------------------------
    def save(self, path: str | Path, info: dict | None = None) -> None:
        """Write the sums atomically; `info` (JSON) is stored in the same file, so it always describes these sums
        (`read_info`)."""
        if not self.source_sums:
            raise StatisticsError("statistics without their source sums are not saved")
        layouts = {"source": self.source.__dict__, "target": self.target.__dict__, "count": self.count}
        metadata = {"kvhandoff_stats": json.dumps(layouts)}
        if info is not None:
            metadata[_INFO_KEY] = json.dumps(info)
        tensors = {n: getattr(self, n).contiguous() for n in _TENSORS}
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata=metadata)

    @staticmethod
    def read_info(path: str | Path) -> dict | None:
        """The `info` saved with the statistics at `path` (None when none was), without reading the tensors."""
        try:
            with safe_open(str(path), framework="pt") as handle:
                text = (handle.metadata() or {}).get(_INFO_KEY)
            return None if text is None else json.loads(text)
        except Exception as exc:  # safetensors raises several types for corrupt files
            raise StatisticsError(f"cannot read statistics file {path}: {exc}; re-run the calibration") from exc

    @classmethod
    def load(cls, path: str | Path) -> CalibrationStats:
        """Read statistics written by `save`; every tensor is checked against the layouts in the metadata."""
        try:
            with safe_open(str(path), framework="pt") as handle:
                meta = json.loads(handle.metadata()["kvhandoff_stats"])
            tensors = load_file(str(path))
            stats = cls(FeatureLayout(**meta["source"]), FeatureLayout(**meta["target"]))
            stats.count = int(meta["count"])
        except Exception as exc:  # safetensors raises several types for corrupt files
            raise StatisticsError(
                f"cannot read statistics file {path}: {exc}; re-run the calibration"
            ) from exc
        if sorted(tensors) != sorted(_TENSORS):
            raise StatisticsError(
                f"statistics file {path} holds tensors {sorted(tensors)}, expected {sorted(_TENSORS)}; "
                "re-run the calibration"
            )
        for name in _TENSORS:
            expected = getattr(stats, name)
            tensor = tensors[name]
            if tuple(tensor.shape) != tuple(expected.shape) or tensor.dtype != expected.dtype:
                raise StatisticsError(
                    f"statistics tensor {name} in {path} is {tuple(tensor.shape)} {tensor.dtype}, but its layouts "
                    f"need {tuple(expected.shape)} {expected.dtype}; the file is damaged: re-run the calibration"
                )
            setattr(stats, name, tensor)
        return stats
