"""The MLP map (method "mlp"): the full linear map plus, per target layer, a small residual MLP that reads the
content-space K and V of a few source layers and corrects what the linear map leaves over (`fit.mlp` trains it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from kvhandoff.errors import MapperFormatError
from kvhandoff.mapper.dense import DenseMapper
from kvhandoff.mapper.manifest import MapperManifest
from kvhandoff.mapper.mapper import register_method
from kvhandoff.mapper.storage import require_tensors

_MLP_TENSORS = ("in_mean", "in_scale", "out_scale", "w1", "b1", "w2", "b2", "w3", "b3")


class ResidualMLP(torch.nn.Module):
    """`layers` independent MLPs applied as batched matmuls: x [layers, rows, in] → [layers, rows, out]."""

    def __init__(self, layers: int, in_features: int, hidden: int, out_features: int, seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)

        def kaiming(fan_in: int, fan_out: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.randn(layers, fan_in, fan_out, generator=generator) * math.sqrt(2 / fan_in))

        self.w1, self.w2 = kaiming(in_features, hidden), kaiming(hidden, hidden)
        self.b1 = torch.nn.Parameter(torch.zeros(layers, 1, hidden))
        self.b2 = torch.nn.Parameter(torch.zeros(layers, 1, hidden))
        self.w3 = torch.nn.Parameter(torch.zeros(layers, hidden, out_features))  # zero: starts as "no correction"
        self.b3 = torch.nn.Parameter(torch.zeros(layers, 1, out_features))
        self.register_buffer("in_mean", torch.zeros(layers, 1, in_features))
        self.register_buffer("in_scale", torch.ones(layers, 1, in_features))
        self.register_buffer("out_scale", torch.ones(layers, 1, out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = (x - self.in_mean) * self.in_scale
        h = torch.relu(torch.baddbmm(self.b1, z, self.w1))
        h = torch.relu(torch.baddbmm(self.b2, h, self.w2))
        return torch.baddbmm(self.b3, h, self.w3) * self.out_scale

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name).detach().contiguous() for name in _MLP_TENSORS}

    def flops_per_token(self) -> int:
        """Multiply-adds ×2 of the three matmuls plus the biases, over every layer (the elementwise
        standardisation is left out)."""
        return 2 * (self.w1.numel() + self.w2.numel() + self.w3.numel()) + sum(
            b.numel() for b in (self.b1, self.b2, self.b3))

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> ResidualMLP:
        layers, in_features, hidden = tensors["w1"].shape
        model = cls(layers, in_features, hidden, tensors["w3"].shape[2])
        with torch.no_grad():
            for name in _MLP_TENSORS:
                if tuple(tensors[name].shape) != tuple(getattr(model, name).shape):
                    raise MapperFormatError(f"MLP tensor {name} has shape {tuple(tensors[name].shape)}, expected "
                                            f"{tuple(getattr(model, name).shape)}; re-fit the mapper")
                getattr(model, name).copy_(tensors[name])
        return model.eval().requires_grad_(False)


class MLPMapper(DenseMapper):
    """A `DenseMapper` whose content-space output each target layer's `ResidualMLP` corrects.

    input_layers: [target layers, m] source layers each target layer's MLP reads (their K, then their V).
    """

    def __init__(self, weight, bias, selected, manifest: MapperManifest | Mapping, input_layers: torch.Tensor,
                 mlp: ResidualMLP):
        super().__init__(weight, bias, selected, manifest)
        self.input_layers = input_layers.long()
        layers = self.target.num_layers
        expected = (layers, layers, 2 * self.input_layers.shape[1] * self.source.layer_width,
                    2 * self.target.layer_width)  # input-layer rows, MLPs, MLP inputs, MLP outputs
        if (self.input_layers.shape[0], *mlp.w1.shape[:2], mlp.w3.shape[2]) != expected:
            raise MapperFormatError(
                f"MLP of {tuple(mlp.w1.shape)}→{tuple(mlp.w3.shape)} does not fit a {layers}-layer target "
                f"reading {self.input_layers.shape[1]} source layers; re-fit the mapper"
            )
        if self.manifest.mlp_input_layers is not None and \
                self.input_layers.tolist() != [list(row) for row in self.manifest.mlp_input_layers]:
            raise MapperFormatError("the MLP's input layers differ from the manifest's mlp_input_layers; re-fit")
        self.mlp = mlp.eval().requires_grad_(False)

    def map_rows(self, x: torch.Tensor) -> torch.Tensor:
        y = super().map_rows(x)  # [2, B, T, Lt, Ht, Dt]
        src, tgt = self.source, self.target
        _, batch, tokens = x.shape[:3]
        rows = x.reshape(2, batch * tokens, src.num_layers, src.layer_width)[:, :, self.input_layers]
        inputs = rows.permute(2, 1, 0, 3, 4).reshape(tgt.num_layers, batch * tokens, -1)  # [Lt, N, 2·m·Fs]
        with torch.no_grad():
            correction = self.mlp(inputs)  # [Lt, N, 2·Ft]
        y += correction.view(tgt.num_layers, batch, tokens, 2, tgt.num_kv_heads, tgt.head_dim).permute(
            3, 1, 2, 0, 4, 5
        )
        return y

    def _move(self, device: torch.device | str | None, dtype: torch.dtype | None) -> None:
        super()._move(device, dtype)
        self.mlp.to(device=device, dtype=dtype)
        self.input_layers = self.input_layers.to(self.device)

    def parameter_tensors(self) -> list[torch.Tensor]:
        return [*super().parameter_tensors(), *(getattr(self.mlp, name) for name in _MLP_TENSORS)]

    def flops_per_token(self) -> int:
        return super().flops_per_token() + self.mlp.flops_per_token()

    def saved_tensors(self) -> dict[str, torch.Tensor]:
        return {**super().saved_tensors(), "mlp_input_layers": self.input_layers,
                **{f"mlp.{k}": v for k, v in self.mlp.tensors().items()}}

    def _target_layer_axis(self, name: str) -> int | None:
        return 0 if name.startswith("mlp.") else super()._target_layer_axis(name)  # the MLPs: [target layer, ...]

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], manifest: MapperManifest) -> MLPMapper:
        require_tensors(tensors, ("weight", "bias", "selected", "mlp_input_layers",
                                  *(f"mlp.{k}" for k in _MLP_TENSORS)), "MLP mapper")
        mlp = ResidualMLP.from_tensors({k: tensors[f"mlp.{k}"] for k in _MLP_TENSORS})
        return cls(tensors["weight"], tensors["bias"], tensors["selected"], manifest, tensors["mlp_input_layers"], mlp)


register_method("mlp", MLPMapper)
