"""The fitted mapper: source cache → target cache (strip source RoPE → linear map → apply target RoPE).

Tensors are laid out once, at construction, for the hot path: K and V maps of all target layers are one
stacked weight [2·target_layers, k·source_features, target_features], applied with a single batched matmul;
when every target layer reads every source layer (k = all) the whole map is one dense GEMM.
"""

from __future__ import annotations

import dataclasses
import json
import weakref
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import DynamicCache

from kvhandoff.errors import (
    ConfigError,
    ContextTooLongError,
    MapperFormatError,
    MapperMismatchError,
    NonFiniteError,
)
from kvhandoff.files import atomic_folder, recover_folder, sha256_file
from kvhandoff.mapper.manifest import MapperManifest, dumps, loads
from kvhandoff.model.cache import cache_of
from kvhandoff.model.capture import ContentKV, all_finite, nonfinite_layers
from kvhandoff.model.geometry import PAIRING_KEYS, model_fingerprint, signatures_match
from kvhandoff.model.rope import rope_frequencies

TENSOR_FILE = "mapper.safetensors"
MANIFEST_FILE = "manifest.json"



def check_mapper_dtype(dtype: torch.dtype | None) -> None:
    """ConfigError unless ``dtype`` (what a mapper's `to` casts to) is None or a floating dtype."""
    if dtype is not None and not dtype.is_floating_point:
        raise ConfigError(f"a mapper's dtype must be a floating dtype, got {dtype}")

class Mapper:
    """A linear content-space map from a source model's KV cache to a target model's.

    weight: [2, target_layers, k · source_kv_features, target_kv_features] (modality K=0, V=1)
    bias:   [2, target_layers, target_kv_features]
    selected: [target_layers, k] source layers feeding each target layer
    manifest: a `MapperManifest` (a mapping of its JSON form is accepted and validated): geometry,
        fingerprints, config, calibration description and fit metrics.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, selected: torch.Tensor,
                 manifest: MapperManifest | Mapping):
        manifest = self._adopt_manifest(manifest)
        self.selected = selected.long()
        if self.selected.tolist() != [list(row) for row in manifest.selected_layers]:
            raise MapperFormatError(
                "the mapper's selected source layers differ from its manifest's selected_layers; re-fit the mapper"
            )
        # "kv": each map reads the selected source layers' K and V (input columns: K block, then V block)
        self.joint_inputs = manifest.joint_inputs
        expected = self._weight_shape()
        if tuple(weight.shape) != expected or tuple(bias.shape) != (2, *expected[1:2], expected[3]):
            raise MapperFormatError(
                f"mapper tensors have shapes {tuple(weight.shape)}/{tuple(bias.shape)}, expected {expected}: "
                "the file does not match its manifest; re-fit the mapper"
            )
        self._lay_out(weight.float(), bias.float())

    def _adopt_manifest(self, manifest: MapperManifest | Mapping) -> MapperManifest:
        """Take the (validated) manifest and what follows from it alone; every mapper class starts here."""
        if not isinstance(manifest, MapperManifest):
            manifest = MapperManifest.from_dict(manifest)
        self.manifest = manifest
        self.source, self.target = manifest.source_layout, manifest.target_layout
        self._verified: dict[str, weakref.WeakSet] = {"source": weakref.WeakSet(), "target": weakref.WeakSet()}
        self._rope_tables: dict = {}
        return manifest

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
        self._rope_tables: dict = {}  # (side, seq_len or None) → (cos, sin, scaling), see _cos_sin

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the map's GEMM runs in (float32 unless `to` changed it)."""
        return self.weight.dtype

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Mapper:
        """Move the mapper's tensors to ``device`` and/or cast them to the floating ``dtype`` (in place; returns
        the mapper). `transfer` then runs its GEMM in that dtype on that device; RoPE is stripped and applied
        in float32 whatever the dtype."""
        check_mapper_dtype(dtype)
        self._lay_out(self.weight.to(device=device, dtype=dtype), self.bias.to(device=device, dtype=dtype))
        return self

    # -- metadata ---------------------------------------------------------------------------------
    @property
    def top_k(self) -> int:
        return int(self.selected.shape[1])

    @property
    def exact_prefix(self) -> int:
        """Leading tokens the target should recompute at handoff (the fit config's exact_prefix)."""
        return self.manifest.exact_prefix

    @property
    def pending(self) -> bool:
        """Whether this (lazily loaded) mapper has not read its tensors yet."""
        return "_pending" in self.__dict__

    def __getattr__(self, name: str):
        # only reached for attributes the instance lacks: a lazily loaded mapper reads its tensors at the first
        # use of any of them, then is exactly the mapper an eager load would have built
        if name.startswith("__") or "_pending" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        self._materialise()
        return getattr(self, name)

    def _materialise(self) -> None:
        verified = self._verified
        built = type(self).from_tensors(_read_tensors(self.__dict__["_pending"], self.manifest), self.manifest)
        del self.__dict__["_pending"]  # only now: a damaged file keeps raising MapperFormatError at every use
        self.__dict__.update(built.__dict__)
        self._verified = verified  # the models already checked stay checked

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], manifest: MapperManifest) -> Mapper:
        """The mapper of a saved file's tensors (what `save` wrote: weight, bias, selected, `extra_tensors`)."""
        missing = [name for name in ("weight", "bias", "selected") if name not in tensors]
        if missing:
            raise MapperFormatError(f"the mapper file lacks tensors {missing}; re-fit the mapper")
        return cls(tensors["weight"], tensors["bias"], tensors["selected"], manifest)

    def extra_tensors(self) -> dict[str, torch.Tensor]:
        """Tensors a subclass saves beside the linear map's."""
        return {}

    # -- pairing ----------------------------------------------------------------------------------
    def check_models(self, source_model=None, target_model=None) -> None:
        """`verify_pair` for these models, once per (mapper, model): the hot path (`handoff_cache`, `catch_up`,
        `SwitchingSession`) calls it every time and fingerprints a model only the first time it sees it."""
        for side, model in (("source", source_model), ("target", target_model)):
            if model is None or model in self._verified[side]:
                continue
            self.verify_pair(**{f"{side}_model": model})
            self._verified[side].add(model)

    def verify_pair(self, source_model=None, target_model=None, source_tokenizer=None, target_tokenizer=None):
        """Raise MapperMismatchError unless the given models (and tokenizers) are the ones fitted for."""
        for side, model, tokenizer in (
            ("source", source_model, source_tokenizer),
            ("target", target_model, target_tokenizer),
        ):
            if model is None:
                continue
            expected = getattr(self.manifest, f"{side}_fingerprint")
            actual = model_fingerprint(model, tokenizer)
            for key in PAIRING_KEYS:
                if key == "tokenizer_hash" and (actual[key] is None or expected.get(key) is None):
                    continue
                same = (
                    signatures_match(actual[key], expected.get(key) or [])
                    if key == "weight_signature"
                    else actual[key] == expected.get(key)
                )
                if not same:
                    raise MapperMismatchError(
                        f"this mapper was fitted for a different {side} model ({key} differs: fitted "
                        f"{_short(expected.get(key))}, given {_short(actual[key])}); load the mapper fitted for "
                        f"this pair or fit one with `kvhandoff fit`"
                    )


#: mapper classes by the manifest's ``method``; a method defined in another module registers itself there
MAPPER_METHODS: dict[str, type[Mapper]] = {"ridge": Mapper, "synthetic": Mapper}


def register_method(name: str, mapper_class: type[Mapper]) -> None:
    """Make `Mapper.load` build ``mapper_class`` for manifests whose ``method`` is ``name``."""
    MAPPER_METHODS[name] = mapper_class


def mapper_class(method: str, where: str = "the manifest") -> type[Mapper]:
    """The mapper class registered for ``method``; MapperFormatError naming ``where`` when none is."""
    if method not in MAPPER_METHODS:
        raise MapperFormatError(
            f"{where} holds a mapper of unknown method {method!r} (known: {', '.join(sorted(MAPPER_METHODS))}); "
            "upgrade kvhandoff or re-fit it"
        )
    return MAPPER_METHODS[method]


_SEQ_LEN_FREE_ROPE = frozenset({"default", "linear", "llama3", "yarn"})


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """x·cos ± rotate_half(x)·sin written per half (negation is exact, so this equals `rope.apply_rope` /
    the numerator of `rope.strip_rope` bit for bit, without materialising rotate_half)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = x * cos
    if inverse:  # (x·cos − rotate_half(x)·sin): first half + x2·sin1, second half − x1·sin2
        out[..., :half] += x2 * sin[..., :half]
        out[..., half:] -= x1 * sin[..., half:]
    else:
        out[..., :half] -= x2 * sin[..., :half]
        out[..., half:] += x1 * sin[..., half:]
    return out


def storage_dtype(manifest: MapperManifest) -> torch.dtype:
    """The dtype a mapper's weight tensors are saved in (its fit config's `storage_dtype`)."""
    return getattr(torch, manifest.config.storage_dtype)


def _to_storage(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Weight tensors (named ``weight`` or ``….weight``, ``projection``) in ``dtype``; everything else as is."""
    if tensor.is_floating_point() and name.rsplit(".", 1)[-1] in ("weight", "projection"):
        return tensor.to(dtype)
    return tensor


def _check_file_size(tensor_path: Path, manifest: MapperManifest) -> None:
    recorded = (manifest.storage or {}).get("file_bytes")
    if recorded is not None and tensor_path.stat().st_size != recorded:
        raise MapperFormatError(
            f"{tensor_path} does not match its manifest ({tensor_path.stat().st_size} bytes, the manifest records "
            f"{recorded}): the file is truncated or was edited; re-fit the mapper or restore it from a backup"
        )


def _read_tensors(tensor_path: Path, manifest: MapperManifest) -> dict[str, torch.Tensor]:
    """The saved tensors, after checking the file against the manifest's size and sha256."""
    _check_file_size(tensor_path, manifest)
    if sha256_file(tensor_path) != manifest.tensor_sha256:
        raise MapperFormatError(
            f"{tensor_path} does not match the checksum in its manifest: the file is truncated or was "
            "edited; re-fit the mapper or restore it from a backup"
        )
    with safe_open(str(tensor_path), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 80 else text[:77] + "..."
