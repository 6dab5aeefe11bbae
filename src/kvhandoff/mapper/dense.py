"""The full linear map (methods "ridge" and "synthetic"): every (K|V, target layer) reads all KV heads of its k
selected source layers.

The tensors are laid out once, at construction, for the hot path: K and V maps of all target layers are one
stacked weight [2·target_layers, k·source_features, target_features], applied with a single batched matmul;
when every target layer reads every source layer (k = all) the whole map is one dense GEMM.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvhandoff.errors import MapperFormatError
from kvhandoff.mapper.manifest import MapperManifest
from kvhandoff.mapper.mapper import Mapper, register_method
from kvhandoff.mapper.storage import require_tensors


class DenseMapper(Mapper):
    """A linear content-space map per (K|V, target layer) from its k selected source layers.

    weight: [2, target_layers, k · source_kv_features, target_kv_features] (modality K=0, V=1); with joint inputs
        (source_inputs="kv") each map reads the selected layers' K block, then their V block: 2 · k · features.
    bias:   [2, target_layers, target_kv_features]
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, selected: torch.Tensor,
                 manifest: MapperManifest | Mapping):
        super().__init__(selected, manifest)
        expected = self._weight_shape()
        if tuple(weight.shape) != expected or tuple(bias.shape) != (2, *expected[1:2], expected[3]):
            raise MapperFormatError(
                f"mapper tensors have shapes {tuple(weight.shape)}/{tuple(bias.shape)}, expected {expected}: "
                "the file does not match its manifest; re-fit the mapper"
            )
        self._lay_out(weight.float(), bias.float())

    @property
    def joint_inputs(self) -> bool:
        """Whether each map reads the selected source layers' K and V (input columns: K block, then V block)."""
        return self.manifest.joint_inputs

    def _weight_shape(self) -> tuple[int, int, int, int]:
        return (
            2,
            self.target.num_layers,
            (2 if self.joint_inputs else 1) * self.selected.shape[1] * self.source.layer_width,
            self.target.layer_width,
        )

    def _lay_out(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        """Lay out (weight, bias) for the hot path, on their device and dtype."""
        expected = self._weight_shape()
        self.bias = bias.contiguous()
        self.selected = self.selected.to(weight.device)
        k = self.selected.shape[1]
        self._dense = k == self.source.num_layers and bool(
            (self.selected.cpu() == torch.arange(self.source.num_layers)).all()
        )
        # the dense layouts are made from `weight` as given: one that is a view of them already (a ridge fit's
        # maps, `fit.RidgeSolution`; this mapper moved by `to`) is not copied
        if self._dense and self.joint_inputs:
            # [2·Ls·Fs, 2·Lt·Ft]: K and V of every target layer from all source K and V in one GEMM
            self._dense_weight = weight.permute(2, 0, 1, 3).reshape(expected[2], -1).contiguous()
            self.weight = self._dense_weight.view(expected[2], 2, expected[1], expected[3]).permute(1, 2, 0, 3)
            self._dense_bias = self.bias.reshape(-1)
        elif self._dense:
            # [2, Ls·Fs, Lt·Ft]: all target layers of one modality in one GEMM. `weight` becomes a view of it,
            # so the mapper holds its parameters once.
            self._dense_weight = weight.permute(0, 2, 1, 3).reshape(2, expected[2], -1).contiguous()
            self.weight = self._dense_weight.view(2, expected[2], expected[1], expected[3]).permute(0, 2, 1, 3)
            self._dense_bias = self.bias.reshape(2, -1)
        else:
            self.weight = weight.contiguous()
            self._flat_weight = self.weight.reshape(-1, *expected[2:])

    def _move(self, device: torch.device | str | None, dtype: torch.dtype | None) -> None:
        self._lay_out(self.weight.to(device=device, dtype=dtype), self.bias.to(device=device, dtype=dtype))

    def parameter_tensors(self) -> list[torch.Tensor]:
        return [self.weight, self.bias]

    def flops_per_token(self) -> int:
        return 2 * self.weight.numel() + self.bias.numel()

    def map_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The (weight, bias) tensors the map reads, in their applied layout. `weight` and `bias` share their
        storage, so training these in place (`refine.refine_mapper`) changes the mapper."""
        if self._dense:
            return self._dense_weight, self._dense_bias
        return self._flat_weight, self.bias

    def map_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Token rows [2, B, T, Ls, Hs, Ds] → a view [2, B, T, Lt, Ht, Dt] of one batched GEMM's output."""
        src, tgt = self.source, self.target
        _, batch, tokens = x.shape[:3]
        rows = batch * tokens
        if self._dense and self.joint_inputs:
            joint = x.view(2, rows, -1).transpose(0, 1).reshape(rows, -1)  # [N, K of all layers ‖ V of all layers]
            y = torch.addmm(self._dense_bias, joint, self._dense_weight)
            return y.view(batch, tokens, 2, tgt.num_layers, tgt.num_kv_heads, tgt.head_dim).permute(2, 0, 1, 3, 4, 5)
        if self._dense:
            y = torch.baddbmm(self._dense_bias[:, None], x.view(2, rows, -1), self._dense_weight)
            return y.view(2, batch, tokens, tgt.num_layers, tgt.num_kv_heads, tgt.head_dim)
        gathered = x.view(2, rows, src.num_layers, src.layer_width)[:, :, self.selected]  # [2, N, Lt, k, Fs]
        if self.joint_inputs:  # both maps of a target layer read [its K block ‖ its V block]
            joint = gathered.permute(2, 1, 0, 3, 4).reshape(tgt.num_layers, rows, -1)
            gathered = torch.cat([joint, joint])
        else:
            gathered = gathered.transpose(1, 2).reshape(2 * tgt.num_layers, rows, -1)
        y = torch.baddbmm(self.bias.reshape(2 * tgt.num_layers, 1, -1), gathered, self._flat_weight)
        y = y.view(2, tgt.num_layers, batch, tokens, tgt.num_kv_heads, tgt.head_dim)
        return y.permute(0, 2, 3, 1, 4, 5)

    def saved_tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight, "bias": self.bias, "selected": self.selected}

    def _target_layer_axis(self, name: str) -> int | None:
        return 1 if name in ("weight", "bias") else None  # [K|V, target layer, ...]

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], manifest: MapperManifest) -> DenseMapper:
        require_tensors(tensors, ("weight", "bias", "selected"), "mapper")
        return cls(tensors["weight"], tensors["bias"], tensors["selected"], manifest)


register_method("ridge", DenseMapper)
register_method("synthetic", DenseMapper)  # the benchmarks' random maps of a given shape
