"""The mapper frame: what every fitted mapper does, whatever its map.

A mapper turns a source model's KV cache into a target model's (`Mapper.transfer`): the source RoPE is stripped
from the keys, the content-space K/V rows are mapped, the target RoPE is applied and the result is a
`DynamicCache`. The frame holds the manifest, RoPE (`rope.RopeTable`), the refusals (another model pair, a context
past the target's window, a cache on another device, NaN/Inf), save and load (eager or lazy) and the registry of
methods a manifest can name. A variant (`dense`, `blocks`, `lowrank`, `mlp`) says only how rows are mapped
(`map_rows`), which tensors it holds and saves, how they move, and what a token costs.
"""

from __future__ import annotations

import json
import weakref
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path

import torch
from transformers import DynamicCache

from kvhandoff.errors import ConfigError, ContextTooLongError, MapperFormatError, MapperMismatchError, NonFiniteError
from kvhandoff.mapper.manifest import GuardCalibration, MapperManifest, RecomputeChoice
from kvhandoff.mapper.storage import (
    check_file_size,
    read_manifest,
    read_tensors,
    refuse_nonfinite,
    storage_dtype,
    to_storage,
    write_folder,
    write_manifest,
)
from kvhandoff.model.cache import cache_of
from kvhandoff.model.capture import ContentKV, all_finite, nonfinite_layers
from kvhandoff.model.geometry import PAIRING_KEYS, model_fingerprint, signatures_match
from kvhandoff.model.rope import RopeTable, rotate


def check_mapper_dtype(dtype: torch.dtype | None) -> None:
    """ConfigError unless ``dtype`` (what a mapper's `to` casts to) is None or a floating dtype."""
    if dtype is not None and not dtype.is_floating_point:
        raise ConfigError(f"a mapper's dtype must be a floating dtype, got {dtype}")


class Mapper(ABC):
    """A fitted map from a source model's KV cache to a target model's, in content space.

    selected: [target_layers, k] source layers feeding each target layer (the manifest's selected_layers).
    manifest: a `MapperManifest` (a mapping of its JSON form is accepted and validated): geometry, fingerprints,
        config, calibration description and fit metrics.
    folder: the folder the mapper was loaded from or last saved to (None: only in memory).
    """

    folder: Path | None = None

    def __init__(self, selected: torch.Tensor, manifest: MapperManifest | Mapping):
        manifest = self._adopt_manifest(manifest)
        self.selected = selected.long()
        if self.selected.tolist() != [list(row) for row in manifest.selected_layers]:
            raise MapperFormatError(
                "the mapper's selected source layers differ from its manifest's selected_layers; re-fit the mapper"
            )

    def _adopt_manifest(self, manifest: MapperManifest | Mapping) -> MapperManifest:
        """Take the (validated) manifest and what follows from it alone (a lazy load stops here)."""
        if not isinstance(manifest, MapperManifest):
            manifest = MapperManifest.from_dict(manifest)
        self.manifest = manifest
        self.source, self.target = manifest.source_layout, manifest.target_layout
        self._verified: dict[str, weakref.WeakSet] = {"source": weakref.WeakSet(), "target": weakref.WeakSet()}
        self._rope_tables: dict[str, RopeTable] = {}
        return manifest

    # -- what a variant defines -------------------------------------------------------------------
    @abstractmethod
    def map_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Content-space source K/V as token rows x [2, B, T, Ls, Hs, Ds] (the mapper's dtype, contiguous) →
        target K/V [2, B, T, Lt, Ht, Dt] (may be a view of one buffer)."""

    @abstractmethod
    def parameter_tensors(self) -> list[torch.Tensor]:
        """The map's fitted tensors (what `num_parameters` counts); the first sets the mapper's device and dtype."""

    def index_tensors(self) -> list[torch.Tensor]:
        """Integer tensors the map reads beside its parameters (counted by `nbytes`, not `num_parameters`)."""
        return []

    @abstractmethod
    def flops_per_token(self) -> int:
        """Floating-point operations of mapping one token's K/V (multiply-adds ×2, plus the biases)."""

    @abstractmethod
    def _move(self, device: torch.device | str | None, dtype: torch.dtype | None) -> None:
        """Move the map's tensors to ``device`` and cast its floating ones to ``dtype`` (either may be None)."""

    @abstractmethod
    def saved_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors `save` writes, by name (what `from_tensors` reads back)."""

    @classmethod
    @abstractmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], manifest: MapperManifest) -> Mapper:
        """The mapper of a saved file's tensors (what `saved_tensors` gave)."""

    def _target_layer_axis(self, name: str) -> int | None:
        """The axis of saved tensor ``name`` that indexes target layers (None: none does), for messages."""
        return None

    def map_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The (weight, bias) tensors a linear map reads, for training in place (`refine.refine_mapper`)."""
        raise ConfigError(f"a {self.manifest.method!r} mapper is not refined end to end; refine the full ridge mapper")

    # -- placement and size -----------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.parameter_tensors()[0].device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the map runs in (float32 unless `to` changed it)."""
        return self.parameter_tensors()[0].dtype

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Mapper:
        """Move the mapper's tensors to ``device`` and/or cast them to the floating ``dtype`` (in place; returns
        the mapper). `transfer` then maps in that dtype on that device; RoPE is stripped and applied in float32
        whatever the dtype."""
        check_mapper_dtype(dtype)
        self._move(device, dtype)
        self.selected = self.selected.to(self.device)
        return self

    @property
    def top_k(self) -> int:
        return int(self.selected.shape[1])

    @property
    def exact_prefix(self) -> int:
        """Leading tokens the target should recompute at handoff (the fit config's exact_prefix)."""
        return self.manifest.exact_prefix

    def num_parameters(self) -> int:
        """Parameters of the map (a lazily loaded mapper answers from its manifest's `storage` record)."""
        if self.pending and self.manifest.storage:
            return int(self.manifest.storage["parameters"])
        return sum(t.numel() for t in self.parameter_tensors())

    def nbytes(self) -> int:
        """Bytes the map's tensors take in memory (a lazily loaded mapper: 0 until its first use)."""
        if self.pending:
            return 0
        return sum(t.numel() * t.element_size() for t in [*self.parameter_tensors(), *self.index_tensors()])

    # -- application ------------------------------------------------------------------------------
    def _check_source(self, layers: int, heads: int, head_dim: int) -> None:
        src = self.source
        if (layers, heads, head_dim) != (src.num_layers, src.num_kv_heads, src.head_dim):
            raise MapperMismatchError(
                f"source cache has {layers} layers × {heads} KV heads × head dim {head_dim}, "
                f"but this mapper was fitted for {src.num_layers} × {src.num_kv_heads} × {src.head_dim}: "
                "load the mapper fitted for this source model"
            )

    @torch.no_grad()
    def map_feature_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Calibration-layout rows (`FeatureLayout`: K then V of every source layer) [n, source width] → target
        rows [n, target width], content space."""
        src = self.source
        grid = x.to(self.device, self.dtype).view(-1, 2, src.num_layers, src.num_kv_heads, src.head_dim)
        y = self.map_rows(grid.transpose(0, 1).unsqueeze(1).contiguous())  # [2, 1, n, Lt, Ht, Dt]
        return y.permute(1, 2, 0, 3, 4, 5).reshape(x.shape[0], -1).float()

    @torch.inference_mode()
    def map_content(self, content: ContentKV) -> ContentKV:
        """Map content-space source K/V [Ls, B, Hs, T, Ds] to content-space target K/V [Lt, B, Ht, T, Dt]."""
        layers, _, heads, _, head_dim = content.keys.shape
        self._check_source(layers, heads, head_dim)
        # [2, Ls, B, Hs, T, Ds] → token rows [2, B, T, Ls, Hs, Ds]: the permute and the cast in one copy
        batch, tokens = content.keys.shape[1], content.keys.shape[3]
        rows = torch.empty(2, batch, tokens, layers, heads, head_dim, dtype=self.dtype, device=self.device)
        rows.copy_(torch.stack([content.keys, content.values]).permute(0, 2, 4, 1, 3, 5))
        y = self.map_rows(rows).permute(0, 3, 1, 4, 2, 5)  # [2, Lt, B, Ht, T, Dt]
        return ContentKV(keys=y[0], values=y[1])

    def check_context(self, length: int) -> None:
        """ContextTooLongError unless ``length`` positions fit the target's context window (checked before any
        work: the target cannot attend past its max_position_embeddings)."""
        limit = self.manifest.target_max_position_embeddings
        if length > limit:
            raise ContextTooLongError(
                f"a context of {length} tokens exceeds the target's max_position_embeddings ({limit}): shorten the "
                "context (drop earlier turns) or hand off to a model with a longer context window"
            )

    @torch.no_grad()  # not inference_mode: the cache's tensors must stay usable (in place) outside it
    def transfer(
        self,
        source_cache,
        position_ids: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> DynamicCache:
        """Turn a source `transformers` cache into a target `DynamicCache` for the same positions.

        position_ids: [batch, tokens] (or [tokens]) positions of the cached tokens (default 0..T−1).
        dtype: dtype of the returned cache (default: the source cache's dtype).

        Same arithmetic as `cache_to_content` → `map_content` → `apply_rope`, laid out for speed: RoPE
        cos/sin tables are kept per mapper, the source cache is gathered in one copy and de-rotated in
        place, the mapped rows are rotated straight into the target cache's buffers, and the DynamicCache
        layers are views of two buffers (no per-layer concatenation). RoPE is stripped and applied in float32;
        the map runs in the mapper's dtype (float32 unless `to` changed it). Refused: positions past the
        target's context window, a cache on another device than the mapper, NaN/Inf in the cache.
        """
        layers = source_cache.layers
        keys0 = layers[0].keys
        _, heads, tokens, head_dim = keys0.shape
        self._check_source(len(layers), heads, head_dim)
        if position_ids is not None and position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        self.check_context(tokens if position_ids is None else int(position_ids.max()) + 1)
        if keys0.device != self.device:
            raise ConfigError(
                f"the source cache is on {keys0.device}, the mapper on {self.device}: move the mapper with "
                f"mapper.to({str(keys0.device)!r})"
            )
        x = self._content_rows(layers, position_ids)
        y = self.map_rows(x.to(self.dtype))  # [2, B, T, Lt, Ht, Dt]
        return self._target_cache(y, position_ids, dtype or keys0.dtype)

    def _content_rows(self, layers, position_ids: torch.Tensor | None) -> torch.Tensor:
        """The source cache gathered straight into token rows [2, B, T, Ls, Hs, Ds] (cache dtype), RoPE stripped
        in place; NaN/Inf refused with the layer named."""
        src = self.source
        keys0 = layers[0].keys
        batch, heads, tokens, head_dim = keys0.shape
        x = torch.empty(2, batch, tokens, src.num_layers, heads, head_dim, dtype=keys0.dtype, device=keys0.device)
        torch.stack([layer.keys.transpose(1, 2) for layer in layers], dim=2, out=x[0])
        torch.stack([layer.values.transpose(1, 2) for layer in layers], dim=2, out=x[1])
        if not all_finite(x):
            bad = nonfinite_layers(x, dim=3)
            raise NonFiniteError(
                f"the source cache holds NaN/Inf in layer(s) {bad}: the source model's prefill overflowed (e.g. in "
                "float16); prefill in bfloat16 or float32 and hand off again"
            )
        cos, sin, scaling = self._rope("source").lookup(position_ids, tokens, self.device)  # [b, T, R]
        rotary = cos.shape[-1]
        keys = x[0, ..., :rotary]
        content = rotate(keys.float(), cos[:, :, None, None], sin[:, :, None, None], inverse=True)
        if scaling != 1.0:  # x / 1 is exact: skipping it changes nothing
            content = content / (scaling * scaling)
        keys.copy_(content)  # rounds to the cache dtype, as strip_rope does
        return x

    def _target_cache(self, y: torch.Tensor, position_ids: torch.Tensor | None, dtype: torch.dtype) -> DynamicCache:
        """Rotate the mapped rows y [2, B, T, Lt, Ht, Dt] into the target cache's buffers [Lt, B, Ht, T, Dt]."""
        tgt = self.target
        batch, tokens = y.shape[1:3]
        shape = (tgt.num_layers, batch, tgt.num_kv_heads, tokens, tgt.head_dim)
        out_keys = torch.empty(shape, dtype=dtype, device=y.device)
        out_values = torch.empty(shape, dtype=dtype, device=y.device)
        out_values.permute(1, 3, 0, 2, 4).copy_(y[1])
        cos, sin, _ = self._rope("target").lookup(position_ids, tokens, self.device)
        rotary = cos.shape[-1]
        rotated = rotate(y[0][..., :rotary].float(), cos[:, :, None, None], sin[:, :, None, None])
        keys_view = out_keys.permute(1, 3, 0, 2, 4)  # [B, T, Lt, Ht, Dt]
        keys_view[..., :rotary].copy_(rotated)
        if rotary < tgt.head_dim:
            keys_view[..., rotary:].copy_(y[0][..., rotary:])
        return cache_of(zip(out_keys.unbind(0), out_values.unbind(0), strict=True))

    def _rope(self, side: str) -> RopeTable:
        """``side``'s RoPE table, made at the first transfer (a mapper solved from statistics alone has none)."""
        if side not in self._rope_tables:
            self._rope_tables[side] = RopeTable(self.manifest.rope_config(side))
        return self._rope_tables[side]

    # -- persistence ------------------------------------------------------------------------------
    def stored(self) -> Mapper:
        """This mapper as its saved file will hold it: weight tensors rounded to the fit config's storage dtype
        (itself when that is float32), so a fitted mapper behaves exactly like the one loaded back."""
        dtype = storage_dtype(self.manifest)
        if dtype == torch.float32:
            return self
        tensors = {name: to_storage(name, tensor.detach().cpu(), dtype).to(tensor.device)
                   for name, tensor in self.saved_tensors().items()}
        return type(self).from_tensors(tensors, self.manifest)

    def save(self, path: str | Path) -> Path:
        """Write `mapper.safetensors` + `manifest.json` into directory `path`, atomically.

        The new mapper is written beside the old one and swapped in by rename (`files.atomic_folder`), so an
        interrupted save never leaves a half-written mapper where a good one was, nor loses the old one. Weight
        tensors are written in the fit config's `storage_dtype` (biases and indices as they are). The manifest
        records the tensor file's sha256, what the tensors take (`storage`: parameters, bytes) and a checksum
        over itself. A mapper with NaN/Inf weights (or weights past the storage dtype's range) is refused
        (nothing is written).
        """
        path = Path(path)
        dtype = storage_dtype(self.manifest)
        tensors = {name: to_storage(name, tensor.detach().to("cpu"), dtype).contiguous()
                   for name, tensor in self.saved_tensors().items()}
        refuse_nonfinite(tensors, self._target_layer_axis)
        self.manifest = write_folder(path, tensors, self.manifest, dtype)
        self.folder = path
        return path

    def record_guard(self, guard: GuardCalibration | None) -> MapperManifest:
        """Record ``guard`` (the quality guard measured for this pair; None: drop the record) in this mapper's
        manifest, in memory and in its `folder`: only `manifest.json` is rewritten, atomically
        (`storage.write_manifest`); the tensors stay as they are. Refused (MapperFormatError) for a mapper that is
        only in memory, or when the folder holds another mapper by now."""
        return self._rewrite_manifest(self.manifest.with_guard(guard), "its guard")

    def record_recompute(self, recompute: RecomputeChoice | None) -> MapperManifest:
        """Record ``recompute`` (the selective-recompute policy chosen for this pair; None: drop the record) in
        this mapper's manifest, in memory and in its `folder`, as `record_guard` does."""
        return self._rewrite_manifest(self.manifest.with_recompute(recompute), "its recompute policy")

    def record_measured(self, guard: GuardCalibration | None, recompute: RecomputeChoice | None) -> MapperManifest:
        """Record what was measured for this pair, its guard and its recompute policy (None: leave that record as
        it is), in one rewrite of the manifest, as `record_guard` does."""
        manifest = self.manifest
        if guard is not None:
            manifest = manifest.with_guard(guard)
        if recompute is not None:
            manifest = manifest.with_recompute(recompute)
        return self._rewrite_manifest(manifest, "what was measured for it")

    def _rewrite_manifest(self, manifest: MapperManifest, what: str) -> MapperManifest:
        """``manifest`` as this mapper's, in memory and in its `folder` (only `manifest.json` rewritten)."""
        if self.folder is None:
            raise MapperFormatError("this mapper is not saved (no folder): save it (`Mapper.save`) before recording "
                                    f"{what}")
        self.manifest = write_manifest(self.folder, manifest)
        return self.manifest

    @classmethod
    def load(
        cls,
        path: str | Path,
        source_model=None,
        target_model=None,
        source_tokenizer=None,
        target_tokenizer=None,
        lazy: bool = False,
    ) -> Mapper:
        """Load a saved mapper of any registered method; with models given, verify it was fitted for exactly this
        pair. Never runs code.

        An interrupted save is finished first (`files.recover_folder`): the good copy is what loads. The manifest
        (and its checksum) is always read and checked here. lazy: the tensors are read only at the mapper's first
        use (a router holding several mappers pays for the ones it uses); the tensor file's size is checked now
        against the manifest's `storage` record and its sha256 at that first use, before any tensor is read —
        a damaged file then raises MapperFormatError from the first transfer instead of from `load`.
        """
        manifest, tensor_path = read_manifest(Path(path))
        kind = mapper_class(manifest.method, str(path))
        if lazy:
            mapper = kind.__new__(kind)
            mapper._adopt_manifest(manifest)
            check_file_size(tensor_path, manifest)
            mapper._pending = tensor_path
        else:
            mapper = kind.from_tensors(read_tensors(tensor_path, manifest), manifest)
        mapper.verify_pair(source_model, target_model, source_tokenizer, target_tokenizer)
        mapper.folder = Path(path)
        return mapper

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
        built = type(self).from_tensors(read_tensors(self.__dict__["_pending"], self.manifest), self.manifest)
        del self.__dict__["_pending"]  # only now: a damaged file keeps raising MapperFormatError at every use
        self.__dict__.update(built.__dict__)
        self._verified = verified  # the models already checked stay checked

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
            key = differing_pairing_key(expected, actual)
            if key is not None:
                raise MapperMismatchError(
                    f"this mapper was fitted for a different {side} model ({key} differs: fitted "
                    f"{_short(expected.get(key))}, given {_short(actual[key])}); load the mapper fitted for "
                    f"this pair or fit one with `kvhandoff fit`"
                )


def differing_pairing_key(expected: dict, actual: dict) -> str | None:
    """The first `PAIRING_KEYS` entry where fingerprint ``actual`` differs from the fitted ``expected`` (None: the
    same model). A tokenizer hash missing on either side is not compared; weight signatures match loosely
    (`signatures_match`)."""
    for key in PAIRING_KEYS:
        if key == "tokenizer_hash" and (actual[key] is None or expected.get(key) is None):
            continue
        if key == "weight_signature":
            same = signatures_match(actual[key], expected.get(key) or [])
        else:
            same = actual[key] == expected.get(key)
        if not same:
            return key
    return None


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


#: mapper classes by the manifest's ``method``; each variant module registers its own (`kvhandoff.mapper` imports
#: them all, so every method loads once any part of the package is imported)
MAPPER_METHODS: dict[str, type[Mapper]] = {}


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
