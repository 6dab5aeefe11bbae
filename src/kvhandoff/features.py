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
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvhandoff.errors import StatisticsError
from kvhandoff.statistics import FeatureLayout

MANIFEST = "features.json"


class FeatureShardWriter:
    """Append (x, y) row blocks as shards in a staging folder; `close()` publishes the folder atomically."""

    def __init__(self, folder: str | Path, source: FeatureLayout, target: FeatureLayout):
        self.folder = Path(folder)
        self.staging = self.folder.with_name(f".{self.folder.name}.writing")
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging.mkdir(parents=True)
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
        shutil.rmtree(self.folder, ignore_errors=True)
        self.staging.rename(self.folder)
        return self.folder


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
    xs, ys, shard_ids = [], [], []
    for index, shard in enumerate(manifest["shards"]):
        if wanted is not None and index not in wanted:
            continue
        try:
            with safe_open(str(folder / shard["file"]), framework="pt") as handle:
                x, y = handle.get_tensor("x"), handle.get_tensor("y")
        except Exception as exc:  # safetensors raises several types for damaged files
            raise StatisticsError(f"cannot read feature shard {folder / shard['file']}: {exc}; collect again") from exc
        if source_columns is not None:
            x = x[:, source_columns]
        if target_columns is not None:
            y = y[:, target_columns]
        xs.append(x.float())
        ys.append(y.float())
        shard_ids.append(torch.full((x.shape[0],), index, dtype=torch.long))
    return torch.cat(xs), torch.cat(ys), torch.cat(shard_ids)


def validation_shards(num_shards: int, fraction: float, seed: int) -> torch.Tensor:
    """Indices of the calibration windows (feature shards) held out for choosing settings."""
    if num_shards < 2:
        raise StatisticsError(
            f"choosing settings on held-out calibration windows needs at least 2 windows, but the features have "
            f"{num_shards}; calibrate on more windows (20+ recommended)"
        )
    count = min(num_shards - 1, max(1, round(fraction * num_shards)))
    return torch.randperm(num_shards, generator=torch.Generator().manual_seed(seed))[:count]
