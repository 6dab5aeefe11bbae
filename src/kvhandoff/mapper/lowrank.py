"""The low-rank map (method "lowrank"): per modality one rank-r projection of all source layers, shared by every
target layer (`fit.compact` solves it: reduced-rank ridge or principal components)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvhandoff.errors import MapperFormatError
from kvhandoff.mapper.manifest import MapperManifest
from kvhandoff.mapper.mapper import Mapper, register_method
from kvhandoff.mapper.storage import require_tensors


class LowRankMapper(Mapper):
    """Per modality (K, V) one projection of all source layers to rank r, shared by every target layer:
    z = x_m @ projection[m] [N, r]; y_m = z @ weight[m] + bias[m] [N, all target layers' K (V)]."""

    def __init__(self, projection: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, selected: torch.Tensor,
                 manifest: MapperManifest | Mapping):
        super().__init__(selected, manifest)
        rank = projection.shape[-1]
        shapes = (tuple(projection.shape), tuple(weight.shape), tuple(bias.shape))
        expected = ((2, self.source.modality_width, rank), (2, rank, self.target.modality_width),
                    (2, self.target.modality_width))
        if shapes != expected:
            raise MapperFormatError(f"low-rank mapper tensors have shapes {shapes}, expected {expected}; re-fit")
        self.projection = projection.float().contiguous()
        self.weight = weight.float().contiguous()
        self.bias = bias.float().contiguous()

    @property
    def rank(self) -> int:
        return int(self.projection.shape[-1])

    def _move(self, device: torch.device | str | None, dtype: torch.dtype | None) -> None:
        self.projection = self.projection.to(device=device, dtype=dtype)
        self.weight = self.weight.to(device=device, dtype=dtype)
        self.bias = self.bias.to(device=device, dtype=dtype)

    def parameter_tensors(self) -> list[torch.Tensor]:
        return [self.projection, self.weight, self.bias]

    def flops_per_token(self) -> int:
        return 2 * (self.projection.numel() + self.weight.numel()) + self.bias.numel()

    def map_rows(self, x: torch.Tensor) -> torch.Tensor:
        tgt = self.target
        _, batch, tokens = x.shape[:3]
        z = torch.bmm(x.reshape(2, batch * tokens, -1), self.projection)  # [2, N, r]
        y = torch.baddbmm(self.bias[:, None], z, self.weight)
        return y.view(2, batch, tokens, tgt.num_layers, tgt.num_kv_heads, tgt.head_dim)

    def saved_tensors(self) -> dict[str, torch.Tensor]:
        return {"projection": self.projection, "weight": self.weight, "bias": self.bias, "selected": self.selected}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], manifest: MapperManifest) -> LowRankMapper:
        require_tensors(tensors, ("projection", "weight", "bias", "selected"), "low-rank mapper")
        return cls(tensors["projection"], tensors["weight"], tensors["bias"], tensors["selected"], manifest)


register_method("lowrank", LowRankMapper)
