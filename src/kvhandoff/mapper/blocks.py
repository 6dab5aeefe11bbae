"""The block map (method "blocks"): dense blocks, each reading a set of source columns and writing a set of target
columns — head-aligned maps and maps that read a different number of source layers per target layer
(`fit.compact` solves them)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvhandoff.errors import MapperFormatError
from kvhandoff.mapper.manifest import MapperManifest
from kvhandoff.mapper.mapper import Mapper, register_method
from kvhandoff.mapper.storage import require_tensors

#: the saved tensors of block group g: ``blocks.{g}.{part}``
BLOCK_PARTS = ("weight", "bias", "inputs", "outputs")


class BlockMapper(Mapper):
    """A map made of dense blocks. Block i of group g reads source columns ``inputs[g][i]`` of the flattened
    content row (the `FeatureLayout` order: K of every source layer, then V) and writes target columns
    ``outputs[g][i]``: y[outputs] = x[inputs] @ weight[g][i] + bias[g][i]. Every target column is written by
    exactly one block. Blocks of a group share their shape, so a group is one batched GEMM."""

    def __init__(self, weights, biases, inputs, outputs, selected: torch.Tensor, manifest: MapperManifest | Mapping):
        super().__init__(selected, manifest)
        if len({len(weights), len(biases), len(inputs), len(outputs)}) != 1 or not weights:
            raise MapperFormatError("a block mapper needs as many weight, bias, input and output groups (≥ 1)")
        self.inputs = [index.long() for index in inputs]
        self.outputs = [index.long() for index in outputs]
        self._check_blocks(weights, biases)
        self.weights = [w.float().contiguous() for w in weights]
        self.biases = [b.float().contiguous() for b in biases]

    def _check_blocks(self, weights, biases) -> None:
        covered = torch.zeros(self.target.width, dtype=torch.long)
        for g, (w, b, i, o) in enumerate(zip(weights, biases, self.inputs, self.outputs, strict=True)):
            if w.dim() != 3 or tuple(i.shape) != tuple(w.shape[:2]) or tuple(o.shape) != (w.shape[0], w.shape[2]) \
                    or tuple(b.shape) != tuple(o.shape):
                raise MapperFormatError(f"block group {g}: weight {tuple(w.shape)}, bias {tuple(b.shape)}, inputs "
                                        f"{tuple(i.shape)}, outputs {tuple(o.shape)} do not fit; re-fit the mapper")
            if i.numel() and not 0 <= int(i.min()) <= int(i.max()) < self.source.width:
                raise MapperFormatError(f"block group {g} reads columns outside the source's {self.source.width}")
            if not 0 <= int(o.min()) <= int(o.max()) < self.target.width:
                raise MapperFormatError(f"block group {g} writes columns outside the target's {self.target.width}")
            covered += torch.bincount(o.reshape(-1).cpu(), minlength=self.target.width)
        if not bool((covered == 1).all()):
            raise MapperFormatError("the blocks do not write every target column exactly once; re-fit the mapper")

    def _move(self, device: torch.device | str | None, dtype: torch.dtype | None) -> None:
        self.weights = [w.to(device=device, dtype=dtype) for w in self.weights]
        self.biases = [b.to(device=device, dtype=dtype) for b in self.biases]
        self.inputs = [i.to(device) for i in self.inputs]
        self.outputs = [o.to(device) for o in self.outputs]

    def parameter_tensors(self) -> list[torch.Tensor]:
        return [*self.weights, *self.biases]

    def index_tensors(self) -> list[torch.Tensor]:
        return [*self.inputs, *self.outputs]

    def flops_per_token(self) -> int:
        return sum(2 * w.numel() + b.numel() for w, b in zip(self.weights, self.biases, strict=True))

    def map_rows(self, x: torch.Tensor) -> torch.Tensor:
        src, tgt = self.source, self.target
        _, batch, tokens = x.shape[:3]
        rows = batch * tokens
        flat = x.reshape(2, rows, src.modality_width).transpose(0, 1).reshape(rows, src.width)
        y = torch.empty(rows, tgt.width, dtype=flat.dtype, device=flat.device)
        for weight, bias, inputs, outputs in zip(self.weights, self.biases, self.inputs, self.outputs, strict=True):
            gathered = flat[:, inputs].transpose(0, 1)  # [blocks, N, in]
            out = torch.baddbmm(bias[:, None], gathered, weight)  # [blocks, N, out]
            y[:, outputs.reshape(-1)] = out.transpose(0, 1).reshape(rows, -1)
        return y.view(batch, tokens, 2, tgt.num_layers, tgt.num_kv_heads, tgt.head_dim).permute(2, 0, 1, 3, 4, 5)

    def saved_tensors(self) -> dict[str, torch.Tensor]:
        tensors = {"selected": self.selected}
        for g, parts in enumerate(zip(self.weights, self.biases, self.inputs, self.outputs, strict=True)):
            tensors.update({f"blocks.{g}.{name}": t for name, t in zip(BLOCK_PARTS, parts, strict=True)})
        return tensors

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], manifest: MapperManifest) -> BlockMapper:
        groups = 0
        while f"blocks.{groups}.weight" in tensors:
            groups += 1
        names = ["selected", *(f"blocks.{g}.{name}" for g in range(max(groups, 1)) for name in BLOCK_PARTS)]
        require_tensors(tensors, names, "block mapper")
        parts = [[tensors[f"blocks.{g}.{name}"] for g in range(groups)] for name in BLOCK_PARTS]
        return cls(*parts, tensors["selected"], manifest)


register_method("blocks", BlockMapper)
