"""Shared helpers of the mapper tests: a hand-made manifest (no models, no fit) and random rows."""

from __future__ import annotations

import torch

from kvhandoff.config import FitConfig
from kvhandoff.mapper.manifest import MapperManifest
from kvhandoff.model.capture import FeatureLayout

#: source: 2 layers × 2 KV heads × head dim 4 (width 32); target: 3 layers × 1 KV head × head dim 4 (width 24)
SRC, TGT = FeatureLayout(2, 2, 4), FeatureLayout(3, 1, 4)
ALL_LAYERS = [[0, 1]] * TGT.num_layers


def hand_manifest(method: str, selected=ALL_LAYERS, config: FitConfig | None = None, **fields) -> MapperManifest:
    """A manifest of ``method`` for SRC → TGT without fingerprints (no RoPE: map rows, save and load only)."""
    return MapperManifest(method=method, config=config or FitConfig(), source_layout=SRC, target_layout=TGT,
                          selected_layers=selected, source_fingerprint={}, target_fingerprint={},
                          source_max_position_embeddings=64, target_max_position_embeddings=64, **fields)


def random_tensor(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
