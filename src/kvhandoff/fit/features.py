"""Calibration feature rows on disk, for mappers that need the rows themselves (the MLP), not only their
second moments.

During the statistics pass every kept token's flattened content-space features (the same rows the
statistics add up: source x = [K, V of every source layer], target y likewise) are appended to safetensors
shards, one per calibration batch, in float16 (half the bytes; the MLP trains in float32 on standardised
inputs, where float16's 11-bit mantissa is far below the mapping error). A manifest written last marks the
folder complete, so an interrupted pass is never mistaken for a finished one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvhandoff.errors import StatisticsError
from kvhandoff.files import publish_folder, staging_folder
from kvhandoff.model.capture import FeatureLayout

MANIFEST = "features.json"


class FeatureShardWriter:
    """Append (x, y) row blocks as shards in a staging folder; `close()` publishes the folder atomically."""

    def __init__(self, folder: str | Path, source: FeatureLayout, target: FeatureLayout):
        self.folder = Path(folder)
        self.staging = staging_folder(self.folder)
        self.source, self.target = source, target
        self.shards: list[dict] = []

    def append(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Rows [n, source width] and [n, target width] of one calibration batch (n may be 0)."""
        if x.shape[0] == 0:
            return
        name = f"shard-{len(self.shards):05d}.safetensors"
        save_file({"x": x.to(torch.float16).contiguous(), "y": y.to(torch.float16).contiguous()},
                  str(self.staging / name))
        self.shards.append({"file": name, "rows": int(x.shape[0])})

    def close(self, description: dict | None = None) -> Path:
        manifest = {"source_layout": self.source.__dict__, "target_layout": self.target.__dict__,
                    "shards": self.shards, "rows": sum(s["rows"] for s in self.shards), **(description or {})}
        (self.staging / MANIFEST).write_text(json.dumps(manifest, indent=2))
        return publish_folder(self.staging, self.folder)


def features_complete(folder: str | Path) -> bool:
    return (Path(folder) / MANIFEST).is_file()


def read_manifest(folder: str | Path) -> dict:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise StatisticsError(
            f"{folder} holds no complete calibration features ({MANIFEST} missing: the pass that wrote them "
            "did not finish); collect them again"
        )
    return json.loads(path.read_text())


def check_layouts(folder: str | Path, manifest: dict, reverse: bool, source: FeatureLayout,
                  target: FeatureLayout) -> None:
    """Refuse rows written for another model pair or direction (`reverse`: rows of the opposite direction,
    used with x and y swapped)."""
    layouts = (FeatureLayout(**manifest["source_layout"]), FeatureLayout(**manifest["target_layout"]))
    if reverse:
        layouts = layouts[::-1]
    if layouts != (source, target):
        raise StatisticsError(
            f"feature rows in {folder} have layouts {layouts}, expected {(source, target)}: they come from "
            "another model pair or direction"
        )


def load_features(
    folder: str | Path, source_columns: torch.Tensor | None = None, target_columns: torch.Tensor | None = None,
    shards=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All rows as float32 (x [N, selected source columns], y [N, selected target columns]) and the shard
    index of each row (one shard = one calibration batch: use it to hold out whole windows).
    shards: only these shard indices (default all)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    wanted = None if shards is None else {int(i) for i in shards}
    chosen = [(i, s) for i, s in enumerate(manifest["shards"]) if wanted is None or i in wanted]
    total = sum(s["rows"] for _, s in chosen)
    x_width = len(source_columns) if source_columns is not None else FeatureLayout(**manifest["source_layout"]).width
    y_width = len(target_columns) if target_columns is not None else FeatureLayout(**manifest["target_layout"]).width
    # filled in place: the float32 rows of a real pair run to gigabytes, so no list-then-concatenate copy
    x_out, y_out = torch.empty(total, x_width), torch.empty(total, y_width)
    shard_ids = torch.empty(total, dtype=torch.long)
    start = 0
    for index, shard in chosen:
        try:
            with safe_open(str(folder / shard["file"]), framework="pt") as handle:
                x, y = handle.get_tensor("x"), handle.get_tensor("y")
        except Exception as exc:  # safetensors raises several types for damaged files
            raise StatisticsError(f"cannot read feature shard {folder / shard['file']}: {exc}; collect again") from exc
        if x.shape[0] != shard["rows"] or y.shape[0] != shard["rows"]:
            raise StatisticsError(f"feature shard {folder / shard['file']} has {x.shape[0]} rows, its manifest says "
                                  f"{shard['rows']}; collect the features again")
        stop = start + shard["rows"]
        x_out[start:stop] = x if source_columns is None else x[:, source_columns]
        y_out[start:stop] = y if target_columns is None else y[:, target_columns]
        shard_ids[start:stop] = index
        start = stop
    return x_out, y_out, shard_ids


def validation_shards(num_shards: int, fraction: float, seed: int) -> torch.Tensor:
    """Indices of the calibration windows (feature shards) held out for choosing settings."""
    if num_shards < 2:
        raise StatisticsError(
            f"choosing settings on held-out calibration windows needs at least 2 windows, but the features have "
            f"{num_shards}; calibrate on more windows (20+ recommended)"
        )
    count = min(num_shards - 1, max(1, round(fraction * num_shards)))
    return torch.randperm(num_shards, generator=torch.Generator().manual_seed(seed))[:count]
